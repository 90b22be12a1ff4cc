"""One truth across a compiled folder's outputs (issue 21, item 6): plan.json, `pipecc inspect`
(text, --format json, --stage I), report.html and each stage.py's docstring agree on every node
list and number they share.

The models are those where the cut moves nodes the planner placed elsewhere: GPT reads
`idx.device` (computed by the stage that uses it), GNMT's LSTMs return tuples (their `getitem`s
follow the tuple's producer), a TransformerEncoder has both; the MLP is the plain case. Before
the fix plan.json listed such a node on one stage and the stage.py computing it on another."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from helpers import run_cli, zoo_path
from pipecc.report.figures import BOTTLENECK_WITH_COMM, bottleneck_stage, first_last
from pipecc.report.formatting import seconds

TRANSFORMER = '''
import torch
from torch import nn

def build_model(d=32, layers=3):
    layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Linear(d, 5))

def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 6, 32),)

def example_target(batch_size=1):
    return torch.randn(batch_size, 6, 5)

def loss_fn(outputs, target):
    return nn.functional.mse_loss(outputs, target)
'''

CASES = {
    "gpt": (["n_layer=2", "n_head=2", "n_embd=32", "vocab_size=101", "block_size=16", "seq_len=8"], "3xcpu"),
    "gnmt": (["vocab_size=53", "hidden=16", "num_layers=4", "src_len=7", "tgt_len=5"], "3xcpu"),
    "mlp": (["in_features=16", "hidden=32", "depth=3", "num_classes=5"], "2xcpu"),
    "transformer": ([], "3xcpu"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def folder(request, tmp_path_factory) -> Path:
    name = request.param
    args, devices = CASES[name]
    tmp = tmp_path_factory.mktemp(f"truth_{name}")
    model = zoo_path(name) if name != "transformer" else tmp / "transformer.py"
    if name == "transformer":
        model.write_text(TRANSFORMER)
    out = tmp / "out"
    from pipecc import cli
    assert cli.main(["compile", str(model), "-b", "4", "-m", "2", "--devices", devices, "--replicas", "1",
                     "-q", "-o", str(out), *(f"--model-arg={a}" for a in args)]) == 0
    return out


def docstring_nodes(stage_py: Path) -> list[str]:
    doc = stage_py.read_text().split('"""')[1]
    found = re.search(r"Nodes \((\d+)\): (.*?)\n\n", doc, re.S)
    assert found, doc[:500]
    listed = " ".join(found.group(2).split())
    names = [] if listed.startswith("(none") else listed.split(", ")
    assert len(names) == int(found.group(1))
    return names


def test_every_output_lists_the_nodes_each_stage_py_computes(folder: Path, capsys) -> None:
    plan = json.loads((folder / "plan.json").read_text())
    code, out, err = run_cli(["inspect", str(folder), "--format", "json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    report = html.unescape((folder / "report.html").read_text())
    for s, row in zip(plan["stages"], summary["stages"], strict=True):
        k = s["index"]
        assert docstring_nodes(folder / f"stage_{k}" / "stage.py") == s["nodes"], f"stage {k}"
        first, last = first_last(s["nodes"])
        assert (row["first_node"], row["last_node"], row["num_nodes"]) == (first, last, len(s["nodes"]))
        code, out, err = run_cli(["inspect", str(folder), "--stage", str(k), "--format", "json"], capsys)
        assert code == 0, err
        assert [n["name"] for n in json.loads(out)["nodes"]] == s["nodes"], f"inspect --stage {k}"
        assert f"{first} … {last} ({len(s['nodes'])})" in report, f"report's stage {k} row"


def test_every_output_shows_the_same_figures_and_labels_the_bottleneck(folder: Path, capsys) -> None:
    plan = json.loads((folder / "plan.json").read_text())
    code, text, err = run_cli(["inspect", str(folder)], capsys)
    assert code == 0, err
    report = html.unescape((folder / "report.html").read_text())
    code, out, err = run_cli(["inspect", str(folder), "--format", "json"], capsys)
    summary = json.loads(out)
    for key in ("bottleneck_s", "lower_bound_s", "predicted_iteration_s"):
        assert summary[key] == plan[key], key
    worst = summary["bottleneck_stage"]
    bottleneck = seconds(plan["bottleneck_s"])
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("bottleneck"))
    line = " ".join(lines[at].split() + [w for x in lines[at + 1:] if x.startswith(" " * 16) for w in x.split()][:40])
    assert bottleneck in line and f"stage {worst}" in line and BOTTLENECK_WITH_COMM in line, line
    assert re.search(rf"<b>{re.escape(bottleneck)}</b><span>bottleneck: stage {worst}, "
                     rf"{re.escape(BOTTLENECK_WITH_COMM)}</span>", report), "report's header figure"
    rows = [x for x in text.splitlines() if re.match(r"^\d+ ", x)]
    for s, row in zip(plan["stages"], rows, strict=True):
        fwd, bwd, comm = (seconds(s[f]) for f in ("forward_s", "backward_s", "comm_s"))
        assert f"{fwd}  " in row and f"{bwd}  " in row and f" {comm} " in row, (row, fwd, bwd, comm)
        assert f"<td>{fwd}</td><td>{bwd}</td><td>{comm}</td>" in report, f"report's stage {s['index']} row"
        total = seconds(s["forward_s"] + s["backward_s"] + s["comm_s"])
        assert total in report, f"report's stage bar of stage {s['index']}"
    assert worst == bottleneck_stage(load_plan(folder))


def load_plan(folder: Path):
    from pipecc.report.compiled import read_plan
    return read_plan(folder)
