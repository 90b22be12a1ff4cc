"""UMPIPE's rule (unequal micro-batches per stage): where per-stage chunk sizes can run. One
`requires`, asked by the planner (before it searches sizes), the plan verifier, compile and
`pipecc run`. The package's other parts: `search` (the recurrence and the GA), `plan` (chunk
costs, `--microbatch-sizes`), `schedule` (the row orders), `runtime` (the re-slicing inbox).

The runtime's re-slicing runs each stage's chunks in order, so GPipe's and 1F1B's row orders
both take unequal sizes (`pipecc.ir.schedule.UNEVEN`: the recurrence prices GPipe, the event
simulator 1F1B, PAPERS-SPEC.md §1.3), with one stage per device and no replica groups; a
recomputing stage is not modelled and every stage's device must take chunks of different sizes
(an FPGA kernel is compiled for one). BPipe's pairs and Bi-Partition's segments assume equal
micro-batches: their rules refuse the pair, not this one.
"""

from __future__ import annotations

from typing import Sequence

from pipecc.errors import PipeccError, UsageError
from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.ir.schedule.registry import UNEVEN
from pipecc.techniques import capabilities as cap
from pipecc.techniques.options import Option, Setting
from pipecc.techniques.umpipe.data import UmpipeChunkCosts, UmpipeSearch
from pipecc.techniques.facts import recomputing, stages_per_device, training, unequal

NAME = "UMPIPE"
TAG = "unequal micro-batches (UMPIPE)"
OFF = "--microbatch-sizes equal"
LOWERS = "rows"  # `lower` rebuilds the base schedule's rows over each stage's chunks


def parse_sizes(text: str) -> list[int]:
    """``--microbatch-sizes S1,S2,...``: the sizes (each > 0; the sum is checked against the
    batch size later)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"expected auto, off or sizes like 3,5, got {text!r}") from None


OPTIONS = (Option("--microbatch-sizes", "microbatch_sizes", "equal", "auto|off|S1,S2,...",
                  "UMPIPE: per-stage micro-batch sizes. off (default): every stage splits "
                  "the batch into equal micro-batches; auto: when the chosen plan runs gpipe or "
                  "1f1b, search each stage's own sizes (genetic search, at most 10 s) and keep "
                  "them if faster; S1,S2,...: these sizes (summing to the batch size) on every "
                  "stage, under gpipe (or --schedule 1f1b) with replicas 1 (old spelling of off: equal)",
                  words={"auto": "auto", "off": "equal"}, old={"equal": "equal"}, parse=parse_sizes,
                  type=str | Sequence[int]),)
SETTINGS = (Setting("umpipe_budget_s", float, 10.0, "UMPIPE's search budget (s) under microbatch_sizes=\"auto\""),)
DATA = (UmpipeSearch, UmpipeChunkCosts)  # its side data in the plan (`pipecc.ir.plan_data`)


def uses(plan: Plan) -> bool:
    return unequal(plan)


def one_shape(options: Any) -> str | None:
    """The switch that plans its folder for one input shape (`pipecc.varlen.check_options` refuses
    it with `--length`), or None."""
    return "--microbatch-sizes (unequal micro-batches)" if options.microbatch_sizes != "equal" else None


def requires(plan: Plan, caps: cap.Capabilities) -> str | None:
    """Why unequal micro-batches cannot run in `plan` on `caps` (one line with the fix), or
    None; the context rules hold whether or not the plan has sizes yet."""
    if not training(plan):
        return f"{TAG} need a training plan (they are a training schedule); use {OFF}"
    if plan.schedule not in UNEVEN:
        return (f"{TAG} run under the gpipe or 1f1b schedule only, not {plan.schedule}: use --schedule 1f1b, "
                f"or {OFF}")
    if plan.replicas != 1:
        return f"{TAG} need replicas 1, not {plan.replicas}: use --replicas 1, or {OFF}"
    if stages_per_device(plan) != 1:
        return f"{TAG} need one stage per device, not {stages_per_device(plan)}: use {OFF}"
    if recomputing(plan):
        return (f"{TAG} do not model recomputation, but stage {recomputing(plan)[0]} recomputes its "
                f"activations: use --recompute none, or {OFF}")
    where = caps.first_lacking(plan, cap.VARIABLE_MICROBATCH)
    if where is not None:
        return f"{TAG}: {where} is compiled for one micro-batch shape; use {OFF}"
    if len(plan.stages) < 2:
        return f"{TAG} need two stages or more (one stage is no pipeline); use {OFF}"
    return None


def lower(plan: Plan, schedule: Schedule) -> Schedule:
    """The plan's schedule with its unequal sizes: the base row order (`schedule`, gpipe or 1f1b
    by name) rebuilt over every stage's own chunks (``schedule.gpipe_uneven``, ``one_f_one_b_uneven``);
    `schedule` itself when the plan has equal micro-batches."""
    if not uses(plan):
        return schedule
    from pipecc.ir.schedule.registry import schedule_for
    n = len(plan.stages)
    return schedule_for(plan.schedule, n, plan.microbatches, num_ranks=schedule.num_ranks,
                        microbatch_sizes=plan.microbatch_sizes)


def at_run(kind: str | Schedule, world: int, microbatches: int, stages_per_rank: int,
           sizes: Sequence[Sequence[int]] | None, balancing: Sequence[dict] | None) -> Schedule | None:
    """The schedule a run's unequal sizes (one list per stage) build by name
    (`pipecc.runtime.engine.build_schedule`; ``microbatches`` is ignored, the longest list
    counts), or None without sizes, beside BPipe's pairs (whose rule refuses them) or when `kind`
    is a folder's parsed ``schedule.txt`` (the engine checks its sizes against the ports)."""
    if sizes is None or balancing or isinstance(kind, Schedule):
        return None
    if kind not in UNEVEN:
        raise UsageError(f"unequal micro-batch sizes run under the {' or '.join(UNEVEN)} schedule only, not "
                         f"{kind!r}; drop --schedule or compile with equal micro-batches")
    from pipecc.ir.schedule.registry import schedule_for
    try:
        return schedule_for(kind, len(sizes), microbatches, num_ranks=world, microbatch_sizes=sizes)
    except ValueError as e:
        raise PipeccError(f"microbatch_sizes: {getattr(e, 'summary', e)}") from None
