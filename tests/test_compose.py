"""Techniques composed in one plan (issue 18, item 2): UMPIPE's unequal micro-batches under
1F1B, BPipe with replica groups and with `--recompute auto`, Bi-Partition with split layers.
Each composition is planned with the CLI's flags on a zoo model, compiled, and run under
torchrun with `pipecc run --verify` (outputs, loss and gradients of the single-process model);
the IR and planner halves are checked here without processes."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from helpers import MLP_TINY, model_args
from helpers import pipecc_here as _cli  # in this process: only torchrun and its ranks start
from pipecc.ir.schedule import format, one_f_one_b, parse, schedule_for, validate
from pipecc.techniques.umpipe.schedule import gpipe_uneven, one_f_one_b_uneven

pytestmark = pytest.mark.xdist_group(name="compose")

ROOT = Path(__file__).resolve().parents[1]
MLP = [str(ROOT / "models" / "mlp.py"), *sum((["--model-arg", a] for a in model_args(MLP_TINY)), [])]


def _verified(out: Path, *extra: str) -> str:
    """`pipecc run OUT --verify` under torchrun (2 steps): its stdout, once it passed."""
    result = _cli("run", str(out), "--verify", "--steps", "2", "--timeout", "120", *extra)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-4000:]
    assert "gradients match the single-process run" in text, text[-4000:]
    return result.stdout


# ---------------------------------------------------------------------------- (a) UMPIPE x 1F1B

def _random_split(rng: random.Random, batch: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, batch), rng.randint(0, min(6, batch - 1)))) if batch > 1 else []
    edges = [0, *cuts, batch]
    return [b - a for a, b in zip(edges, edges[1:])]


def test_uneven_1f1b_with_equal_lists_is_1f1b() -> None:
    for p in range(1, 6):
        for m in range(1, 9):
            assert one_f_one_b_uneven([[3] * m] * p).actions == one_f_one_b(p, m).actions, (p, m)


def test_uneven_1f1b_random_sizes_are_valid_and_round_trip() -> None:
    rng = random.Random(18)
    for _ in range(300):
        batch = rng.randint(1, 12)
        sizes = [_random_split(rng, batch) for _ in range(rng.randint(1, 5))]
        schedule = one_f_one_b_uneven(sizes)
        validate(schedule)  # complete, matched, deadlock-free
        assert parse(format(schedule)) == schedule
        for s, row in enumerate(schedule.actions):  # each stage's chunks in order, as the re-slicer needs
            for kind in ("F", "B"):
                seen = [a.microbatch for a in row if a.kind.name == kind]
                assert seen == list(range(len(sizes[s])))


def test_uneven_1f1b_holds_fewer_samples_than_gpipe() -> None:
    """1F1B's point: stage s keeps about p - s chunks in flight, GPipe the whole batch."""
    sizes = [[1, 3, 2, 2], [4, 4]]
    assert gpipe_uneven(sizes).stash_sample_profile() == [8, 8]
    assert one_f_one_b_uneven(sizes).stash_sample_profile() == [5, 4]
    # a downstream chunk needing more upstream chunks than the cap lets through still runs
    wide = one_f_one_b_uneven([[1] * 8, [8]])
    validate(wide)
    assert wide.stash_sample_profile() == [8, 8]


def test_schedule_for_builds_uneven_1f1b() -> None:
    sizes = [[1, 3, 4], [4, 4]]
    assert schedule_for("1f1b", 2, 3, microbatch_sizes=sizes) == one_f_one_b_uneven(sizes)
    assert schedule_for("gpipe", 2, 3, microbatch_sizes=sizes) == gpipe_uneven(sizes)


def test_simulated_pricing_is_the_simulator() -> None:
    """The search's price of a split under 1F1B is the event simulator's timeline."""
    from pipecc.techniques.umpipe import search as umpipe
    from pipecc.passes.simulate import simulate
    curves = umpipe.Curves.from_functions(3, 8, f=lambda s, b: 1.0 + b * (s + 1), g=lambda s, b: 2.0 + 2 * b,
                                          send_f=lambda s, b: 0.1 * b, send_b=lambda s, b: 0.1 * b)
    price = umpipe.SimulatedPricing(curves, "1f1b")
    population = [[[2, 2, 4], [4, 4], [1, 7]], [[8], [8], [8]], [[2] * 4] * 3]
    got = price.times(population)
    for t, sizes in zip(got, population):
        want = simulate(one_f_one_b_uneven(sizes), umpipe.stage_costs(sizes, curves)).iteration_s
        assert t == pytest.approx(want)
    gpipe = umpipe.GPipePricing(curves).times(population)
    assert list(gpipe) == pytest.approx([umpipe.end_times(sz, curves).T for sz in population])
    res = umpipe.search(curves, budget_s=5.0, price=price)
    assert res.T <= res.edp_T + 1e-12  # never worse than the best equal split under 1F1B


def test_planner_searches_sizes_under_1f1b() -> None:
    """`--microbatch-sizes auto` on a 1f1b plan: the search runs (it is no longer "not tried")."""
    from pipecc import driver
    analysis = driver.analyze("models/mlp.py", model_args=MLP_TINY, batch_size=8)
    plan, _ = driver.plan(analysis, "2xcpu", batch_size=8, schedule="1f1b", replicas=1,
                          microbatch_sizes="auto", umpipe_budget_s=2.0)
    assert plan.schedule == "1f1b"
    line = next(d for d in plan.decisions if "UMPIPE" in d)
    assert line.startswith("unequal micro-batches (UMPIPE): "), line


@pytest.mark.slow  # torchrun launches
def test_umpipe_under_1f1b_plans_compiles_and_verifies(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    result = _cli("plan", *MLP, "-b", "8", "--devices", "cpu,cpu", "--schedule", "1f1b",
                    "--microbatch-sizes", "1,3,4", "-o", str(plan_file))
    assert result.returncode == 0, result.stderr[-3000:]
    planned = json.loads(plan_file.read_text())
    assert planned["schedule"] == "1f1b" and planned["microbatch_sizes"] == [[1, 3, 4], [1, 3, 4]]
    out = tmp_path / "out"
    result = _cli("compile", *MLP, "-b", "8", "--devices", "cpu,cpu", "--schedule", "1f1b",
                    "--microbatch-sizes", "1,3,4", "-o", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    schedule = parse((out / "schedule.txt").read_text())
    assert schedule == one_f_one_b_uneven([[1, 3, 4], [1, 3, 4]])
    _verified(out)


@pytest.mark.slow  # torchrun launches
def test_umpipe_under_1f1b_reslices_between_stages(tmp_path: Path) -> None:
    """Different sizes on the two stages (stage 1 re-slices stage 0's chunks) under 1F1B."""
    from pipecc import driver
    model = str(ROOT / "models" / "mlp.py")
    analysis = driver.analyze(model, model_args=MLP_TINY, batch_size=8)
    plan, graph = driver.plan(analysis, "2xcpu", batch_size=8, microbatches=2, schedule="1f1b", replicas=1)
    sizes = [[1, 3, 4], [4, 4]]
    plan = dataclasses.replace(plan, model_path=model, model_args=dict(MLP_TINY), microbatches=3,
                               microbatch_sizes=sizes)
    out = tmp_path / "mlp"
    driver.compile(analysis, plan, graph, out)
    assert parse((out / "schedule.txt").read_text()) == one_f_one_b_uneven(sizes)
    _verified(out)


# ---------------------------------------------------------------------------- the rules

def test_every_pair_that_does_not_compose_is_refused_by_one_rule() -> None:
    from pipecc.techniques import matrix
    names = list(matrix.TURN_ON)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            per_order = matrix.refusers(a, b)
            assert all(len(who) <= 1 for who in per_order), (a, b, per_order)
            if matrix.pair(a, b) is not None and per_order:  # refused (not just two schedules)
                assert all(len(who) == 1 for who in per_order), (a, b, per_order)
    for a, b in (("UMPIPE", "BPipe"), ("UMPIPE", "Bi-Partition"), ("BPipe", "Bi-Partition")):
        assert matrix.pair(a, b) is not None  # still out of scope, each by one rule
    for a, b in (("BPipe", "replicas"), ("BPipe", "recompute")):
        assert matrix.pair(a, b) is None  # the compositions of item 2


def test_bpipe_refuses_a_recomputing_evictor_only() -> None:
    from pipecc import techniques
    from pipecc.techniques import matrix
    plan = matrix.with_on("BPipe", "recompute", "replicas")
    assert techniques.requires(plan) is None and plan.replicas == 2 and plan.stages[-1].recompute
    plan.stages[0].recompute = True  # the evictor
    why = techniques.bpipe.requires(plan, techniques.COMPILED)
    assert why is not None and why.startswith("activation balancing (BPipe): evictor stage 0 recomputes")


# ---------------------------------------------------------------------------- (b) BPipe x replicas, x recompute

TINY_GPT = [str(ROOT / "models" / "gpt.py"), *sum((["--model-arg", f"{k}={v}"] for k, v in
                                                   dict(n_layer=2, n_head=2, n_embd=32, vocab_size=101,
                                                        block_size=16, seq_len=8).items()), [])]
# 12 Linear layers of 32 on 4 small devices (230 kB each): 1F1B's stage 0 overflows; with
# `--recompute auto --activation-balancing on` the evictors move activations to an acceptor
# that recomputes (found by the planner, not set by hand)
DEEP_MLP = [str(ROOT / "models" / "mlp.py"), *sum((["--model-arg", a] for a in model_args(
    dict(MLP_TINY, depth=12))), [])]


def _small_devices(tmp_path: Path, memory_bytes: float, n: int = 4) -> str:
    """n CPUs of `memory_bytes` each on one fast link (stash transfers hide)."""
    names = ", ".join(['"small"'] * n)
    links = "[" + ", ".join("[" + ", ".join('""' if i == j else '"fast"' for j in range(n)) + "]" for i in range(n)) + "]"
    path = tmp_path / "devices.toml"
    path.write_text(f'devices = [{names}]\nlink_matrix = {links}\n[device.small]\nbase = "cpu"\n'
                    f'memory_bytes = {memory_bytes}\nsource = "user: a small test device"\n'
                    '[link.fast]\nbandwidth = 1e12\nlatency = 1e-6\nsource = "user: test link"\n')
    return f"@{path}"


DEEP_FLAGS = ["-b", "512", "-m", "16", "--schedule", "1f1b", "--replicas", "1", "--recompute", "auto",
              "--activation-balancing", "on", "--no-split-layers"]
# a device size where BPipe alone fits no split and BPipe with recomputation does: measured on
# 2026-12-05 (16 micro-batches), BPipe with recomputation fits from 124.7 kB, BPipe alone from
# 133.5 kB; at 8 micro-batches both need 200.1 kB since the plan holds the last stage's sent
# input gradients until the step ends (`Schedule.send_release`)
SMALL = 129e3


def test_planner_composes_bpipe_with_recompute_auto(tmp_path: Path) -> None:
    from pipecc import driver
    analysis = driver.analyze(DEEP_MLP[0], model_args=dict(MLP_TINY, depth=12), batch_size=512)
    plan, _ = driver.plan(analysis, _small_devices(tmp_path, SMALL), microbatches=16, schedule="1f1b",
                          replicas=1, recompute="auto", activation_balancing="on", split_layers=False)
    evictors = {p["evictor"] for p in plan.activation_balancing}
    recomputing = {s.index for s in plan.stages if s.recompute}
    assert evictors and recomputing and not evictors & recomputing, (evictors, recomputing)
    with pytest.raises(Exception, match="no split fits memory"):  # BPipe alone fits none of these devices
        driver.plan(analysis, _small_devices(tmp_path, SMALL), microbatches=16, schedule="1f1b", replicas=1,
                    recompute="none", activation_balancing="on", split_layers=False)


def test_planner_pairs_replica_groups() -> None:
    from pipecc import driver
    analysis = driver.analyze(TINY_GPT[0], model_args=dict(n_layer=2, n_head=2, n_embd=32, vocab_size=101,
                                                           block_size=16, seq_len=8), batch_size=8)
    plan, _ = driver.plan(analysis, "4xcpu", microbatches=4, schedule="1f1b", replicas=2,
                          activation_balancing="on")
    assert plan.replicas == 2 and len(plan.stages) == 2
    assert plan.activation_balancing == [{"evictor": 0, "acceptor": 1, "threshold": 1, "policy": "jit"}]
    assert [s.replica_devices for s in plan.stages] == [[0, 1], [2, 3]]


def _evictions(text: str) -> dict[tuple[int, int], float]:
    """(stage, replica) -> stash bytes its SEND_S moved, from `pipecc run --json`'s stdout."""
    rows = json.loads(text)["stages"]
    return {(r["index"], r["replica"]): r["stash_evicted_bytes"] for r in rows}


@pytest.mark.slow  # torchrun launches
def test_bpipe_with_replicas_plans_compiles_and_verifies(tmp_path: Path) -> None:
    """2 stages of 6 Linear layers (internal activations to move) on 2 replica groups of 2."""
    flags = ["-b", "64", "-m", "4", "--devices", "4xcpu", "--schedule", "1f1b", "--replicas", "2",
             "--activation-balancing", "on", "--no-split-layers"]
    result = _cli("plan", *DEEP_MLP, *flags, "-o", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    planned = json.loads((tmp_path / "plan.json").read_text())
    assert planned["replicas"] == 2 and planned["activation_balancing"]
    out = tmp_path / "out"
    result = _cli("compile", *DEEP_MLP, *flags, "-o", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    moved = _evictions(_verified(out, "--json"))
    assert moved[(0, 0)] > 0 and moved[(0, 1)] > 0  # both replicas of the evictor move their slice's stash
    assert moved[(1, 0)] == moved[(1, 1)] == 0


@pytest.mark.slow  # torchrun launches
def test_bpipe_with_recompute_auto_plans_compiles_and_verifies(tmp_path: Path) -> None:
    devices = _small_devices(tmp_path, SMALL)
    out = tmp_path / "out"
    result = _cli("compile", *DEEP_MLP, *DEEP_FLAGS, "--devices", devices, "-o", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    planned = json.loads((out / "plan.json").read_text())
    evictors = {p["evictor"] for p in planned["activation_balancing"]}
    recomputing = {s["index"] for s in planned["stages"] if s["recompute"]}
    assert evictors and recomputing and not evictors & recomputing
    moved = _evictions(_verified(out, "--json"))
    assert all(moved[(s, 0)] > 0 for s in evictors), moved


# ---------------------------------------------------------------------------- (c) Bi-Partition x split layers

# the zoo MLP whose wide layer 2 the planner splits over two CPUs (its shards on both stages)
WIDE = dict(in_features=256, hidden=1024, depth=3, num_classes=256)
WIDE_MLP = [str(ROOT / "models" / "mlp.py"), *sum((["--model-arg", a] for a in model_args(WIDE)), [])]


def _with_segment(plan: Any) -> Any:
    """`plan` with its last forward node of stage 0 (a split layer's first shard) run backward
    on stage 1: a segment holding a shard."""
    plan = copy.deepcopy(plan)
    order = [n for s in plan.stages for n in s.nodes]
    cut = len(plan.stages[0].nodes) - 1
    plan.stages[0].backward_nodes, plan.stages[1].backward_nodes = order[:cut], order[cut:]
    plan.bipartition_mode = "ship"
    return plan


def test_planner_searches_cut_pairs_on_the_split_plan() -> None:
    """`--bipartition auto` on a plan that splits a layer: the cut pairs are searched on the
    split plan's own graph (before, only on the unsplit plan), and the rule admits the result."""
    from pipecc import driver
    from pipecc import techniques
    from pipecc.techniques.bipartition.data import BipartitionSearch
    analysis = driver.analyze(WIDE_MLP[0], model_args=WIDE, batch_size=32)
    plan, graph = driver.plan(analysis, "2xcpu", microbatches=8, schedule="1f1b", replicas=1, bipartition="auto")
    assert plan.split_layers and plan.data(BipartitionSearch) is not None  # the split plan's own search ran
    assert not any("not tried" in d for d in plan.decisions if "Bi-Partition" in d)
    segmented = _with_segment(plan)
    assert segmented.is_bipartition() and techniques.requires(segmented) is None
    assert segmented.stages[0].nodes[-1].endswith(".shard0")


@pytest.mark.slow  # torchrun launches
def test_bipartition_with_split_layers_plans_compiles_and_verifies(tmp_path: Path) -> None:
    """`pipecc plan` splits layer 2 over the two CPUs; the forward of its first shard stays on
    stage 0, its backward moves to stage 1 (a segment owned by worker 1, replicated on worker 0);
    compile and `run --verify` (each shard's gradient against its slice of the model's)."""
    from pipecc import driver
    from pipecc.ir.plan import Plan
    flags = ["-b", "8", "-m", "4", "--devices", "2xcpu", "--replicas", "1", "--schedule", "1f1b"]
    result = _cli("plan", *WIDE_MLP, *flags, "-o", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    planned = Plan.from_json(json.loads((tmp_path / "plan.json").read_text()))
    assert planned.split_layers
    analysis = driver.analyze(WIDE_MLP[0], model_args=WIDE, batch_size=8)
    plan, graph = driver.plan(analysis, "2xcpu", microbatches=4, schedule="1f1b", replicas=1)
    assert [s.nodes for s in plan.stages] == [s.nodes for s in planned.stages]  # the CLI's plan
    plan = dataclasses.replace(_with_segment(plan), model_path=WIDE_MLP[0], model_args=dict(WIDE))
    out = tmp_path / "out"
    driver.compile(analysis, plan, graph, out)
    marker = json.loads((out / "pipecc.json").read_text())
    assert marker["bipartition"] == "ship"
    assert (out / "stage_0" / "segment_0.py").is_file() and (out / "stage_1" / "segment_0.py").is_file()
    _verified(out)
