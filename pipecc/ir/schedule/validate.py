"""The schedule validator: the contract every generator, transform and parsed ``schedule.txt``
is checked against before anything runs it.

Communication semantics (what ``validate`` and the simulator assume): sends are asynchronous
and buffered (NCCL ``isend``), receives block until the matching send was executed. Stages
``s`` and ``s + 1`` on the same rank exchange data locally, without SEND/RECV actions.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NoReturn

from pipecc.ir.schedule.actions import _B, _F, _I, _W, Action, ActionKind, Schedule
from pipecc.ir.schedule.progress import advance
from pipecc.ir.schedule.text import ScheduleError

__all__ = ["validate"]

# The schedules that passed, by identity: a Schedule is immutable, so one that passed once passes
# again, and a rank that hands the same object on (schedule.txt read, checked against the run,
# given to the executor) validates it once. Weak: a schedule nobody holds drops out.
_PASSED: weakref.WeakValueDictionary[int, Schedule] = weakref.WeakValueDictionary()


def _remote(schedule: Schedule, neighbour: int, rank: int) -> bool:
    """True when stage ``neighbour`` exists and sits on a rank other than ``rank``."""
    return 0 <= neighbour < schedule.num_stages and schedule.stage_to_rank[neighbour] != rank


def _message_peer(schedule: Schedule, key: tuple[str, int, int], sending: bool) -> int:
    """The stage at the other end of message ``key`` from the sender's (``sending``) or the
    receiver's side."""
    kind, stage, _ = key
    if kind == "F":
        return stage if sending else stage - 1
    if kind == "B":
        return stage if sending else stage + 1
    acceptor = schedule.partner[stage] if schedule.partner is not None else None
    acceptor = stage if acceptor is None else acceptor
    # "S": evictor -> acceptor; "R": acceptor -> evictor
    return (acceptor if kind == "S" else stage) if sending else (stage if kind == "S" else acceptor)


def _check_pairing(schedule: Schedule, fail: Callable[..., NoReturn]) -> None:
    """BPipe pairs (PAPERS-SPEC.md 2.3): one stage per rank, stage s with p-1-s for s < p//2,
    symmetric; anything else is an odd pairing."""
    p, partner = schedule.num_stages, schedule.partner
    assert partner is not None
    if schedule.num_ranks != p:
        fail(f"BPipe needs one stage per rank, got {p} stages on {schedule.num_ranks} ranks")
    for s, a in enumerate(partner):
        if a is None:
            continue
        if a == s:
            fail(f"odd BPipe pairing: stage {s} is paired with itself (pairs are (s, {p - 1}-s))")
        if not 0 <= a < p or partner[a] != s:
            fail(f"odd BPipe pairing: partner of stage {s} is {a} but partner of {a} is "
                 f"{partner[a] if 0 <= a < p else 'out of range'} (pairs are symmetric)")
        if a != p - 1 - s:
            fail(f"odd BPipe pairing: stage {s} paired with {a}; BPipe pairs stage s with p-1-s = {p - 1 - s}")


def _check_stash_role(schedule: Schedule, a: Action, r: int, i: int, fail: Callable[..., NoReturn]) -> None:
    """A stash action runs on a stage with a partner: SEND_S/RECV_R on the evictor (the lower
    stage of the pair), RECV_S/SEND_R on the acceptor."""
    partner = schedule.partner
    if partner is None or partner[a.stage] is None:
        fail(f"rank {r} step {i}: {a} but stage {a.stage} has no BPipe partner (add a 'partner:' line)", (r, i))
    evicting = a.kind in (ActionKind.SEND_S, ActionKind.RECV_R)
    if evicting != schedule.is_evictor(a.stage):
        role = "evictor" if evicting else "acceptor"
        fail(f"rank {r} step {i}: {a} runs on stage {a.stage}, which is not the {role} of its pair "
             f"(the lower stage of a pair evicts)", (r, i))
    if not schedule.is_training:
        fail(f"rank {r} step {i}: {a} in a forward-only schedule", (r, i))


def _check_collective(a: Action, r: int, i: int, training: bool,
                      seen: dict[tuple[ActionKind, int], tuple[int, int]], fail: Callable[..., NoReturn]) -> None:
    """REDUCE and REFRESH: training schedules only, at most one of each per stage."""
    if not training:
        fail(f"rank {r} step {i}: {a} in a forward-only schedule", (r, i))
    first = seen.setdefault((a.kind, a.stage), (r, i))
    if first != (r, i):
        fail(f"rank {r} step {i}: {a} is stage {a.stage}'s second {a.kind.value} (one per stage and iteration)",
             first, (r, i))


def _check_collective_order(schedule: Schedule, fail: Callable[..., NoReturn]) -> None:
    """REDUCE after every gradient action (B or W) of its stage, REFRESH after every F of its
    stage: what they act on is final by then (along the row, which is the rank's time)."""
    for r, row in enumerate(schedule.actions):
        last: dict[tuple[str, int], int] = {}
        for i, a in enumerate(row):
            if a.kind.frees_stash:
                last[("grad", a.stage)] = i
            elif a.kind is ActionKind.F:
                last[("F", a.stage)] = i
        for i, a in enumerate(row):
            if not a.kind.is_collective:
                continue
            what, why = (("grad", "the gradients it all-reduces are final after them") if a.kind is ActionKind.REDUCE
                         else ("F", "the replicas it refreshes are read until then"))
            after = last.get((what, a.stage), -1)
            if after > i:
                fail(f"rank {r} step {i}: {a} runs before {row[after]} ({why})", (r, i), (r, after))


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` unless the schedule is complete, ordered, matched and deadlock-free.

    With ``microbatch_sizes``, counts are per stage and the dependencies follow the overlap
    of chunks (module docstring): F after every upstream chunk it overlaps, SEND_B after the
    backward of every chunk overlapping the upstream chunk it returns.

    Checks, in order: (1) every action is in range, on the rank owning its stage, and
    appears once; SEND/RECV only cross ranks; every (stage, mb) has one F and, if the
    schedule trains, either one B or one I and one W (never B with I or W); (2) every SEND
    has its RECV and vice versa; (3) along each row, local inputs come first: F after its
    RECV_F (or the local F of stage-1), B or I after its own F and its RECV_B (or the local
    B or I of stage+1), W after its own I, SEND_F after the F, SEND_B after the B or I;
    (4) running all rows with async sends and blocking receives finishes.
    BPipe (``partner``): pairs are (s, p-1-s), one stage per rank; SEND_S/RECV_R only on the
    evictor, RECV_S/SEND_R only on the acceptor; every SEND_S has its RECV_R; SEND_S after the
    F, RECV_R after the SEND_S and before the B, SEND_R after the RECV_S; stash messages take
    part in matching (2) and in the deadlock run (4).
    Collectives: REDUCE and REFRESH only in training schedules, at most one of each per stage,
    REDUCE after the stage's every B or W, REFRESH after its every F.
    The first broken rule is raised. O(R * A) for R ranks and A actions (O(A) in practice); a
    schedule object that passed before returns at once.
    """
    if _PASSED.get(id(schedule)) is schedule:
        return
    _check(schedule)
    _PASSED[id(schedule)] = schedule


def _check(schedule: Schedule) -> None:
    """``validate``'s rules, run (no memo)."""
    S = schedule.num_stages
    owner = schedule.stage_to_rank
    training = schedule.is_training

    def fail(summary: str, *marks: tuple[int, int]) -> NoReturn:
        raise ScheduleError(summary, schedule, list(marks))

    # (1) ownership, range, uniqueness, completeness
    if schedule.partner is not None:
        _check_pairing(schedule, fail)
    where: dict[Action, tuple[int, int]] = {}
    collectives: dict[tuple[ActionKind, int], tuple[int, int]] = {}
    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if not (0 <= a.stage < S):
                fail(f"rank {r} step {i}: {a} is out of range (stages 0..{S - 1})", (r, i))
            if not (0 <= a.microbatch < schedule.index_range(a)):
                m = schedule.index_range(a)
                fail(f"rank {r} step {i}: {a} is out of range (stages 0..{S - 1}, microbatches 0..{m - 1})", (r, i))
            if owner[a.stage] != r:
                fail(f"rank {r} step {i}: {a} runs on rank {r} but stage {a.stage} is on rank {owner[a.stage]}", (r, i))
            if a in where:
                fail(f"rank {r} step {i}: {a} appears twice", where[a], (r, i))
            if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) and not _remote(schedule, a.stage + 1, r):
                fail(f"rank {r} step {i}: {a} but stage {a.stage + 1} is not on another rank", (r, i))
            if a.kind in (ActionKind.SEND_B, ActionKind.RECV_F) and not _remote(schedule, a.stage - 1, r):
                fail(f"rank {r} step {i}: {a} but stage {a.stage - 1} is not on another rank", (r, i))
            if a.kind is ActionKind.RECV_B and not training:
                fail(f"rank {r} step {i}: {a} in a forward-only schedule", (r, i))
            if a.kind.is_stash:
                _check_stash_role(schedule, a, r, i, fail)
            if a.kind.is_collective:
                _check_collective(a, r, i, training, collectives, fail)
            where[a] = (r, i)
    for s in range(S):
        if owner[s] == -1:
            fail(f"stage {s} has no actions")
        for mb in range(schedule.chunks(s)):
            if _F(s, mb) not in where:
                fail(f"missing {_F(s, mb)}: forward of stage {s} microbatch {mb} never runs")
            if not training:
                continue
            split = [x for x in (_I(s, mb), _W(s, mb)) if x in where]
            if _B(s, mb) in where and split:
                fail(f"{_B(s, mb)} and {split[0]}: stage {s} microbatch {mb} runs its backward twice "
                     f"(either B, or I then W)", where[_B(s, mb)], where[split[0]])
            if _B(s, mb) not in where and not split:
                fail(f"missing {_B(s, mb)}: backward of stage {s} microbatch {mb} never runs", where[_F(s, mb)])
            for x, y in ((_I(s, mb), _W(s, mb)), (_W(s, mb), _I(s, mb))):
                if x in where and y not in where:
                    fail(f"missing {y}: stage {s} microbatch {mb} has {x} but not {y} "
                         f"(a split backward needs both I and W)", where[x])

    for a, (r, i) in where.items():  # an evicted stash comes back before its backward
        if a.kind is ActionKind.SEND_S and Action(ActionKind.RECV_R, a.stage, a.microbatch) not in where:
            fail(f"rank {r} step {i}: {a} evicts a stash that never comes back "
                 f"(missing {Action(ActionKind.RECV_R, a.stage, a.microbatch)})", (r, i))
        if a.kind is ActionKind.RECV_R and Action(ActionKind.SEND_S, a.stage, a.microbatch) not in where:
            fail(f"rank {r} step {i}: {a} takes back a stash that was never evicted "
                 f"(missing {Action(ActionKind.SEND_S, a.stage, a.microbatch)})", (r, i))

    _check_collective_order(schedule, fail)

    # (2) matching
    sends = {schedule.message(a): where[a] for a in where if a.kind.is_send}
    recvs = {schedule.message(a): where[a] for a in where if a.kind.is_recv}
    for key, (r, i) in sends.items():
        if key not in recvs:
            dst = _message_peer(schedule, key, sending=True)
            fail(f"rank {r} step {i}: {schedule.actions[r][i]} has no matching receive on rank {owner[dst]}", (r, i))
    for key, (r, i) in recvs.items():
        if key not in sends:
            src = _message_peer(schedule, key, sending=False)
            fail(f"rank {r} step {i}: {schedule.actions[r][i]} has no matching send on rank {owner[src]}", (r, i))

    # (3) per-row order of local dependencies
    def grad_of(stage: int, mb: int) -> Action:
        """The action that produces stage's input gradient: its B, or its I when split."""
        return _I(stage, mb) if _I(stage, mb) in where else _B(stage, mb)

    def before(need: Action, r: int, i: int, a: Action, why: str) -> None:
        got = where.get(need)
        if got is None or got[0] != r or got[1] > i:
            fail(f"rank {r} step {i}: {a} runs before {need} ({why})", (r, i))

    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            s, mb, k = a.stage, a.microbatch, a.kind
            prev_remote, next_remote = _remote(schedule, s - 1, r), _remote(schedule, s + 1, r)
            if k is ActionKind.F and s > 0:
                for j in schedule.forward_inputs(s, mb):
                    need = Action(ActionKind.RECV_F, s, j) if prev_remote else _F(s - 1, j)
                    before(need, r, i, a, "its input")
            elif k in (ActionKind.B, ActionKind.I):
                before(_F(s, mb), r, i, a, "backward needs its forward")
                if s < S - 1:
                    if next_remote:
                        before(Action(ActionKind.RECV_B, s, mb), r, i, a, "its output gradient")
                    else:
                        for j in schedule.gradient_inputs(s, mb):
                            before(grad_of(s + 1, j), r, i, a, "its output gradient")
            elif k is ActionKind.W:
                before(_I(s, mb), r, i, a, "the weight gradient comes after the input gradient")
            elif k is ActionKind.SEND_F:
                before(_F(s, mb), r, i, a, "sends the forward's output")
            elif k is ActionKind.SEND_B:
                for j in schedule.gradient_inputs(s - 1, mb):
                    before(grad_of(s, j), r, i, a, "sends the backward's input gradient")
            elif k is ActionKind.SEND_S:
                before(_F(s, mb), r, i, a, "evicts the stash its forward made")
            elif k is ActionKind.RECV_R:
                before(Action(ActionKind.SEND_S, s, mb), r, i, a, "takes back what it evicted")
                back = where.get(grad_of(s, mb))
                if back is not None and back[0] == r and back[1] < i:
                    fail(f"rank {r} step {i}: {a} runs after {grad_of(s, mb)} (the backward needs its "
                         f"stash back first)", (r, i), back)
            elif k is ActionKind.SEND_R:
                before(Action(ActionKind.RECV_S, s, mb), r, i, a, "returns what it accepted")

    # (4) deadlock: advance every row until it blocks on a receive whose send has not run
    sent: set[tuple[str, int, int] | None] = set()
    pc = advance(schedule, lambda a: a.kind.is_recv and schedule.message(a) not in sent,
                 lambda a, r: sent.add(schedule.message(a)) if a.kind.is_send else None)
    stuck = [(r, pc[r]) for r in range(schedule.num_ranks) if pc[r] < len(schedule.actions[r])]
    if stuck:
        waits = ", ".join(f"rank {r} at step {i} ({schedule.actions[r][i]})" for r, i in stuck)
        fail(f"deadlock: every unfinished rank waits on a receive: {waits}", *stuck)
