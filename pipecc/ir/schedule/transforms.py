"""Schedule transforms over the generators' output: unequal micro-batches (UMPIPE's GPipe
and 1F1B with per-stage chunk sizes, ``gpipe_uneven`` and ``one_f_one_b_uneven``), the collectives
(``gradient_reduce`` for replica groups, ``weight_refresh`` for Bi-Partition's segment replicas,
both applied by ``lower``; ``without_collectives`` the simulator's view) and the forward-only view
of a training schedule (``forward_only``). BPipe's stash transfers are its package's transform
(``pipecc.techniques.bpipe.schedule.bpipe``).

UMPIPE (PAPERS-SPEC.md section 1): ``F(s, k)`` needs every chunk of ``s-1`` that overlaps chunk
``k``'s samples; ``B(s, k)`` (or ``I``) needs its own ``RECV_B(s, k)``. ``gpipe_uneven`` and
``one_f_one_b_uneven`` build the two row orders the runtime executes with unequal sizes
(GPipe's and 1F1B's); both run each stage's forwards and its backwards in chunk order, which is
all the runtime's re-slicing needs (``pipecc.runtime.reslice``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipecc.ir.schedule.actions import _B, _F, Action, ActionKind, Schedule
from pipecc.ir.schedule.chunks import check_size_lists, overlapping
from pipecc.ir.schedule.validate import validate

__all__ = ["forward_only", "gpipe_uneven", "gradient_reduce", "one_f_one_b_uneven", "weight_refresh",
           "without_collectives"]


def _place_comms_uneven(
    compute: list[list[Action]], stage_to_rank: tuple[int, ...], sizes: tuple[tuple[int, ...], ...]
) -> tuple[tuple[Action, ...], ...]:
    """``_place_comms`` for per-stage chunk sizes: before ``F(s, k)`` receive every chunk of
    ``s-1`` overlapping it not yet received; after ``F(s, k)`` send it whole; before ``B(s, k)``
    (or ``I``) receive its gradient; after it, send the gradient of every chunk of ``s-1`` whose
    overlapping chunks of ``s`` have all run their backward. O(actions + chunks)."""
    last = len(stage_to_rank) - 1
    needs = [[]] + [overlapping(sizes[s - 1], sizes[s]) for s in range(1, last + 1)]  # [s][k] -> chunks of s-1
    covers = [overlapping(sizes[s + 1], sizes[s]) for s in range(last)]  # [s][j] -> chunks of s+1
    rows = []
    for rank, row in enumerate(compute):
        out: list[Action] = []
        received: set[tuple[int, int]] = set()
        graded: set[tuple[int, int]] = set()
        sent: set[tuple[int, int]] = set()
        for a in row:
            s, k = a.stage, a.microbatch
            if a.kind is ActionKind.F:
                if s > 0 and stage_to_rank[s - 1] != rank:
                    for j in needs[s][k]:
                        if (s, j) not in received:
                            received.add((s, j))
                            out.append(Action(ActionKind.RECV_F, s, j))
                out.append(a)
                if s < last and stage_to_rank[s + 1] != rank:
                    out.append(Action(ActionKind.SEND_F, s, k))
            elif a.kind is ActionKind.W:
                out.append(a)
            else:
                if s < last and stage_to_rank[s + 1] != rank:
                    out.append(Action(ActionKind.RECV_B, s, k))
                out.append(a)
                graded.add((s, k))
                if s > 0 and stage_to_rank[s - 1] != rank:
                    for j in needs[s][k]:
                        if (s, j) not in sent and all((s, i) in graded for i in covers[s - 1][j]):
                            sent.add((s, j))
                            out.append(Action(ActionKind.SEND_B, s, j))
        rows.append(tuple(out))
    return tuple(rows)


def gpipe_uneven(sizes: Sequence[Sequence[int]], num_ranks: int | None = None) -> Schedule:
    """GPipe with per-stage chunk sizes (UMPIPE, tied mode: one list per stage for its forward
    and backward chunks): stage ``s`` on rank ``s`` runs ``F(s, 0..K_s-1)`` then
    ``B(s, 0..K_s-1)`` in sample order. Messages carry whole chunks of the upstream stage
    (module docstring); ``F(s, k)`` first receives every upstream chunk it overlaps, and the
    gradient of upstream chunk ``j`` goes out right after the last ``B`` overlapping it.
    Every stage stashes the whole batch (``stash_sample_profile``). With equal lists the
    actions are ``gpipe``'s.

    ``num_ranks`` (default: one rank per stage) must divide the stage count; rank ``r`` then
    holds stages ``r, r + p, ...`` (interleaved placement; ``num_ranks=1`` runs every stage in
    one process) and runs all its stages' forwards in stage order, then all their backwards in
    reverse stage order. Raises ValueError for size lists that are empty, not positive or of
    different sums, or a rank count that does not divide the stages.
    """
    table = tuple(tuple(row) for row in sizes)
    check_size_lists(table)
    p = len(table) if num_ranks is None else num_ranks
    if p < 1 or len(table) % p:
        raise ValueError(f"{len(table)} stages do not divide over {p} ranks")
    placement = tuple(s % p for s in range(len(table)))
    compute = []
    for r in range(p):
        mine = [s for s in range(len(table)) if placement[s] == r]
        row = [_F(s, k) for s in mine for k in range(len(table[s]))]
        row += [_B(s, k) for s in reversed(mine) for k in range(len(table[s]))]
        compute.append(row)
    m = max(len(row) for row in table)
    return Schedule(p, len(table), m, placement, _place_comms_uneven(compute, placement, table), table)


def one_f_one_b_uneven(sizes: Sequence[Sequence[int]]) -> Schedule:
    """1F1B (PipeDream-flush) with per-stage chunk sizes (UMPIPE under 1F1B, tied mode), stage
    ``s`` on rank ``s``: PAPERS-SPEC.md §1.3 gives 1F1B-like orders no recurrence, so the rows
    come from a dependency walk and the planner prices them with the event simulator.

    Rank ``s`` keeps at most ``p - s`` of its chunks in flight (forwarded, backward not yet
    run), as 1F1B keeps ``min(p - s, m)`` micro-batches: it runs its next forward while it is
    under that cap, else its next backward, each in chunk order, waiting for what the action
    needs (``F(s, k)`` every chunk of ``s-1`` overlapping chunk ``k``; ``B(s, k)`` the backward
    of every chunk of ``s+1`` overlapping it). Where every rank waits (a chunk of ``s+1`` that
    needs more chunks of ``s`` than the cap lets through), the lowest stage held back by its cap
    runs one more forward, so the walk always ends; a stage then stashes more than ``p - s``
    chunks (``stash_sample_profile`` counts its samples). With equal lists the rows are
    ``one_f_one_b``'s. Raises ValueError for size lists that are empty, not positive or of
    different sums.
    """
    table = tuple(tuple(row) for row in sizes)
    check_size_lists(table)
    p = len(table)
    needs = [[]] + [overlapping(table[s - 1], table[s]) for s in range(1, p)]  # F(s, k) <- F(s-1, j)
    grads = [overlapping(table[s + 1], table[s]) for s in range(p - 1)] + [[]]  # B(s, k) <- B(s+1, j)
    done_f, done_b = [0] * p, [0] * p  # chunks forwarded / backwarded, in order
    cap = [p - s for s in range(p)]  # chunks in flight, as 1F1B's min(p - s, m)
    rows: list[list[Action]] = [[] for _ in range(p)]
    total = sum(len(row) for row in table)

    def forward_ready(s: int) -> bool:
        k = done_f[s]
        return s == 0 or max(needs[s][k]) < done_f[s - 1]

    def backward_ready(s: int) -> bool:
        k = done_b[s]
        return k < done_f[s] and (s == p - 1 or max(grads[s][k]) < done_b[s + 1])

    while sum(done_b) < total:
        moved = False
        for s in range(p):
            forwards_left = done_f[s] < len(table[s])
            if forwards_left and done_f[s] - done_b[s] < cap[s]:
                if forward_ready(s):
                    rows[s].append(_F(s, done_f[s]))
                    done_f[s] += 1
                    moved = True
            elif done_b[s] < done_f[s] and backward_ready(s):
                rows[s].append(_B(s, done_b[s]))
                done_b[s] += 1
                moved = True
        if not moved:  # every rank waits: the lowest stage its cap holds back forwards once more
            held = [s for s in range(p) if done_f[s] < len(table[s]) and forward_ready(s)]
            # NOTE: the lowest stage with forwards left has its inputs, so `held` is never empty
            s = held[0]
            rows[s].append(_F(s, done_f[s]))
            done_f[s] += 1
    placement = tuple(range(p))
    m = max(len(row) for row in table)
    return Schedule(p, p, m, placement, _place_comms_uneven(rows, placement, table), table)


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
    the stage's gradients over its replicas (``pipecc.runtime.replicas``). Stages that have their
    REDUCE already keep it, so applying it twice changes nothing."""
    if not schedule.is_training:
        return schedule
    return _after_last(schedule, ActionKind.REDUCE, None, lambda a: a.kind.frees_stash)


def weight_refresh(schedule: Schedule, stages: Sequence[int]) -> Schedule:
    """Bi-Partition: a training schedule with ``REFRESH(s, j)`` right after the last F of each of
    ``stages`` (the workers holding a replica of a misplaced segment, ``pipecc.runtime.segments``):
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
