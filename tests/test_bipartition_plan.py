"""Bi-Partition in the planner: the plan's FP/BP ranges and their pieces, the exact
search against brute force (spec §3.2 example), the lower bound, and the CLI."""
from __future__ import annotations

import pytest

from pipecc.errors import PipeccError
from pipecc.ir.plan import Plan, StagePlan


def _plan(fwd: list[list[str]], bwd: list[list[str]]) -> Plan:
    stages = [StagePlan(index=j, device=j, nodes=f, backward_nodes=b)
              for j, (f, b) in enumerate(zip(fwd, bwd))]
    return Plan(model="m", batch_size=4, microbatches=2, schedule="1f1b",
                devices=[{"name": "cpu", "kind": "cpu"}] * len(fwd), stages=stages,
                split_layers=[], bottleneck_s=1.0, lower_bound_s=1.0,
                predicted_iteration_s=1.0, bubble_fraction=0.0)


def test_pieces_without_bipartition_are_the_stages():
    plan = _plan([["a", "b"], ["c"]], [[], []])
    assert not plan.is_bipartition()
    assert plan.bipartition_pieces() == [("core", 0, 0, ["a", "b"]), ("core", 1, 1, ["c"])]


def test_pieces_name_segments_in_both_directions():
    # a = (0, 3, 5, 7), c = (0, 2, 6, 7) over nodes n0..n6
    n = [f"n{i}" for i in range(7)]
    plan = _plan([n[0:3], n[3:5], n[5:7]], [n[0:2], n[2:6], n[6:7]])
    assert plan.is_bipartition()
    assert plan.bipartition_pieces() == [
        ("core", 0, 0, ["n0", "n1"]), ("segment", 0, 1, ["n2"]), ("core", 1, 1, ["n3", "n4"]),
        ("segment", 2, 1, ["n5"]), ("core", 2, 2, ["n6"])]
    again = Plan.from_json(plan.to_json())
    assert again.bipartition_pieces() == plan.bipartition_pieces()


def test_old_plans_load_with_defaults():
    data = _plan([["a"], ["b"]], [[], []]).to_json()
    for s in data["stages"]:
        del s["backward_nodes"], s["extra_send_bytes"]
    del data["bipartition_mode"], data["weight_sync_bytes"]
    plan = Plan.from_json(data)
    assert plan.bipartition_mode == "" and plan.stages[0].backward_nodes == []


@pytest.mark.parametrize("fwd, bwd, what", [
    ([["a", "b"], ["c"]], [["a"], ["b", "c", "x"]], "no stage's forward range"),
    ([["a", "b"], ["c"]], [["a", "b"], ["b", "c"]], "backward ranges of stages 0 and 1"),
    ([["a", "b"], ["c"]], [["a"], ["b"]], "in no stage's backward range"),
    ([["a", "b"], ["c"]], [["b", "c"], ["a"]], "not in stage order"),
    ([["a"], ["b"], ["c", "d"]], [["a", "b"], ["c"], ["d"]], "stage 1 has no node"),
])
def test_bad_ranges_are_refused_in_one_line(fwd, bwd, what):
    with pytest.raises(PipeccError, match=what):
        _plan(fwd, bwd).bipartition_pieces()


# ---- the pure search (passes.bipartition) ---------------------------------------------------
import math
import random

from pipecc.passes.bipartition import bipartition, brute_force_bi, evaluate_bi
from pipecc.passes.partition import PartitionProblem, brute_force, evaluate, lower_bound, partition


def _problem(f, g, p, out=None, link=None, caps=None, act=None, static=None, charged=False):
    n = len(f[0]) if isinstance(f[0], list) else len(f)
    f = f if isinstance(f[0], list) else [list(f)] * p
    g = g if isinstance(g[0], list) else [list(g)] * p
    return PartitionProblem(
        fwd=f, bwd=g, out_bytes=out or [0.0] * n, last_use=[min(i + 1, n) for i in range(n)],
        static_mem=static or [0.0] * n, act_mem=act or [0.0] * n,
        mem_cap=caps or [math.inf] * p, inflight=[p - j for j in range(p)],
        link_time=link or (lambda k, b: 0.0), comm="charged" if charged else "overlapped")


def test_spec_example_ship_beats_single_cut_and_recompute_does_not():
    # PAPERS-SPEC §3.2: f = (1, 3, 1), g = (2, 6, 2), two workers, communication ignored
    pr = _problem([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 2)
    assert brute_force(pr).bottleneck == 12.0 and partition(pr).bottleneck == 12.0
    ex = evaluate_bi(pr, (0, 1, 3), (0, 2, 3))
    assert ex.stage_time == (9.0, 6.0) and ex.bottleneck == 9.0
    assert brute_force_bi(pr).bottleneck == 9.0
    best = bipartition(pr)
    assert best.bottleneck == 9.0 and best.is_split
    assert brute_force_bi(pr, mode="recompute").bottleneck == 12.0
    assert bipartition(pr, mode="recompute").bottleneck == 12.0
    # single cut: item max_i (f+g) = 9 dominates; Bi-Partition: fluid 7.5 (item term 6)
    assert lower_bound(pr, comm=False) == pytest.approx(9.0)
    assert lower_bound(pr, comm=False, bipartition=True) == pytest.approx(7.5)
    one = _problem([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 1)  # item terms alone
    assert lower_bound(one, comm=False) == 15.0
    pr4 = _problem([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 4)
    # item term with Bi-Partition: max_i max(f_i, g_i) = 6, not max_i (f+g) = 9
    assert lower_bound(pr4, comm=False, bipartition=True) == pytest.approx(6.0)
    assert lower_bound(pr4, comm=False) == pytest.approx(9.0)


def test_equal_cuts_cost_what_the_single_cut_costs():
    rng = random.Random(3)
    for _ in range(20):
        n, p = rng.randint(3, 8), rng.randint(2, 3)
        if p > n:
            continue
        pr = _random_problem(rng, n, p)
        for cuts in [(0, *sorted(rng.sample(range(1, n), p - 1)), n) for _ in range(3)]:
            one, bi = evaluate(pr, cuts), evaluate_bi(pr, cuts, cuts)
            assert bi.bottleneck == pytest.approx(one.bottleneck, rel=1e-12)
            assert bi.stage_memory == pytest.approx(one.stage_memory, rel=1e-12)
            assert bi.fits == one.fits


def _random_problem(rng, n, p, charged=False):
    f = [[rng.uniform(0.1, 3.0) for _ in range(n)] for _ in range(p)]
    g = [[2 * x * rng.uniform(0.5, 1.5) for x in row] for row in f]
    out = [float(rng.randint(0, 4) * 1000) for _ in range(n)]
    act = [float(rng.randint(0, 3) * 1000) for _ in range(n)]
    static = [float(rng.randint(0, 3) * 1000) for _ in range(n)]
    bw = [rng.uniform(2e3, 2e4) for _ in range(p)]
    caps = [rng.choice([math.inf, 3e4, 6e4]) for _ in range(p)]
    return _problem(f, g, p, out=out, act=act, static=static, caps=caps, charged=charged,
                    link=lambda k, b: 1e-3 + b / bw[k])


@pytest.mark.parametrize("charged", [False, True])
def test_windowed_dp_is_exact_against_brute_force(charged):
    rng = random.Random(7 + charged)
    checked = 0
    for _ in range(40):
        n, p = rng.randint(3, 7), rng.randint(2, 3)
        if p > n:
            continue
        pr = _random_problem(rng, n, p, charged)
        for mode in ("ship", "recompute"):
            try:
                ref = brute_force_bi(pr, mode)
            except ValueError:  # InfeasibleError
                with pytest.raises(ValueError):
                    bipartition(pr, window=n, mode=mode)
                continue
            got = bipartition(pr, window=n, mode=mode)
            assert got.fits and got.bottleneck == pytest.approx(ref.bottleneck, rel=1e-9)
            # never worse than the single cut, never below the Bi-Partition lower bound
            assert got.bottleneck <= partition(pr).bottleneck * (1 + 1e-12)
            assert got.bottleneck >= lower_bound(pr, bipartition=True) * (1 - 1e-9)
            checked += 1
    assert checked > 30


def test_no_segment_keeps_marked_nodes_on_one_worker():
    pr = _problem([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 2)
    got = bipartition(pr, no_segment=[False, True, False])
    assert got.bottleneck == 12.0 and not got.is_split


def test_shipping_costs_the_stash_on_the_link():
    # the §3.2 example with a slow link: the segment (unit 2) stash makes shipping lose
    pr = _problem([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 2, out=[1e3, 1e3, 0.0],
                  act=[0.0, 1e6, 0.0], link=lambda k, b: b * 1e-5)
    ex = evaluate_bi(pr, (0, 1, 3), (0, 2, 3))
    assert ex.misplaced_stash_bytes == (1e6,) and ex.bwd_cut_bytes == (1e6 + 1e3,)
    assert ex.bottleneck > 12.0
    assert not bipartition(pr).is_split
