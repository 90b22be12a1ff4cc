"""Bi-Partition's report lines (`pipecc plan`, `pipecc inspect`, the HTML report): the cut pair
and each stage's forward and backward node ranges. A report part's optional hooks:

    html(plan)                          report.html's section (`pipecc.report.html`)
    compiled_lines(plan)                lines `pipecc compile` prints after its summary
                                        (`pipecc.cli.compile`): the segments shipped
    timeline_costs(plan, schedule, costs)   the timeline's costs (`pipecc.report.artifacts.timeline_for`):
                                        the two directions' transfers and the tail
"""

from __future__ import annotations

from typing import Any

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.report.figures import first_last
from pipecc.report.svg import esc
from pipecc.techniques.bipartition.data import BipartitionCosts, BipartitionSearch

__all__ = ["bipartition_lines", "compiled_lines", "html", "lines", "timeline_costs"]


def bipartition_lines(plan: Plan) -> list[str]:
    """Text lines for a plan with separate forward/backward cuts (Bi-Partition): the cut pair
    in units and, per stage, its forward and backward node ranges; [] without."""
    if not plan.is_bipartition():
        return []
    info = plan.data(BipartitionSearch)
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


def html(plan: Plan) -> str:
    """Bi-Partition's cut pair and each stage's forward/backward range ("" without)."""
    lines = bipartition_lines(plan)
    if not lines:
        return ""
    items = "".join(f"<li>{esc(x.strip())}</li>" for x in lines[1:])
    return (f'<h3>Forward/backward cuts (Bi-Partition)</h3><p class="note">'
            f'{esc(lines[0].removeprefix("Bi-Partition").strip())}</p><ul>{items}</ul>')


def compiled_lines(plan: Plan) -> list[str]:
    """`pipecc compile`'s line on the segments it shipped ([] without Bi-Partition)."""
    if not plan.is_bipartition():
        return []
    segments = [(f, b) for kind, f, b, _ in plan.bipartition_pieces() if kind == "segment"]
    where = ", ".join(f"forward on {f} / backward on {b}" for f, b in segments)
    return [f"Bi-Partition (ship): {len(segments)} segment(s) ({where}); each stage_<i>/ "
            "holds its core and segment_<b>.py files, the forward worker a replica "
            "refreshed after every step"]


def timeline_costs(plan: Plan, schedule: Schedule, costs: Any) -> Any:
    """The simulator's `StageCosts` for the timeline: the two directions' transfers differ, so
    the planner saved both, and the tail (`BipartitionCosts`); `costs` unchanged without."""
    saved = plan.data(BipartitionCosts) if plan.is_bipartition() else None
    if saved is not None:
        m = plan.microbatches
        costs.send_forward_s = [[float(t)] * m for t in saved.send_forward_s]
        costs.send_backward_s = [[float(t)] * m for t in saved.send_backward_s]
        costs.tail_s = [float(t) for t in saved.tail_s] or None
    return costs
