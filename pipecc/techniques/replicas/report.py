"""Replica groups' share of the report: the timeline's gradient all-reduce (`timeline_costs`,
asked by `pipecc.report.artifacts.timeline_for`). The replica groups' words in a summary (each
stage's group, the per-replica rows) are the summary's own (`pipecc.report.text.replica_group`,
`replica_rows`): every stage has a group, possibly of one device."""

from __future__ import annotations

from typing import Any

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule

__all__ = ["lines", "timeline_costs"]


def lines(plan: Plan, verbose: bool = False) -> list[str]:
    """None in the technique lines (the stage table names each stage's group)."""
    return []


def timeline_costs(plan: Plan, schedule: Schedule, costs: Any) -> Any:
    """The simulator's `StageCosts` for the timeline: each rank's gradient all-reduce, summed
    over its stages (`StagePlan.allreduce_s`) as the planner has it; `costs` unchanged with one
    replica."""
    if plan.replicas > 1:
        costs.allreduce_s = [0.0] * schedule.num_ranks
        for k, s in enumerate(plan.stages):
            costs.allreduce_s[schedule.stage_to_rank[k]] += s.allreduce_s
    return costs
