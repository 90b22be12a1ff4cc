"""Schedule transforms over the generators' output: unequal micro-batches (UMPIPE's GPipe
and 1F1B with per-stage chunk sizes, ``gpipe_uneven`` and ``one_f_one_b_uneven``), BPipe's stash
transfers inserted into 1F1B (``bpipe``), the collectives (``gradient_reduce`` for replica groups,
``weight_refresh`` for Bi-Partition's segment replicas, both applied by ``lower``;
``without_collectives`` the simulator's view) and the forward-only view of a training schedule (``forward_only``).

UMPIPE (PAPERS-SPEC.md section 1): ``F(s, k)`` needs every chunk of ``s-1`` that overlaps chunk
``k``'s samples; ``B(s, k)`` (or ``I``) needs its own ``RECV_B(s, k)``. ``gpipe_uneven`` and
``one_f_one_b_uneven`` build the two row orders the runtime executes with unequal sizes
(GPipe's and 1F1B's); both run each stage's forwards and its backwards in chunk order, which is
all the runtime's re-slicing needs (``pipecc.runtime.reslice``).

BPipe (PAPERS-SPEC.md 2.3-2.4): ``bpipe(one_f_one_b(p, m), thresholds)`` builds the schedule;
``Schedule.stash_profile`` counts an evicted stash on the acceptor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipecc.ir.schedule.actions import _B, _F, Action, ActionKind, Schedule
from pipecc.ir.schedule.chunks import check_size_lists, overlapping
from pipecc.ir.schedule.generators import one_f_one_b
from pipecc.ir.schedule.progress import advance
from pipecc.ir.schedule.validate import validate

__all__ = ["BPIPE_POLICIES", "bpipe", "bpipe_pairs", "forward_only", "gpipe_uneven", "gradient_reduce",
           "one_f_one_b_uneven", "weight_refresh", "without_collectives"]


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



# ---------------------------------------------------------------------------- BPipe

BPIPE_POLICIES = ("jit", "eager")


def bpipe_pairs(num_stages: int) -> list[tuple[int, int]]:
    """BPipe's (evictor, acceptor) pairs: ``(s, p-1-s)`` for ``s < p // 2`` (PAPERS-SPEC.md 2.3);
    with odd ``p`` the middle stage has no partner."""
    return [(s, num_stages - 1 - s) for s in range(num_stages // 2)]


def _unit_times(base: Schedule, backward: float) -> dict[Action, tuple[float, float]]:
    """(start, end) of every compute action of a one-stage-per-rank schedule when every F takes
    1 and every B ``backward`` and messages are free: the clock the BPipe generator aligns the
    acceptor's returns with."""
    last = base.num_stages - 1
    done: dict[Action, tuple[float, float]] = {}
    clock = [0.0] * base.num_ranks

    def deps(a: Action) -> list[Action]:
        s, mb = a.stage, a.microbatch
        if not a.kind.is_compute:
            return []
        if a.kind is ActionKind.F:
            return [_F(s - 1, mb)] if s > 0 else []
        return [_F(s, mb)] + ([_B(s + 1, mb)] if s < last else [])

    def run(a: Action, r: int) -> None:
        if a.kind.is_compute:
            start = max([clock[r]] + [done[d][1] for d in deps(a)])
            clock[r] = start + (1.0 if a.kind is ActionKind.F else backward)
            done[a] = (start, clock[r])

    advance(base, lambda a: any(d not in done for d in deps(a)), run)
    return done


def _evictions(compute: list[Action], stage: int, threshold: int, policy: str
               ) -> tuple[dict[int, list[Action]], dict[int, list[Action]]]:
    """The evictor's stash actions around its compute actions: ``(before, after)``, each
    compute index -> actions. A stash counts as resident from its F (or its return) until its
    B or its eviction; after F(j), more than ``threshold`` resident evicts j, the newest.
    "jit" takes stash j back one compute step before B(j); "eager" takes the oldest remote
    stash back after every B that leaves fewer than ``threshold`` resident (and, either way,
    one still away is taken back right before its B)."""
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    resident, remote = 0, []  # remote: evicted micro-batches, oldest first

    def take_back(where: dict[int, list[Action]], i: int, mb: int) -> None:
        nonlocal resident
        remote.remove(mb)
        where.setdefault(i, []).append(Action(ActionKind.RECV_R, stage, mb))
        resident += 1

    for i, c in enumerate(compute):
        nxt = compute[i + 1] if i + 1 < len(compute) else None
        if policy == "jit" and nxt is not None and nxt.kind is ActionKind.B and nxt.microbatch in remote:
            take_back(before, i, nxt.microbatch)
        if c.kind is ActionKind.B and c.microbatch in remote:
            take_back(before, i, c.microbatch)
        if c.kind is ActionKind.F:
            resident += 1
            if resident > threshold:
                after.setdefault(i, []).append(Action(ActionKind.SEND_S, stage, c.microbatch))
                remote.append(c.microbatch)
                resident -= 1
        else:
            resident -= 1
            while policy == "eager" and remote and resident < threshold:
                take_back(after, i, min(remote))
    return before, after


def _insert(row: Sequence[Action], before: dict[int, list[Action]], after: dict[int, list[Action]]) -> tuple[Action, ...]:
    """``row`` with ``before[i]`` right before its i-th compute action (after that action's
    receives) and ``after[i]`` after it and its sends."""
    out: list[Action] = []
    pending: list[Action] = []
    index = 0
    for x in row:
        if x.kind.is_compute or x.kind.is_recv:
            out += pending
            pending = []
        if x.kind.is_compute:
            out += before.get(index, [])
            out.append(x)
            pending = list(after.get(index, []))
            index += 1
        else:
            out.append(x)
    return tuple(out + pending)


def bpipe(base: Schedule, thresholds: Sequence[int | None], policy: str = "jit",
          backward_ratio: float = 2.0) -> Schedule:
    """BPipe (PAPERS-SPEC.md 2.3-2.4): ``base`` (``one_f_one_b(p, m)``) with stash transfers
    between each evictor ``s`` (``thresholds[s]`` = K_s, not None) and its acceptor ``p-1-s``.

    Evictor ``s``: after ``F(s, j)`` (and its SEND_F), if more than K_s of its stashes are
    resident, ``SEND_S`` the newest (j, needed last); it takes j back with ``RECV_R(s, j)``
    one compute step before ``B(s, j)`` ("jit", a prefetch of one), or after each B that
    leaves fewer than K_s resident, oldest first ("eager"). Resident counts include a
    returned stash, so the evictor peaks at K_s + 1 (the F that overflows, before its SEND_S:
    PAPERS-SPEC.md 2.10 item 1). Acceptor ``a = p-1-s``: ``RECV_S(j)`` right after its
    ``F(a, j)``, which needs the evictor's F(s, j) anyway; ``SEND_R(j)`` after its last
    compute that ends, on a clock where F costs 1 and B ``backward_ratio`` and messages are
    free, no later than the evictor's RECV_R(j) starts (never before its RECV_S(j)). Every
    stash dependency then points forward on that clock, so ``validate`` finds no deadlock.

    Raises ValueError unless ``base`` is plain 1F1B (one stage per rank, equal micro-batches,
    no partner), ``thresholds`` has one entry per stage, only stages ``s < p // 2`` have one,
    each at least 1, and ``policy`` is one of ``BPIPE_POLICIES``. All None: ``base`` itself.
    """
    p, m = base.num_stages, base.num_microbatches
    if policy not in BPIPE_POLICIES:
        raise ValueError(f"unknown BPipe policy {policy!r}; choose from {', '.join(BPIPE_POLICIES)}")
    if base.partner is not None or base.uneven or base.num_ranks != p or base != one_f_one_b(p, m):
        raise ValueError("BPipe inserts its transfers into plain 1F1B (one stage per rank, equal "
                         "micro-batches): build the base with one_f_one_b(p, m)")
    if len(thresholds) != p:
        raise ValueError(f"thresholds needs one entry per stage ({p}), got {len(thresholds)}")
    partner: list[int | None] = [None] * p
    for s, k in enumerate(thresholds):
        if k is None:
            continue
        if s >= p // 2:
            raise ValueError(f"stage {s} cannot evict: BPipe evictors are stages s < p//2 = {p // 2}, "
                             f"paired with p-1-s")
        if isinstance(k, bool) or int(k) != k or k < 1:
            raise ValueError(f"threshold of stage {s} must be an integer >= 1, got {k!r}")
        partner[s], partner[p - 1 - s] = p - 1 - s, s
    if all(x is None for x in partner):
        return base
    clock = _unit_times(base, backward_ratio)
    rows = [list(row) for row in base.actions]
    for s, k in enumerate(thresholds):
        if k is None:
            continue
        a = p - 1 - s
        compute = [x for x in base.actions[s] if x.kind.is_compute]
        before, after = _evictions(compute, s, int(k), policy)
        rows[s] = list(_insert(base.actions[s], before, after))
        needed_at: dict[int, float] = {}  # j -> when the evictor's RECV_R(j) starts on the clock
        for where, at_start in ((before, True), (after, False)):
            for i, acts in where.items():
                span = clock[compute[i]]
                for x in acts:
                    if x.kind is ActionKind.RECV_R:
                        needed_at[x.microbatch] = span[0] if at_start else span[1]
        mine = [x for x in base.actions[a] if x.kind.is_compute]
        position = {x: i for i, x in enumerate(mine)}
        acc_after: dict[int, list[Action]] = {}
        for j in sorted(needed_at):
            acc_after.setdefault(position[_F(a, j)], []).append(Action(ActionKind.RECV_S, a, j))
        for j in sorted(needed_at):
            first = position[_F(a, j)]
            last = max([first] + [i for i in range(first, len(mine)) if clock[mine[i]][1] <= needed_at[j]])
            acc_after.setdefault(last, []).append(Action(ActionKind.SEND_R, a, j))
        rows[a] = list(_insert(base.actions[a], {}, acc_after))
    return Schedule(p, p, m, base.stage_to_rank, tuple(tuple(r) for r in rows), None, tuple(partner))



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
