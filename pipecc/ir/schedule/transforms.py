"""Schedule transforms over the generators' output: the collectives (``gradient_reduce`` for
replica groups, ``weight_refresh`` for Bi-Partition's segment replicas, both applied by
``lower``; ``without_collectives`` the simulator's view) and the forward-only view of a training
schedule (``forward_only``). A technique's own transform is its package's: UMPIPE's row orders
(``pipecc.techniques.umpipe.schedule``), BPipe's stash transfers (``pipecc.techniques.bpipe.schedule``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.ir.schedule.validate import validate

__all__ = ["forward_only", "gradient_reduce", "weight_refresh", "without_collectives"]


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule with its backward actions removed (same placement and forward order): what
    a training schedule runs for inference (``PipelineRuntime.infer``)."""
    keep = (ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F)
    rows = tuple(tuple(a for a in row if a.kind in keep) for row in schedule.actions)
    result = Schedule(schedule.num_ranks, schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank, rows,
                      schedule.microbatch_sizes)
    validate(result)
    return result


# ---------------------------------------------------------------------------- collectives


def _rebuilt(schedule: Schedule, rows: Sequence[Sequence[Action]]) -> Schedule:
    """``schedule`` with other action rows (same placement, sizes and pairs), validated."""
    result = Schedule(schedule.num_ranks, schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank,
                      tuple(tuple(row) for row in rows), schedule.microbatch_sizes, schedule.partner)
    validate(result)
    return result


def _after_last(schedule: Schedule, kind: ActionKind, stages: Sequence[int] | None,
                marks: Callable[[Action], bool]) -> Schedule:
    """``schedule`` with ``Action(kind, s, j)`` right after the last action of stage ``s`` on
    its row for which ``marks`` holds (``j``: that action's micro-batch), for every stage in
    ``stages`` (None: all) that has no ``kind`` action yet; a row's other actions keep their order."""
    wanted = set(range(schedule.num_stages) if stages is None else stages)
    have = {a.stage for row in schedule.actions for a in row if a.kind is kind}
    if wanted <= have:  # NOTE: already lowered (a compiled schedule.txt): itself, not rebuilt and validated again
        return schedule
    rows = []
    for row in schedule.actions:
        last = {a.stage: i for i, a in enumerate(row) if marks(a) and a.stage in wanted - have}
        after = {i: Action(kind, row[i].stage, row[i].microbatch) for i in last.values()}
        rows.append([x for i, a in enumerate(row) for x in ((a, after[i]) if i in after else (a,))])
    return _rebuilt(schedule, rows)


def gradient_reduce(schedule: Schedule) -> Schedule:
    """Replica groups (PP x DP): a training schedule with ``REDUCE(s, j)`` right after every
    stage's last gradient action (its last B, or W when the backward is split), which all-reduces
    the stage's gradients over its replicas (``pipecc.techniques.replicas.runtime``). Stages that have their
    REDUCE already keep it, so applying it twice changes nothing."""
    if not schedule.is_training:
        return schedule
    return _after_last(schedule, ActionKind.REDUCE, None, lambda a: a.kind.frees_stash)


def weight_refresh(schedule: Schedule, stages: Sequence[int]) -> Schedule:
    """Bi-Partition: a training schedule with ``REFRESH(s, j)`` right after the last F of each of
    ``stages`` (the workers holding a replica of a misplaced segment, ``techniques.bipartition.runtime_segments``):
    from there the replica is not read again this iteration, so its refresh from the owner can
    be received into it while the rank runs its remaining backwards. Idempotent, as
    ``gradient_reduce``."""
    if not schedule.is_training or not stages:
        return schedule
    return _after_last(schedule, ActionKind.REFRESH, stages, lambda a: a.kind is ActionKind.F)


def without_collectives(schedule: Schedule) -> Schedule:
    """The schedule without its REDUCE and REFRESH actions: what the simulator times (it charges
    the all-reduce as a per-rank cost, ``StageCosts.allreduce_s``, and the refresh as the tail)."""
    if not any(a.kind.is_collective for row in schedule.actions for a in row):
        return schedule
    return _rebuilt(schedule, [[a for a in row if not a.kind.is_collective] for row in schedule.actions])
