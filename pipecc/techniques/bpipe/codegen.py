"""The compiled folder's BPipe record: the plan's stage pairs, with the schedule the runtime
(`pipecc.techniques.bpipe.runtime_stash`, `pipecc.techniques.bpipe.schedule`) will build from
them validated (`marker_fields`, the torch backend's hook)."""

from __future__ import annotations

from typing import Any

from pipecc.errors import PipeccError
from pipecc.ir.plan import Plan
from pipecc.techniques.bpipe import thresholds as bpipe_thresholds


def check_activation_balancing(plan: Plan) -> list[dict]:
    """The plan's BPipe pairs as `pipecc.json` records them ([] when off). Where BPipe can run
    (1f1b, one stage per rank, well-formed pairs, ...) the driver asked already
    (`pipecc.techniques.bpipe.requires`); what remains is that the IR's `bpipe` generator
    builds and validates this schedule, as the runtime will."""
    pairs = [dict(p) for p in getattr(plan, "activation_balancing", None) or []]
    if not pairs:
        return []
    thresholds, policy = bpipe_thresholds(pairs, len(plan.stages))
    from pipecc.ir.schedule.registry import schedule_for
    from pipecc.ir.schedule.text import ScheduleError
    try:
        schedule_for("1f1b", len(plan.stages), plan.microbatches, bpipe_thresholds=thresholds, bpipe_policy=policy)
    except (ValueError, ScheduleError) as e:
        raise PipeccError(f"activation balancing {pairs}: {getattr(e, 'summary', e)}; "
                          "plan with --activation-balancing off") from None
    return pairs


def marker_fields(plan: Plan) -> dict[str, Any]:
    """The technique's entries of the compiled folder's marker (the torch backend's hook):
    "activation_balancing", the plan's pairs ([] when off; `check_activation_balancing`)."""
    return {"activation_balancing": check_activation_balancing(plan)}
