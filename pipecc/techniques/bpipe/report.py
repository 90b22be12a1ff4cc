"""BPipe's report lines (`pipecc plan`, `pipecc inspect`): its pairs, each stage's peak memory
before and after, or why the planner did not use it, from the plan's BPipe estimate; and its
timeline costs (`timeline_costs`, asked by `pipecc.report.artifacts.timeline_for`): the stash
transfers."""

from __future__ import annotations

from typing import Any

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule

__all__ = ["DECISIONS", "bpipe_lines", "lines", "timeline_costs"]

DECISIONS = "BPipe"  # the planner's decision lines its lines already say (verbose summaries skip them)


def bpipe_lines(plan: Plan, verbose: bool = False) -> list[str]:
    """Activation balancing (BPipe): the pairs and each stage's peak memory before and after, or
    (`verbose`) why it was not used, from the estimate; [] when the planner did not weigh it."""
    est = plan.estimate or {}
    if not plan.activation_balancing:
        if not verbose:
            return []
        return [f"BPipe           not used: {est['reason']}" + (
            f" (estimated {est['speedup']:.2f}x)" if est.get("speedup") else "")] if est.get("reason") else []
    pairs = ", ".join(f"{p['evictor']}<->{p['acceptor']} K={p['threshold']}" for p in plan.activation_balancing)
    lines = [f"BPipe           pairs {pairs} ({plan.activation_balancing[0].get('policy', 'jit')} returns)"
             + (f", estimated {est['speedup']:.2f}x" if est.get("speedup") else "")
             + (f", stash transfers {est['hidden_fraction']:.0%} hidden" if "hidden_fraction" in est else "")]
    before, after = est.get("memory_before_bytes"), est.get("memory_after_bytes")
    if before and after:
        from pipecc.report.formatting import human
        lines.append("  memory        " + ", ".join(f"{k}: {human(b, 'B')} -> {human(a, 'B')}"
                                                  for k, (b, a) in enumerate(zip(before, after))))
    return lines


def lines(plan: Plan, verbose: bool = False) -> list[str]:
    """The technique's lines in a plan's summary (`pipecc.techniques.parts("report")`)."""
    return bpipe_lines(plan, verbose)


def timeline_costs(plan: Plan, schedule: Schedule, costs: Any) -> Any:
    """The simulator's `StageCosts` for the timeline: its stash transfers, as the planner timed
    them (the estimate's `stash_transfer_s`); `costs` unchanged without activation balancing."""
    if plan.activation_balancing:
        n, m = len(plan.stages), plan.microbatches
        costs.stash_transfer_s = [[float(x)] * m for x in plan.estimate.get("stash_transfer_s", [0.0] * n)]
    return costs
