"""Schedule IR: text form, generators, stash counts and the validator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecc.ir.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    format,
    gpipe,
    inference,
    interleaved_1f1b,
    one_f_one_b,
    parse,
    parse_action,
    validate,
)

# ---------------------------------------------------------------------------- golden text

ONE_F_ONE_B_2x3 = (
    "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2\n"
    "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2"
)

GPIPE_2x2 = (
    "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
    "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"
)

# p=2, v=2: rank 0 holds stages 0 and 2, rank 1 holds 1 and 3; chunk-major groups of p microbatches.
INTERLEAVED_2x2x2 = (
    "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1"
    " 2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1\n"
    "rank 1: 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3B0 3SEND_B0"
    " 3RECV_F1 3F1 3B1 3SEND_B1 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1"
)


@pytest.mark.parametrize(
    "schedule, text",
    [
        (one_f_one_b(2, 3), ONE_F_ONE_B_2x3),
        (gpipe(2, 2), GPIPE_2x2),
        (interleaved_1f1b(2, 2, 2), INTERLEAVED_2x2x2),
        (inference(3, 2), "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1\nrank 1: 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1\nrank 2: 2RECV_F0 2F0 2RECV_F1 2F1"),
    ],
)
def test_golden_text(schedule: Schedule, text: str) -> None:
    assert format(schedule) == text
    assert parse(text) == schedule
    validate(schedule)


def test_action_text() -> None:
    assert parse_action("2RECV_B1") == Action(ActionKind.RECV_B, 2, 1)
    assert str(Action(ActionKind.SEND_F, 10, 3)) == "10SEND_F3"
    for bad in ("F0", "0X1", "0F", "0 F1", "0SEND1"):
        with pytest.raises(ValueError, match="not an action"):
            parse_action(bad)
    with pytest.raises(ValueError, match="expected 'rank 1:'"):
        parse("rank 0: 0F0\nrank 2: 1F0")


# ---------------------------------------------------------------------------- round trip


@st.composite
def generated(draw: st.DrawFn) -> Schedule:
    kind = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "inference"]))
    p = draw(st.integers(1, 5))
    m = draw(st.integers(1, 8))
    if kind == "gpipe":
        return gpipe(p, m)
    if kind == "1f1b":
        return one_f_one_b(p, m)
    if kind == "inference":
        return inference(p, m)
    return interleaved_1f1b(p, p * draw(st.integers(1, 3)), draw(st.integers(1, 3)))


actions = st.builds(Action, st.sampled_from(list(ActionKind)), st.integers(0, 12), st.integers(0, 12))


@settings(max_examples=60, deadline=None)
@given(generated())
def test_round_trip_generated(schedule: Schedule) -> None:
    text = format(schedule)
    assert parse(text) == schedule
    assert format(parse(text)) == text
    assert len(text.splitlines()) == schedule.num_ranks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(actions, max_size=6), min_size=1, max_size=4))
def test_round_trip_arbitrary_rows(rows: list[list[Action]]) -> None:
    # the text form is exact even for schedules that would not validate
    schedule = Schedule.from_actions(rows)
    assert parse(format(schedule)) == schedule
    assert [list(r) for r in parse(format(schedule)).actions] == rows


# ---------------------------------------------------------------------------- generators


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 11))
def test_generators_validate(p: int, m: int) -> None:
    for schedule in (gpipe(p, m), one_f_one_b(p, m), inference(p, m)):
        validate(schedule)
        assert schedule.stage_to_rank == tuple(range(p))
    if m % p == 0:
        for v in range(1, 5):
            schedule = interleaved_1f1b(p, m, v)
            validate(schedule)
            assert schedule.num_stages == p * v
            assert schedule.stage_to_rank == tuple(s % p for s in range(p * v))


def _compute(schedule: Schedule, rank: int) -> list[Action]:
    return [a for a in schedule.actions[rank] if a.kind.is_compute]


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (5, 5), (1, 3), (3, 1)])
def test_one_f_one_b_shape(p: int, m: int) -> None:
    schedule = one_f_one_b(p, m)
    for r in range(p):
        kinds = "".join(a.kind.value for a in _compute(schedule, r))
        warmup = min(p - r - 1, m)
        steady = m - warmup
        assert kinds == "F" * warmup + "FB" * steady + "B" * warmup
        # backwards run in microbatch order
        assert [a.microbatch for a in _compute(schedule, r) if a.kind is ActionKind.B] == list(range(m))


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (5, 5), (1, 3), (3, 1)])
def test_stash_profiles(p: int, m: int) -> None:
    assert one_f_one_b(p, m).stash_profile() == [min(p - r, m) for r in range(p)]
    assert gpipe(p, m).stash_profile() == [m] * p
    assert inference(p, m).stash_profile() == [0] * p
    assert one_f_one_b(p, m).rank_stash_profile() == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 4, 2), (2, 6, 3), (3, 3, 2)])
def test_interleaved_stash(p: int, m: int, v: int) -> None:
    schedule = interleaved_1f1b(p, m, v)
    for r in range(p):
        warmup = min(m * v, (v - 1) * p + 2 * (p - r - 1))
        assert schedule.rank_stash_profile()[r] == min(warmup + 1, m * v)
        assert sum(schedule.stash_profile()[s] for s in schedule.stages_of(r)) >= schedule.rank_stash_profile()[r]


def test_interleaved_needs_divisible_microbatches() -> None:
    with pytest.raises(ValueError, match="divisible by num_ranks: m=6, p=4"):
        interleaved_1f1b(4, 6, 2)
    assert interleaved_1f1b(4, 6, 1) == one_f_one_b(4, 6)  # v=1 is plain 1F1B
    with pytest.raises(ValueError):
        gpipe(0, 3)


# ---------------------------------------------------------------------------- validator


def _rejected(text: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(parse(text))
    message = str(info.value)
    lines = message.splitlines()
    assert lines[0] == info.value.summary
    assert lines[1].startswith("step")
    # the whole grid follows, one row per rank
    assert [line.split(":")[0] for line in lines[2:]] == [f"rank {r}" for r in range(len(lines) - 2)]
    return info.value


def _marked_row(error: ScheduleError, rank: int) -> str:
    return str(error).splitlines()[2 + rank]


def test_rejects_missing_backward() -> None:
    error = _rejected(ONE_F_ONE_B_2x3.replace(" 1B1", ""))
    assert "missing 1B1" in error.summary
    assert ">1F1<" in _marked_row(error, 1)


def test_rejects_backward_before_forward() -> None:
    error = _rejected("rank 0: 0B0 0F0")
    assert "0B0 runs before 0F0" in error.summary
    assert _marked_row(error, 0).startswith("rank 0: >0B0<")


def test_rejects_unmatched_send() -> None:
    error = _rejected(ONE_F_ONE_B_2x3.replace("1RECV_F2 ", ""))
    assert "0SEND_F2 has no matching receive on rank 1" in error.summary
    assert ">0SEND_F2<" in _marked_row(error, 0)
    error = _rejected(ONE_F_ONE_B_2x3.replace(" 1SEND_B0", ""))
    assert "0RECV_B0 has no matching send on rank 1" in error.summary


def test_rejects_planted_deadlock() -> None:
    # each rank receives first: rank 0 waits for a gradient that needs rank 1's forward, which waits for rank 0
    error = _rejected("rank 0: 0RECV_B0 0F0 0SEND_F0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    assert error.summary.startswith("deadlock")
    assert error.marks == [(0, 0), (1, 0)]
    assert ">0RECV_B0<" in _marked_row(error, 0) and ">1RECV_F0<" in _marked_row(error, 1)


def test_rejects_deadlock_from_reordered_microbatches() -> None:
    # rank 1 insists on microbatch 1 first while rank 0 waits on a gradient for microbatch 0
    text = (
        "rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1\n"
        "rank 1: 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F0 1F0 1B0 1SEND_B0"
    )
    error = _rejected(text)
    assert error.summary.startswith("deadlock") and error.marks == [(0, 2), (1, 0)]


def test_rejects_wrong_rank_duplicates_and_local_sends() -> None:
    assert "stage 0 is on rank 0" in _rejected("rank 0: 0F0\nrank 1: 0B0").summary
    assert "appears twice" in _rejected("rank 0: 0F0 0F0").summary
    assert "not on another rank" in _rejected("rank 0: 0F0 0SEND_F0 1F0").summary
    assert "RECV_B0 in a forward-only" in _rejected("rank 0: 0F0 0SEND_F0 0RECV_B0\nrank 1: 1RECV_F0 1F0").summary
    assert "runs before 1RECV_F0" in _rejected("rank 0: 0F0 0SEND_F0\nrank 1: 1F0 1RECV_F0").summary
    assert "runs before 0F0" in _rejected("rank 0: 0SEND_F0 0F0\nrank 1: 1RECV_F0 1F0").summary


def test_schedule_module_is_free_of_torch_and_passes() -> None:
    # the distributed runtime imports the schedule IR; it must not drag in the compiler
    import subprocess
    import sys

    code = "import sys, pipecc.ir.schedule; bad = [m for m in ('torch', 'pipecc.passes') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
