"""BPipe's schedule transform (PAPERS-SPEC.md 2.3-2.4): ``bpipe(one_f_one_b(p, m), thresholds)``
inserts the stash transfers (SEND_S, RECV_S, SEND_R, RECV_R) between each evictor ``s`` and its
acceptor ``p-1-s`` into 1F1B; ``Schedule.stash_profile`` counts an evicted stash on the acceptor.
``pipecc.ir.schedule.registry.schedule_for`` builds it from a plan's thresholds, BPipe's ``lower``
from the plan. ``placement_problem`` is BPipe's rule of where the transfers go (1f1b, one stage
per pipeline rank, equal micro-batches), asked by its ``requires`` (a plan), its ``at_run`` (a
run's ``--schedule``) and the registry (``schedule_for`` with thresholds, through the schedule
part's hooks ``thresholds_refusal`` and ``with_thresholds``). IR: imports only the schedule IR.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipecc.ir.schedule.actions import _B, _F, Action, ActionKind, Schedule
from pipecc.ir.schedule.generators import one_f_one_b
from pipecc.ir.schedule.progress import advance

__all__ = ["BPIPE_POLICIES", "bpipe", "bpipe_pairs", "placement_problem", "thresholds_refusal", "with_thresholds"]


BPIPE_POLICIES = ("jit", "eager")


def placement_problem(schedule: str, stages_per_rank: int, unequal: bool) -> str | None:
    """BPipe's one placement rule: its transfers go into the 1f1b schedule with one stage per
    pipeline rank and equal micro-batches. The first part a placement breaks, "schedule" (not
    1f1b), "stages" (`stages_per_rank` other than 1) or "sizes" (`unequal` micro-batches), for
    its caller to word the refusal; None when it keeps the rule."""
    if schedule != "1f1b":
        return "schedule"
    if stages_per_rank != 1:
        return "stages"
    if unequal:
        return "sizes"
    return None


def thresholds_refusal(schedule: str, stages_per_rank: int) -> str | None:
    """The schedule part's hook for ``schedule_for(schedule, ..., bpipe_thresholds=...)``, asked
    before the base schedule is built: its one-line refusal when ``placement_problem`` says the
    transfers cannot go into it, else None."""
    if placement_problem(schedule, stages_per_rank, False) is not None:
        return (f"BPipe inserts its transfers into 1f1b with one stage per rank, not {schedule!r} "
                f"with {stages_per_rank} stages per rank")
    return None


def with_thresholds(base: Schedule, thresholds: Sequence[int | None], policy: str) -> Schedule:
    """The schedule part's hook for ``schedule_for(..., bpipe_thresholds=thresholds,
    bpipe_policy=policy)``: ``bpipe(base, thresholds, policy)``."""
    return bpipe(base, thresholds, policy)


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
