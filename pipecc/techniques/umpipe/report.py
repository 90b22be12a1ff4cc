"""UMPIPE's share of the report (`pipecc plan`, `pipecc inspect`, OUT/timeline.json, report.html):
how its summaries name the unequal split, and the timeline of its chunks. A report part's hooks
(`pipecc.report.text.technique_answer` asks them; each None or [] where the plan does not use it):

    lines(plan, verbose)         the technique lines of a summary (none: its words are below)
    batch_split(plan, view)      how the summary's first line names the batch's split ("plan":
                                 `pipecc plan`, "inspect": `pipecc inspect`)
    labelled(plan)               (label, text) lines after `pipecc plan`'s "times" line
    timeline(plan, schedule)     the simulator's timeline when the technique prices the actions
                                 itself (`pipecc.report.artifacts.timeline_for`)
"""

from __future__ import annotations

from typing import Any

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.report.artifacts import step_tail
from pipecc.techniques.umpipe.data import UmpipeChunkCosts

__all__ = ["batch_split", "labelled", "lines", "sizes_text", "timeline"]


def lines(plan: Plan, verbose: bool = False) -> list[str]:
    """None in the technique lines: the split is in the first line (`batch_split`) and below
    the times (`labelled`)."""
    return []


def sizes_text(plan: Plan) -> str:
    """The per-stage micro-batch sizes, `stage 0 [4, 4], stage 1 [8]` ("" without)."""
    if not plan.microbatch_sizes:
        return ""
    return ", ".join(f"stage {k} {list(row)}" for k, row in enumerate(plan.microbatch_sizes))


def batch_split(plan: Plan, view: str) -> str | None:
    """The words of the summary's first line on the unequal split (`view` "plan" or "inspect"),
    or None with equal micro-batches."""
    if not plan.microbatch_sizes:
        return None
    if view == "plan":
        return f"unequal micro-batches per stage (UMPIPE): {sizes_text(plan)}, "
    per = _figures_microbatch(plan)
    return (f", unequal micro-batches per stage: {sizes_text(plan)} (batch {plan.batch_size}); "
            f"figures per micro-batch of {'?' if per is None else per}")


def _figures_microbatch(plan: Plan) -> int | None:
    """The micro-batch the stage table's figures are at (the planner's equal one), if saved."""
    saved = plan.data(UmpipeChunkCosts)
    return saved.stage_figures_microbatch if saved is not None else None


def labelled(plan: Plan) -> list[tuple[str, str]]:
    """`pipecc plan`'s "micro-batches" line: how the iteration was predicted."""
    if not plan.microbatch_sizes:
        return []
    per = _figures_microbatch(plan)
    return [("micro-batches", "unequal per stage (UMPIPE, gpipe order, forward and backward "
             "alike); the iteration predicted from per-chunk costs with per-call overhead"
             + (f"; stage figures above at {per} samples" if per else ""))]


def timeline(plan: Plan, schedule: Schedule) -> Any:
    """The row order over the plan's per-stage sizes, with the per-chunk seconds the planner
    predicted with (`UmpipeChunkCosts`); a plan without them (written by hand) gets the
    stage figures scaled linearly in the chunk size. None with equal micro-batches."""
    from pipecc.passes.simulate import StageCosts, simulate

    if not plan.microbatch_sizes:
        return None
    sizes = plan.microbatch_sizes or []
    saved = plan.data(UmpipeChunkCosts)
    if saved is not None:
        costs = StageCosts(**saved.costs())
        if not saved.has_tail:  # NOTE: plans before the one cost model saved no tails
            costs.tail_s = step_tail(plan, schedule)
    else:
        per = max(plan.batch_size // max(plan.microbatches, 1), 1)
        n = len(plan.stages)
        send = [s.comm_s / 4 for s in plan.stages]  # NOTE: a rough split of 2*recv + 2*send
        costs = StageCosts(
            [[s.forward_s * b / per for b in sizes[k]] for k, s in enumerate(plan.stages)],
            [[s.backward_s * b / per for b in sizes[k]] for k, s in enumerate(plan.stages)],
            [[send[k] * b / per if k < n - 1 else 0.0 for b in sizes[k]] for k in range(n)],
            [[send[k] * b / per if k > 0 else 0.0 for b in sizes[max(k - 1, 0)]] for k in range(n)],
            [[0.0] * len(sizes[k]) for k in range(n)], [0.0] * n)
        costs.tail_s = step_tail(plan, schedule)
    return simulate(schedule, costs)
