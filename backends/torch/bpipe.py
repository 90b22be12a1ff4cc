"""The compiled folder's BPipe record: the plan's stage pairs, checked against what the runtime
(`pipecc.runtime.stash`, `pipecc.ir.schedule.bpipe`) can execute."""

from __future__ import annotations

from pipecc.errors import PipeccError
from pipecc.ir.plan import Plan
from pipecc.runtime.stash import bpipe_thresholds


def check_activation_balancing(plan: Plan, sizes: list[list[int]] | None = None) -> list[dict]:
    """The plan's BPipe pairs as `pipecc.json` records them ([] when off). Refuses, in one line, what
    the runtime cannot execute (`pipecc.runtime.stash`): anything but the 1f1b schedule with one
    stage per rank, replicas 1, equal micro-batches and no FPGA stage; a pairing other than
    (s, p-1-s) with s < p // 2; a schedule the IR's `bpipe` generator cannot build and validate."""
    pairs = [dict(p) for p in getattr(plan, "activation_balancing", None) or []]
    if not pairs:
        return []
    off = "plan with --activation-balancing off"
    fpga = plan.fpga_stages()
    if plan.schedule != "1f1b":
        raise PipeccError(f"activation balancing (BPipe) runs under the 1f1b schedule only, the plan says "
                          f"{plan.schedule!r}; plan with --schedule 1f1b or {off}")
    for problem in (f"{plan.virtual_stages} virtual stages per rank" if plan.virtual_stages != 1 else "",
                    f"replicas {plan.replicas}" if plan.replicas != 1 else "",
                    "unequal micro-batch sizes" if sizes is not None else "",
                    f"an FPGA stage ({min(fpga)})" if fpga else ""):
        if problem:
            raise PipeccError(f"activation balancing (BPipe) cannot run with {problem}; {off}")
    thresholds, policy = bpipe_thresholds(pairs, len(plan.stages))
    from pipecc.ir.schedule.registry import schedule_for
    from pipecc.ir.schedule.text import ScheduleError
    try:
        schedule_for("1f1b", len(plan.stages), plan.microbatches, bpipe_thresholds=thresholds, bpipe_policy=policy)
    except (ValueError, ScheduleError) as e:
        raise PipeccError(f"activation balancing {pairs}: {getattr(e, 'summary', e)}; {off}") from None
    return pairs
