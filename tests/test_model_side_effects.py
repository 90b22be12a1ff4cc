"""Model code must not leak into pipecc's output (issue 33): a `print` in the model file stays off
stdout under --json (which carries one JSON document), and `os.chdir` in `build_model` does not
move where compile writes (the working folder is put back after the model's code ran)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import run_cli

LEAKY = '''
import os, torch
from torch import nn
print("hello from the model file")
def build_model(**_):
    print("building")
    os.makedirs({elsewhere!r}, exist_ok=True)
    os.chdir({elsewhere!r})
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
def example_inputs(batch_size=1, **_):
    print("inputs")
    return (torch.randn(batch_size, 4),)
'''


@pytest.fixture
def leaky(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "leaky.py"
    path.write_text(LEAKY.format(elsewhere=str(tmp_path / "elsewhere")))
    return path


@pytest.mark.parametrize("argv", [["plan", "-d", "cpu,cpu", "--json"], ["cost", "--json"]], ids=["plan", "cost"])
def test_prints_in_the_model_stay_off_json_stdout(argv, leaky, capsys):
    code, out, err = run_cli([argv[0], str(leaky), "-b", "4", *argv[1:]], capsys)
    assert code == 0, err
    json.loads(out)  # stdout is the JSON document alone
    assert "building" in err  # the model's prints are not lost: they went to stderr


def test_chdir_in_build_model_does_not_move_the_output(leaky, tmp_path, capsys):
    code, out, err = run_cli(["compile", str(leaky), "-b", "4", "-d", "cpu,cpu", "-o", "out", "-q"], capsys)
    assert code == 0, err
    assert Path.cwd() == tmp_path
    assert (tmp_path / "out" / "pipecc.json").is_file() and not (tmp_path / "elsewhere" / "out").exists()
    assert os.getcwd() == str(tmp_path)
