"""`pipecc inspect`: the stage table, one stage's graph, JSON, dot, ONNX per stage, bad folders.

Compiled folders are made the way `pipecc compile` makes them: driver.analyze -> driver.plan
-> cut_stages -> write_output with graph.json, timeline.json and report.html as extra files.
"""
from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import MLP_TINY, run_cli, zoo_module, zoo_path
from pipecc import driver, progress
from pipecc.backends.torch import cut_stages, write_output
from pipecc.report.artifacts import MODEL_INPUT, graph_json, timeline_for, timeline_json
from pipecc.report.compiled import load_compiled, stage_json, summary_json
from pipecc.report.dot import dot_text
from pipecc.report.figures import bottleneck_stage
from pipecc.report.html import render_report

# TINY gpt with 4 layers and a longer sequence, so 4 CPUs get 4 real stages.
GPT_ARGS = dict(zoo_module("gpt").TINY, n_layer=4, n_embd=64, block_size=32, seq_len=32)


def compile_folder(out: Path, name: str, model_args: dict, devices: str, batch: int = 8,
                   with_model_file: bool = True, extras: bool = True) -> Path:
    analysis = driver.analyze(zoo_path(name), model_args=model_args, batch_size=batch, debug=True)
    plan, graph = driver.plan(analysis, devices, compare=True, debug=True)
    if with_model_file:
        plan.model_path, plan.model_args = str(zoo_path(name)), dict(model_args)
    timeline = timeline_for(plan)
    extra = {"graph.json": json.dumps(graph_json(graph, plan), indent=1),
             "timeline.json": json.dumps(timeline_json(timeline)),
             "report.html": render_report(graph, plan, timeline)} if extras else {}
    return write_output(out, graph, plan, cut_stages(graph, plan.stage_of()), extra_files=extra)


@pytest.fixture(scope="module")
def gpt_out(tmp_path_factory) -> Path:
    return compile_folder(tmp_path_factory.mktemp("gpt") / "out", "gpt", GPT_ARGS, "4xcpu")


@pytest.fixture(scope="module")
def mlp_out(tmp_path_factory) -> Path:
    # no model file recorded: the ONNX check must make the inputs from the ports
    return compile_folder(tmp_path_factory.mktemp("mlp") / "out", "mlp", MLP_TINY, "2xcpu",
                          with_model_file=False)


# ----------------------------------------------------------------------------- text
def test_summary_table_marks_bottleneck_and_bound(gpt_out, capsys):
    code, out, err = run_cli(["inspect", str(gpt_out)], capsys)
    assert code == 0, err
    c = load_compiled(gpt_out)
    plan = c.plan
    assert len(plan.stages) == 4
    header = next(line for line in out.splitlines() if line.startswith("stage "))
    lines = out.splitlines()
    # a table wider than 100 columns gives each row's node range, in/out bytes and shards a line
    # of its own under the row (issue 30): those columns are in the header or on that line
    below = [lines[i + 1] for i, line in enumerate(lines) if re.match(r"^\d+( \*)?\s", line)]
    for column in ("device", "nodes", "fwd FLOPs", "params", "fwd", "bwd", "peak mem", "in", "out",
                   "split-layer shards"):
        assert column in header or all(f"{column} " in b for b in below if b.startswith("       ")) or (
            column == "split-layer shards" and not plan.split_layers), column  # an empty cell is left out
    rows = [line for line in out.splitlines() if re.match(r"^\d+( \*)?\s", line)]
    assert len(rows) == len(plan.stages)
    worst = bottleneck_stage(plan)
    assert [r.split()[0] for r in rows] == [str(i) for i in range(4)]
    assert [r.split()[1] == "*" for r in rows] == [i == worst for i in range(4)]
    for s in plan.stages:  # every row names its device and first .. last node (or the line under it)
        assert f"{s.nodes[0]} .. {s.nodes[-1]}" in rows[s.index] + below[s.index]
    assert f"balance ratio {plan.balance_ratio:.3f}" in out
    assert "lower bound" in out and "bottleneck" in out
    mbs = f"{plan.microbatches} micro-batches" if plan.microbatches > 1 else "1 micro-batch "
    assert f"schedule {plan.schedule}" in out and mbs in out
    assert "device 0 |" in out  # the schedule drawn


def test_stage_lists_nodes_with_sources_and_destinations(gpt_out, capsys):
    code, out, err = run_cli(["inspect", str(gpt_out), "--stage", "1"], capsys)
    assert code == 0, err
    c = load_compiled(gpt_out)
    nodes = c.nodes_of(1)
    assert nodes and {n["name"] for n in nodes} <= set(c.plan.stages[1].nodes)
    table = out[out.index("#  "):]
    for n in nodes:
        line = next(line for line in table.splitlines() if f"  {n['name']}  " in line)
        assert n["op"] in line and (n["shapes"][0] if n["shapes"] else "-") in line
    # what comes from stage 0 and what goes to stage 2, by tensor name as in stage.py
    ports = json.loads((gpt_out / "stage_1" / "ports.json").read_text())
    head = out[:out.index("#  ")]
    received, sent = head.split("\nsends")
    assert all(f"  {p['name']} " in received for p in ports["receives"])
    assert all(f"  {p['name']} " in sent for p in ports["sends"])
    assert re.search(r"s2:\w+", table), "no output to stage 2 shown"
    assert re.search(r"s0:\w+", table), "no input from stage 0 shown"
    # costs: FLOPs per node (per micro-batch) add up to the plan's stage FLOPs
    assert sum(n["forward_flops_mb"] for n in nodes) == c.plan.stages[1].forward_flops


def test_stage_json_and_summary_json_have_stable_keys(gpt_out, capsys):
    code, out, err = run_cli(["inspect", str(gpt_out), "--format", "json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data == json.loads(json.dumps(summary_json(load_compiled(gpt_out))))
    assert {"format", "version", "out", "model", "batch_size", "microbatches", "microbatch_size",
            "schedule", "virtual_stages", "devices", "stages", "bottleneck_stage", "bottleneck_s",
            "lower_bound_s", "balance_ratio", "predicted_iteration_s", "bubble_fraction",
            "split_layers", "baselines", "decisions", "has_graph"} <= data.keys()
    assert data["format"] == "pipecc-inspect" and data["version"] == 1
    stage_keys = {"index", "device", "device_name", "device_kind", "first_node", "last_node",
                  "num_nodes", "forward_flops", "param_bytes", "forward_s", "backward_s", "comm_s",
                  "recv_bytes", "send_bytes", "peak_memory_bytes", "memory_capacity_bytes",
                  "split_layers", "receives", "sends", "bottleneck", "fpga_estimates"}
    for s in data["stages"]:
        assert stage_keys <= s.keys()
    assert [s["bottleneck"] for s in data["stages"]].count(True) == 1
    assert len(data["baselines"]) == 3
    code, out, _ = run_cli(["inspect", str(gpt_out), "--format", "json", "--stage", "2"], capsys)
    one = json.loads(out)
    assert {"stage", "receives", "sends", "nodes", "parameters", "fpga_estimates"} <= one.keys()
    node_keys = {"name", "id", "op", "kind", "stage", "shapes", "shapes_at", "inputs", "users",
                 "forward_flops", "backward_flops", "param_bytes", "output_bytes",
                 "forward_flops_mb", "backward_flops_mb", "output_bytes_mb", "forward_flops_expr"}
    assert one["nodes"] and all(node_keys <= n.keys() for n in one["nodes"])
    assert all(n["stage"] == 2 for n in one["nodes"])
    assert one == json.loads(json.dumps(stage_json(load_compiled(gpt_out), 2)))


def test_dot_clusters_stages_and_labels_cross_stage_edges(gpt_out, capsys):
    code, dot, err = run_cli(["inspect", str(gpt_out), "--format", "dot"], capsys)
    assert code == 0, err
    c = load_compiled(gpt_out)
    assert dot.lstrip().startswith("digraph ") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    for i in range(len(c.plan.stages)):
        assert f"subgraph cluster_{i} {{" in dot
    declared = set(re.findall(r'^\s*"([^"]+)" \[label=', dot, re.M)) | {"output"}
    edges = re.findall(r'^\s*"([^"]+)" -> "([^"]+)"(.*);$', dot, re.M)
    assert edges and all(a in declared and b in declared for a, b, _ in edges)
    stage = {n["id"]: n["stage"] for n in c.graph["nodes"]}
    stage["output"] = len(c.plan.stages)
    cross = [(a, b, attrs) for a, b, attrs in edges if stage[a] != stage[b] and stage[a] != MODEL_INPUT]
    assert cross
    for _, _, attrs in cross:
        assert re.search(r'label="[\d.]+[kMGT]?B"', attrs), attrs
    assert dot_text(c.plan, c.graph) == dot.rstrip("\n")


def test_folder_without_graph_json_still_inspects(tmp_path, capsys):
    out = compile_folder(tmp_path / "old", "mlp", MLP_TINY, "2xcpu", extras=False)
    code, text, err = run_cli(["inspect", str(out)], capsys)
    assert code == 0, err
    assert "recompile for node details" in text
    code, text, err = run_cli(["inspect", str(out), "--stage", "0"], capsys)
    assert code == 0 and "no graph.json" in text


def test_fpga_stage_shows_its_estimates(mlp_out, tmp_path, capsys):
    out = tmp_path / "fpga"
    shutil.copytree(mlp_out, out)
    layer = {"name": "dense_0", "kind": "dense", "pe": 4, "simd": 8, "dsp": 40, "bram18": 6,
             "lut": 900, "ii_cycles": 128, "latency_cycles": 140}
    est = {"source": "analytic", "card": "u250", "number": "float", "layers": [layer],
           "total": {"dsp": 40, "bram18": 6, "lut": 900}, "utilisation": {"dsp": 0.004, "bram18": 0.002},
           "fits": True, "interval_cycles": 128, "interval_s": 4.3e-7, "latency_cycles": 140}
    (out / "stage_1" / "estimates.json").write_text(json.dumps(est))
    code, text, err = run_cli(["inspect", str(out), "--stage", "1"], capsys)
    assert code == 0, err
    assert "FPGA estimates (analytic, u250, float): DSP 40" in text and "fits" in text
    assert "dense_0" in text and "ii_cycles" in text
    code, text, _ = run_cli(["inspect", str(out), "--stage", "1", "--format", "json"], capsys)
    assert json.loads(text)["fpga_estimates"]["total"]["dsp"] == 40


@pytest.mark.parametrize("make", ["missing", "empty", "file", "foreign", "bad_stage"])
def test_bad_out_is_one_line_error(tmp_path, capsys, make, mlp_out):
    target = tmp_path / "x"
    args = ["inspect", str(target)]
    if make == "empty":
        target.mkdir()
    elif make == "file":
        target.write_text("hello")
    elif make == "foreign":
        target.mkdir()
        (target / "pipecc.json").write_text('{"format": "something-else"}')
    elif make == "bad_stage":
        args = ["inspect", str(mlp_out), "--stage", "9"]
    code, out, err = run_cli(args, capsys)
    assert code == 1 and out == ""
    assert err.startswith("pipecc: error: ") and err.count("\n") == 1, err


def test_usage_errors_exit_2(mlp_out, capsys):
    code, _, err = run_cli(["inspect", str(mlp_out), "--format", "svg"], capsys)
    assert code == 2 and err.startswith("pipecc: error: ")
    code, _, err = run_cli(["inspect", str(mlp_out), "--stage", "-1"], capsys)
    assert code == 2


# ----------------------------------------------------------------------------- ONNX per stage
@pytest.mark.parametrize("which", ["mlp", "gpt"])
def test_every_stage_as_onnx_matches_the_torch_stage(which, mlp_out, gpt_out, tmp_path, capsys):
    import onnxruntime as ort

    from pipecc.report.stage_onnx import RELAY_SUFFIX, stage_modules_and_inputs

    out = mlp_out if which == "mlp" else gpt_out
    code, text, err = run_cli(["inspect", str(out), "--onnx", str(tmp_path)], capsys)
    assert code == 0, err
    chain = stage_modules_and_inputs(out)
    assert text.count("matches torch") == len(chain)
    for i, (module, ports, args) in enumerate(chain):
        path = tmp_path / f"stage_{i}.onnx"
        assert path.is_file()
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {p["name"]: a.numpy() for p, a in zip(ports["receives"], args)
                 if isinstance(a, torch.Tensor)}
        assert {x.name for x in session.get_inputs()} == feeds.keys()
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        with torch.no_grad():
            expected = module(*args)
        for p, value in zip(ports["sends"], expected):
            if isinstance(value, torch.Tensor):
                name = p["name"] + (RELAY_SUFFIX if p["name"] in feeds else "")
                torch.testing.assert_close(torch.from_numpy(got[name]), value, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- progress
def test_progress_is_quiet_off_a_terminal_and_draws_on_one():
    quiet = io.StringIO()  # not a TTY
    p = progress.Progress(quiet)
    with p.step("tracing", total=2) as s:
        s.advance()
    p.explain("ignored without -v")
    assert quiet.getvalue() == ""
    shown = io.StringIO()
    p = progress.Progress(shown, force=True, verbose=True)
    with p.step("planning"):
        with p.step("writing weights", total=3) as s:
            s.advance(3)
        p.explain("why: because")
    text = shown.getvalue()
    assert "✓ planning › writing weights 3/3" in text and "✓ planning" in text
    assert "  why: because\n" in text
    muted = io.StringIO()
    p = progress.Progress(muted, force=True, quiet=True)
    with pytest.raises(ValueError):
        with p.step("fails"):
            raise ValueError
    assert muted.getvalue() == ""
    failing = io.StringIO()
    p = progress.Progress(failing, force=True)
    with pytest.raises(ValueError):
        with p.step("fails"):
            raise ValueError
    assert "✗ fails" in failing.getvalue()
