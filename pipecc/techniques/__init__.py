"""The paper techniques, one package each: `pipecc/techniques/<name>/` holds everything of a
technique (its rule, its planner search, its schedule transform, its runtime handlers, its
generated code), and the one line that registers it is its place in `TECHNIQUES` below: the
lowering's order (`LOWERING`, from each package's `LOWERS`), the planner's fields
(`passes.plan_options.PlanOptions`, from `OPTIONS` and `SETTINGS`), the command line's switches
and the installed packages (setup.py finds them) all come from the package.

A package's `__init__` is its rule: pure functions over plan fields (onnx-ir's `requires`),
where the technique can run, asked alike by the planner, the plan verifier
(`pipecc.ir.verify.verify_plan`), compile (`pipecc.driver.compile`) and the compiled-folder
loader (`pipecc run`, which imports no compiler: so the rule imports only the IR). The protocol
every consumer iterates (`TECHNIQUES`, `LOWERING`):

    NAME, TAG, OFF                      how people, its refusals and their fixes name it
    OPTIONS                             its command-line switches (`options.Option`), which
                                        `pipecc.cli.args` adds to the plan commands and
                                        `passes.plan_options.PlanOptions` makes fields of
    SETTINGS                            (optional) its planner fields without a switch
                                        (`options.Setting`)
    options_problem(options) -> str | None   (optional) its checks across the planner's
                                        options: None, or the one line of the UsageError
    one_shape(options) -> str | None   (optional) its switch that plans a folder for one input shape
                                        (refused with `--length`: `pipecc.varlen.check_options`)
    uses(plan) -> bool                  whether `plan` applies the technique
    requires(plan, caps) -> str | None  None: admissible; else one line naming the problem and the fix
    LOWERS                              the phase of the lowering its `lower` belongs to
                                        (`PHASES`: "unchanged", "rows", "transfers", "collectives")
    lower(plan, schedule)               the schedule transform it applies (`schedule` itself
                                        when the plan does not use it)
    at_run(kind, world, m, stages_per_rank, sizes, balancing)   (optional) its rule again on a
                                        run's own placement, and the schedule it builds by name
                                        (`pipecc.runtime.engine.build_schedule`), or None
    folder.folder_sizes(meta, asked)    (optional) a compiled folder's per-stage micro-batch sizes or None
    folder.folder_balancing(meta)       (optional) a compiled folder's stash pairs or None
                                        (`folder`: IR like the rule, torch-free for `pipecc run`'s launcher)
    runtime.load_stage(folder, module, ports)   (optional) its stage module around a loaded one, or None
    runtime.one_process(modules)        (optional) before `pipecc.load` runs the stages in one process
    schedule.sized_rows(name, sizes, ranks)     (optional) `schedule_for`'s rows for `microbatch_sizes`
    schedule.thresholds_refusal(name, stages_per_rank)   (optional) why `bpipe_thresholds` cannot go in, or None
    schedule.with_thresholds(schedule, thresholds, policy)   (optional) `schedule_for`'s `bpipe_thresholds` transform
    DATA                                (optional) its side data types in the plan (`Plan.data`; `pipecc.ir.plan_data`)

Its other modules are parts of other layers, named by the layer (`tests/test_layering.py`
`layer_of` holds each to its layer's imports): `search*`/`plan*` planner passes, `runtime*`
the runtime's handlers, `codegen*` the torch backend's code, `report*` its report lines; any
other module is IR like the rule. A part's optional hooks, asked by role (`getattr`), in `TECHNIQUES` order:

    graph_requires(graph, plan) -> str | None   (`search`/`plan` part) its rule's part that needs the graph
    marker_fields(plan) -> dict                 (`codegen`) its entries of OUT/pipecc.json, checked
    check(graph, plan)                          (`codegen`) a PipeccError for what only its generated code shows
    write_stages(tmp, graph, plan, stages, device_desc) -> bool   (`codegen`) True: it wrote the stage folders
    notes(plan, out) -> list[str]               (`codegen`) its notes on the compiled folder `out`
    forward_wrapper(planned) -> wrapper | None  (`codegen`) the forward wrapper of a stage.py (`StagePlan`)
    wrap_module(module, planned) -> nn.Module | None   (`codegen`) the drop-in module's stage for `planned`

Over all techniques:

    requires(plan, caps)                the first reason of any technique `plan` uses
    lower(plan, schedule)               every technique's `lower`, in LOWERING order (by
                                        `PHASES`, then `TECHNIQUES` order)
    schedule_of(plan)                   the plan's final action list: its base schedule by name,
                                        lowered (what compile writes as OUT/schedule.txt)

A part's optional hooks, asked of every technique's part in `TECHNIQUES` order (never by name):

    search.before_search(ev)            before the balance search's candidates (BPipe's mode checks)
    search.candidate(ev, schedule, m, d)   a candidate of the search, or None (recomputation's modes)
    search.after_search(ev, results, tried)   (results, notes, estimate): the ranked results weighed (BPipe)
    search.nothing_fits(ev, schedule, m, reason, d)   why nothing fits, with its fix (recomputation)
    search.plan_fields(cand) -> dict    its `Plan` fields of the chosen candidate (BPipe's pairs)
    plan.base_options(options, batch) -> dict   the planner's options its switches fix (UMPIPE's)
    search.schedules(options, names) -> names   the schedules the search may try (BPipe forced: 1f1b)
    search.decision_lines(cand, notes, estimate)   of its `after_search` notes, those of the plan's candidate (BPipe)
    search.all_devices(options) -> bool   its options ask for every device given (`passes.device_count`)

| module | technique | what it asks of the plan |
|---|---|---|
| `bpipe` | activation balancing (BPipe) | 1f1b, one stage per pipeline rank (replica groups and recomputation compose), equal micro-batches, stash-keeping devices, no Bi-Partition, a process per rank; well-formed pairs |
| `umpipe` | unequal micro-batches (UMPIPE) | gpipe or 1f1b, one stage per device, no replicas, no recomputation, variable-micro-batch devices |
| `bipartition` | separate forward/backward cuts | 1f1b or gpipe, one stage per device, no replicas, equal micro-batches, no recomputation, stash-keeping devices (split layers compose); mode ship |
| `recompute` | activation recomputation | training, recompute-capable devices |
| `replicas` | replica groups (PP x DP) | groups on consecutive devices per rank, replicable devices |
| `zero_bubble` | zb-h1 | split-backward-capable devices |

A planner asks a technique's `requires` *before* it searches (the context rules hold whether
or not the plan applies the technique yet), on the plan it would extend or on a `sketch` of its
options; compile and the loader ask `requires` for the techniques the plan uses. What needs the
graph stays beside the search (`techniques.bipartition.plan.graph_requires`,
`techniques.recompute.search.graph_requires`); what needs generated code stays in the backend.
`docs/techniques.md` shows which pairs compose (`matrix`); a pair that does not is refused by
one rule only (the technique whose scope excludes it), so each reason is written once.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any, Sequence

from pipecc.ir.plan import Plan, StagePlan
from pipecc.techniques import bipartition, bpipe, recompute, replicas, umpipe, zero_bubble
from pipecc.techniques.capabilities import COMPILED, DROP_IN, Capabilities

__all__ = ["LOWERING", "PHASES", "TECHNIQUES", "Capabilities", "COMPILED", "DROP_IN", "first_answer", "hooks", "lower",
           "parts", "requires",
           "schedule_of", "sketch"]

TECHNIQUES = (umpipe, bpipe, bipartition, recompute, replicas, zero_bubble)

# The phases of the lowering, in the order they apply; each technique names its own (`LOWERS`):
# "unchanged" its `lower` is the identity (recomputation changes what a B runs, zero-bubble is its
# generator); "rows" it rebuilds the base schedule's compute rows from the plan (UMPIPE's chunks:
# first, since it builds from the schedule's name and drops what came before); "transfers" it
# inserts point-to-point actions into those rows (BPipe's stash transfers); "collectives" it adds
# actions across the copies of a stage after the compute they follow (the replicas' REDUCE,
# Bi-Partition's REFRESH). Within a phase, `TECHNIQUES` order: two techniques of one phase either
# never both change an admissible plan's schedule or commute (REDUCE follows a stage's last
# gradient action, REFRESH its last F; `tests/test_techniques.py` checks every such pair).
PHASES = ("unchanged", "rows", "transfers", "collectives")
# the order the schedule transforms apply: by phase, then `TECHNIQUES` order (a stable sort)
LOWERING = tuple(sorted(TECHNIQUES, key=lambda technique: PHASES.index(technique.LOWERS)))


def parts(layer: str) -> list[ModuleType]:
    """Every technique's part of `layer` (``pipecc.techniques.<name>.<layer>``: "search" and
    "plan" the planner's and the driver's, "codegen" the torch backend's, "runtime" the engine's
    and the loader's, "folder" the launcher's (torch-free), "schedule" the registry's, "report"
    the report's), in `TECHNIQUES` order, where it has one. Only that layer's callers ask:
    importing a part follows the layering the import test holds it to."""
    out = []
    for technique in TECHNIQUES:
        name = f"{technique.__name__}.{layer}"
        if importlib.util.find_spec(name) is not None:
            out.append(importlib.import_module(name))
    return out


def hooks(layer: str, name: str) -> list[Any]:
    """The optional hook `name` of every technique's part of `layer` that defines it, in
    `TECHNIQUES` order: how a shared module asks a technique, never by its name."""
    return [hook for part in parts(layer) if (hook := getattr(part, name, None)) is not None]


def first_answer(layer: str, name: str, *args: Any) -> Any:
    """The first answer other than None of the hooks `name` of `layer`'s parts (`hooks`), or None."""
    for hook in hooks(layer, name):
        answer = hook(*args)
        if answer is not None:
            return answer
    return None


def requires(plan: Plan, caps: Capabilities = COMPILED) -> str | None:
    """The first reason any technique `plan` uses cannot run on `caps`, or None."""
    for technique in TECHNIQUES:
        if technique.uses(plan):
            why = technique.requires(plan, caps)
            if why is not None:
                return why
    return None


def lower(plan: Plan, schedule: Any) -> Any:
    """`schedule` (the plan's base schedule, by name) through every technique's `lower`."""
    for technique in LOWERING:
        schedule = technique.lower(plan, schedule)
    return schedule


def schedule_of(plan: Plan) -> Any:
    """The plan's final, validated action list: what compile writes as ``OUT/schedule.txt``, the
    runtime executes and the report draws. The base schedule by name (``schedule_for``; only a
    schedule in ``VIRTUAL`` holds ``virtual_stages`` stages per rank), then every technique's
    schedule transform (`lower`: UMPIPE's sizes, BPipe's transfers, the replicas' REDUCE,
    Bi-Partition's REFRESH). ValueError when they cannot be built."""
    from pipecc.ir.schedule.registry import VIRTUAL, schedule_for
    n = len(plan.stages)
    v = max(plan.virtual_stages, 1) if plan.schedule in VIRTUAL else 1
    return lower(plan, schedule_for(plan.schedule, n, plan.microbatches, num_ranks=n // v))


def sketch(*, schedule: str, devices: Sequence[Any], training: bool = True,
           replicas: int = 1, recompute: bool = False, batch_size: int = 1,
           microbatches: int = 1) -> Plan:
    """A plan with one stage per device (per replica group of `replicas`; nodes unknown) for asking a technique's `requires`
    about planner options before any partition exists. `devices`: plan device dicts, or
    objects with `kind` and `name` (`pipecc.targets.hardware.Device`)."""
    devices = [dict(d) if isinstance(d, dict) else {"kind": d.kind, "name": d.name} for d in devices]
    d = max(replicas, 1)
    stages = [StagePlan(index=j, device=j * d, nodes=[], recompute=recompute,
                        replica_devices=list(range(j * d, j * d + d)) if d > 1 else [])
              for j in range(len(devices) // d)]
    return Plan(model="", batch_size=batch_size, microbatches=microbatches, schedule=schedule,
                devices=devices, stages=stages, split_layers=[], bottleneck_s=0.0,
                lower_bound_s=0.0, predicted_iteration_s=0.0, bubble_fraction=0.0, replicas=replicas,
                options={"training": training})
