"""UMPIPE planner: the end-time recurrence (loop and vectorised) against the event simulator,
the spec's worked example, the GA and its baselines (pipecc/techniques/umpipe/search.py), and the plan/CLI
surface (`--microbatch-sizes`)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecc.ir.schedule import gpipe
from pipecc.techniques.umpipe import search as umpipe
from pipecc.passes.simulate import StageCosts, simulate
from pipecc.techniques.umpipe.schedule import gpipe_uneven
from pipecc.techniques.umpipe.search import Curves, end_times, population_times, stage_costs


def _worked_curves() -> Curves:
    # PAPERS-SPEC.md §1.3: f_s(b) = b, g_s(b) = 2b, both link directions 0.5·b
    return Curves.from_functions(2, 4, lambda s, b: b, lambda s, b: 2 * b,
                                 lambda s, b: 0.5 * b, lambda s, b: 0.5 * b)


def test_worked_example_of_the_spec():
    r = end_times([[2, 2], [4]], _worked_curves(), backward_sizes=[[1, 3], [4]])
    assert r.ef == [[2, 4], [9]]
    assert r.cf[0] == [3, 5]
    assert r.eb == [[21, 27], [17]]
    assert r.cb[1] == [19]
    assert r.T == 27


def test_tied_worked_example_by_hand():
    # tied [2, 2] | [4]: gradient of stage 0's chunk j (2 samples, 1 s) leaves after B(1,0)=17
    r = end_times([[2, 2], [4]], _worked_curves())
    assert r.cb[0] == [18, 19]
    assert r.eb[0] == [22, 26]
    assert r.T == 26
    assert population_times([[[2, 2], [4]]], _worked_curves())[0] == 26


def _split(draw, batch: int) -> list[int]:
    cuts = draw(st.sets(st.integers(1, batch - 1), max_size=batch - 1)) if batch > 1 else set()
    edges = [0] + sorted(cuts) + [batch]
    return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def _instances(draw):
    p = draw(st.integers(1, 4))
    batch = draw(st.integers(1, 10))
    sizes = [_split(draw, batch) for _ in range(p)]
    coef = st.floats(0.0, 3.0, allow_nan=False)
    table = {name: [(draw(coef), draw(coef)) for _ in range(p)] for name in ("f", "g", "sf", "sb")}

    def fn(name):  # a + c·b: a fixed cost per chunk (the non-linearity UMPIPE exploits)
        return lambda s, b: table[name][s][0] + table[name][s][1] * b
    curves = Curves.from_functions(p, batch, fn("f"), fn("g"), fn("sf"), fn("sb"))
    return sizes, curves


@settings(max_examples=150, deadline=None)
@given(_instances())
def test_recurrence_equals_simulator(instance):
    sizes, curves = instance
    loop = end_times(sizes, curves).T
    assert population_times([sizes], curves)[0] == pytest.approx(loop, rel=1e-12, abs=1e-12)
    timeline = simulate(gpipe_uneven(sizes), stage_costs(sizes, curves))
    assert timeline.iteration_s == pytest.approx(loop, rel=1e-12, abs=1e-12)


def test_vectorised_population_matches_loop_seeded():
    rng = np.random.default_rng(7)
    batch, p = 16, 3
    curves = Curves.from_functions(p, batch, lambda s, b: 1 + s + 0.3 * b, lambda s, b: 2 + 0.5 * b,
                                   lambda s, b: 0.2 + 0.05 * b, lambda s, b: 0.1 + 0.02 * b)
    pop = []
    for _ in range(100):
        ind = []
        for _ in range(p):
            cuts = sorted(rng.choice(np.arange(1, batch), size=rng.integers(0, batch), replace=False))
            edges = [0] + [int(c) for c in cuts] + [batch]
            ind.append([b - a for a, b in zip(edges, edges[1:])])
        pop.append(ind)
    np.testing.assert_allclose(population_times(pop, curves), [end_times(i, curves).T for i in pop],
                               rtol=1e-12)


def test_equal_sizes_simulate_like_gpipe():
    """gpipe_uneven with equal lists is gpipe: same simulated time as the existing path."""
    p, m = 3, 4
    costs = StageCosts.per_stage(m, [1.0, 2.0, 1.5], [2.0, 3.0, 2.5], [0.3, 0.2, 0.0], [0.0, 0.3, 0.2])
    want = simulate(gpipe(p, m), costs).iteration_s
    curves = Curves.from_functions(p, 8, lambda s, b: [1.0, 2.0, 1.5][s], lambda s, b: [2.0, 3.0, 2.5][s],
                                   lambda s, b: [0.3, 0.2, 0.0][s], lambda s, b: [0.0, 0.3, 0.2][s])
    assert end_times([[2] * 4] * p, curves).T == pytest.approx(want)


def test_simulator_rejects_rows_of_the_wrong_length():
    sizes = [[1, 3], [4]]
    costs = stage_costs(sizes, _worked_curves())
    costs.forward_s[1] = [1.0, 1.0]
    with pytest.raises(ValueError, match="forward_s"):
        simulate(gpipe_uneven(sizes), costs)


def _knees(p: int = 4, batch: int = 32) -> Curves:
    # per-chunk fixed costs spread over two decades (spec §1.6 "simulated networks")
    alpha = [0.001, 0.01, 0.1, 0.02][:p]
    beta = [0.01, 0.002, 0.001, 0.004][:p]
    return Curves.from_functions(p, batch, lambda s, b: alpha[s] + beta[s] * b,
                                 lambda s, b: 2 * (alpha[s] + beta[s] * b),
                                 lambda s, b: 1e-4 + 1e-5 * b, lambda s, b: 1e-4 + 1e-5 * b)


def test_search_never_worse_than_best_equal_split_and_deterministic():
    curves = _knees()
    res = umpipe.search(curves, budget_s=5.0)
    equal = [population_times([[e] * 4], curves)[0] for e in umpipe.equal_splits(32)]
    assert res.edp_T == pytest.approx(min(equal))
    assert res.T <= res.edp_T + 1e-15
    assert res.T == pytest.approx(end_times(res.sizes, curves).T)
    umpipe.check_sizes(res.sizes, 32, 4)
    assert res.T < res.edp_T * 0.99  # the knees differ: unequal splits must win here
    again = umpipe.search(curves, budget_s=5.0)
    assert again.sizes == res.sizes and again.generations == res.generations


def test_baselines():
    curves = _knees()
    greedy = umpipe.local_greedy(curves)
    for s, row in enumerate(greedy):  # b* minimises the per-sample time, ties to the smaller b
        per = [(curves.f[s][b] + curves.g[s][b]) / b for b in range(1, 33)]
        assert row[0] == 1 + int(np.argmin(per))
        assert sum(row) == 32
    dp = umpipe.greedy_dp(curves)
    umpipe.check_sizes(dp, 32, 4)
    res = umpipe.search(curves, budget_s=5.0)
    assert res.T <= min(t for _, t in res.baselines.values()) + 1e-15


def test_memory_cap_is_honoured():
    """A cap below what a split needs makes the GA prefer a split that fits."""
    base = _knees(2, 8)
    mem = np.zeros_like(base.f)
    mem[:, 1:] = 100.0  # a fixed 100 bytes per chunk: fewer chunks hold less
    curves = Curves(base.f, base.g, base.send_f, base.send_b, mem=mem, static=np.zeros(2),
                    cap=np.array([250.0, 250.0]))
    res = umpipe.search(curves, budget_s=5.0)
    assert all(m <= 250.0 for m in curves.memory(res.sizes))


# ----------------------------------------------------------------------------- plan and CLI
@pytest.fixture(scope="module")
def gpt_analysis():
    from pipecc import driver
    return driver.analyze("models/gpt.py", model_args=dict(n_layer=4, n_head=4, n_embd=256,
                                                           vocab_size=5000, block_size=128),
                          batch_size=37)  # NOTE: prime: equal splits are 1 or 37 micro-batches,
    # unequal ones absorb the remainder (with the fixed costs per micro-batch, even splits of a
    # divisible batch are what UMPIPE keeps on this model: issue #20)


@pytest.fixture(scope="module")
def auto_plan(gpt_analysis):
    from pipecc import driver
    plan, _ = driver.plan(gpt_analysis, "2xa100", schedule="gpipe", replicas=1,
                          microbatch_sizes="auto", umpipe_budget_s=5.0, split_layers=False)
    return plan


def test_auto_finds_unequal_sizes_and_predicts_them(auto_plan):
    from pipecc.report.artifacts import timeline_for
    plan = auto_plan
    assert plan.schedule == "gpipe" and plan.replicas == 1
    assert plan.microbatch_sizes is not None and len(plan.microbatch_sizes) == len(plan.stages)
    umpipe.check_sizes(plan.microbatch_sizes, plan.batch_size, len(plan.stages))
    assert plan.microbatches == len(plan.microbatch_sizes[0])
    line = next(d for d in plan.decisions if d.startswith("unequal micro-batches (UMPIPE): stage 0"))
    got, equal = (float(x) for x in
                  re.search(r"predicted (\S+) s vs (\S+) s for the best equal", line).groups())
    assert got < equal
    assert plan.predicted_iteration_s == pytest.approx(got, rel=1e-3)
    assert timeline_for(plan).iteration_s == pytest.approx(plan.predicted_iteration_s)  # from the plan alone


def test_plan_json_round_trips_and_old_plans_load(auto_plan):
    from pipecc.ir.plan import Plan
    again = Plan.from_json(json.loads(auto_plan.dumps()))
    assert again.microbatch_sizes == auto_plan.microbatch_sizes
    old = auto_plan.to_json()
    del old["microbatch_sizes"]
    assert Plan.from_json(old).microbatch_sizes is None


def test_auto_says_why_it_was_not_tried(gpt_analysis):
    from pipecc import driver
    plan, _ = driver.plan(gpt_analysis, "2xa100", schedule="zb-h1", replicas=1,
                          microbatch_sizes="auto", split_layers=False)
    assert plan.microbatch_sizes is None
    assert any("UMPIPE not tried: unequal micro-batches (UMPIPE) run under the gpipe or 1f1b schedule only, not zb-h1"
               in d for d in plan.decisions)


def test_equal_is_the_default(gpt_analysis):
    from pipecc import driver
    plan, _ = driver.plan(gpt_analysis, "2xa100", schedule="gpipe", replicas=1, split_layers=False)
    assert plan.microbatch_sizes is None
    assert not any("UMPIPE" in d for d in plan.decisions)


def test_cli_given_sizes(capsys):
    from helpers import run_cli
    code, out, _ = run_cli(["plan", "models/mlp.py", "-b", "8", "--devices", "cpu,cpu", "--use-all-devices",
                            "--microbatch-sizes", "3,5", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["microbatch_sizes"] == [[3, 5], [3, 5]]
    assert data["schedule"] == "gpipe" and data["replicas"] == 1 and data["microbatches"] == 2
    code, out, _ = run_cli(["plan", "models/mlp.py", "-b", "8", "--devices", "cpu,cpu", "--use-all-devices",
                            "--microbatch-sizes", "3,5"], capsys)
    assert code == 0 and "stage 0 [3, 5], stage 1 [3, 5]" in out


@pytest.mark.parametrize("extra, message", [
    (["--microbatch-sizes", "3,3"], "--microbatch-sizes 3,3 sums to 6, not the batch size 8"),
    (["--microbatch-sizes", "4,0,4"], "--microbatch-sizes 4,0,4 has a size of 0"),
    (["--microbatch-sizes", "3,5", "--schedule", "zb-h1"], "run under the gpipe or 1f1b schedule only, not zb-h1"),
    (["--microbatch-sizes", "3,5", "--replicas", "2"], "need replicas 1, not 2"),
    (["--microbatch-sizes", "3,5", "--microbatches", "4"], "--microbatches 4 conflicts"),
    (["--microbatch-sizes", "3,5", "--inference"], "need a training plan"),
    (["--microbatch-sizes", "x"], "expected auto, off or sizes like 3,5"),
])
def test_cli_bad_sizes_are_one_line_usage_errors(capsys, extra, message):
    from helpers import run_cli
    code, out, err = run_cli(["plan", "models/mlp.py", "-b", "8", "--devices", "cpu,cpu", "--use-all-devices", *extra], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("pipecc: error: ") and message in err


def test_drop_in_module_refuses_unequal_sizes():
    import pipecc
    from pipecc.errors import UsageError
    from helpers import zoo_module
    mlp = zoo_module("mlp")
    with pytest.raises(UsageError, match="drop-in module runs equal micro-batches"):
        pipecc.compile(mlp.build_model(), mlp.example_inputs(8), "cpu,cpu", microbatch_sizes=[3, 5])


def test_bench_papers_synthetic():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_papers
    assert bench_papers.runs([3, 3, 3, 2]) == "3x3, 2"
    rows = bench_papers.synthetic_rows([2], [8], budget_s=0.5)
    (row,) = rows
    assert row["umpipe_s"] <= row["gpipe_s"] + 1e-12
    umpipe.check_sizes(row["sizes"], 8, 2)
    text = bench_papers.render(rows, 0.5, 1.0)
    assert "| synthetic | 2 stages | 8 |" in text and "Bi-Partition and BPipe have their own sections" in text


# ----------------------------------------------------------------------------- chunk costs
def _curves_of(analysis, devices, profile=None):
    from pipecc import driver
    from pipecc.passes.plan_options import PlanOptions
    from pipecc.passes.plan_search import Planner
    from pipecc.techniques.umpipe.plan import curves_for_plan
    from pipecc.targets.devices import parse_devices
    from pipecc.targets.profiled import use_profile
    cluster = parse_devices(devices)
    plan, graph = driver.plan(analysis, cluster, profile=profile, microbatches=2, schedule="gpipe",
                              split_layers=False)
    if profile is not None:
        profile, cluster = use_profile(profile, analysis, cluster)
    ev = Planner(graph, cluster, PlanOptions(batch_size=8, schedule="gpipe", profile=profile)).evaluator
    return plan, ev, curves_for_plan(ev, plan)


def test_chunk_costs_are_the_profiled_curves_with_a_profile():
    """With --profile, f_s(b) is the sum of the stage's measured a + c·b (no per-call cost added:
    a curve holds it) plus the stage's per-micro-batch fixed cost, which no node's curve holds."""
    from pipecc import driver
    from test_plan_profile import MLP, TINY, curve, synthetic
    analysis = driver.analyze(MLP, model_args=TINY, batch_size=8)
    plan, ev, curves = _curves_of(analysis, "cpu,cpu", synthetic())
    assert not ev.tables.unit_fixed(0)[0].any()  # every node has a curve
    for k, stage in enumerate(plan.stages):
        fixed_f, fixed_b = ev.tables.stage_fixed(k)
        for b in (1, 3, 8):
            want_f = sum(curve(n, b)[0] for n in stage.nodes) + fixed_f
            want_g = sum(curve(n, b)[1] for n in stage.nodes) + fixed_b
            assert curves.f[k][b] == pytest.approx(want_f)
            assert curves.g[k][b] == pytest.approx(want_g)


def test_chunk_costs_are_the_one_cost_models():
    """A chunk of b costs what the planner's stage of b costs: the unit times (their per-call
    fixed costs included: `CostTables.unit_fixed`) plus the stage's per-micro-batch fixed
    costs; no second model (issue #20: UMPIPE's LAUNCH_S is gone)."""
    from pipecc import driver
    from test_plan_profile import MLP, TINY
    analysis = driver.analyze(MLP, model_args=TINY, batch_size=8)
    plan, ev, curves = _curves_of(analysis, "cpu,cpu")
    units = ev.builder.at(4)
    fwd, bwd = ev.tables.times(units, 4)
    roof_f, roof_b = ev.tables.costs[0].unit_times(units, 4)
    unit_f, unit_b = ev.tables.unit_fixed(0)
    assert unit_f.sum() > 0 and unit_b.sum() > 0
    assert fwd[0] == pytest.approx(roof_f + unit_f) and bwd[0] == pytest.approx(roof_b + unit_b)
    unit_of = {nm: u for u, names in enumerate(units.names) for nm in names}
    for k, stage in enumerate(plan.stages):
        us = sorted({unit_of[n] for n in stage.nodes})
        fixed_f, fixed_b = ev.tables.stage_fixed(k)
        assert fixed_f > 0 and fixed_b > 0
        assert curves.f[k][4] == pytest.approx(fwd[k, us].sum() + fixed_f)
        assert curves.g[k][4] == pytest.approx(bwd[k, us].sum() + fixed_b)
        assert curves.f[k][0] == 0.0  # padding is free
