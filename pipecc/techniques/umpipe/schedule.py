"""UMPIPE's row orders (PAPERS-SPEC.md section 1): GPipe and 1F1B with per-stage chunk sizes,
``gpipe_uneven`` and ``one_f_one_b_uneven``, which ``pipecc.ir.schedule.registry.schedule_for``
builds for a plan's ``microbatch_sizes`` (through ``sized_rows``, the schedule part's hook the
registry asks). IR: pure functions over schedules.

``F(s, k)`` needs every chunk of ``s-1`` that overlaps chunk ``k``'s samples; ``B(s, k)`` (or
``I``) needs its own ``RECV_B(s, k)``. Both orders run each stage's forwards and its backwards
in chunk order, which is all the runtime's re-slicing needs (``pipecc.techniques.umpipe.runtime``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipecc.ir.schedule.actions import _B, _F, Action, Schedule
from pipecc.ir.schedule.chunks import check_size_lists, overlapping
from pipecc.ir.schedule.sendrecv import add_send_recv

__all__ = ["gpipe_uneven", "one_f_one_b_uneven", "sized_rows"]


def sized_rows(name: str, sizes: Sequence[Sequence[int]], num_ranks: int) -> Schedule:
    """The schedule part's hook for ``schedule_for(name, ..., microbatch_sizes=sizes)`` (the
    registry has checked `name` and the stage count): ``gpipe_uneven`` for gpipe,
    ``one_f_one_b_uneven`` for 1f1b (one stage per rank), both lowered by ``add_send_recv``."""
    return gpipe_uneven(sizes, num_ranks) if name == "gpipe" else one_f_one_b_uneven(sizes)


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
    return add_send_recv(Schedule(p, len(table), m, placement, tuple(map(tuple, compute)), table))


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
    return add_send_recv(Schedule(p, p, m, placement, tuple(map(tuple, rows)), table))
