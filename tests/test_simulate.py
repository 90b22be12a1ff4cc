"""Simulator: closed forms, the unbalanced-stage formula, and invariants on random costs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecc.passes.simulate import Event, StageCosts, Timeline, simulate
from pipecc.ir.schedule import ActionKind, Schedule, ScheduleError, gpipe, inference, interleaved_1f1b, one_f_one_b, parse

close = pytest.approx

# ---------------------------------------------------------------------------- closed forms

times = st.floats(0.05, 5.0)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 10), t_f=times, t_b=times)
def test_equal_stages_closed_forms(p: int, m: int, t_f: float, t_b: float) -> None:
    act, static = 10.0, 1000.0
    costs = StageCosts.uniform(p, m, t_f, t_b, activation_bytes=act, static_bytes=static)
    makespan = (m + p - 1) * (t_f + t_b)
    bubble = (p - 1) / (m + p - 1)

    g = simulate(gpipe(p, m), costs)
    assert g.iteration_s == close(makespan, rel=1e-9)
    assert g.bubble_fraction == close(bubble, rel=1e-9, abs=1e-12)
    assert g.busy_s == close([m * (t_f + t_b)] * p)
    assert g.peak_memory_bytes == [static + m * act] * p

    o = simulate(one_f_one_b(p, m), costs)
    assert o.iteration_s == close(makespan, rel=1e-9)
    assert o.bubble_fraction == close(bubble, rel=1e-9, abs=1e-12)
    assert o.peak_memory_bytes == [static + min(p - r, m) * act for r in range(p)]

    i = simulate(inference(p, m), costs)
    assert i.iteration_s == close((m + p - 1) * t_f, rel=1e-9)
    assert i.peak_memory_bytes == [static + act] * p  # nothing stashed; one activation in flight


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (2, 4, 2), (4, 4, 3), (3, 9, 2), (1, 3, 2)])
def test_interleaved_beats_1f1b(p: int, m: int, v: int) -> None:
    t_f, t_b = 1.0, 2.0
    plain = simulate(one_f_one_b(p, m), StageCosts.uniform(p, m, t_f, t_b))
    # same model, each rank's work split into v virtual stages of t/v
    inter = simulate(interleaved_1f1b(p, m, v), StageCosts.uniform(p * v, m, t_f / v, t_b / v))
    assert inter.busy_s == close(plain.busy_s)
    # Megatron's closed form: the bubble shrinks by v
    assert inter.iteration_s == close((m + (p - 1) / v) * (t_f + t_b), rel=1e-9)
    if p > 1:
        assert inter.bubble_fraction < plain.bubble_fraction
        assert inter.iteration_s < plain.iteration_s


# ---------------------------------------------------------------------------- unbalanced GPipe


@st.composite
def unbalanced(draw: st.DrawFn, proportional: bool) -> tuple[int, int, StageCosts]:
    p, m = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    f = [draw(times) for _ in range(p)]
    ratio = draw(st.floats(0.5, 3.0))
    b = [ratio * x for x in f] if proportional else [draw(times) for _ in range(p)]
    # proportional case: comm never the bottleneck
    limit = min(f + b) if proportional else 5.0
    cf = [draw(st.floats(0.0, limit)) if s < p - 1 else 0.0 for s in range(p)]
    cb = [draw(st.floats(0.0, limit)) if s > 0 else 0.0 for s in range(p)]
    return p, m, StageCosts.per_stage(m, f, b, cf, cb)


def _stage(costs: StageCosts, name: str) -> list[float]:
    return [row[0] for row in getattr(costs, name)]


def background_formula(m: int, costs: StageCosts) -> float:
    """BACKGROUND.md: sum_s(t_f,s + t_b,s + comm_s) + (m-1) * max_s(t_f,s + t_b,s)."""
    f, b = _stage(costs, "forward_s"), _stage(costs, "backward_s")
    comm = [x + y for x, y in zip(_stage(costs, "send_forward_s"), _stage(costs, "send_backward_s"))]
    return sum(f) + sum(b) + sum(comm) + (m - 1) * max(x + y for x, y in zip(f, b))


@settings(max_examples=60, deadline=None)
@given(unbalanced(proportional=False))
def test_gpipe_unbalanced_exact_flow_shop(case: tuple[int, int, StageCosts]) -> None:
    """GPipe is two flow shops of m identical jobs (forward over stages and links, then
    backward), so its makespan is exactly sum + (m-1)*(bottleneck_F + bottleneck_B).
    Since max f + max b >= max (f + b), the background formula is a lower bound."""
    p, m, costs = case
    f, b = _stage(costs, "forward_s"), _stage(costs, "backward_s")
    cf, cb = _stage(costs, "send_forward_s"), _stage(costs, "send_backward_s")
    exact = sum(f + b + cf + cb) + (m - 1) * (max(f + cf) + max(b + cb))
    got = simulate(gpipe(p, m), costs).iteration_s
    assert got == close(exact, rel=1e-9)
    assert got >= background_formula(m, costs) * (1 - 1e-9)


@settings(max_examples=40, deadline=None)
@given(unbalanced(proportional=True))
def test_gpipe_matches_background_formula_with_one_bottleneck(case: tuple[int, int, StageCosts]) -> None:
    """When t_b,s = k * t_f,s the same stage is the bottleneck forward and backward, and
    with comm below every compute time the background formula is exact."""
    p, m, costs = case
    assert simulate(gpipe(p, m), costs).iteration_s == close(background_formula(m, costs), rel=1e-9)


# ---------------------------------------------------------------------------- invariants


@st.composite
def random_case(draw: st.DrawFn) -> tuple[Schedule, StageCosts]:
    kind = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "inference"]))
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    if kind == "gpipe":
        schedule = gpipe(p, m)
    elif kind == "1f1b":
        schedule = one_f_one_b(p, m)
    elif kind == "inference":
        schedule = inference(p, m)
    else:
        schedule = interleaved_1f1b(p, p * draw(st.integers(1, 2)), draw(st.integers(2, 3)))
    S, m = schedule.num_stages, schedule.num_microbatches
    value = st.floats(0.0, 3.0)

    def table() -> list[list[float]]:
        return [[draw(value) for _ in range(m)] for _ in range(S)]

    costs = StageCosts(table(), table(), table(), table(), table(), [draw(value) for _ in range(S)])
    return schedule, costs


def _check_invariants(schedule: Schedule, costs: StageCosts, tl: Timeline) -> None:
    eps = 1e-9
    owner = schedule.stage_to_rank
    S, m = schedule.num_stages, schedule.num_microbatches
    by_key: dict[tuple[ActionKind, int, int], Event] = {(e.kind, e.stage, e.microbatch): e for e in tl.events}
    assert len(by_key) == len(tl.events) == sum(len(row) for row in schedule.actions)
    F, B, SF, SB, RF, RB = (ActionKind.F, ActionKind.B, ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B)

    def after(e: Event, dep: Event) -> None:
        assert e.start >= dep.end - eps, (e, dep)

    for e in tl.events:
        s, mb = e.stage, e.microbatch
        assert e.end >= e.start >= 0.0
        if e.kind is F and s > 0:
            after(e, by_key[(F, s - 1, mb)])
            if owner[s - 1] != owner[s]:
                after(e, by_key[(SF, s - 1, mb)])
        if e.kind is B:
            after(e, by_key[(F, s, mb)])
            if s < S - 1:
                after(e, by_key[(B, s + 1, mb)])
                if owner[s + 1] != owner[s]:
                    after(e, by_key[(SB, s + 1, mb)])
        if e.kind is SF:
            after(e, by_key[(F, s, mb)])
            assert by_key[(RF, s + 1, mb)].end == close(max(e.end, by_key[(RF, s + 1, mb)].start))
        if e.kind is SB:
            after(e, by_key[(B, s, mb)])
            assert by_key[(RB, s - 1, mb)].end == close(max(e.end, by_key[(RB, s - 1, mb)].start))

    # one compute at a time per rank, in row order; one transfer at a time per link
    for r, row in enumerate(schedule.actions):
        compute = [by_key[(a.kind, a.stage, a.microbatch)] for a in row if a.kind.is_compute]
        for x, y in zip(compute, compute[1:]):
            after(y, x)
        assert tl.busy_s[r] == close(sum(e.duration for e in compute))
        sends = [by_key[(a.kind, a.stage, a.microbatch)] for a in row if a.kind.is_send]
        for peer in {e.peer for e in sends}:
            link = [e for e in sends if e.peer == peer]
            for x, y in zip(link, link[1:]):
                after(y, x)

    # lower bounds on the makespan
    assert tl.iteration_s >= max(tl.busy_s) - eps
    for mb in range(m):
        path = sum(costs.forward_s[s][mb] for s in range(S))
        path += sum(costs.send_forward_s[s][mb] for s in range(S - 1) if owner[s] != owner[s + 1])
        if schedule.is_training:
            path += sum(costs.backward_s[s][mb] for s in range(S))
            path += sum(costs.send_backward_s[s][mb] for s in range(1, S) if owner[s] != owner[s - 1])
        assert tl.iteration_s >= path - eps
    assert 0.0 <= tl.bubble_fraction <= 1.0 + eps
    for r in range(schedule.num_ranks):
        assert tl.peak_memory_bytes[r] >= sum(costs.static_bytes[s] for s in schedule.stages_of(r)) - eps


@settings(max_examples=80, deadline=None)
@given(random_case())
def test_invariants_on_random_costs(case: tuple[Schedule, StageCosts]) -> None:
    schedule, costs = case
    overlapped = simulate(schedule, costs)
    _check_invariants(schedule, costs, overlapped)
    blocking = simulate(schedule, costs, overlap_comm=False)
    _check_invariants(schedule, costs, blocking)
    # occupying the sender can only delay things (the system is monotone in max-plus)
    assert blocking.iteration_s >= overlapped.iteration_s - 1e-9


# ---------------------------------------------------------------------------- small cases


def test_blocking_sends_by_hand() -> None:
    costs = StageCosts.uniform(2, 2, 1.0, 1.0, send_s=0.5)
    assert simulate(gpipe(2, 2), costs).iteration_s == close(7.0)
    # rank 0: F0 [0,1] send [1,1.5] F1 [1.5,2.5] send [2.5,3]; rank 1: F0 [1.5,2.5] F1 [3,4]
    # B0 [4,5] send [5,5.5] B1 [5.5,6.5] send [6.5,7]; rank 0: B0 [5.5,6.5] B1 [7,8]
    tl = simulate(gpipe(2, 2), costs, overlap_comm=False)
    assert tl.iteration_s == close(8.0)
    assert [(e.start, e.end) for e in tl.compute_events(0)] == [(0, 1), (1.5, 2.5), (5.5, 6.5), (7, 8)]


def test_link_serialises_transfers() -> None:
    # stage 0 is fast, the link is slow: activations queue on the link
    costs = StageCosts.per_stage(3, [0.1, 1.0], [0.0, 0.0], [2.0, 0.0], [0.0, 0.0])
    tl = simulate(inference(2, 3), costs)
    sends = [(e.start, e.end) for e in tl.events if e.kind is ActionKind.SEND_F]
    assert sends == [(close(0.1), close(2.1)), (close(2.1), close(4.1)), (close(4.1), close(6.1))]
    assert tl.iteration_s == close(7.1)


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"forward_s must be \[2\]\[3\]"):
        simulate(gpipe(2, 3), StageCosts.uniform(2, 2, 1.0, 1.0))
    with pytest.raises(ScheduleError, match="deadlock"):
        bad = parse("rank 0: 0RECV_B0 0F0 0SEND_F0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
        simulate(bad, StageCosts.uniform(2, 1, 1.0, 1.0))


def test_to_text() -> None:
    tl = simulate(one_f_one_b(4, 8), StageCosts.uniform(4, 8, 1.0, 2.0))
    text = tl.to_text(width=66)
    lines = text.splitlines()
    assert lines[0] == "iteration 33 s, bubble 27.3%"
    assert len(lines) == 5
    assert lines[1].startswith("rank 0 |FFF") and lines[4].startswith("rank 3 |......")
    assert all(len(line.split("|")[1]) == 66 for line in lines[1:])
    assert math.isclose(tl.bubble_fraction, 3 / 11)
