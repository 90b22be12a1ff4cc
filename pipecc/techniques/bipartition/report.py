"""Bi-Partition's report lines (`pipecc plan`, `pipecc inspect`, the HTML report): the cut pair
and each stage's forward and backward node ranges; and its timeline costs (`timeline_costs`,
asked by `pipecc.report.artifacts.timeline_for`): the two directions' transfers and the tail."""

from __future__ import annotations

from typing import Any

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.report.figures import first_last

__all__ = ["bipartition_lines", "lines", "timeline_costs"]


def bipartition_lines(plan: Plan) -> list[str]:
    """Text lines for a plan with separate forward/backward cuts (Bi-Partition): the cut pair
    in units and, per stage, its forward and backward node ranges; [] without."""
    if not plan.is_bipartition():
        return []
    info = plan.bipartition
    cuts = ""
    if info is not None and info.fwd_bounds:
        cuts = (f"FP cuts {list(info.fwd_bounds[1:-1])}, BP cuts {list(info.bwd_bounds or ())[1:-1]} "
                "(in units); ")
    out = [f"Bi-Partition    {cuts}mode {plan.bipartition_mode}: a segment between two cuts runs "
           f"forward on one stage, backward on its neighbour; {plan.weight_sync_bytes} bytes of "
           "replica refresh per iteration"]
    for s in plan.stages:
        f0, f1 = first_last(s.nodes)
        b0, b1 = first_last(s.backward_nodes or s.nodes)
        extra = f", sends {s.extra_send_bytes} B of segment stash per micro-batch" if s.extra_send_bytes else ""
        out.append(f"  stage {s.index}: forward {f0} .. {f1}, backward {b0} .. {b1}{extra}")
    return out


def lines(plan: Plan, verbose: bool = False) -> list[str]:
    """The technique's lines in a plan's summary (`pipecc.techniques.parts("report")`)."""
    return bipartition_lines(plan)


def timeline_costs(plan: Plan, schedule: Schedule, costs: Any) -> Any:
    """The simulator's `StageCosts` for the timeline: the two directions' transfers differ, so
    the planner saved both, and the tail (`plan.bipartition_costs`); `costs` unchanged without."""
    saved = plan.bipartition_costs if plan.is_bipartition() else None
    if saved is not None:
        m = plan.microbatches
        costs.send_forward_s = [[float(t)] * m for t in saved.send_forward_s]
        costs.send_backward_s = [[float(t)] * m for t in saved.send_backward_s]
        costs.tail_s = [float(t) for t in saved.tail_s] or None
    return costs
