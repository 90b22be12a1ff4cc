"""Bi-Partition's rule (separate forward/backward cuts; its parts: `search`, the windowed cut-pair
search, `plan`, the planner pass, `codegen`, the torch backend's worker folders, `runtime` and
`runtime_segments`, the executor's): where a stage's backward range may differ from its forward range.
One `requires`, asked by the planner (before the windowed search), the plan verifier, compile
and `pipecc run`. What needs the graph (tied weights, BatchNorm or the loss in a segment,
non-tensor boundaries) is `plan.graph_requires`, beside the search that
avoids it; what needs generated code (AOTAutograd splitting a segment) is `codegen`'s.

v1 scope (PAPERS-SPEC §3.8): a training plan under 1f1b or gpipe, one stage per device,
replicas 1, equal micro-batches, no recomputing stage, stages whose devices
keep an autograd stash, at least two stages; split layers compose (a split layer's shards are
graph nodes, cut into cores and segments like any other, their slices named by the workers'
`SHARDS`); the runtime mode is "ship" ("recompute" is costed only: a misplaced segment's
forward would run twice, never faster than the single cut, §3.2). BPipe pairs are BPipe's rule
to refuse (it does not move the segments' stashes), not this one.
"""

from __future__ import annotations

from typing import Any

from pipecc.errors import PipeccError
from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.techniques import capabilities as cap
from pipecc.techniques.options import Option, Setting
from pipecc.techniques.bipartition.data import BipartitionCosts, BipartitionSearch
from pipecc.techniques.facts import bipartition_on, recomputing, stages_per_device, training, unequal

NAME = "Bi-Partition"
TAG = "separate forward/backward cuts (Bi-Partition)"
OFF = "--bipartition off"
LOWERS = "collectives"  # `lower` adds REFRESH after the compute it follows
OPTIONS = (Option("--bipartition", "bipartition", "off", "auto|off",
                  "Bi-Partition: separate forward and backward cuts (a layer's forward on "
                  "one device, its backward on the next; its saved tensors and weights travel). "
                  "off (default); auto: search them around the chosen cuts (training, 1f1b or "
                  "gpipe, replicas 1) and keep them only if the simulated iteration is faster",
                  words={"auto": "auto", "off": "off"}, choices=("off", "auto")),)
SETTINGS = (Setting("bipartition_window", int, 8, "units each cut may move from the single cut (PAPERS-SPEC §3.4)"),)
DATA = (BipartitionSearch, BipartitionCosts)  # its side data in the plan (`pipecc.ir.plan_data`)
SCHEDULES = ("1f1b", "gpipe")
MODES = ("", "ship", "recompute")


def uses(plan: Plan) -> bool:
    return bipartition_on(plan)


def options_problem(options: Any) -> str | None:
    """Why the planner's options (`passes.plan_options.PlanOptions`) cannot ask for Bi-Partition
    (one line with the fix), or None."""
    if options.precision != "fp32" and options.bipartition != "off":
        return (f"--precision {options.precision} does not run Bi-Partition pipelines yet: "
                "drop --bipartition, or plan in fp32")
    return None


def one_shape(options: Any) -> str | None:
    """The switch that plans its folder for one input shape (`pipecc.varlen.check_options` refuses
    it with `--length`), or None."""
    return "--bipartition" if options.bipartition != "off" else None


def requires(plan: Plan, caps: cap.Capabilities) -> str | None:
    """Why separate forward/backward cuts cannot run in `plan` on `caps` (one line with the
    fix), or None; the context rules hold whether or not the plan has such cuts yet."""
    if plan.bipartition_mode not in MODES:
        return f"{TAG}: bipartition_mode {plan.bipartition_mode!r} is not one of '', 'ship', 'recompute'; re-plan"
    if not training(plan):
        return f"{TAG} need a training plan (an inference plan has no backward pass); use {OFF}"
    if plan.schedule not in SCHEDULES:
        return f"{TAG} run under the 1f1b or gpipe schedule only, not {plan.schedule}: use --schedule 1f1b, or {OFF}"
    if plan.replicas != 1:
        return f"{TAG} need replicas 1, not {plan.replicas}: use --replicas 1, or {OFF}"
    if stages_per_device(plan) != 1:
        return f"{TAG} need one stage per device, not {stages_per_device(plan)}: use {OFF}"
    if unequal(plan):
        return f"{TAG} need equal micro-batches: use --microbatch-sizes equal, or {OFF}"
    if recomputing(plan):
        return (f"{TAG} with stage {recomputing(plan)[0]} recomputing its activations: use --recompute none, "
                f"or {OFF}")
    where = caps.first_lacking(plan, cap.SAVED_TENSOR_STASH)
    if where is not None:
        return f"{TAG}: {where} keeps no autograd stash to ship; use {OFF}"
    if len(plan.stages) < 2:
        return f"{TAG} need two stages or more (one stage is no pipeline); use {OFF}"
    if not uses(plan):
        return None
    if plan.bipartition_mode == "recompute":
        return (f"{TAG}: mode 'recompute' is only costed, the runtime ships saved tensors (a misplaced "
                f"segment's forward would run twice, never faster than the single cut); re-plan with "
                f"--bipartition auto (mode ship), or {OFF}")
    if plan.bipartition_mode != "ship":
        return f"{TAG}: stages have separate backward ranges but bipartition_mode is empty; set it to 'ship' or re-plan"
    try:
        plan.bipartition_pieces()
    except PipeccError as exc:
        return f"{TAG}: {exc}"
    return None


def lower(plan: Plan, schedule: Schedule) -> Schedule:
    """The plan's schedule with its weight refresh: REFRESH after the last F of each worker that
    holds a segment's replica (``pipecc.ir.schedule.lower``); `schedule` itself without a cut pair."""
    if not plan.is_bipartition():
        return schedule
    from pipecc.ir.schedule.lower import lower as add_collectives
    refresh = sorted({f for kind, f, _, _ in plan.bipartition_pieces() if kind == "segment"})
    return add_collectives(schedule, refresh_stages=refresh)
