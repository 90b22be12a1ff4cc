"""The partitioner's communication model against the event simulator (issue #11 item 3).

The partitioner's bottleneck (passes/partition.py: max over windows of consecutive stages of
(Σ T + 2 Σ t) / stages, and max t; forward-only: max(max T, max t)) must be the steady-state
time per micro-batch that passes/simulate.py measures for the runtime's machine: async sends
(`isend`), one message at a time per link direction, receives that wait.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipecc.ir.schedule import inference, one_f_one_b
from pipecc.passes.partition import Partition, PartitionProblem, bottleneck, evaluate, partition
from pipecc.passes.simulate import StageCosts, simulate

from tests.test_partition import problems


def _iteration(pr: PartitionProblem, part: Partition, m: int) -> float:
    p = len(part.stage_time)
    fwd, bwd = np.asarray(pr.fwd, dtype=float), np.asarray(pr.bwd, dtype=float)
    f = [float(fwd[k, a:e].sum()) for k, (a, e) in enumerate(zip(part.bounds, part.bounds[1:]))]
    b = [float(bwd[k, a:e].sum()) for k, (a, e) in enumerate(zip(part.bounds, part.bounds[1:]))]
    send = list(part.link_time) + [0.0]
    if not pr.training:
        costs = StageCosts.per_stage(m, f, [0.0] * p, send_forward_s=send)
        return simulate(inference(p, m), costs).iteration_s
    costs = StageCosts.per_stage(m, f, b, send_forward_s=send, send_backward_s=[0.0] + send[:-1])
    return simulate(one_f_one_b(p, m), costs).iteration_s


def _slope(pr: PartitionProblem, part: Partition, m1: int, m2: int) -> float:
    """Simulated time per extra micro-batch: the steady-state period once the pipeline is full."""
    return (_iteration(pr, part, m2) - _iteration(pr, part, m1)) / (m2 - m1)


def _fill(part: Partition) -> float:
    """One micro-batch's trip through the pipeline: bounds how far a transient can shift
    the iteration time from m · period (the max-plus system's start-up offset)."""
    return sum(part.stage_time) + 2 * sum(part.link_time)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_n=8, max_p=4, memory=False), st.booleans())
def test_partition_bottleneck_is_the_simulated_steady_state(pr: PartitionProblem, training: bool):
    pr = dataclasses.replace(pr, training=training)
    if not training:  # forward-only: the partitioner gets no backward times
        pr = dataclasses.replace(pr, bwd=[[0.0] * len(r) for r in pr.bwd])
    if len(pr.out_bytes) < len(pr.mem_cap):
        return
    part = partition(pr)
    p, m1, m2 = len(part.stage_time), 8, 208
    slope = _slope(pr, part, m1 * p, m1 * p + (m2 - m1))
    # NOTE: cycles of almost equal weight leave a long transient; it moves the slope by at
    # most two fills over the m2 - m1 extra micro-batches
    tol = 2 * _fill(part) / (m2 - m1) + 1e-9 * part.bottleneck
    assert slope == pytest.approx(part.bottleneck, abs=tol)


@pytest.mark.parametrize("seed", range(6))
def test_steady_state_matches_exactly_once_the_transient_is_over(seed: int):
    rng = np.random.default_rng(seed)
    p, n = 4, 12
    link = rng.uniform(0.1, 3.0, p)
    pr = PartitionProblem(
        fwd=rng.uniform(0, 1, (p, n)).tolist(), bwd=rng.uniform(0, 2, (p, n)).tolist(),
        out_bytes=rng.uniform(1, 10, n).tolist(), last_use=[min(j + 1, n) for j in range(n)],
        static_mem=[0.0] * n, act_mem=[0.0] * n, mem_cap=[np.inf] * p, inflight=[1] * p,
        link_time=lambda k, x: link[k] * x / 5.0)
    part = partition(pr)
    assert _slope(pr, part, 400, 1000) == pytest.approx(part.bottleneck, rel=1e-9)


def test_transfers_overlap_compute_but_round_trips_do_not():
    # two stages of 3 s compute, 1 s per message: the old model charged 3 + 2·1 = 5 s per
    # stage; the runtime overlaps each transfer with the other micro-batch's compute but the
    # forward-backward round trip of one micro-batch spans two periods: (3 + 3 + 2) / 2 = 4
    pr = PartitionProblem(fwd=[[1.0, 1.0]] * 2, bwd=[[2.0, 2.0]] * 2, out_bytes=[1.0, 1.0],
                          last_use=[1, 2], static_mem=[0.0] * 2, act_mem=[0.0] * 2,
                          mem_cap=[np.inf] * 2, inflight=[1, 1], link_time=lambda k, x: 1.0)
    part = evaluate(pr, (0, 1, 2))
    assert part.bottleneck == 4.0 and _slope(pr, part, 40, 100) == pytest.approx(4.0)
    # forward-only: the link is busy 1 s of every 3: hidden completely
    fwd_only = dataclasses.replace(pr, bwd=[[0.0, 0.0]] * 2, training=False)
    part = evaluate(fwd_only, (0, 1, 2))
    assert part.bottleneck == 1.0 and _slope(fwd_only, part, 40, 100) == pytest.approx(1.0)
    # a link slower than the compute is the bottleneck: one message at a time per direction
    slow = dataclasses.replace(fwd_only, link_time=lambda k, x: 5.0)
    assert evaluate(slow, (0, 1, 2)).bottleneck == 5.0
    assert _slope(slow, evaluate(slow, (0, 1, 2)), 40, 100) == pytest.approx(5.0)


def test_bottleneck_formula_by_hand():
    assert bottleneck([4.0], []) == 4.0
    assert bottleneck([4.0, 4.0, 4.0], [1.0, 1.0]) == pytest.approx((12 + 4) / 3)
    assert bottleneck([4.0, 4.0, 4.0], [1.0, 1.0], training=False) == 4.0
    assert bottleneck([1.0, 1.0], [7.0]) == 8.0  # pair window (1 + 1 + 14) / 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_n=7, max_p=3, memory=False), st.booleans())
def test_charged_mode_is_the_old_model_and_exact(pr: PartitionProblem, training: bool):
    """comm="charged" (the second cut model the planner tries; the simulator keeps the faster
    cuts): T_k + (2 when training) * transfer on both sides of each cut,
    max over stages, and the partitioner finds its optimum (brute force)."""
    import itertools
    pr = dataclasses.replace(pr, training=training, comm="charged")
    n, p = len(pr.out_bytes), len(pr.mem_cap)
    if n < p:
        return
    factor = 2.0 if training else 1.0

    def old(bounds):
        part = evaluate(pr, bounds)
        times = []
        for k in range(p):
            t = float(np.asarray(pr.fwd)[k, bounds[k]:bounds[k + 1]].sum()
                      + np.asarray(pr.bwd)[k, bounds[k]:bounds[k + 1]].sum())
            for j, x in ((k - 1, part.cut_bytes[k - 1] if k > 0 else 0.0),
                         (k, part.cut_bytes[k] if k < p - 1 else 0.0)):
                if 0 <= j < p - 1 and x > 0:
                    t += factor * pr.link_time(j, x)
            times.append(t)
        return max(times), part
    best = math.inf
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        value, part = old(bounds)
        assert part.bottleneck == pytest.approx(value, rel=1e-9, abs=1e-12)
        best = min(best, value)
    assert partition(pr).bottleneck == pytest.approx(best, rel=1e-9, abs=1e-12)
