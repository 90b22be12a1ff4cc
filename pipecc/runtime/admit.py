"""A compiled folder asked the techniques' rules before a run (`pipecc run`, and every rank
again): the same `requires` the planner, the verifier and compile ask
(`pipecc.techniques`), so a hand-edited plan.json or pipecc.json, or a `--schedule` the
folder cannot run, is refused with the line compile would give.

The plans asked: plan.json as it stands (compile's answer for it), then the one the run would
execute: plan.json with pipecc.json's runtime fields over it (schedule, replicas, per-stage micro-batch sizes, BPipe pairs: what the
runtime reads) and the run's own `--schedule`. One process without torchrun runs without
BPipe's pairs and places every stage on its one rank (Bi-Partition's workers under
`--schedule interleaved`, say): its `--schedule` is left to the engine's schedule builder. A folder without a readable plan.json (written by hand, or before plan.json)
is left to the checks the runtime makes on its way.
"""

from __future__ import annotations

import copy
from typing import Any

from pipecc.errors import PipeccError, UsageError
from pipecc import techniques
from pipecc.ir.plan import Plan

__all__ = ["folder_plan", "check_folder_plan"]


def folder_plan(meta: dict[str, Any] | None, plan_data: dict[str, Any] | None) -> Plan | None:
    """The plan a folder runs (module docstring), or None without a readable plan.json."""
    if not plan_data:
        return None
    try:
        plan = Plan.from_json(copy.deepcopy(plan_data))
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    meta = meta or {}
    for key in ("schedule", "replicas", "microbatch_sizes", "activation_balancing"):
        if key in meta:
            setattr(plan, key, copy.deepcopy(meta[key]))
    plan.activation_balancing = plan.activation_balancing or []
    return plan


def check_folder_plan(meta: dict[str, Any] | None, plan_data: dict[str, Any] | None, schedule: str | None,
                      one_process: bool = False) -> None:
    """Refuse (one line) a folder whose plan a technique's rule refuses on the compiled folder's
    capabilities: a PipeccError with compile's line, or a UsageError naming `--schedule` when
    only the run's schedule makes it refused."""
    plan = folder_plan(meta, plan_data)
    if plan is None:
        return
    written = Plan.from_json(copy.deepcopy(plan_data))  # plan.json as it stands: compile's line for it
    why = techniques.requires(written, techniques.COMPILED)
    if why is not None:
        raise PipeccError(why)
    if one_process:
        plan.activation_balancing = []  # NOTE: every stage on one rank: no partner to move stashes to
    why = techniques.requires(plan, techniques.COMPILED)
    if why is not None:
        raise PipeccError(why)
    if one_process or schedule is None or schedule == plan.schedule:
        return  # NOTE: one process runs every stage on one rank, its --schedule is the engine's to refuse
    plan.schedule = schedule
    why = techniques.requires(plan, techniques.COMPILED)
    if why is not None:
        raise UsageError(f"--schedule {schedule}: {why} (or drop --schedule)")
