"""Arguments that need no model are checked before the analysis (issue 21, item 8): a
misspelled device name in `pipecc plan/compile` was reported after 11.6 s of analysis. The
model file here records every call of build_model / example_inputs in a marker file: a bad
argument must give its one line without the model ever being built, and nothing on disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_cli

MODEL = '''
from pathlib import Path
import torch

def build_model():
    with open(Path(__file__).with_suffix(".calls"), "a") as f:
        f.write("build_model\\n")
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

def example_inputs(batch):
    with open(Path(__file__).with_suffix(".calls"), "a") as f:
        f.write("example_inputs\\n")
    return (torch.randn(batch, 4),)
'''


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "marked.py"
    path.write_text(MODEL)
    return path


def calls(model: Path) -> list[str]:
    marker = model.with_suffix(".calls")
    return marker.read_text().split() if marker.exists() else []


CASES = [  # (extra arguments, exit code, what the line says)
    (["--devices", "2xa10O"], 2, "unknown device 'a10O' in --devices; known: cpu, "),
    (["--devices", "@missing.toml"], 2, "cluster file missing.toml not found"),
    (["--devices", "4xa100", "--replicas", "3"], 2, "--replicas 3 does not divide the 4 devices"),
    (["--devices", "2xcpu", "--fpga-number", "ap_fixed<3>"], 1, "number format 'ap_fixed<3>'"),
    (["--devices", "2xcpu", "--profile", "not_a_profile.json"], 1, "is not a pipecc profile"),
    (["--devices", "2xcpu", "--profile", "absent.json"], 1, "cannot read profile absent.json"),
]


@pytest.mark.parametrize("command", ["plan", "compile"])
@pytest.mark.parametrize("extra, code, says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_model_free_argument_is_one_line_before_the_model_is_built(
        model: Path, tmp_path: Path, monkeypatch, capsys, command: str, extra: list[str], code: int,
        says: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not_a_profile.json").write_text('{"format": "something else"}')
    out = tmp_path / "out"
    argv = [command, str(model), *extra] + (["-o", str(out)] if command == "compile" else [])
    got, stdout, stderr = run_cli(argv, capsys)
    lines = stderr.strip().splitlines()
    assert (got, len(lines)) == (code, 1), stderr
    assert lines[0].startswith("pipecc: error: ") and says in lines[0], lines[0]
    assert calls(model) == [], "the model was built before the argument was checked"
    assert stdout == "" and not out.exists()


def test_good_arguments_still_build_and_plan_the_model(model: Path, capsys) -> None:
    """The control: the same file with valid arguments is built (the marker works)."""
    got, stdout, stderr = run_cli(["plan", str(model), "--devices", "2xcpu", "-b", "4", "-q"], capsys)
    assert got == 0, stderr
    assert "build_model" in calls(model) and "example_inputs" in calls(model)
    assert "stage" in stdout


def test_a_misspelled_device_is_reported_without_importing_torch(model: Path) -> None:
    """At once: the check runs before anything imports torch (seconds on a loaded machine)."""
    code = ("import sys\nfrom pipecc.cli import app\n"
            f"code = app.main(['plan', {str(model)!r}, '--devices', '2xa10O'])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stdout.strip() == "no torch"
    assert result.stderr.strip().startswith("pipecc: error: unknown device 'a10O'")
    assert calls(model) == []
