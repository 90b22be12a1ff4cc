"""The zero-bubble schedules' rule (`zb-h1`; the executor's I and W handler is this package's
`runtime`): every stage's backward runs as an input-gradient action I and a weight-gradient
action W. One `requires`, asked by the planner (an explicit `--schedule zb-h1`; `auto` leaves
the schedule out where it would refuse), the plan verifier, compile and `pipecc run --schedule`.
"""

from __future__ import annotations

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.ir.schedule import ZERO_BUBBLE
from pipecc.techniques import capabilities as cap

NAME = "zero-bubble"
TAG = "the zero-bubble schedule"
OFF = "--schedule 1f1b"
LOWERS = "unchanged"  # `lower` is the identity: zb-h1 is its generator


def uses(plan: Plan) -> bool:
    return plan.schedule in ZERO_BUBBLE


def requires(plan: Plan, caps: cap.Capabilities) -> str | None:
    """Why `plan`'s zero-bubble schedule cannot run on `caps` (one line with the fix), or None."""
    if not uses(plan):
        return None
    where = caps.first_lacking(plan, cap.SPLIT_BACKWARD)
    if where is not None:
        return (f"{TAG} {plan.schedule} splits every stage's backward into input and weight gradients, "
                f"which {where} cannot run; use {OFF}, or leave that device out")
    if not caps.runtime_can(cap.SPLIT_BACKWARD):
        return f"{TAG} {plan.schedule}: {caps.where} cannot split a backward; use {OFF}"
    return None


def lower(plan: Plan, schedule: Schedule) -> Schedule:
    """`schedule` unchanged: zero-bubble is its generator (``zb_h1``, I and W in place of B),
    chosen by the plan's schedule name before any technique lowers it."""
    return schedule
