"""One rule for every output file (`pipecc.runtime.outfile`; issue 33, "files pipecc must never
replace"): `plan -o`, `profile -o`, `run --trace`, `inspect --report` and `export-checkpoint`
never rename over a device node (they write into it), never replace an input of the same
command (the model file, a profile, a run document, a file of the compiled folder), and replace
a file pipecc did not write only with --force.

The device node is a private one made in the test's folder (`os.mknod` of the null device's
numbers needs root; without root a FIFO with a reader stands in for it). One torchrun launch
(the traced run the report needs); everything else is refused before any process starts."""
from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from helpers import MLP_TINY, model_args, run_cli
from helpers import run_pipecc as pipecc
from pipecc import cli
from pipecc.errors import PipeccError
from pipecc.runtime import outfile
from pipecc.runtime.trace import check_trace_path

pytestmark = pytest.mark.xdist_group(name="outfiles")
ROOT = Path(__file__).resolve().parents[1]
MODEL_SRC = (ROOT / "models" / "mlp.py").read_text()


def tiny_args() -> list[str]:
    return [a for arg in model_args(MLP_TINY) for a in ("--model-arg", arg)]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    """A model file of its own, the folder compiled from it, a traced run and its checkpoint."""
    root = tmp_path_factory.mktemp("outfiles")
    model = root / "m.py"
    model.write_text(MODEL_SRC)
    out = root / "out"
    assert cli.main(["compile", str(model), "-d", "2xcpu", "-b", "8", "-m", "2", "-q", "--replicas", "1",
                     "-o", str(out), *tiny_args()]) == 0
    trace, ckpt = root / "trace.json", root / "ckpt"
    run = pipecc("run", str(out), "--steps", "2", "--trace", str(trace), "--checkpoint-dir", str(ckpt),
                 "--timeout", "30")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"root": root, "model": model, "out": out, "trace": trace, "ckpt": ckpt}


def device_node(folder: Path) -> Path:
    """A private character device with /dev/null's numbers (root), else a FIFO read by a thread."""
    path = folder / "node"
    if os.geteuid() == 0:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    else:
        os.mkfifo(path)

        def drain() -> None:
            with open(path, "rb") as fh:
                while fh.read(1 << 16):
                    pass
        threading.Thread(target=drain, daemon=True).start()
    return path


def still_a_node(path: Path) -> bool:
    mode = os.lstat(path).st_mode
    return stat.S_ISCHR(mode) if os.geteuid() == 0 else stat.S_ISFIFO(mode)


def commands(w: dict[str, Path], target: str) -> dict[str, list[str]]:
    """Every output flag, writing to `target`."""
    return {
        "plan -o": ["plan", str(w["model"]), "-d", "2xcpu", "-b", "8", *tiny_args(), "-o", target],
        "profile -o": ["profile", str(w["model"]), "-d", "cpu", "-b", "2", "--repeat", "1", "--warmup", "0",
                       "--no-link", "--no-cache", "--no-fixed-costs", *tiny_args(), "-o", target],
        "run --trace": ["run", str(w["out"]), "--steps", "1", "--trace", target],
        "inspect --report": ["inspect", str(w["out"]), "--trace", str(w["trace"]), "--report", target],
        "export-checkpoint": ["export-checkpoint", str(w["ckpt"]), target],
    }


FLAGS = ["plan -o", "profile -o", "run --trace", "inspect --report", "export-checkpoint"]
# the commands that read the model file (inspect and run through the compiled folder's pipecc.json);
# export-checkpoint reads only the checkpoint, so --force may replace a file there
READS_MODEL = {"plan -o", "profile -o", "run --trace", "inspect --report"}


@pytest.mark.parametrize("flag", FLAGS)
def test_the_model_file_as_output_is_refused_and_kept(flag, work, capsys):
    argv = commands(work, str(work["model"]))[flag]
    code, out, err = run_cli(argv, capsys)
    assert code == 1 and err.startswith("pipecc: error: ") and err.count("\n") == 1, err
    assert work["model"].read_text() == MODEL_SRC
    if flag in READS_MODEL:  # an input of the command: not even --force replaces it
        assert "which this command reads" in err
        code, out, err = run_cli(argv + ["--force"], capsys)
        assert code == 1 and "which this command reads" in err, err
        assert work["model"].read_text() == MODEL_SRC
    else:
        assert "--force" in err


@pytest.mark.parametrize("flag", FLAGS)
def test_a_device_node_is_written_into_never_replaced(flag, work, tmp_path, capsys):
    node = device_node(tmp_path)
    code, out, err = run_cli(commands(work, str(node))[flag], capsys)
    assert code == 0, err
    assert still_a_node(node)
    assert [p.name for p in tmp_path.iterdir()] == ["node"]  # no temporary left beside it


@pytest.mark.parametrize("flag", FLAGS)
def test_a_file_pipecc_did_not_write_needs_force(flag, work, tmp_path, capsys):
    theirs = tmp_path / "notes.txt"
    theirs.write_text("years of work")
    argv = commands(work, str(theirs))[flag]
    code, out, err = run_cli(argv, capsys)
    assert code == 1 and "--force" in err and err.count("\n") == 1, err
    assert theirs.read_text() == "years of work"
    code, out, err = run_cli(argv + ["--force"], capsys)
    assert code == 0, err
    assert theirs.read_bytes() != b"years of work"
    if flag != "export-checkpoint":  # a file pipecc wrote: replaced again without --force
        code, out, err = run_cli(argv, capsys)
        assert code == 0, err


def test_inputs_of_the_command_are_never_replaced(work, tmp_path, capsys):
    profile = tmp_path / "prof.json"
    assert cli.main(commands(work, str(profile))["profile -o"]) == 0
    before = profile.read_bytes()
    plan = ["plan", str(work["model"]), "-d", "cpu", "-b", "8", *tiny_args(), "--profile", str(profile)]
    code, _, err = run_cli(plan + ["-o", str(profile), "--force"], capsys)
    assert code == 1 and "which this command reads" in err, err
    link = tmp_path / "link.json"  # through a symbolic link, too
    link.symlink_to(profile)
    code, _, err = run_cli(plan + ["-o", str(link), "--force"], capsys)
    assert code == 1 and "which this command reads" in err, err
    assert profile.read_bytes() == before
    for target in (work["out"] / "plan.json", work["trace"]):  # the compiled folder's files, the trace read
        kept = target.read_bytes()
        code, _, err = run_cli(commands(work, str(target))["inspect --report"] + ["--force"], capsys)
        assert code == 1 and "this command reads" in err, err
        assert target.read_bytes() == kept
    code, _, err = run_cli(commands(work, str(work["out"] / "pipecc.json"))["run --trace"] + ["--force"], capsys)
    assert code == 1 and "inside" in err, err
    latest = work["ckpt"] / "latest.json"
    kept = latest.read_bytes()
    code, _, err = run_cli(commands(work, str(latest))["export-checkpoint"] + ["--force"], capsys)
    assert code == 1 and "inside" in err, err
    assert latest.read_bytes() == kept


def test_the_rank_refuses_too(work, tmp_path):
    """`run_stage.py` started by hand (the torchrun command of --print-command) checks alike."""
    theirs = tmp_path / "t.json"
    theirs.write_text("mine")
    with pytest.raises(PipeccError, match="not written by pipecc"):
        check_trace_path(theirs, type("A", (), {"out": work["out"], "checkpoint_dir": None, "force": False})())


def test_a_pipe_nobody_reads_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PipeccError, match="a pipe that nobody reads"):
        outfile.write(fifo, "x", "-o")


@pytest.mark.skipif(os.geteuid() != 0, reason="a block device node needs root")
def test_a_block_device_is_refused(tmp_path):
    node = tmp_path / "blk"
    os.mknod(node, 0o600 | stat.S_IFBLK, os.makedev(7, 200))
    with pytest.raises(PipeccError, match="is a block device"):
        outfile.write(node, "x", "-o")
    assert stat.S_ISBLK(os.lstat(node).st_mode)


def test_an_empty_file_and_a_link_to_a_file_pipecc_wrote(tmp_path):
    empty = tmp_path / "empty.json"
    empty.touch()
    outfile.write(empty, '{"format": "pipecc.profile"}', "-o")  # empty: nothing to lose
    link = tmp_path / "link"
    link.symlink_to(empty)
    outfile.write(link, '{"format": "pipecc.profile", "x": 1}', "-o")
    assert link.is_symlink() and json.loads(empty.read_text())["x"] == 1  # the link stays a link


def test_a_full_device_is_one_line(tmp_path):
    if not Path("/dev/full").exists() or not stat.S_ISCHR(os.stat("/dev/full").st_mode):
        pytest.skip("no /dev/full here")
    with pytest.raises(PipeccError, match="No space left"):
        outfile.write("/dev/full", "x" * 100000, "-o")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
