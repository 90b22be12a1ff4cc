"""Bi-Partition in the planner: the plan's FP/BP ranges and their pieces, the exact
search against brute force (spec §3.2 example), the lower bound, and the CLI."""
from __future__ import annotations

import json

import pytest

from pipecc.errors import PipeccError
from pipecc import techniques
from pipecc.ir.plan import Plan, StagePlan
from pipecc.techniques.bipartition.data import BipartitionCosts, BipartitionSearch


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


# ---- the pure search (techniques.bipartition.search) ---------------------------------------------------
import math
import random

from pipecc.techniques.bipartition.search import bipartition, brute_force_bi, evaluate_bi
from pipecc.passes.bound import lower_bound
from pipecc.passes.partition import PartitionProblem, brute_force, evaluate, partition


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
    # single cut: contiguity (issue 31: two stages hold (3, 9, 3) in order) gives the single-cut
    # optimum 12, above the item term max_i (f+g) = 9; Bi-Partition: fluid 7.5 (item term 6)
    assert lower_bound(pr) == pytest.approx(12.0)
    assert lower_bound(pr, bipartition=True) == pytest.approx(7.5)
    one = _problem([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 1)  # item terms alone
    assert lower_bound(one) == 15.0
    pr4 = _problem([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 4)
    # item term with Bi-Partition: max_i max(f_i, g_i) = 6, not max_i (f+g) = 9
    assert lower_bound(pr4, bipartition=True) == pytest.approx(6.0)
    assert lower_bound(pr4) == pytest.approx(9.0)


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


# ---- the simulator's tail (the replica refresh after the step) -------------------------------
def test_simulator_tail_delays_the_iteration_end():
    from pipecc.ir.schedule import by_name
    from pipecc.passes.simulate import StageCosts, simulate
    sched = by_name("1f1b", 2, 4, 1)
    costs = StageCosts.uniform(2, 4, 1.0, 2.0)
    plain = simulate(sched, costs).iteration_s
    costs.tail_s = [0.0, 5.0]  # rank 1 ends first (1F1B cooldown ends on rank 0), then sends 5 s
    rank1_end = max(e.end for e in simulate(sched, costs).events if e.rank == 1)
    assert simulate(sched, costs).iteration_s == pytest.approx(max(plain, rank1_end + 5.0))
    assert simulate(sched, costs).iteration_s > plain
    costs.tail_s = [0.0]
    with pytest.raises(ValueError, match="tail_s"):
        simulate(sched, costs)


# ---- the planner (driver.plan with bipartition="auto") ----------------------------------------
from helpers import run_cli, zoo_path  # noqa: E402

LUMPY = dict(in_features=512, hidden=4096, depth=3, num_classes=512)  # layer FLOPs 1 : 8 : 1


@pytest.fixture(scope="module")
def lumpy():
    from pipecc import driver
    analysis = driver.analyze(zoo_path("mlp"), model_args=LUMPY, batch_size=64)
    kw = dict(microbatches=8, schedule="1f1b", replicas=1, split_layers=False)
    on, graph = driver.plan(analysis, "2xcpu", bipartition="auto", debug=True, **kw)
    off, _ = driver.plan(analysis, "2xcpu", bipartition="off", **kw)
    return analysis, on, off, graph


def test_the_search_record_stays_where_plan_json_had_it():
    """Bi-Partition's plan data (`BipartitionSearch`, `BipartitionCosts`) is written inside `options`, before the
    options later steps add, so a plan.json reads back and writes out byte-identical; a record the
    fields cannot write back as read (hand-edited) stays an option."""
    plan = techniques.sketch(schedule="1f1b", devices=[{"kind": "cpu", "name": "cpu"}] * 2)
    plan = plan.with_data(BipartitionSearch(
        used=True, window=8, mode="ship", single_iteration_s=1.0, single_bottleneck_s=0.5,
        recompute_bottleneck_s=None, recompute_iteration_s=1.0, best_ship_bottleneck_s=0.4, fwd_bounds=(0, 3, 6),
        bwd_bounds=(0, 2, 6), iteration_s=0.9, bottleneck_s=0.4, stash_bytes=(64.0,), weight_sync_bytes=(32.0,)),
        BipartitionCosts((0.1, 0.0), (0.0, 0.1), (0.2, 0.3)))
    plan.options["devices_given"] = 3
    data = json.loads(plan.dumps())
    assert list(data["options"]) == ["training", "bipartition", "bipartition_costs", "devices_given"]
    assert "bipartition" not in data and data["options"]["bipartition"]["fwd_bounds"] == [0, 3, 6]
    again = Plan.from_json(json.loads(plan.dumps()))
    assert (again.data(BipartitionSearch), again.data(BipartitionCosts)) == (
        plan.data(BipartitionSearch), plan.data(BipartitionCosts))
    assert again.dumps() == plan.dumps() and "bipartition" not in again.options
    data["options"]["bipartition"]["edited"] = 1
    odd = Plan.from_json(json.loads(json.dumps(data)))
    assert odd.data(BipartitionSearch) is None and odd.options["bipartition"]["edited"] == 1
    assert odd.dumps() == json.dumps(data, indent=1)


def test_auto_keeps_a_faster_cut_pair_and_fills_the_plan(lumpy):
    from pipecc import driver
    from pipecc.report.artifacts import timeline_for
    _, on, off, graph = lumpy
    assert not off.is_bipartition() and off.bipartition_mode == ""
    assert not any("Bi-Partition" in d for d in off.decisions)
    assert on.is_bipartition() and on.bipartition_mode == "ship"
    line = next(d for d in on.decisions if d.startswith("Bi-Partition"))
    assert "faster than the single cut (FP cuts" in line and "BP cuts" in line
    assert on.predicted_iteration_s < off.predicted_iteration_s
    assert on.data(BipartitionSearch).single_iteration_s == pytest.approx(off.predicted_iteration_s)
    # the proven bound covers cut pairs: never above the bi plan's bottleneck, never above off's
    assert on.lower_bound_s <= on.bottleneck_s and on.lower_bound_s <= off.lower_bound_s
    # forward ranges are a cover in graph order; backward ranges are the other cut
    assert [n for s in on.stages for n in s.nodes] == [n for s in off.stages for n in s.nodes]
    pieces = on.bipartition_pieces()
    assert [k for k, *_ in pieces].count("segment") >= 1
    assert sum(s.extra_send_bytes for s in on.stages) > 0 and on.weight_sync_bytes > 0
    # reports rebuild the planner's timeline from the plan (both directions, the tail)
    assert timeline_for(on).iteration_s == pytest.approx(on.predicted_iteration_s, rel=1e-9)
    again = Plan.from_json(json.loads(on.dumps()))
    assert again.bipartition_pieces() == pieces
    driver.check_techniques(graph, on, techniques.COMPILED)  # compile accepts what the planner makes


def test_recompute_mode_plan_is_refused_at_compile(lumpy):
    from pipecc import driver
    _, on, _, graph = lumpy
    bad = Plan.from_json(json.loads(on.dumps()))
    bad.bipartition_mode = "recompute"
    with pytest.raises(PipeccError, match="only costed"):
        driver.check_techniques(graph, bad, techniques.COMPILED)
    bad.bipartition_mode = ""
    with pytest.raises(PipeccError, match="bipartition_mode is empty"):
        driver.check_techniques(graph, bad, techniques.COMPILED)


def test_auto_outside_the_scope_says_why_not(lumpy):
    from pipecc import driver
    analysis = lumpy[0]
    plan, _ = driver.plan(analysis, "2xcpu", microbatches=8, schedule="interleaved", replicas=1,
                          split_layers=False, bipartition="auto")
    assert any(d.startswith("Bi-Partition not tried: separate forward/backward cuts (Bi-Partition) run under "
                              "the 1f1b or gpipe schedule only, not interleaved") for d in plan.decisions)
    assert not plan.is_bipartition()
    plan, _ = driver.plan(analysis, "2xcpu", microbatches=8, replicas=1, training=False,
                          split_layers=False, bipartition="auto")
    assert any(d.startswith("Bi-Partition not tried: separate forward/backward cuts (Bi-Partition) need a "
                              "training plan") for d in plan.decisions)


def test_batchnorm_never_lands_in_a_segment():
    from pipecc import driver
    from pipecc.techniques.bipartition.plan import graph_requires, segment_blockers
    analysis = driver.analyze(zoo_path("tiny_cnn"), batch_size=4)
    blockers = segment_blockers(analysis.graph)
    bn = [n for n, why in blockers.items() if "BatchNorm" in why]
    assert bn
    plan, graph = driver.plan(analysis, "2xcpu", microbatches=2, schedule="1f1b", replicas=1,
                              split_layers=False, bipartition="auto")
    for kind, _, _, nodes in plan.bipartition_pieces():
        assert kind == "core" or not set(nodes) & set(bn)
    # a hand-made plan that moves the first BatchNorm's backward to the next stage is refused
    order = [n for s in plan.stages for n in s.nodes]
    i = order.index(bn[0])
    edited = Plan.from_json(json.loads(plan.dumps()))
    edited.stages[0].nodes, edited.stages[1].nodes = order[:i + 1], order[i + 1:]
    edited.stages[0].backward_nodes, edited.stages[1].backward_nodes = order[:i], order[i:]
    edited.bipartition_mode = "ship"
    assert "BatchNorm" in graph_requires(graph, edited)


def test_cli_flag(capsys, tmp_path):
    args = ["plan", str(zoo_path("mlp")), "--devices", "2xcpu", "--replicas", "1", "--use-all-devices",
            "--batch-size", "64", "-m", "8", "--schedule", "1f1b", "--no-split-layers",
            *[f"--model-arg={k}={v}" for k, v in LUMPY.items()]]
    code, out, err = run_cli([*args, "--bipartition", "auto", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["bipartition_mode"] == "ship" and data["weight_sync_bytes"] > 0
    assert any(s["backward_nodes"] != s["nodes"] for s in data["stages"])
    code, out, err = run_cli([*args, "--bipartition", "auto"], capsys)
    assert code == 0 and "Bi-Partition    FP cuts" in out and "backward" in out
    code, out, err = run_cli([*args, "--bipartition", "always"], capsys)
    assert code == 2 and "--bipartition" in err and len(err.strip().splitlines()) <= 2


def test_bench_section_renders_ratios():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_papers
    row = {"model": "vgg16", "devices": "2xa100", "batch": 32, "m": 16, "a_s": 1.2,
           "a_bottleneck": 0.06, "b_s": 1.0, "b_bottleneck": 0.05, "b_used": True,
           "b_cuts": "[3] / [4]", "c_s": 1.2, "c_bottleneck": 0.06, "d_s": 1.1,
           "d_bottleneck": 0.055, "d_m": 16, "d_splits": 1, "mb": 2, "bound": 0.04, "why": "",
           "seconds": 0.1}
    text = bench_papers.render_bipartition([row], 1.0)
    assert "| vgg16 | 2xa100 | 16 | 1.2, 33.33 | 1, 40 | [3] / [4] | 1.2 | 1.1 (1) | 1.200x |" in text
    assert "kept in 1 of 1 cases" in text and "up to 1.9x" in text


def test_compiled_folder_reports_both_ranges(lumpy, tmp_path, capsys):
    from pipecc import driver
    analysis, on, _, graph = lumpy
    out = tmp_path / "out"
    driver.compile(analysis, on, graph, out)
    code, text, err = run_cli(["inspect", str(out)], capsys)
    assert code == 0, err
    assert "Bi-Partition    FP cuts" in text and "stage 1: forward" in text
    code, text, err = run_cli(["inspect", str(out), "--format", "json"], capsys)
    data = json.loads(text)
    assert data["bipartition_mode"] == "ship" and data["bipartition"]["used"]
    assert [s["backward_nodes"] for s in data["stages"]] == [s.backward_nodes for s in on.stages]
    assert "Forward/backward cuts (Bi-Partition)" in (out / "report.html").read_text()


def test_window_widens_while_a_cut_sits_at_its_edge():
    # found by a seeded random search: the best pair (0, 2, 6) / (0, 4, 6) lies 2 units away
    pr = _problem([5.0, 3.0, 4.0, 1.0, 1.0, 2.0], [3.0, 1.0, 2.0, 9.0, 7.0, 9.0], 2)
    assert brute_force_bi(pr).bottleneck == 24.0
    assert bipartition(pr, window=1).bottleneck == 27.0
    wide = bipartition(pr, window=1, widen_to=6)
    assert wide.bottleneck == 24.0 and wide.fwd_bounds == (0, 2, 6) and wide.bwd_bounds == (0, 4, 6)


def test_inference_plans_run_their_forward_ranges(lumpy):
    from pipecc import driver
    _, on, _, graph = lumpy
    inf = Plan.from_json(json.loads(on.dumps()))
    inf.schedule = "inference"
    driver.check_techniques(graph, inf, techniques.COMPILED)  # not refused: the backward ranges are unused


def test_dropin_module_runs_a_bipartition_plan():
    import torch
    import pipecc
    from pipecc.models import mlp
    torch.manual_seed(0)
    model = mlp.build_model(**LUMPY)
    x, y = mlp.example_inputs(64, **LUMPY)[0], mlp.example_target(64, **LUMPY)
    piped = pipecc.compile(model, (x,), "2xcpu", microbatches=8, schedule="1f1b",
                           split_layers=False, bipartition="auto")
    assert piped.plan.is_bipartition()  # in one process autograd runs every backward in place
    mlp.loss_fn(piped(x), y).backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    mlp.loss_fn(model(x), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad)
