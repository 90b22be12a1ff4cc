"""The driver: the steps pipecc runs, top to bottom, each a named function over one `State`.

    analyze         build ─► capture ─► costs          (an ONNX file: import ─► costs)
    analyze_module  capture ─► costs                   (an in-memory module)
    plan            recost ─► balance ─► split layers ─► [unequal micro-batches] ─► [bipartition]
                    (all devices, then fewer: `_fewer_devices`, unless use_all_devices)
    compile         cut stages ─► report ─► check ─► write     (the compiled folder OUT)
    compile_module  cut stages ─► check ─► module              (pipecc.compile's drop-in)

Each function builds its list of `Step`s and hands it to `Instruments` (`pipecc.instruments`),
which runs every step through one function: progress (consecutive steps with one label share
one progress line), its time, with `debug` (tests always set it) the IR verifier and the step's
contract, and with `dump_ir=DIR` the file `DIR/NNN_<step>.txt`. Every step declares its contract
(`pipecc.passes.contract`: what it reads, what it produces, whether it changes its input); no
step edits a plan or graph it read (it puts a new one in the state), only the two cost
annotations (`costs`, `recost`) write on the graph they read.

Backends: torch always, FPGA when the plan puts stages on FPGA cards (`backends_for`).

Analysis leaves an in-memory model as it found it (weights, buffers, train flags, RNG:
`model_state.preserved_state` around the capture step). What analysis and compile refuse, each
with its reason: a forward that returns no tensor or exits, a `--symbol` naming a missing input
or dim (the frontend), a training pipeline for a model with nothing to train (`compile_checks.trainable`),
and, with `strict_batchnorm`, BatchNorm statistics that micro-batching would change
(`compile_checks.batchnorm_note`; by default a warning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from pipecc import cost, progress
from pipecc.errors import PipeccError, UsageError
from pipecc.frontend import constants, loss_memory, model_checks, modelfile, onnx_import, torch_capture
from pipecc.frontend.torch_capture import parse_symbols  # noqa: F401  (driver.parse_symbols: the CLI's)
from pipecc.frontend.model_state import preserved_state
from pipecc.frontend.modelfile import ModelSpec, kept_cwd, load_model_file
from pipecc import techniques
from pipecc.runtime.loss_reduction import check_split
from pipecc.instruments import Instruments, State, Step
from pipecc.ir.graph import AnnotatedGraph
from pipecc.ir.plan import Plan
from pipecc.techniques import capabilities as caps
from pipecc.ir.verify import verify, verify_plan
from pipecc.passes.contract import PlanContext
from pipecc.passes.plan_options import PlanOptions
from pipecc.report.formatting import count
from pipecc.compile_checks import (batchnorm_message, batchnorm_note, batchnorm_warning,  # noqa: F401
                                   capabilities_of, check_techniques, separable, strict_batchnorm_message, trainable)

if TYPE_CHECKING:  # the backends and the planner load only when a step needs them
    from pipecc.backends.base import Backend, Target
    from pipecc.passes.plan_evaluate import Evaluator
    from pipecc.passes.plan_search import Planner
    from pipecc.targets.hardware import Cluster


LOSS_META = "pipecc.loss_reduction"  # graph.gm.meta: the LossReduction check_loss found


@dataclass
class Analysis:
    """A costed graph and, for .py models, the model it came from."""

    graph: AnnotatedGraph
    spec: ModelSpec | None  # None for ONNX files


@dataclass
class Compiled:
    """What `compile` wrote: the folder, the cut stages, and the lines to print after it."""

    out: Path
    stages: list[Any]
    notes: list[str]


# ----------------------------------------------------------------------------- analyze
def _build(state: State, *, path: Path, model_args: dict[str, Any] | None, batch_size: int) -> None:
    state.spec = load_model_file(path, model_args, batch_size=batch_size)
    state.model, state.inputs = state.spec.model, tuple(state.spec.example_inputs)


def _import_onnx(state: State, *, path: Path, batch_size: int) -> None:
    from pipecc.frontend import onnx_import
    state.graph = onnx_import.from_onnx(path, batch_size=batch_size)


def _capture(state: State, *, model_name: str, symbols: Sequence[torch_capture.SymbolSpec]) -> None:
    first = next((x for x in state.inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    batch = int(first.shape[0]) if first is not None else 1
    syms = torch_capture.default_symbols(state.inputs, batch) + list(symbols)
    assert state.model is not None
    from pipecc.frontend.modelfile import deadline
    limit = deadline(f"tracing {model_name}") if state.spec is not None else contextlib.nullcontext()
    with preserved_state(state.model), limit:  # the user's model, as it was before the analysis
        state.graph = torch_capture.from_module(state.model, state.inputs, symbols=syms,
                                                model_name=model_name)


def _costs(state: State) -> None:
    assert state.graph is not None
    cost.annotate(state.graph)
    state.costed = True


def _trace(model_name: str, symbols: Sequence[torch_capture.SymbolSpec],
           label: str | None = None) -> list[Step]:
    return [Step("capture", partial(_capture, model_name=model_name, symbols=symbols), label),
            Step("costs", _costs, label)]


def analyze_module(model: torch.nn.Module, example_inputs: tuple, *, model_name: str = "model",
                   symbols: Sequence[torch_capture.SymbolSpec] = (), debug: bool = False,
                   dump_ir: str | Path | None = None) -> AnnotatedGraph:
    """Capture, annotate and cost an in-memory module."""
    state = State(model=model, inputs=tuple(example_inputs))
    Instruments(debug, dump_ir).run(_trace(model_name, symbols), state)
    assert state.graph is not None
    return state.graph


def analyze(path: str | Path, *, model_args: dict[str, Any] | None = None, batch_size: int = 1,
            symbols: Sequence[torch_capture.SymbolSpec] = (), debug: bool = False,
            dump_ir: str | Path | None = None) -> Analysis:
    """Load a model file (.py or .onnx) and return its costed graph (the model's code runs here:
    a working folder it changes is changed back, `kept_cwd`)."""
    with kept_cwd():
        return _analyze(Path(path), model_args=model_args, batch_size=batch_size, symbols=symbols, debug=debug,
                        dump_ir=dump_ir)


def _analyze(path: Path, *, model_args: dict[str, Any] | None, batch_size: int,
             symbols: Sequence[torch_capture.SymbolSpec], debug: bool, dump_ir: str | Path | None) -> Analysis:
    if batch_size < 1:
        raise UsageError(f"--batch-size must be a positive integer, got {batch_size}")
    if path.suffix == ".onnx":
        if model_args:
            raise UsageError("--model-arg applies to .py model files, not ONNX files")
        if symbols:
            raise UsageError("--symbol applies to .py model files, not ONNX files (an ONNX "
                             "file's symbolic dims are its batch dim B)")
        steps = [Step("import", partial(_import_onnx, path=path, batch_size=batch_size),
                      f"importing {path.name}"),
                 Step("costs", _costs)]
    else:
        steps = [Step("build", partial(_build, path=path, model_args=model_args,
                                       batch_size=batch_size), f"building {path.name}"),
                 *_trace(path.stem, symbols, f"tracing {path.name}")]
    state = Instruments(debug, dump_ir).run(steps, State())
    graph = state.graph
    assert graph is not None
    if state.spec is not None and graph.batch_size != batch_size and "B" in graph.symbols:
        raise PipeccError(f"example_inputs({batch_size}) returned a batch of {graph.batch_size}")
    if state.spec is not None:  # the loss and target a run will use, checked now, not in a rank
        spec, checks = state.spec, model_checks
        with modelfile.deadline(f"the loss check of {path.name} (forward and loss_fn on the example)"):
            graph.gm.meta[checks.OUTPUT_GRAD_META] = checks.check_forward(spec.model, tuple(spec.example_inputs), path.name)
            graph.gm.meta[LOSS_META] = checks.check_loss(  # how micro-batch losses combine (pipecc.json's loss_reduction)
                spec.model, tuple(spec.example_inputs), batch_size, spec.loss_fn, spec.make_target, path.name)
            graph.gm.meta[loss_memory.LOSS_STASH_META] = loss_memory.loss_stash_per_sample(  # the last stage's
                spec.model, tuple(spec.example_inputs), batch_size, spec.loss_fn, spec.make_target)
    return Analysis(graph, state.spec)


# ----------------------------------------------------------------------------- plan
def _recost(state: State, *, options: PlanOptions, cluster: Cluster) -> None:
    """The graph's costs in this plan's attention mode and precision, for these devices' kinds
    (`cost.recost_attention`: nothing to do when it was last costed so)."""
    assert state.graph is not None
    cost.recost_attention(state.graph, bool(options.flash_attention), options.precision,
                          [d.kind for d in cluster.devices])


def _balance(state: State, *, planner: Planner) -> None:
    state.plan, state.candidate = planner.run()


def _evaluator(graph: AnnotatedGraph, cluster: Cluster, options: PlanOptions) -> Evaluator:
    """An evaluator over `graph` (a layer-split graph has its own units and costs)."""
    from pipecc.passes import split_search
    from pipecc.passes.plan_costs import CostTables
    from pipecc.passes.plan_evaluate import Evaluator
    return Evaluator(CostTables(graph, cluster, options, splittable=split_search.splittable_names(graph)))


def _split_layers(state: State, *, planner: Planner, cluster: Cluster, options: PlanOptions,
                  debug: bool) -> None:
    """The split search from the best candidate of every schedule; the fastest result kept.

    NOTE: splitting can reorder schedules (interleaved, with twice the stages, gains most: 20%
    on GPT-2 at 8 devices), so each schedule's best candidate is split (at most three
    searches). With `debug`, every graph clone the search rewrites is verified before it is
    planned, and the plan made for it after.
    """
    from pipecc.passes import plan_emit, split_search
    from pipecc.passes.plan_search import Planner
    assert state.graph is not None and state.plan is not None
    graph, result, cand = state.graph, state.plan, state.candidate
    tried: list[tuple[Any, AnnotatedGraph]] = []
    # NOTE: one evaluator per graph for every contender's bounds, the planner's own for its graph
    evaluators: dict[int, tuple[AnnotatedGraph, Evaluator]] = {id(graph): (graph, planner.evaluator)}
    for cand_k in planner.contenders():
        plan_k = result if cand_k is cand else planner.to_plan(cand_k)
        if len(plan_k.stages) == 1:  # one stage (plain data parallelism): no cut to refine
            tried.append((plan_k, graph))
            continue
        notes: list[str] = []
        fixed = dict(schedule=plan_k.schedule, microbatches=plan_k.microbatches,
                     replicas=plan_k.replicas)

        def replan(g: AnnotatedGraph, keep: bool, fixed=fixed) -> Plan:
            if debug:
                verify(g, costed=True)
            opts = PlanOptions.of(options, **(fixed if keep else {}), compare=False)
            # NOTE: no bounds: the search keeps the unsplit plan's, which covers every split;
            # so no splittable names either (only the bounds read them)
            planned = Planner(g, cluster, opts, bounds=False).run()[0]
            if debug:
                verify_plan(g, planned)
            return planned

        def bound(g: AnnotatedGraph, names: list[str], fixed=fixed, bounds=evaluators) -> float:
            # NOTE: prunes a trial no split of `names` can make pay (passes.split_search)
            if id(g) not in bounds or bounds[id(g)][0] is not g:
                bounds[id(g)] = (g, _evaluator(g, cluster, options))
            return plan_emit.shape_bound(bounds[id(g)][1], fixed["schedule"], fixed["microbatches"],
                                         fixed["replicas"], set(names))

        times = planner.unit_times(cand_k)
        unsplit = plan_k
        with progress.step(f"splitting layers ({plan_k.schedule}, {plan_k.microbatches} "
                           "micro-batches)"):
            plan_k, graph_k = split_search.search(graph, plan_k, replan,
                                                  lambda n, t=times: t.get(n, 0.0),
                                                  note=notes.append, bound=bound)
        split, plan_k = plan_k is not unsplit, _noted(plan_k, *notes)
        tried.append((plan_k, graph_k))
        if split and plan_k.predicted_iteration_s > unsplit.predicted_iteration_s:
            # NOTE: a split that lowers the bottleneck may still lengthen the iteration: the unsplit plan stays
            tried.append((_noted(unsplit, f"layer splits lowered the bottleneck but predicted "
                                          f"{plan_k.predicted_iteration_s:.4g} s per iteration: not used"), graph))
    tried.sort(key=lambda r: r[0].predicted_iteration_s)
    result, graph = tried[0]
    state.plan, state.graph = _noted(result, *(
        f"after layer splitting, {other.schedule} with {count(other.microbatches, 'micro-batch')} "
        f"predicts {other.predicted_iteration_s:.4g} s per iteration vs "
        f"{result.predicted_iteration_s:.4g} s" for other, _ in tried[1:])), graph


def _noted(plan: Plan, *lines: str) -> Plan:
    """`plan` with `lines` added to its decisions: a copy (a step never edits a plan it read)."""
    return dataclasses.replace(plan, decisions=[*plan.decisions, *lines])


def resolve_options(options: PlanOptions, analysis: Analysis | AnnotatedGraph,
                    cluster: Cluster) -> tuple[PlanOptions, Cluster]:
    """`options` as the planner reads them, and the cluster it plans on: the batch size the
    graph's when None; a `microbatch_sizes` list parsed and checked, fixing the base plan's
    schedule, replicas and micro-batch count (each technique's `plan` part's optional
    `base_options(options, batch)`, in `TECHNIQUES` order: UMPIPE's); a profile
    loaded, checked against the model and devices, its links measured (`use_profile`); a
    calibration run loaded and checked alike (`use_calibration`)."""
    graph = analysis.graph if isinstance(analysis, Analysis) else analysis
    batch = options.batch_size or graph.batch_size
    fixed: dict[str, Any] = {}
    for part in techniques.parts("plan"):  # the fields a technique's options fix
        base_options = getattr(part, "base_options", None)
        if base_options is not None:
            fixed.update(base_options(options, batch))
    profile = options.profile
    if profile is not None:  # checked against the model and devices; its links measured
        from pipecc.targets.profiled import use_profile
        profile, cluster = use_profile(profile, analysis, cluster)
    calibrate = options.calibrate
    if calibrate is not None:  # a run of this model on these devices (pipecc.targets.calibrated)
        from pipecc.targets.calibrated import use_calibration
        calibrate = use_calibration(calibrate, analysis, cluster, profile)
    return PlanOptions.of(options, batch_size=batch, profile=profile, calibrate=calibrate, **fixed), cluster


def plan(analysis: Analysis | AnnotatedGraph, devices: Any, options: PlanOptions | None = None, *,
         debug: bool = False, dump_ir: str | Path | None = None, **fields: Any) -> tuple[Plan, AnnotatedGraph]:
    """Balance a costed graph over devices. Returns (plan, graph) — the graph may have been
    rewritten by intra-layer splitting, and the plan's node names refer to it.

    `options` (`passes.plan_options.PlanOptions`, whose docstring says what each field does)
    with `fields` replacing its values (`plan(g, "2xcpu", microbatches=4)`); the defaults are
    the Python API's (`replicas=1`, `activation_balancing="off"`, `use_all_devices=True`; with it
    False, fewer devices when predicted faster: `_fewer_devices`). `debug` verifies the IR after
    each step, `dump_ir` writes it (`Instruments`)."""
    from pipecc.targets.devices import Cluster, DeviceSpecError, parse_devices
    options = PlanOptions.of(options, **fields)
    try:
        cluster = devices if isinstance(devices, Cluster) else parse_devices(devices)
    except DeviceSpecError as exc:
        raise UsageError(str(exc)) from exc
    from pipecc.passes import device_count
    if not device_count.applies(options, len(cluster.devices)):
        return _plan_on(analysis, cluster, options, debug=debug, dump_ir=dump_ir)
    return _fewer_devices(analysis, cluster, options, debug=debug, dump_ir=dump_ir)


def _fewer_devices(analysis: Analysis | AnnotatedGraph, cluster: Cluster, options: PlanOptions, *,
                   debug: bool, dump_ir: str | Path | None) -> tuple[Plan, AnnotatedGraph]:
    """The plan over every device, or over fewer when that is predicted faster
    (`passes.device_count`: the balance search on each k < p, the best k planned in full)."""
    from pipecc.passes import device_count
    from pipecc.passes.plan_search import Planner
    graph = analysis.graph if isinstance(analysis, Analysis) else analysis
    p = len(cluster.devices)
    try:
        whole: tuple[Plan, AnnotatedGraph] | None = _plan_on(analysis, cluster, options, debug=debug,
                                                             dump_ir=dump_ir)
        why = ""
    except UsageError:
        raise
    except PipeccError as exc:  # e.g. more devices than units to place: fewer may fit
        whole, why = None, str(exc)
    resolved, measured = resolve_options(options, analysis, cluster)  # a profile's links measured
    best: tuple[tuple[bool, float], list[int], Cluster] | None = None
    with progress.step(f"weighing fewer than {count(p, 'device')}"):
        for (keep, sub), (_, timed) in zip(device_count.subsets(cluster), device_count.subsets(measured)):
            try:
                balanced = Planner(graph, timed, resolved).run()[0]
            except PipeccError:
                continue
            key = (bool(device_count.negligible_of_plan(balanced)), balanced.predicted_iteration_s)
            if best is None or key < best[0]:
                best = (key, keep, sub)
    if best is None and whole is None:
        raise PipeccError(why)
    alone = None
    if best is not None and (whole is None or best[0] < (bool(device_count.negligible_of_plan(whole[0])),
                                                         whole[0].predicted_iteration_s)):
        try:
            alone = _plan_on(graph, best[2], options, debug=debug, dump_ir=dump_ir)
        except PipeccError:
            if whole is None:
                raise
    keep = best[1] if best is not None else list(range(p))
    chosen, line = device_count.decide(whole and whole[0], alone and alone[0], keep, p, why)
    result = whole if whole is not None and chosen is whole[0] else alone
    assert result is not None
    if result is alone:
        chosen = device_count.remap(chosen, keep)
    return dataclasses.replace(chosen, options={**chosen.options, "devices_given": p},
                               decisions=[line, *chosen.decisions]), result[1]


def _plan_on(analysis: Analysis | AnnotatedGraph, cluster: Cluster, options: PlanOptions, *,
             debug: bool, dump_ir: str | Path | None) -> tuple[Plan, AnnotatedGraph]:
    """`plan` on every device of `cluster`."""
    from pipecc.passes import split_search
    from pipecc.passes.plan_search import Planner
    graph = analysis.graph if isinstance(analysis, Analysis) else analysis
    instruments, state = Instruments(debug, dump_ir), State(graph=graph, costed=True)
    instruments.run([Step("recost", partial(_recost, options=options, cluster=cluster))], state)
    given_profile = options.profile
    options, cluster = resolve_options(options, analysis, cluster)
    splittable = split_search.splittable_names(graph) if options.split_layers else []
    planner = Planner(graph, cluster, options, splittable=splittable)
    steps = [Step("balance", partial(_balance, planner=planner),
                  f"planning on {count(len(cluster.devices), 'device')}")]
    if options.split_layers and splittable and len(cluster.devices) > 1:
        steps.append(Step("split layers", partial(_split_layers, planner=planner,
                                                  cluster=cluster, options=options, debug=debug)))
    ctx = PlanContext(planner, graph, cluster, options, partial(_evaluator, cluster=cluster, options=options))
    for part in techniques.parts("plan"):  # each technique's planning step, where its options ask for it
        technique_step = getattr(part, "STEP", None)
        if technique_step is not None and technique_step.wanted(options):
            steps.append(Step(technique_step.contract.name, partial(technique_step.run, ctx=ctx),
                              technique_step.label, technique_step.contract))
    fpgas = [d for d in cluster.devices if not d.can(caps.BACKWARD)]  # the FPGA cards: no backward pass
    if not (options.training and options.replicas == "auto" and fpgas and len(fpgas) < len(cluster.devices)
            and given_profile is None):
        instruments.run(steps, state)
        return state.plan, state.graph
    # NOTE: data parallelism on the GPUs alone is one of the plans --replicas auto weighs: a
    # training plan may leave the FPGA cards out (they have no backward pass; their stage bounds
    # everyone's pace), which the plain pipeline over every device cannot do
    try:
        instruments.run(steps, state)
        whole: tuple[Plan, AnnotatedGraph] | None = (state.plan, state.graph)
        why = ""
    except UsageError:
        raise  # a request these devices cannot take (e.g. zb-h1 with an FPGA) stays an error
    except PipeccError as exc:
        whole, why = None, str(exc)
    from pipecc.techniques.replicas import search as rep
    sub, keep = rep.without_fpgas(cluster)
    try:
        alone = plan(graph, sub, PlanOptions.of(options, use_all_devices=True), debug=debug)
    except PipeccError:
        if whole is None:
            raise
        return whole
    return rep.faster_of(whole, alone, keep, fpgas, why)


# ----------------------------------------------------------------------------- compile
def backends_for(plan: Plan) -> list[Backend]:
    """The backends `plan` needs: torch always (the compiled folder, every stage's torch
    form), FPGA when it places stages on FPGA cards. The last one builds the drop-in module."""
    from pipecc.backends.torch.backend import TorchBackend
    chosen: list[Backend] = [TorchBackend()]
    if plan.fpga_stages():
        from pipecc.backends.fpga.backend import FpgaBackend
        chosen.append(FpgaBackend())
    return chosen


def _cut_stages(state: State) -> None:
    from pipecc.backends.torch.stages import cut_stages
    assert state.graph is not None and state.plan is not None
    state.stages = cut_stages(state.graph, state.plan.stage_of())


def _report(state: State) -> None:
    """report.html and the data behind it (the graph and the schedule's timeline)."""
    import json

    from pipecc.report.artifacts import graph_json, timeline_for, timeline_json
    from pipecc.report.html import render_report
    graph, plan = state.graph, state.plan
    timeline = timeline_for(plan)
    state.extra_files = {"graph.json": json.dumps(graph_json(graph, plan), indent=1),
                         "timeline.json": json.dumps(timeline_json(timeline)),
                         "report.html": render_report(graph, plan, timeline)}


def _check(state: State, *, target: Target) -> None:
    for backend in state.backends:
        backend.check(state.graph, state.plan, state.stages, target)


def _write(state: State, *, out: str | Path, force: bool, target: Target) -> None:
    from pipecc.backends.torch.compile import write_output
    writers = [w for b in state.backends for w in b.writers(state.graph, state.plan, state.stages, target)]
    write_output(out, state.graph, state.plan, state.stages, force=force,
                 extra_files=state.extra_files, writers=writers)


def _module(state: State, *, model: nn.Module, target: Target) -> None:
    state.module = state.backends[-1].module(model, state.graph, state.plan, state.stages, target)


def compile(analysis: Analysis, plan: Plan, graph: AnnotatedGraph, out: str | Path, *,  # noqa: A001
            force: bool = False, fpga_number: str = "float", strict_batchnorm: bool = False,
            debug: bool = False, dump_ir: str | Path | None = None) -> Compiled:
    """Write the compiled folder `out` for `plan` over `graph` (what `driver.plan` returned):
    every stage's torch code, report.html, and each backend's files (FPGA stages' HLS
    projects). Every backend checks the plan first; a failure writes nothing (no OUT).

    Refused: a training pipeline (`pipecc run` trains) of a model with no trainable
    parameters, and BatchNorm over several micro-batches with `strict_batchnorm` (by default
    that is a warning among the returned notes)."""
    from pipecc.backends.base import Target
    model_checks.check_trains(graph.gm.meta, plan.schedule, trainable(graph))  # parameters, outputs with grads
    check_techniques(graph, plan, capabilities_of(backends_for(plan)))
    onnx_import.check_executable(graph.gm)
    replicas = plan.replicas if isinstance(plan.replicas, int) else 1
    batchnorm = batchnorm_warning(graph, plan, strict_batchnorm, replicas=replicas)
    separable(graph, plan, replicas)
    if plan.schedule != "inference":  # a loss_fn mixing samples: refused when the batch is split
        check_split(graph.gm.meta.get(LOSS_META), plan.microbatches, replicas, Path(plan.model_path or "model").name)
    example = tuple(analysis.spec.example_inputs) if analysis.spec is not None else None
    target = Target(example_inputs=example, number=fpga_number)
    steps = [Step("cut stages", _cut_stages),
             Step("report", _report, "writing report"),
             Step("check", partial(_check, target=target)),
             Step("write", partial(_write, out=out, force=force, target=target))]
    state = State(graph=graph, costed=True, plan=plan, backends=backends_for(plan))
    Instruments(debug, dump_ir).run(steps, state)
    assert state.stages is not None
    notes = [f"warning: {batchnorm}"] if batchnorm else []
    notes += [w for w in graph.warnings if w.startswith(constants.NOTE_PREFIX)]  # frozen attributes
    return Compiled(Path(out), state.stages,
                    notes + [line for b in state.backends for line in b.notes(plan, out)])


def compile_module(model: nn.Module, graph: AnnotatedGraph, plan: Plan, example_inputs: tuple, *,
                   devices: Sequence[str] | None = None, fpga_number: str = "float",
                   fpga_dir: str | Path | None = None, strict_batchnorm: bool = False,
                   debug: bool = False, dump_ir: str | Path | None = None) -> nn.Module:
    """`compile`'s in-process counterpart (`pipecc.compile`): the drop-in module over
    `model`'s own parameters, each stage on `devices[i]`; `module.plan` is `plan`. BatchNorm over several
    micro-batches: a warning, or refused with `strict_batchnorm` (a model in eval mode: at `train()`)."""
    from pipecc.backends.base import Target
    check_techniques(graph, plan, capabilities_of(backends_for(plan), in_process=True))
    onnx_import.check_executable(graph.gm)
    batchnorm = batchnorm_warning(graph, plan, strict_batchnorm, current_mode=True)
    separable(graph, plan, 1)  # one process runs each micro-batch whole (no replicas' slices)
    if batchnorm:
        warnings.warn(batchnorm, UserWarning, stacklevel=3)
    in_train_mode = batchnorm_note(graph, plan)  # what `train()` would start
    target = Target(example_inputs=tuple(example_inputs), number=fpga_number,
                    fpga_dir=Path(fpga_dir) if fpga_dir is not None else None, devices=devices)
    steps = [Step("cut stages", _cut_stages),
             Step("check", partial(_check, target=target)),
             Step("module", partial(_module, model=model, target=target))]
    state = State(graph=graph, costed=True, plan=plan, backends=backends_for(plan))
    Instruments(debug, dump_ir).run(steps, state)
    module = state.module
    assert module is not None
    module.plan = plan  # type: ignore[assignment]  # for inspection: pm.plan.stages, ...
    if in_train_mode and not batchnorm and hasattr(module, "warn_on_train"):
        module.warn_on_train(strict_batchnorm_message(in_train_mode) if strict_batchnorm
                             else batchnorm_message(in_train_mode), refuse=strict_batchnorm)
    return module
