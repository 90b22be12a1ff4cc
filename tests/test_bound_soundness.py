"""The lower bound bounds every placement the planner can return, fixed costs included:
brute force over small random problems, whole and with layers split into shards.

A split is modelled on the numbers as `passes.split_layers` rewrites the graph (dim 0): unit i
becomes q shards, each reading the layer's input and paying the unit's per-call fixed cost
again, plus a combine that reads every shard; `split_bytes` is what `passes.plan_emit.
split_floor` gives such a unit. Every problem carries per-stage fixed costs (per micro-batch)
and per-message costs (a latency on every link).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from pipecc.passes.bound import lower_bound
from pipecc.passes.partition import InfeasibleError, PartitionProblem, brute_force, cut_bytes


def _random_problem(rng: np.random.Generator, n: int, p: int):
    var = rng.uniform(0, 10, (p, n)) * rng.uniform(0.3, 3, (p, 1))  # heterogeneous devices
    # per-call fixed, per device: one op call's (op) and, on some units, more (a matmul's
    # half-rate term, a second call)
    op = rng.uniform(0, 2, (p, 1)) * (rng.random() < 0.8)
    call = op + rng.uniform(0, 1, (1, n)) * (rng.random((1, n)) < 0.5) * rng.uniform(0.5, 2, (p, 1))
    out = np.where(rng.random(n) < 0.2, 0.0, rng.integers(1, 1000, n)).astype(float)
    last = [int(rng.integers(j, n + 1)) for j in range(n)]
    lat, bw = rng.uniform(0, 1, p), rng.uniform(10, 1000, p)
    fixed_f, fixed_b = rng.uniform(0, 1, p).tolist(), rng.uniform(0, 1, p).tolist()
    training = bool(rng.random() < 0.8)

    def link(k: int, x: float) -> float:
        return lat[k] + x / bw[k]
    return var, call, op, out, last, link, fixed_f, fixed_b, training


def _problem(var, call, out, last, link, fixed_f, fixed_b, training) -> PartitionProblem:
    p, n = var.shape
    cost = var + call
    return PartitionProblem(fwd=cost * 0.4, bwd=cost * 0.6, out_bytes=list(out), last_use=list(last),
                            static_mem=[0.0] * n, act_mem=[0.0] * n, mem_cap=[math.inf] * p,
                            inflight=[1] * p, link_time=link, training=training,
                            fixed_fwd=fixed_f, fixed_bwd=fixed_b)


def _split(rng, var, call, op, out, last, splits: dict[int, int], combine: float):
    """The numbers of the graph with unit i split into splits[i] shards of random extents and
    a combine: shard j does its share x_j of the work, pays the unit's per-call fixed cost
    again and outputs x_j of its bytes; the combine (one op call) reads every shard."""
    n = var.shape[1]
    new_index, cols, outs, lasts, owner = [], [], [], [], []
    for i in range(n):
        q = splits.get(i, 1)
        first = len(cols)
        if q == 1:
            cols.append((var[:, i], call[:, i]))
            outs.append(out[i])
            owner.append(("whole", i))
        else:
            share = rng.dirichlet(np.ones(q))
            for x in share:
                cols.append((var[:, i] * x, call[:, i]))  # each shard pays the call again
                outs.append(out[i] * x)
                owner.append(("shard", i))
            cols.append((np.full(var.shape[0], combine), op[:, 0]))
            outs.append(out[i])
            owner.append(("combine", i))
        new_index.append((first, len(cols) - 1))  # (first, last) position of unit i
    m = len(cols)
    new_last = []
    for pos, (kind, i) in enumerate(owner):
        if kind == "shard":
            new_last.append(new_index[i][1])  # read by the combine
            continue
        u = last[i]
        if u == i:
            new_last.append(pos)
        elif u == n:
            new_last.append(m)
        elif splits.get(u, 1) > 1:
            new_last.append(new_index[u][1] - 1)  # every shard of u reads it: the last shard
        else:
            new_last.append(new_index[u][0])
    v = np.stack([c[0] for c in cols], axis=1)
    f = np.stack([c[1] for c in cols], axis=1)
    return v, f, np.array(outs), new_last


def _split_floor(out, last, splittable) -> list[float]:
    n = len(out)
    X = np.zeros(n + 1)
    X[1:n] = cut_bytes(out, last)
    end = list(X[1:n]) + [float(out[n - 1])]
    return [float(min(max(X[i], 5e-324 if out[i] > 0 else 0.0), end[i])) if s else 0.0
            for i, s in enumerate(splittable)]


@pytest.mark.parametrize("seed", range(40))
def test_bound_never_beats_brute_force_whole_or_split(seed):
    rng = np.random.default_rng(seed)
    for _ in range(10):
        n, p = int(rng.integers(2, 7)), int(rng.integers(2, 4))
        if p > n:
            continue
        var, call, op, out, last, link, ff, fb, training = _random_problem(rng, n, p)
        base = _problem(var, call, out, last, link, ff, fb, training)
        splittable = [bool(b) for b in rng.random(n) < 0.5]
        floor = _split_floor(out, last, splittable)
        piece = np.broadcast_to(op, var.shape)  # every piece's stage pays one call
        bound = lower_bound(base, splittable, split_bytes=floor, split_fixed=piece)
        assert bound <= lower_bound(base) * (1 + 1e-9)  # more freedom never raises it
        assert bound >= lower_bound(base, splittable, split_bytes=floor) * (1 - 3e-3)  # f: only the grid moves
        assert bound >= lower_bound(base, splittable, comm=False, split_fixed=piece) * (1 - 1e-12)
        try:
            whole = brute_force(base).bottleneck
        except InfeasibleError:
            continue
        assert lower_bound(base) <= whole * (1 + 1e-9)
        assert bound <= whole * (1 + 1e-9)
        for _ in range(3):  # the same problem with some splittable layers split
            chosen = {i: int(rng.integers(2, 4)) for i, s in enumerate(splittable) if s and rng.random() < 0.7}
            if not chosen:
                continue
            v, f, o, lu = _split(rng, var, call, op, out, last, chosen, float(rng.uniform(0, 0.5)))
            split = _problem(v, f, o, lu, link, ff, fb, training)
            if split.fwd.shape[1] > 11:
                continue
            opt = brute_force(split).bottleneck
            assert bound <= opt * (1 + 1e-9), (seed, chosen, bound, opt)


def test_fixed_costs_and_messages_raise_the_bound_to_the_optimum_of_a_uniform_chain():
    # identical devices, equal units of which each pays a per-call cost, a per-stage fixed cost
    # and a message latency: the optimum is (Σ c + Σ fixed + 2 Σ t) / p and the bound finds it
    p, n = 4, 8
    var, call = np.full((p, n), 1.0), np.full((p, n), 0.25)
    pr = _problem(var, call, np.full(n, 8.0), [j + 1 for j in range(n)], lambda k, x: 0.5 + x / 16,
                  [0.1] * p, [0.2] * p, True)
    opt = brute_force(pr).bottleneck
    assert opt == pytest.approx((n * 1.25 + p * 0.3 + 2 * (p - 1) * 1.0) / p)
    assert lower_bound(pr) == pytest.approx(opt, rel=1e-9)
    # every layer splittable: a cut inside one still sends the layer's input (8 bytes), but
    # inside the first (its input is the model's, not charged) only its first shards' outputs
    # of unknown size: one message's latency. Charged apart, messages and contiguity allow
    # the first cut there and every round trip at the least (4.05); charged at once (the grid,
    # `passes.bound_grid`), such a cut leaves the other three stages too much: splitting gains
    # nothing here, and the bound is the whole-unit optimum less the grid's rounding (≤ 0.2 %)
    floor = _split_floor([8.0] * n, [j + 1 for j in range(n)], [True] * n)
    split = lower_bound(pr, [True] * n, split_bytes=floor)
    assert opt * (1 - 2e-3) <= split <= opt
    assert split > (n * 1.25 + p * 0.3 + 2 * ((p - 1) * 1.0 - 0.5)) / p
    # and with every piece paying the per-call cost again, as a split's shards do
    assert lower_bound(pr, [True] * n, split_bytes=floor, split_fixed=np.full((p, n), 0.25)) >= split * (1 - 2e-3)


def test_grid_bound_is_the_whole_unit_optimum_without_memory_or_splits():
    # no unit splittable, memory free: bound (7) is the partitioner's optimum itself (δ = 0)
    rng = np.random.default_rng(7)
    for _ in range(30):
        n, p = int(rng.integers(3, 9)), int(rng.integers(2, 4))
        var, call, op, out, last, link, ff, fb, training = _random_problem(rng, n, p)
        pr = _problem(var, call, out, last, link, ff, fb, training)
        opt = brute_force(pr).bottleneck
        assert lower_bound(pr) == pytest.approx(opt, rel=1e-8)


def test_bound_follows_a_split_that_pays_and_stays_below_it():
    # one heavy splittable layer between two light ones on three devices: whole units leave it
    # alone on a stage (bottleneck ≥ 12); split into shards it spreads, each shard paying its
    # call again, and the bound stays under every split while following it down
    p = 3
    var = np.array([[1.0, 12.0, 1.0]] * p) * np.array([[1.0], [1.2], [0.9]])
    op = np.full((p, 1), 0.2)
    call = np.broadcast_to(op, var.shape).copy()
    out, last = np.array([64.0, 64.0, 8.0]), [1, 2, 3]
    link = lambda k, x: 0.05 + x / 640  # noqa: E731
    base = _problem(var, call, out, last, link, [0.1] * p, [0.1] * p, True)
    flags = [False, True, False]
    floor = _split_floor(out, last, flags)
    bound = lower_bound(base, flags, split_bytes=floor, split_fixed=np.broadcast_to(op, var.shape))
    rng = np.random.default_rng(0)
    best = math.inf
    for q in range(2, 8):
        v, f, o, lu = _split(rng, var, call, op, out, last, {1: q}, 0.05)
        v[:, 1:1 + q] = var[:, [1]] / q  # equal shards: the best a split of q does here
        best = min(best, brute_force(_problem(v, f, o, lu, link, [0.1] * p, [0.1] * p, True)).bottleneck)
    assert bound <= best * (1 + 1e-9)
    assert bound >= 0.9 * best  # the grid follows the split (whole units: ≥ 12)
    assert brute_force(base).bottleneck > 12
