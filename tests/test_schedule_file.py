"""A compiled folder carries its schedule: compile writes OUT/schedule.txt (the plan's validated
action list, text form), `pipecc run` executes exactly it, `pipecc inspect` draws it, and a
missing, invalid or mismatched file is one line naming the fix.

The proof that the file is what runs: an edited schedule.txt that places stage 0 on rank 1 and
stage 1 on rank 0 (a valid schedule no generator builds) still passes `--verify`, and `--json`
reports each stage on the rank the file gave it; `--schedule 1f1b` builds one from the plan
again (stage s on rank s)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import compile_mlp, pipecc_here, run_cli
from pipecc.techniques import schedule_of
from pipecc.ir.schedule.text import format, parse
from pipecc.report.compiled import load_compiled, summary_json, timeline_of
from pipecc.runtime import dist

pytestmark = pytest.mark.xdist_group(name="schedule_file")

# stage 0 on rank 1, stage 1 on rank 0, plain backwards: valid, and not what compile wrote
SWAPPED = ("rank 0: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1\n"
           "rank 1: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    return compile_mlp(tmp_path_factory.mktemp("schedule_file") / "mlp", "--schedule", "1f1b")


@pytest.fixture
def folder(compiled: Path, tmp_path: Path) -> Path:
    """A copy of the compiled folder this test may edit."""
    return Path(shutil.copytree(compiled, tmp_path / "out"))


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipecc: error: "), err
    return lines[0]


def test_the_compiled_folder_carries_its_schedule(compiled: Path) -> None:
    text = (compiled / "schedule.txt").read_text(encoding="utf-8")
    marker = json.loads((compiled / "pipecc.json").read_text(encoding="utf-8"))
    assert "schedule.txt" in marker["files"]
    c = load_compiled(compiled)
    assert parse(text) == schedule_of(c.plan) == c.schedule
    assert format(parse(text)) + "\n" == text
    assert summary_json(c)["schedule_text"] == text.strip()
    assert timeline_of(c) == c.timeline  # unedited: the same timeline compile wrote


def test_run_executes_the_folders_schedule_txt(folder: Path) -> None:
    (folder / "schedule.txt").write_text(SWAPPED, encoding="utf-8")
    done = pipecc_here("run", str(folder), "--steps", "2", "--verify", "--json", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    assert "verify: outputs, loss and" in done.stderr
    ranks = {s["index"]: s["rank"] for s in json.loads(done.stdout)["stages"]}
    assert ranks == {0: 1, 1: 0}  # where the file put them
    # inspect draws the file too: stage 0's work on rank 1
    events = timeline_of(load_compiled(folder))["events"]
    assert {e["rank"] for e in events if e["stage"] == 0} == {1}
    assert {e["kind"] for e in events} >= {"F", "B"}
    # --schedule builds one from the plan instead: stage s on rank s
    again = pipecc_here("run", str(folder), "--steps", "1", "--schedule", "1f1b", "--json", "--timeout", "30",
                        "--warmup-steps", "0")
    assert again.returncode == 0, again.stderr
    assert {s["index"]: s["rank"] for s in json.loads(again.stdout)["stages"]} == {0: 0, 1: 1}


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.replace(" 0SEND_F1", ""), "is not a valid schedule: rank 1 step"),
    (lambda t: t + "rank 2: nonsense\n", "not an action: 'nonsense'"),
    (lambda t: t.replace("rank 1:", "rank 3:"), "expected 'rank 1:'"),
    (lambda t: "rank 0: 0F0 1F0 1B0 0B0\n", "does not match the folder: it has 1 micro-batches, the folder 2"),
])
def test_a_broken_schedule_txt_is_one_line(folder: Path, capsys, edit, words: str) -> None:
    path = folder / "schedule.txt"
    path.write_text(edit(path.read_text(encoding="utf-8")), encoding="utf-8")
    code, _, err = run_cli(["run", str(folder), "--steps", "1"], capsys)
    assert code == 1
    line = _one_error_line(err)
    assert words in line and "compile again" in line, line
    code, _, err = run_cli(["inspect", str(folder)], capsys)
    assert code == 1 and words in _one_error_line(err)


def test_a_folder_without_schedule_txt_says_compile_again(folder: Path, capsys) -> None:
    (folder / "schedule.txt").unlink()
    code, _, err = run_cli(["run", str(folder), "--steps", "1"], capsys)
    assert code == 1
    assert "has no schedule.txt (compiled by an older pipecc" in _one_error_line(err)
    # the runtime itself (one process, as run_stage.py starts it) refuses it the same way
    assert dist.main([str(folder), "--steps", "1"]) == 1
    assert "has no schedule.txt" in _one_error_line(capsys.readouterr().err)
