"""BPipe in the planner: thresholds, the estimate both ways, plan fields, flash attention in
the cost model, the CLI flags and their one-line refusals (PAPERS-SPEC.md 2.3, 2.6, 2.7)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import ROOT, run_cli, zoo_module
from pipecc import cost, driver
from pipecc.errors import PipeccError, UsageError
from pipecc import techniques
from pipecc.ir.plan import Plan
from pipecc.ir.schedule import one_f_one_b, validate
from pipecc.techniques.bpipe import search as bp
from pipecc.techniques.bpipe.schedule import bpipe

MLP = str(ROOT / "models" / "mlp.py")
# activation-heavy: at batch 4096 each stage's stash (512 samples x 256 floats per layer) is
# about its weights and Adam state, so an 8-device 1F1B overflows stage 0 long before stage 7
MLP_HEAVY = dict(hidden=256, depth=16, in_features=256)


def cluster(tmp_path: Path, memory_bytes: float, n: int = 8) -> str:
    """n CPUs with `memory_bytes` each, every pair on a fast link (stash transfers hide)."""
    names = ", ".join(['"small"'] * n)
    matrix = "[" + ", ".join("[" + ", ".join('""' if i == j else '"fast"' for j in range(n)) + "]"
                             for i in range(n)) + "]"
    path = tmp_path / f"cluster_{memory_bytes:g}.toml"
    path.write_text(f'devices = [{names}]\nlink_matrix = {matrix}\n[device.small]\nbase = "cpu"\n'
                    f'memory_bytes = {memory_bytes}\nsource = "user: a small test device"\n'
                    '[link.fast]\nbandwidth = 1e12\nlatency = 1e-6\nsource = "user: test link"\n')
    return f"@{path}"


@pytest.fixture(scope="module")
def mlp() -> driver.Analysis:
    return driver.analyze(MLP, model_args=MLP_HEAVY, batch_size=4096)


def plan(analysis, devices: str, mode: str = "auto", recompute: str = "auto", **kw) -> Plan:
    return driver.plan(analysis, devices, schedule=kw.pop("schedule", "1f1b"), microbatches=8,
                       recompute=recompute, replicas=1, split_layers=False,
                       activation_balancing=mode, **kw)[0]


# ---------------------------------------------------------------------------- thresholds
def test_thresholds_equal_stages_follow_the_spec() -> None:
    """Equal W and A: K with the +1 in flight balances evictor and acceptor (2.3)."""
    assert bp.thresholds([0.0] * 8, [1.0] * 8, 8, 32) == [4, 4, 4, None, None, None, None, None]
    # p = 4: K = 2 gives 3 and 3 instead of 4 and 1; the inner pair (1, 2) holds 3 and 2: idle
    assert bp.thresholds([0.0] * 4, [1.0] * 4, 4, 8) == [2, None, None, None]
    # heavy acceptor weights: evicting less is better; nothing to gain: no pair
    assert bp.thresholds([0.0, 0, 0, 2.0], [1.0] * 4, 4, 8) == [None, None, None, None]
    assert bp.thresholds([0.0] * 2, [1.0] * 2, 2, 4) == [None, None]
    assert bp.thresholds([0.0] * 2, [1.0] * 2, 2, 4, forced=True) == [1, None]


def test_thresholds_match_the_generated_counts() -> None:
    """The byte formula's counts are the schedule's: evictor min(K+1, n), acceptor n_a + n - K."""
    for p, m in ((4, 8), (6, 6), (8, 32)):
        ks = bp.thresholds([0.0] * p, [1.0] * p, p, m)
        counts = bpipe(one_f_one_b(p, m), ks).stash_profile()
        for s, k in enumerate(ks):
            if k is not None:
                n = min(p - s, m)
                assert counts[s] == min(k + 1, n)
                assert counts[p - 1 - s] == min(s + 1, m) + n - k


# ---------------------------------------------------------------------------- the estimate
def test_memory_bound_plan_uses_bpipe(mlp, tmp_path) -> None:
    """Memory binds plain 1F1B's cuts: BPipe frees it for better-balanced ones, estimated > 1.02x."""
    p = plan(mlp, cluster(tmp_path, 15e6))  # stage 0 also holds the step's inputs (4.2 MB)
    assert [(x["evictor"], x["acceptor"]) for x in p.activation_balancing] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert all(x["policy"] == "jit" and 1 <= x["threshold"] < 8 - x["evictor"] for x in p.activation_balancing)
    assert not any(s.recompute for s in p.stages) and p.schedule == "1f1b"
    est = p.estimate
    assert est["used"] and est["speedup"] > 1 + bp.EPSILON and not est["baseline"]["recompute"]
    assert est["bpipe"]["iteration_s"] == pytest.approx(p.predicted_iteration_s)
    assert max(est["memory_after_bytes"]) < max(est["memory_before_bytes"])
    assert all(m <= c for m, c in zip(est["memory_after_bytes"], est["memory_cap_bytes"]))
    assert 0.95 <= est["hidden_fraction"] <= 1.0
    line = next(d for d in p.decisions if d.startswith("BPipe"))
    assert re.match(r"BPipe used: estimated 1\.\d\dx \(the freed memory buys better-balanced cuts; ", line), line
    # the runtime's schedule for it is valid and round-trips through the plan's JSON
    again = Plan.from_json(json.loads(p.dumps()))
    assert again.activation_balancing == p.activation_balancing and again.estimate == p.estimate
    validate(bpipe(one_f_one_b(8, 8), again.bpipe_thresholds()))
    assert techniques.requires(again) is None
    # the report's timeline (rebuilt from the plan) is the planner's, stash transfers included
    from pipecc.report.artifacts import timeline_for
    assert timeline_for(again).iteration_s == pytest.approx(p.predicted_iteration_s, rel=1e-6)
    assert any(e.kind.value == "SEND_S" for e in timeline_for(again).events)


def test_ample_memory_does_not_use_bpipe(mlp, tmp_path) -> None:
    p = plan(mlp, cluster(tmp_path, 40e6))
    assert p.activation_balancing == [] and p.estimate["used"] is False
    assert p.estimate["speedup"] <= 1 + bp.EPSILON
    line = next(d for d in p.decisions if d.startswith("BPipe"))
    assert re.match(r"BPipe not used: estimated (0\.9\d|1\.0[0-2])x \(memory does not bind; BPipe 1f1b b=512", line), line


def test_on_forces_it_and_off_never_looks(mlp, tmp_path) -> None:
    devices = cluster(tmp_path, 40e6)
    forced = plan(mlp, devices, "on")
    assert forced.activation_balancing and forced.estimate["used"]
    assert any(d.startswith("BPipe used (--activation-balancing on)") for d in forced.decisions)
    with pytest.raises(PipeccError, match=r"^--activation-balancing on: .*GB.*; use --activation-balancing auto$"):
        plan(mlp, cluster(tmp_path, 8e6), "on", recompute="none")  # (with auto, BPipe recomputes: test_compose)
    off = plan(mlp, devices, "off")
    assert off.activation_balancing == [] and off.estimate == {}
    assert not any("BPipe" in d for d in off.decisions)


def test_out_of_scope_auto_says_why_and_on_refuses(mlp, tmp_path) -> None:
    devices = cluster(tmp_path, 40e6, n=4)
    p = plan(mlp, devices, schedule="gpipe")
    # auto (the CLI's default) was asked for nothing: the reason, no advice to turn it off (issue 30)
    assert "BPipe (activation balancing) not considered: activation balancing (BPipe) pairs stages " \
           "under the 1f1b schedule only, not gpipe" in p.decisions
    for kw, match in ((dict(schedule="gpipe"), "1f1b schedule only, not gpipe"),
                      (dict(training=False), "forward-only")):
        with pytest.raises(UsageError, match=f"--activation-balancing on: .*{match}"):
            plan(mlp, devices, "on", **{"recompute": "none", **kw})


def test_refusal_of_edited_plans(mlp, tmp_path) -> None:
    good = plan(mlp, cluster(tmp_path, 15e6))
    assert good.activation_balancing

    def edited(**changes) -> str | None:
        data = json.loads(good.dumps())
        data.update(changes)
        return techniques.bpipe.requires(Plan.from_json(data), techniques.COMPILED)
    pairs = good.activation_balancing
    assert "odd pairing (0, 2)" in edited(activation_balancing=[{**pairs[0], "acceptor": 2}])
    assert "odd pairing (5, 2)" in edited(activation_balancing=[{"evictor": 5, "acceptor": 2,
                                                                 "threshold": 1}])
    assert "under the 1f1b schedule only" in edited(schedule="gpipe")
    assert "out of range" in edited(activation_balancing=[{**pairs[0], "threshold": 0}])
    assert "two pairs" in edited(activation_balancing=[pairs[0], pairs[0]])
    assert "policy" in edited(activation_balancing=[{**pairs[0], "policy": "lazy"}])
    assert "drop-in module" in techniques.bpipe.requires(good, techniques.DROP_IN)
    bad = Plan.from_json({**json.loads(good.dumps()), "schedule": "interleaved"})
    assert re.search(r"under the 1f1b schedule only.*--activation-balancing off", techniques.requires(bad))


# ---------------------------------------------------------------------------- flash attention
def test_flash_attention_switch_in_the_cost_model() -> None:
    """Math path: the fused attention node keeps its softmax probabilities (batch x heads x L x
    S floats); flash: only the log-sum-exp, and its backward recomputes QK^T (2.6)."""
    tiny = zoo_module("gpt").TINY
    graph = driver.analyze(str(ROOT / "models" / "gpt.py"), model_args=tiny, batch_size=2).graph
    node = next(n for n in graph.gm.graph.nodes if n.meta.get("pipecc.kind") == "attention")
    math_cost = node.meta["pipecc.cost"].values
    b, heads, length, e = 2, tiny["n_head"], tiny["seq_len"], tiny["n_embd"] // tiny["n_head"]
    assert math_cost["stash_bytes"] == math_cost["output_bytes"] + b * heads * length * length * 4
    cost.annotate(graph, flash_attention=True)
    assert cost.flash_attention(graph)
    flash = node.meta["pipecc.cost"].values
    assert flash["stash_bytes"] == flash["output_bytes"] + b * heads * length * 4
    extra = 2 * b * heads * length * length * e
    assert flash["backward_flops_matmul"] == math_cost["backward_flops_matmul"] + extra
    assert flash["backward_flops"] == math_cost["backward_flops"] + extra + 5 * b * heads * length * length
    # driver.plan re-costs the graph in the mode asked for, and records it
    p, _ = driver.plan(graph, "2xcpu", replicas=1, split_layers=False, flash_attention=False)
    assert not cost.flash_attention(graph) and p.options["flash_attention"] is False


# ---------------------------------------------------------------------------- CLI
def test_cli_flags_and_one_line_errors(capsys) -> None:
    tiny = [f"--model-arg={k}={v}" for k, v in zoo_module("gpt").TINY.items()]
    base = ["plan", "models/gpt.py", *tiny, "-b", "8", "--devices", "4xcpu", "--replicas", "1", "--use-all-devices",
            "--no-split-layers"]
    code, out, err = run_cli([*base, "--schedule", "gpipe", "--activation-balancing", "on"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("pipecc: error: --activation-balancing on: activation balancing (BPipe) pairs stages "
                          "under the 1f1b schedule only, not gpipe"), err
    code, out, err = run_cli([*base, "--activation-balancing", "sometimes"], capsys)
    assert code == 2 and "--activation-balancing" in err and err.count("\n") == 1
    code, out, err = run_cli([*base, "--microbatch-sizes", "2,6", "--activation-balancing", "on"], capsys)
    assert code == 2 and "needs equal micro-batches" in err and err.count("\n") == 1
    code, out, err = run_cli([*base, "--schedule", "1f1b", "--flash-attention", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["options"]["activation_balancing"] == "auto" and data["options"]["flash_attention"] is True
    assert "estimate" in data and "activation_balancing" in data


# ---------------------------------------------------------------------------- bench
@pytest.fixture(scope="module")
def bench_papers():
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("bench_papers", ROOT / "bench" / "bench_papers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_papers"] = module
    spec.loader.exec_module(module)
    return module


def test_bench_bpipe_configs(bench_papers) -> None:
    """The §2.8 bench's contenders: BPipe with free transfers lowers the peak; over one HDR port
    its stash transfers do not hide (the RESULTS.md finding); recompute frees memory."""
    shape = bench_papers.BPIPE_MODELS["gpt3-96b"]
    plain = bench_papers.bpipe_config(shape, 1, False, False, False)
    free = bench_papers.bpipe_config(shape, 1, False, False, True, ports=0)
    slow = bench_papers.bpipe_config(shape, 1, False, False, True, ports=1)
    redo = bench_papers.bpipe_config(shape, 1, True, False, False)
    assert plain["fits"] and free["peak"] < plain["peak"] and free["hidden"] == 1.0
    assert free["iteration_s"] == pytest.approx(plain["iteration_s"], rel=1e-9)
    assert slow["iteration_s"] > 2 * plain["iteration_s"] and slow["hidden"] < 0.9
    assert redo["peak"] < plain["peak"] and redo["iteration_s"] > plain["iteration_s"]
    flash = bench_papers._gpt3_stage_costs(shape, 1, False, True)
    math_path = bench_papers._gpt3_stage_costs(shape, 1, False, False)
    assert flash["stash"][2] < math_path["stash"][2] and flash["backward_s"][2] > math_path["backward_s"][2]
