"""`pipecc profile`: the curve fit against brute force, node timing on the tiny MLP (every node,
positive times, fits that match their samples, the model left bit-identical), the cache
(hit, and keyed), one-line errors that write nothing, the gloo link measurement, and the
cross-host link between two `pipecc profile --nnodes 2` launchers meeting on 127.0.0.1."""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers import MLP_TINY, PIPECC, ROOT, free_port, model_args, zoo_module, zoo_path
from pipecc.cli.app import main
from pipecc.cli.profile import profile_table
from pipecc.profile.fit import fit_affine
from pipecc.profile.measure import TIMED_OPS, Sample, microbatch_sizes
from pipecc.profile.profiler import node_entry, profile_graph, profile_model

MLP = zoo_path("mlp")
TINY = zoo_module("mlp").TINY
TINY_ARGS = [f"--model-arg={k}={v}" for k, v in TINY.items()]
FAST = dict(warmup=0, repeat=1)  # the fields and the bookkeeping, not the accuracy


# ---------------------------------------------------------------------------- fit
def test_fit_recovers_an_affine_curve_exactly():
    mbs = [1, 2, 4, 8, 16]
    fit = fit_affine(mbs, [3e-5 + 2e-6 * b for b in mbs])
    assert fit.a == pytest.approx(3e-5, rel=1e-9) and fit.c == pytest.approx(2e-6, rel=1e-9)
    assert fit.error < 1e-9


def test_fit_keeps_overhead_and_slope_non_negative():
    falling = fit_affine([1, 2, 4], [5.0, 4.0, 3.0])  # noise, not a negative slope
    assert falling.c == 0 and falling.a == pytest.approx(3.9, rel=0.1)
    steep = fit_affine([1, 2, 4], [1.0, 3.0, 7.0])    # unconstrained a would be negative
    assert steep.a == 0 and steep.c > 0
    one_size = fit_affine([4, 4], [2.0, 2.0])         # overhead and slope indistinguishable
    assert one_size.a == 0 and one_size.c == pytest.approx(0.5)
    assert fit_affine([1, 2], [0.0, 0.0]).c == 0  # a node without backward


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 64), st.floats(1e-6, 1e-2)), min_size=1, max_size=6))
def test_fit_is_the_best_non_negative_curve(points):
    """Brute force over a grid of (a, c) >= 0: nothing beats the fit in relative squares."""
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    fit = fit_affine(xs, ts)
    assert fit.a >= 0 and fit.c >= 0

    def loss(a: float, c: float) -> float:
        return sum(((a + c * x - t) / t) ** 2 for x, t in zip(xs, ts))
    best = loss(fit.a, fit.c)
    top = max(ts)
    for i in range(21):
        for j in range(21):
            assert best <= loss(top * i / 20, top * j / 20) * (1 + 1e-9) + 1e-12
    assert fit.error == pytest.approx(max(abs(fit(x) - t) / t for x, t in zip(xs, ts)))


def test_microbatch_sizes_double_up_to_the_batch():
    assert microbatch_sizes(1) == [1]
    assert microbatch_sizes(8) == [1, 2, 4, 8]
    assert microbatch_sizes(6) == [1, 2, 4, 6]


def test_node_entry_fits_reproduce_the_samples():
    samples = [Sample(b, 1e-5 + 1e-6 * b, 3e-5 + 2e-6 * b) for b in (1, 2, 4, 8)]
    entry = node_entry("fc", "linear", samples)
    assert entry["fit_error"] < 1e-9
    for s in entry["samples"]:
        for key, t in (("fwd", s["fwd_s"]), ("bwd", s["bwd_s"])):
            f = entry["fit"][key]
            assert f["a"] + f["c"] * s["mb"] == pytest.approx(t, rel=1e-9)


# ---------------------------------------------------------------------------- timing
def test_profile_has_every_node_with_positive_times_and_honest_fits(tmp_path):
    from pipecc import driver
    result = profile_model(MLP, "cpu,cpu,u250", model_args=TINY, batch_size=4, link=False,
                           fixed_costs=False, cache_directory=tmp_path, **FAST)  # the nodes only
    data = json.loads(json.dumps(result.data, allow_nan=False))  # plain JSON, no inf/NaN
    assert not result.cache_hit
    assert data["format"] == "pipecc.profile" and data["version"] == 1
    assert data["model"]["args"] == TINY and len(data["model"]["sha256"]) == 64
    assert data["torch_version"] == torch.__version__
    assert data["microbatch_sizes"] == [1, 2, 4] and data["link"] is None
    assert [d["name"] for d in data["devices"]] == ["cpu", "cpu", "u250"]
    assert [d["torch_device"] for d in data["devices"]] == ["cpu", "cpu", None]
    assert any("u250" in n and "analytic" in n for n in data["notes"])
    [target] = data["targets"]  # cpu,cpu is one device kind here, timed once
    assert target["torch_device"] == "cpu" and target["devices"] == ["cpu"]
    graph = driver.analyze(MLP, model_args=TINY, batch_size=4).graph
    expected = [n.meta["pipecc.name"] for n in graph.gm.graph.nodes if n.op in TIMED_OPS]
    assert [n["name"] for n in target["nodes"]] == expected
    for node in target["nodes"]:
        assert [s["mb"] for s in node["samples"]] == [1, 2, 4]
        for s in node["samples"]:
            assert s["fwd_s"] > 0 and s["bwd_s"] > 0, node["name"]  # every MLP node has a backward
            for key in ("fwd", "bwd"):
                f = node["fit"][key]
                assert f["a"] >= 0 and f["c"] >= 0
                t = s[f"{key}_s"]
                assert abs(f["a"] + f["c"] * s["mb"] - t) <= f["error"] * t * (1 + 1e-9)
        assert node["fit_error"] == max(node["fit"]["fwd"]["error"], node["fit"]["bwd"]["error"])


class _Noisy(nn.Module):
    """BatchNorm (running statistics), dropout (random) and an in-place ReLU, in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.act(self.bn(self.fc(x)))).add_(1.0) * 2


def test_profiling_leaves_the_model_bit_identical():
    model = _Noisy().train()
    gm = fx.symbolic_trace(model)
    before = copy.deepcopy(model.state_dict())
    rng = torch.random.get_rng_state()
    nodes = profile_graph(gm, lambda b: (torch.randn(b, 6),), "cpu", [2, 4], warmup=1, repeat=2)
    assert {"fc", "bn", "act", "drop", "add_", "mul"} <= {n["name"] for n in nodes}
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:  # running_mean/var and num_batches_tracked included
        assert torch.equal(before[k], after[k]), k
    assert torch.equal(rng, torch.random.get_rng_state())  # dropout drew from a forked stream
    assert model.training and all(p.grad is None for p in model.parameters())


def test_profiling_the_zoo_mlp_keeps_its_state_dict():
    from pipecc import driver
    analysis = driver.analyze(MLP, model_args=TINY, batch_size=2)
    before = {k: v.clone() for k, v in analysis.spec.model.state_dict().items()}
    profile_graph(analysis.graph.gm, analysis.spec.make_inputs, "cpu", [1, 2], **FAST)
    for k, v in analysis.spec.model.state_dict().items():
        assert torch.equal(before[k], v), k


# ---------------------------------------------------------------------------- cache
def test_cache_is_hit_the_second_time_and_keyed(tmp_path):
    first = profile_model(MLP, "cpu", model_args=TINY, batch_size=2, cache_directory=tmp_path, **FAST)
    assert not first.cache_hit and first.cache_path is not None and first.cache_path.is_file()
    again = profile_model(MLP, "cpu", model_args=TINY, batch_size=2, cache_directory=tmp_path, **FAST)
    assert again.cache_hit and again.data == first.data
    other_args = profile_model(MLP, "cpu", model_args={**TINY, "hidden": 24}, batch_size=2,
                               cache_directory=tmp_path, **FAST)
    other_batch = profile_model(MLP, "cpu", model_args=TINY, batch_size=4, cache_directory=tmp_path, **FAST)
    assert not other_args.cache_hit and not other_batch.cache_hit
    assert len({first.data["cache_key"], other_args.data["cache_key"], other_batch.data["cache_key"]}) == 3
    forced = profile_model(MLP, "cpu", model_args=TINY, batch_size=2, cache_directory=tmp_path,
                           use_cache=False, **FAST)
    assert not forced.cache_hit
    # the same hardware in another spec: the timings are reused, the spec's own parts are not
    mixed = profile_model(MLP, "cpu,u250", model_args=TINY, batch_size=2, link=False,
                          cache_directory=tmp_path, **FAST)
    mixed_again = profile_model(MLP, "cpu,cpu", model_args=TINY, batch_size=2, link=False,
                                cache_directory=tmp_path, **FAST)
    assert mixed_again.cache_hit and mixed_again.data["targets"] == mixed.data["targets"]
    assert [d["name"] for d in mixed_again.data["devices"]] == ["cpu", "cpu"]
    assert mixed_again.data["notes"] == [] and mixed.data["notes"]
    assert (mixed.data["fixed_costs"]["cpu"]["ranks"], mixed_again.data["fixed_costs"]["cpu"]["ranks"]) == (1, 2)
    first.cache_path.write_text("{half a profi")  # a torn entry is a miss, not a crash
    assert not profile_model(MLP, "cpu", model_args=TINY, batch_size=2, cache_directory=tmp_path,
                             **FAST).cache_hit


def test_nodes_are_timed_with_the_threads_of_a_run_rank(tmp_path, monkeypatch):
    """One intra-op thread (what `pipecc run` gives each rank) unless $OMP_NUM_THREADS says
    otherwise; recorded, keyed, and torch's setting restored afterwards."""
    from pipecc.profile import profiler
    seen: list[int] = []
    real = profiler.profile_graph

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)
    monkeypatch.setattr(profiler, "profile_graph", spy)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    one = profile_model(MLP, "cpu", model_args=TINY, batch_size=2, link=False, cache_directory=tmp_path, **FAST)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    two = profile_model(MLP, "cpu", model_args=TINY, batch_size=2, link=False, cache_directory=tmp_path, **FAST)
    assert seen == [1, 2] and torch.get_num_threads() == before
    assert one.data["timing"]["cpu_threads"] == 1 and two.data["timing"]["cpu_threads"] == 2
    assert not two.cache_hit and one.data["cache_key"] != two.data["cache_key"]


# ---------------------------------------------------------------------------- command line
BAD_MODEL = """
import torch
from torch import nn

class Fixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).view(4, 8)  # runs at batch 4 only

def build_model(**_):
    return Fixed()

def example_inputs(batch_size=1, **_):
    return (torch.randn(batch_size, 8),)
"""


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], int, str]]:
    bad = tmp_path / "bad.py"
    bad.write_text(BAD_MODEL)
    cases = [
        ([str(MLP), "--devices", "tpu9"], 2, "unknown device 'tpu9'"),
        ([str(MLP), "--devices", "cpu", "--nnodes", "2"], 2, "needs --rdzv-endpoint HOST:PORT"),
        ([str(MLP), "--devices", "cpu", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500"], 2,
         "needs --node-rank R"),
        ([str(MLP), "--devices", "cpu", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint",
          "127.0.0.1:29500"], 2, "--node-rank 2 is not below --nnodes 2"),
        ([str(MLP), "--devices", "cpu", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
          "127.0.0.1"], 2, "expected HOST:PORT"),
        ([str(MLP), "--devices", "cpu", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
          "127.0.0.1:0"], 2, "expected HOST:PORT"),
        ([str(MLP), "--devices", "cpu", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
          "127.0.0.1:29500"], 2, "--no-link with --nnodes 2"),  # the test adds --no-link
        ([str(MLP), "--devices", "cpu", "--timeout", "0"], 2, "must be > 0"),
        ([str(MLP), "--devices", "cpu", "--repeat", "0"], 2, "positive integer"),
        ([str(MLP), "--devices", "u250"], 1, "no device in --devices can be timed"),
        ([str(tmp_path / "missing.py"), "--devices", "cpu"], 1, "does not exist"),
        ([str(MLP), "--devices", "cpu", "--model-arg", "depth=0"], 1, "depth must be >= 1"),
        ([str(bad), "--devices", "cpu", "-b", "4"], 1, "node view failed on cpu at micro-batch 1"),
    ]
    if not torch.cuda.is_available():
        cases.append(([str(MLP), "--devices", "a100"], 1, "CUDA is not available here"))
    return cases


def test_bad_input_gets_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "profile.json"
    for argv, code, message in _bad_inputs(tmp_path):
        assert main(["profile", *TINY_ARGS, *argv, "-o", str(out), "--no-link"]) == code, argv
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pipecc: error: "), err
        assert message in lines[0], lines[0]
        assert not out.exists(), argv
    assert not (tmp_path / "cache").exists()
    assert main(["profile", str(MLP), "--devices", "cpu", "-o", str(tmp_path / "no" / "p.json")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_command_writes_the_profile_and_measures_the_link(tmp_path, monkeypatch, capsys):
    """End to end with the gloo link between two CPU processes (a few seconds: one spawn)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("pipecc.profile.profiler.measure_link", _quick_link)
    out = tmp_path / "profile.json"
    argv = ["profile", str(MLP), "--devices", "cpu,cpu", "-b", "2", *TINY_ARGS, "-o", str(out),
            "--repeat", "1", "--warmup", "0", "-q"]
    assert main([*argv, "--json"]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert json.loads(printed) == data  # --json: exactly one document on stdout
    link = data["link"]
    assert link["backend"] == "gloo" and link["devices"] == ["cpu", "cpu"]
    assert link["scope"] == "in-host" and data["links"] == [link]
    assert link["latency_s"] > 0 and link["bandwidth_Bps"] > 0 and math.isfinite(link["bandwidth_Bps"])
    assert [s["bytes"] for s in link["samples"]] == [4, 4096, 1 << 20]
    assert all(s["seconds"] > 0 for s in link["samples"])
    assert list((tmp_path / "cache" / "pipecc" / "profiles").glob("*.json"))
    assert main(argv) == 0  # the table, from the cache
    table = capsys.readouterr().out
    assert "[from the cache]" in table and "link (gloo" in table and "linear" in table
    assert data["fixed_costs"]["cpu"]["ranks"] == 2 and "fixed costs on cpu (2 rank(s) at once)" in table
    assert main([*argv, "--no-fixed-costs", "--json"]) == 0
    assert "fixed_costs" not in json.loads(capsys.readouterr().out)


def _quick_link(backend, devices):
    from pipecc.profile.link import measure_link
    return measure_link(backend, devices, (4, 4096, 1 << 20), warmup=1, repeat=3)


# ---------------------------------------------------------------------------- across hosts
@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_two_launchers_measure_the_cross_host_link(tmp_path):
    """Node 0 and node 1 as two `pipecc profile` processes meeting at 127.0.0.1:PORT: node 0
    writes the profile with the cross-host link in `links`; node 1 prints one line, writes
    nothing (not even with -o); the planner still reads the profile."""
    from pipecc.targets.profiled import load_profile
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = [tmp_path / f"node{r}.json" for r in (0, 1)]
    argv = ["profile", str(MLP), "--devices", "cpu", *[f"--model-arg={a}" for a in model_args(MLP_TINY)],
            "--nnodes", "2", "--rdzv-endpoint", endpoint, "--no-cache", "-q", "--repeat", "1",
            "--warmup", "0", "--timeout", "30"]
    nodes = [subprocess.Popen([*PIPECC, *argv, "--node-rank", str(r), "-o", str(out[r])], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        results = [n.communicate(timeout=60) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    for n, (stdout, stderr) in zip(nodes, results):
        assert n.returncode == 0, stderr
    data = json.loads(out[0].read_text())
    assert not out[1].exists()
    assert data["link"] is None  # one device per host: no in-host link
    [link] = data["links"]
    assert link["scope"] == "cross-host" and link["endpoint"] == endpoint
    assert link["nodes"] == [0, 1] and link["backend"] == "gloo" and link["devices"] == ["cpu", "cpu"]
    assert link["latency_s"] > 0 and link["bandwidth_Bps"] > 0 and math.isfinite(link["bandwidth_Bps"])
    assert all(s["seconds"] > 0 for s in link["samples"]) and len(link["samples"]) >= 3
    assert any("cross-host" in n and "in-host link only" in n for n in data["notes"])
    assert "cross-host, node 0 <-> node 1" in results[0][0]
    line = results[1][0].strip()
    assert "\n" not in line and line.startswith("node 1: cross-host gloo link to node 0") \
        and endpoint in line, line
    assert load_profile(out[0]).measured_link() is None  # the planner: in-host figures only
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_node_that_never_shows_up_is_one_line_naming_the_endpoint(tmp_path, monkeypatch, capsys,
                                                                     rank):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    endpoint = f"127.0.0.1:{free_port()}"
    out = tmp_path / "profile.json"
    code = main(["profile", str(MLP), "--devices", "cpu", *TINY_ARGS, "--nnodes", "2",
                 "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--timeout", "1",
                 "-o", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("pipecc: error: "), lines
    assert endpoint in lines[0] and ("did not join" if rank == 0 else "no rendezvous") in lines[0]
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_older_profiles_without_links_or_scope_still_print_and_load():
    link = {"backend": "gloo", "devices": ["cpu", "cpu"], "latency_s": 2e-5, "bandwidth_Bps": 1e9,
            "fit_error": 0.1, "samples": []}
    data = {"model": {"name": "mlp"}, "batch_size": 1, "microbatch_sizes": [1], "targets": [],
            "link": link, "notes": []}
    assert "link (gloo, cpu <-> cpu): latency 20.0 us, bandwidth 1 GB/s" in profile_table(data)


# ---------------------------------------------------------------------------- fixed costs
def test_fixed_costs_are_measured_on_a_rank_per_device_at_once():
    """`measure_fixed_costs`: one record per rank, every rank measuring in the same window (the
    machine loaded as a run loads it), paired ranks timing one message each side."""
    from pipecc.profile.fixed import measure_fixed_costs
    ranks = measure_fixed_costs(["cpu", "cpu"], threads=1, repeat=5)
    assert [(r["rank"], r["device"], r["peer"]) for r in ranks] == [(0, "cpu", 1), (1, "cpu", 0)]
    (a0, a1), (b0, b1) = ranks[0]["window"], ranks[1]["window"]
    assert a0 < b1 and b0 < a1  # the two windows overlap
    for r in ranks:
        assert r["op_forward_s"] > 0 and r["op_backward_s"] > 0 and r["message_s"] > 0
        assert r["microbatch_s"] >= 0 and r["step_s"] >= 0


def test_the_profile_has_the_fixed_costs_section_the_planner_reads(tmp_path, monkeypatch):
    """The section per device name (FPGA cards have none), `ranks` = the spec's CPU/GPU devices,
    read back by `fixed_costs_for`; cached apart from the node timings (a second profile of another
    model measures nothing); --no-fixed-costs leaves it out; an old profile without it loads."""
    from pipecc.profile import fixed
    from pipecc.targets.fixed_costs import DEFAULTS, FIELDS, fixed_costs_for
    from pipecc.targets.devices import parse_devices
    from pipecc.targets.profiled import load_profile
    data = profile_model(MLP, "cpu,cpu,u250", model_args=TINY, batch_size=2, link=False,
                         cache_directory=tmp_path, **FAST).data
    section = data["fixed_costs"]
    assert list(section) == ["cpu"] and section["cpu"]["ranks"] == 2
    assert "2 rank(s) at once" in section["cpu"]["source"] and section["cpu"]["message_s"] > 0
    profile = load_profile(data)
    device = parse_devices("cpu").devices[0]
    got = fixed_costs_for(device, profile)
    assert all(getattr(got, f) == pytest.approx(section["cpu"][f]) for f in FIELDS)
    assert got.source == section["cpu"]["source"]
    monkeypatch.setattr(fixed, "measure_fixed_costs", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr("pipecc.profile.profiler.measure_fixed_costs", fixed.measure_fixed_costs)
    other = profile_model(MLP, "cpu,cpu", model_args={**TINY, "hidden": 24}, batch_size=2, link=False,
                          cache_directory=tmp_path, **FAST).data
    assert other["fixed_costs"] == section  # from the cache: two ranks of cpu, as before
    bare = profile_model(MLP, "cpu,cpu", model_args=TINY, batch_size=2, link=False, fixed_costs=False,
                         cache_directory=tmp_path, **FAST).data
    assert "fixed_costs" not in bare
    assert fixed_costs_for(device, load_profile(bare)) == DEFAULTS["cpu"]
    assert "fixed costs on cpu (2 rank(s) at once)" in profile_table(data)


def test_a_malformed_fixed_costs_section_is_one_line():
    from pipecc.errors import PipeccError
    from pipecc.targets.profiled import load_profile
    base = {"format": "pipecc.profile", "version": 1, "model": {"args": {}}, "microbatch_sizes": [1],
            "targets": [{"devices": ["cpu"], "nodes": []}]}
    load_profile(base)  # without the section: loads
    with pytest.raises(PipeccError, match="fixed_costs of cpu: fixed_costs field 'step_s' is -1"):
        load_profile({**base, "fixed_costs": {"cpu": {"step_s": -1}}})
    with pytest.raises(PipeccError, match="is not {device name"):
        load_profile({**base, "fixed_costs": [1]})
