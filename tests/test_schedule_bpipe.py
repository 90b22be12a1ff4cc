"""BPipe in the schedule IR: stash actions, message keys, partner text form, the generator,
the validator's rules and the stash counts (PAPERS-SPEC.md 2.3-2.4)."""

from __future__ import annotations

import math

import pytest

from pipecc.ir.schedule import (
    Action,
    ActionKind,
    ScheduleError,
    format,
    gpipe,
    one_f_one_b,
    parse,
    parse_action,
    validate,
)
from pipecc.techniques.bpipe.schedule import bpipe, bpipe_pairs


def balanced(p: int) -> list[int | None]:
    """K = ceil((p+1)/2) for every evictor (PAPERS-SPEC.md 2.3)."""
    k = math.ceil((p + 1) / 2)
    return [k if s < p // 2 else None for s in range(p)]


def evictions(schedule, stage: int = 0) -> int:
    return sum(1 for a in schedule.actions[stage] if a.kind is ActionKind.SEND_S)


def test_action_kinds_and_text() -> None:
    for kind in ("SEND_S", "RECV_S", "SEND_R", "RECV_R"):
        k = ActionKind(kind)
        assert k.value == kind and k.is_stash and not k.is_compute
        assert parse_action(f"2{kind}11") == Action(k, 2, 11)
    assert ActionKind.SEND_S.is_send and ActionKind.SEND_R.is_send
    assert ActionKind.RECV_S.is_recv and ActionKind.RECV_R.is_recv


def test_message_keys_name_the_evictor() -> None:
    partner = (3, 2, 1, 0)
    assert Action(ActionKind.SEND_S, 0, 5).message(partner) == ("S", 0, 5)
    assert Action(ActionKind.RECV_S, 3, 5).message(partner) == ("S", 0, 5)
    assert Action(ActionKind.SEND_R, 3, 5).message(partner) == ("R", 0, 5)
    assert Action(ActionKind.RECV_R, 0, 5).message(partner) == ("R", 0, 5)
    with pytest.raises(ValueError, match="no BPipe partner"):
        Action(ActionKind.RECV_S, 3, 5).message()


@pytest.mark.parametrize("p, m, jit, eager", [(8, 32, 12, 27), (16, 64, 28, 55)])
def test_transfer_counts_of_the_spec_table(p: int, m: int, jit: int, eager: int) -> None:
    """PAPERS-SPEC.md 2.4: micro-batches the first evictor sends out and back per iteration."""
    assert evictions(bpipe(one_f_one_b(p, m), balanced(p), "jit")) == jit
    assert evictions(bpipe(one_f_one_b(p, m), balanced(p), "eager")) == eager == m - math.ceil((p + 1) / 2)


@pytest.mark.parametrize("policy", ["jit", "eager"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 5), (3, 7), (4, 2), (4, 8), (5, 9), (6, 6), (7, 20), (8, 32)])
def test_generated_schedules_validate_and_round_trip(p: int, m: int, policy: str) -> None:
    for k in range(1, p + 1):
        thresholds = [min(k, p - s) if s < p // 2 else None for s in range(p)]
        sched = bpipe(one_f_one_b(p, m), thresholds, policy)
        validate(sched)
        assert parse(format(sched)) == sched
        base = one_f_one_b(p, m).stash_profile()
        counts = sched.stash_profile()
        for s, a in bpipe_pairs(p):
            # evictor: at most K + 1 (the overflowing F before its SEND_S); pair total unchanged
            assert counts[s] <= min(base[s], thresholds[s] + 1)
            assert counts[a] >= base[a]
        assert sum(sched.stash_bytes_profile([1.0] * p)) == sum(counts)


def test_balanced_counts_p8() -> None:
    """K = 5 on p = 8: evictors hold K + 1 at most (a prefetch or an overflow in flight), the
    acceptors take the rest; the peak over stages drops from 8 to 6."""
    sched = bpipe(one_f_one_b(8, 32), balanced(8))
    assert sched.stash_profile() == [6, 6, 6, 5, 4, 4, 4, 4]
    assert one_f_one_b(8, 32).stash_profile() == [8, 7, 6, 5, 4, 3, 2, 1]
    assert max(sched.rank_stash_profile()) == 6
    # bytes: an acceptor holds its evictor's (bigger) stashes
    assert sched.stash_bytes_profile([2.0] + [1.0] * 7)[7] > sched.stash_profile()[7]


def test_partner_text_form() -> None:
    sched = bpipe(one_f_one_b(4, 6), [2, None, None, None])
    text = format(sched)
    assert text.splitlines()[0] == "partner: 3 - - 0"
    assert "0SEND_S" in text and "3RECV_S" in text and "3SEND_R" in text and "0RECV_R" in text
    assert parse(text) == sched and format(parse(text)) == text
    assert sched.partner == (3, None, None, 0)
    assert sched.message(Action(ActionKind.RECV_S, 3, 2)) == ("S", 0, 2)


def test_no_thresholds_is_the_base() -> None:
    assert bpipe(one_f_one_b(4, 6), [None] * 4) == one_f_one_b(4, 6)


@pytest.mark.parametrize("base, thresholds, match", [
    (gpipe(4, 6), [3, None, None, None], "plain 1F1B"),
    (one_f_one_b(4, 6), [3, None], "one entry per stage"),
    (one_f_one_b(4, 6), [None, None, 2, None], "cannot evict"),
    (one_f_one_b(4, 6), [0, None, None, None], ">= 1"),
])
def test_generator_refuses(base, thresholds, match) -> None:
    with pytest.raises(ValueError, match=match):
        bpipe(base, thresholds)
    with pytest.raises(ValueError, match="policy"):
        bpipe(one_f_one_b(4, 6), [3, None, None, None], policy="lazy")


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def test_validator_rules() -> None:
    text = format(bpipe(one_f_one_b(4, 6), [2, None, None, None]))
    cases = [
        # odd pairings
        (_edit(text, "partner: 3 - - 0", "partner: 2 - 0 -"), "odd BPipe pairing"),
        (_edit(text, "partner: 3 - - 0", "partner: 0 - - -"), "paired with itself"),
        (_edit(text, "partner: 3 - - 0", "partner: 3 - - -"), "symmetric"),
        # a stash action without partner line
        (_edit(text, "partner: 3 - - 0\n", ""), "no BPipe partner"),
        # never returned
        (_edit(text, " 0RECV_R5", ""), "never comes back"),
        # returned after its backward
        (_edit(_edit(text, " 0RECV_R5 0B4", " 0B4"), "0RECV_B5 0B5", "0RECV_B5 0B5 0RECV_R5"), "needs its stash back first"),
        # evicted before its forward
        (_edit(_edit(text, " 0SEND_S2", ""), "0F2", "0SEND_S2 0F2"), "evicts the stash its forward made"),
        # acceptor returns before it received
        (_edit(_edit(text, " 3RECV_S2", ""), "3SEND_R2", "3SEND_R2 3RECV_S2"), "returns what it accepted"),
        # a missing receive on the acceptor
        (_edit(text, " 3RECV_S3", ""), "no matching receive"),
    ]
    for bad, match in cases:
        with pytest.raises((ScheduleError, ValueError), match=match):
            validate(parse(bad))


def test_deadlock_with_stash_messages() -> None:
    """The acceptor returning a stash only after the evictor's backward needs it: deadlock."""
    text = format(bpipe(one_f_one_b(4, 6), [2, None, None, None]))
    rows = _edit(text, " 3SEND_R2", "").splitlines()
    rows[-1] = rows[-1] + " 3SEND_R2"
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(parse("\n".join(rows)))
