"""Baseline partitions other tools would pick, and that none of them beats `partition`."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecc.passes.baselines import block_partition, equal_count, equal_params
from pipecc.passes.partition import PartitionProblem, evaluate, partition


@st.composite
def unconstrained(draw) -> PartitionProblem:
    """Random heterogeneous times, skips and links; memory never binds."""
    p = draw(st.integers(1, 4))
    n = draw(st.integers(p, 10))
    num = st.floats(0, 10, allow_nan=False, allow_subnormal=False)
    per_dev = st.lists(st.lists(num, min_size=n, max_size=n), min_size=p, max_size=p)
    lat = draw(st.lists(st.floats(0, 1), min_size=p, max_size=p))
    bw = draw(st.lists(st.floats(0.01, 100), min_size=p, max_size=p))
    return PartitionProblem(
        fwd=draw(per_dev), bwd=draw(per_dev), out_bytes=draw(st.lists(num, min_size=n, max_size=n)),
        last_use=[draw(st.integers(j, n)) for j in range(n)], static_mem=[0.0] * n, act_mem=[0.0] * n,
        mem_cap=[math.inf] * p, inflight=[1] * p, link_time=lambda k, x: lat[k] + x / bw[k])


def _valid(bounds, n, p) -> bool:
    return len(bounds) == p + 1 and bounds[0] == 0 and bounds[-1] == n and all(
        a < b for a, b in zip(bounds, bounds[1:]))


def test_equal_count_splits_nodes_or_layer_units():
    assert equal_count(10, 4) == (0, 3, 5, 8, 10)
    assert equal_count(8, 8) == tuple(range(9))
    assert equal_count(5, 1) == (0, 5)
    # only every other node is a layer; glue after a layer opens the next stage
    assert equal_count(8, 2, weights=[1, 0, 1, 0, 1, 0, 1, 0]) == (0, 3, 8)
    assert equal_count(4, 3, weights=[0, 0, 0, 0]) == (0, 2, 3, 4)
    with pytest.raises(ValueError):
        equal_count(2, 3)


def test_equal_params_minimises_the_largest_parameter_sum():
    assert equal_params([1, 1, 1, 1, 4], 2) == (0, 4, 5)
    b = equal_params([5, 1, 1, 1, 1, 1], 3)  # greedy needs 2 stages; a third is split off
    assert _valid(b, 6, 3) and max(np.diff(np.r_[0, np.cumsum([5, 1, 1, 1, 1, 1])][list(b)])) == 5
    assert equal_params([0, 0, 0], 3) == (0, 1, 2, 3)
    assert equal_params([1e-9, 3e-9, 2e-9], 2) == (0, 2, 3)


def _ds_spread_reference(w, m):
    """DeepSpeed's newer partition_balanced, written out as its plain triple loop."""
    n, pre = len(w), [0.0, *itertools.accumulate(w)]
    inf = math.inf
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    pos = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                top, bot = max(hi[k][j - 1], pre[i] - pre[k]), min(lo[k][j - 1], pre[i] - pre[k])
                if cost[i][j] >= top - bot:
                    cost[i][j], hi[i][j], lo[i][j], pos[i][j] = top - bot, top, bot, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(pos[parts[-1]][j])
    return tuple(parts[::-1])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 4))
def test_equal_params_spread_matches_deepspeed_dp(w, p):
    if p > len(w):
        return
    assert equal_params(w, p, method="spread") == _ds_spread_reference(w, p)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100, allow_subnormal=False), min_size=1, max_size=9), st.integers(1, 4))
def test_equal_params_is_the_exact_min_max(w, p):
    if p > len(w):
        return
    pre = np.r_[0.0, np.cumsum(w)]
    best = min(max(pre[b] - pre[a] for a, b in zip(c, c[1:]))
               for c in ((0, *cut, len(w)) for cut in itertools.combinations(range(1, len(w)), p - 1)))
    got = equal_params(w, p)
    assert _valid(got, len(w), p)
    assert max(pre[b] - pre[a] for a, b in zip(got, got[1:])) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_block_partition_hand_examples():
    # normalised [0,0,0,0,1,0,0,0]: the initial halves already differ by ≤ 1 → kept
    assert block_partition([1, 1, 1, 1, 10, 1, 1, 1], 2) == (0, 4, 8)
    # normalised [1,1,1,1,0,0,0,0]: nodes move one at a time from block 0 to block 1
    assert block_partition([3, 3, 3, 3, 0, 0, 0, 0], 2) == (0, 2, 8)
    assert block_partition([5, 5, 5], 3) == (0, 1, 2, 3)
    assert block_partition([2, 7, 1], 1) == (0, 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100, allow_subnormal=False), min_size=1, max_size=30), st.integers(1, 6))
def test_block_partition_keeps_the_paper_guarantee(times, p):
    if p > len(times):
        return
    b = block_partition(times, p)
    assert _valid(b, len(times), p)
    t = np.asarray(times)
    x = (t - t.min()) / (t.max() - t.min()) if t.max() > t.min() else np.zeros_like(t)
    sums = [x[a:e].sum() for a, e in zip(b, b[1:])]
    assert max(sums) <= min(sums) + 1 + 1e-9


@settings(max_examples=300, deadline=None)
@given(unconstrained(), st.lists(st.integers(0, 1000), min_size=10, max_size=10))
def test_no_baseline_beats_partition(pr: PartitionProblem, params):
    n, p = len(pr.out_bytes), len(pr.mem_cap)
    opt = partition(pr).bottleneck
    times = np.asarray(pr.fwd[0]) + np.asarray(pr.bwd[0])  # the reference device
    for bounds in (equal_count(n, p), equal_params(params[:n], p),
                   equal_params(params[:n], p, method="spread"), block_partition(times, p)):
        assert _valid(bounds, n, p)
        assert evaluate(pr, bounds).bottleneck >= opt * (1 - 1e-9)


def test_block_partition_stops_when_rounding_hides_the_guarantee():
    # M − m reads 1.0000000000000004 at the fixed point: it used to loop and raise
    t = np.tile([2.9689294059948647e-08, 8.862475838790642e-10, 1.7724951677581284e-09,
                 1.329371375818596e-09], 25)
    b = block_partition(t, 8)
    assert len(b) == 9 and b[0] == 0 and b[-1] == 100 and all(x < y for x, y in zip(b, b[1:]))
    x = (t - t.min()) / (t.max() - t.min())
    sums = [x[a:e].sum() for a, e in zip(b, b[1:])]
    assert max(sums) - min(sums) <= 1 + 1e-9
