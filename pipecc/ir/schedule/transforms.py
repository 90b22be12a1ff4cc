"""Schedule transforms over the generators' output: BPipe's stash transfers inserted into 1F1B
(``bpipe``), the collectives (``gradient_reduce`` for replica groups,
``weight_refresh`` for Bi-Partition's segment replicas, both applied by ``lower``;
``without_collectives`` the simulator's view) and the forward-only view of a training schedule (``forward_only``).

BPipe (PAPERS-SPEC.md 2.3-2.4): ``bpipe(one_f_one_b(p, m), thresholds)`` builds the schedule;
``Schedule.stash_profile`` counts an evicted stash on the acceptor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipecc.ir.schedule.actions import _B, _F, Action, ActionKind, Schedule
from pipecc.ir.schedule.generators import one_f_one_b
from pipecc.ir.schedule.progress import advance
from pipecc.ir.schedule.validate import validate

__all__ = ["BPIPE_POLICIES", "bpipe", "bpipe_pairs", "forward_only", "gradient_reduce",
           "weight_refresh", "without_collectives"]


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
