"""Replica groups' rule (PP x DP, `--replicas`; the planner's part is `search`, the runtime's
`runtime`): how a plan's stages sit on replica groups. One `requires`, asked by the planner (`--replicas`),
the plan verifier, compile and `pipecc run`.

`Plan.replicas` = d divides the n devices, P = n/d pipeline ranks; stage k sits on rank
j = k % P (the schedule's round robin), `device` = j*d and `replica_devices` =
[j*d .. j*d+d-1] (global rank g = j*d + r); with d = 1 `replica_devices` is [] or [device].
Every device of a group must replicate (an FPGA card is never a replica). Whether the batch
slices over d replicas is the runtime's `replica_problem` (asked with the run's micro-batches).
"""

from __future__ import annotations

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.techniques import capabilities as cap

NAME = "replicas"
TAG = "replica groups (PP x DP)"
OFF = "--replicas 1"
LOWERS = "collectives"  # `lower` adds REDUCE after each stage's last gradient action


def uses(plan: Plan) -> bool:
    return plan.replicas != 1 or any(s.replica_devices for s in plan.stages)


def requires(plan: Plan, caps: cap.Capabilities) -> str | None:
    """Why `plan`'s replica groups cannot run on `caps` (one line with the fix), or None."""
    d, n = plan.replicas, len(plan.devices)
    if not isinstance(d, int) or isinstance(d, bool) or d < 1 or n % d:
        return f"{TAG}: replicas {d!r} must be a positive divisor of the plan's {n} devices; re-plan"
    ranks = n // d
    for k, stage in enumerate(plan.stages):
        group = list(stage.replica_devices)
        if d == 1:
            if group not in ([], [stage.device]):
                return f"{TAG}: stage {k} lists replica devices {group} in a plan without replication; re-plan"
            continue
        j = k % ranks
        want = list(range(j * d, j * d + d))
        if stage.device != j * d or group != want:
            return (f"{TAG}: stage {k} runs on device {stage.device} with replicas {group}; with {d} replicas "
                    f"per stage and {ranks} pipeline ranks it belongs on rank {j}: devices {want}; re-plan")
    if d == 1:
        return None
    where = caps.first_lacking(plan, cap.REPLICATE)
    if where is not None:
        return f"{TAG}: {where} is never replicated; use {OFF}"
    if not caps.runtime_can(cap.REPLICATE):
        return f"{TAG}: {caps.where} runs one replica per stage; use {OFF}"
    return None


def lower(plan: Plan, schedule: Schedule) -> Schedule:
    """The plan's schedule with its gradient all-reduce: REDUCE after each stage's last gradient
    action when its stages have replicas (``pipecc.ir.schedule.lower``, the one lowering the
    runtime also applies); `schedule` itself otherwise."""
    from pipecc.ir.schedule.lower import lower as add_collectives
    return add_collectives(schedule, replicas=plan.replicas)
