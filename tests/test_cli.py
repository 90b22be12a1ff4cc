"""`pipecc` commands: contract JSON, readable tables, and one-line errors with exit codes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, zoo_module

DATA = Path(__file__).parent / "data"
GPT_TINY = [f"--model-arg={k}={v}" for k, v in zoo_module("gpt").TINY.items()]


def pipecc(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Through `python -m pipecc.cli` on purpose: that entry must keep working too."""
    return subprocess.run([sys.executable, "-m", "pipecc.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_cost_json_has_the_contract_fields():
    r = pipecc("cost", "models/gpt.py", "--batch-size", "2", "--json", *GPT_TINY)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)  # exactly one JSON document on stdout
    assert data["batch_size"] == 2
    for key in ("forward_flops", "backward_flops", "forward_flops_matmul",
                "backward_flops_matmul", "param_bytes", "activation_bytes"):
        assert isinstance(data["total"][key], int) and data["total"][key] > 0, key
    node = next(n for n in data["nodes"] if n["name"] == "blocks.0.attn.qkv")
    assert node["op"] == "linear" and node["kind"] == "linear"
    assert node["forward_flops_expr"].endswith("*B") and node["param_bytes"] > 0
    for n in data["nodes"]:
        assert {"name", "op", "kind", "forward_flops", "forward_flops_expr", "param_bytes",
                "output_bytes"} <= set(n)


def test_cost_table_and_grouping():
    r = pipecc("cost", "models/mlp.py", "-b", "3")
    assert r.returncode == 0, r.stderr
    assert "fwd FLOPs" in r.stdout and "16512*B" in r.stdout, r.stdout  # Linear(16, 32): 2*16*32+32 per sample
    rows = [line.split() for line in r.stdout.splitlines()]
    assert [row[1] for row in rows if len(row) > 2 and row[0] in ("0", "1", "2")] == ["linear", "relu", "linear"]
    r = pipecc("cost", "models/gpt.py", "--by-module", "2", *GPT_TINY)
    assert r.returncode == 0 and "blocks.0" in r.stdout and "blocks.0.attn.qkv" not in r.stdout


def test_help():
    assert pipecc("--help").returncode == 0
    r = pipecc("cost", "--help")
    assert r.returncode == 0 and "--batch-size" in r.stdout


@pytest.mark.parametrize("args,code,message", [
    (["cost", "missing.py"], 1, "does not exist"),
    (["cost", str(DATA / "no_build.py")], 1, "does not define build_model, example_inputs"),
    (["cost", str(DATA / "broken_forward.py")], 1, "forward raised ValueError: this model is broken"),
    (["cost", str(DATA / "uncapturable.py")], 1, "could not capture the model"),
    (["cost", "models/mlp.py", "--batch-size", "-2"], 2, "must be a positive integer"),
    (["cost", "models/mlp.py", "--model-arg", "oops"], 2, "is not KEY=VALUE"),
    (["cost", "pyproject.toml"], 1, "neither .py nor .onnx"),
    (["cost"], 2, "required"),
    (["frobnicate"], 2, "invalid choice"),
])
def test_bad_input_gets_one_line_and_exit_code(args, code, message):
    r = pipecc(*args)
    assert r.returncode == code, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipecc: error: "), r.stderr
    assert message in lines[0]
    assert r.stdout == ""


def test_corrupt_onnx_file(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    r = pipecc("cost", str(bad))
    assert r.returncode == 1 and r.stderr.startswith("pipecc: error: ") and "ONNX" in r.stderr


def test_debug_shows_the_traceback():
    r = pipecc("cost", str(DATA / "broken_forward.py"), "--debug")
    assert r.returncode == 1 and "Traceback" in r.stderr


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "pipecc"
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "pipecc" in r.stdout
