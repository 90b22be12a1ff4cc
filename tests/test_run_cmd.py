"""`pipecc run OUT`: torchrun launches of compiled pipelines, --verify, several nodes.

Launches cost seconds each, so there are four: a tiny MLP and a tiny GPT with --verify on one
machine, a planted bug that --verify must catch, and two launchers (one process each) that
meet on 127.0.0.1 and must print the single-machine losses. Everything else runs in process.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipecc import cli
from pipecc.runtime import dist

# NOTE: tests sharing a compiled folder (module fixtures) stay on one worker under xdist.
pytestmark = pytest.mark.xdist_group(name="run_cmd")

ROOT = Path(__file__).resolve().parents[1]
MLP_ARGS = ["in_features=16", "hidden=32", "depth=3", "num_classes=5"]
# batch 16 makes the planner cut the tiny GPT between its blocks, so the tied embedding/head
# weight lands on both ranks and its gradient is summed across them
GPT_ARGS = ["n_layer=2", "n_head=2", "n_embd=32", "vocab_size=101", "block_size=16", "seq_len=8",
            "tie_weights=True"]
PIPECC = [sys.executable, "-c", "import sys; from pipecc.cli import main; sys.exit(main())"]  # the entry point
STEP = re.compile(r"^step (\d+): loss (\S+), (\S+) samples/s$", re.MULTILINE)


def compile_model(model: str, out: Path, model_args: list[str], batch: int) -> Path:
    argv = ["compile", str(ROOT / "models" / model), "--devices", "2xcpu", "-o", str(out), "-b", str(batch),
            "-m", "2", "-q"]
    for arg in model_args:
        argv += ["--model-arg", arg]
    assert cli.main(argv) == 0
    return out


def pipecc(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*PIPECC, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def losses(stdout: str) -> list[str]:
    return [loss for _, loss, _ in STEP.findall(stdout)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlp_out(tmp_path_factory) -> Path:
    return compile_model("mlp.py", tmp_path_factory.mktemp("run") / "mlp", MLP_ARGS, 8)


@pytest.fixture(scope="module")
def gpt_out(tmp_path_factory) -> Path:
    return compile_model("gpt.py", tmp_path_factory.mktemp("run") / "gpt", GPT_ARGS, 16)


@pytest.fixture(scope="module")
def mlp_run(mlp_out: Path) -> subprocess.CompletedProcess:
    return pipecc("run", str(mlp_out), "--steps", "2", "--verify", "--timeout", "30")


# ---------------------------------------------------------------------------- launches


def test_mlp_runs_and_verifies(mlp_run: subprocess.CompletedProcess) -> None:
    assert mlp_run.returncode == 0, mlp_run.stdout[-3000:] + mlp_run.stderr[-3000:]
    assert re.search(r"^verify: outputs, loss and \d+ gradients match the single-process run$", mlp_run.stdout,
                     re.MULTILINE), mlp_run.stdout
    steps = STEP.findall(mlp_run.stdout)
    assert [int(i) for i, _, _ in steps] == [0, 1], mlp_run.stdout
    assert all(float(rate) > 0 for _, _, rate in steps)
    assert float(steps[1][1]) < float(steps[0][1])  # SGD on the model's cross-entropy
    assert "pipecc: error" not in mlp_run.stderr


def test_gpt_runs_and_verifies(gpt_out: Path) -> None:
    result = pipecc("run", str(gpt_out), "--steps", "2", "--verify", "--timeout", "30")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.search(r"^verify: outputs, loss and (\d+) gradients match", result.stdout, re.MULTILINE)
    assert found and int(found.group(1)) >= 20, result.stdout  # every parameter (tensor) of the model
    assert len(losses(result.stdout)) == 2


def test_verify_catches_a_planted_bug(mlp_out: Path, tmp_path: Path) -> None:
    """A stage that computes something else (here: outputs scaled by 1.01) fails --verify."""
    out = tmp_path / "buggy"
    shutil.copytree(mlp_out, out)
    last = out / "stage_1" / "stage.py"
    source, n = re.subn(r"return \((\w+),\)", r"return (\1 * 1.01,)", last.read_text())
    assert n == 1, "the generated last stage no longer ends in `return (x,)`"
    last.write_text(source)
    result = pipecc("run", str(out), "--steps", "1", "--verify", "--timeout", "30")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"pipecc: error: verify: rank \d stage \d gradient of \S+.* differs: ", result.stderr), \
        result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert re.match(r"pipecc: error: run failed: verify: rank \d ", last_line), last_line
    assert "Traceback" not in result.stderr  # torchrun's ChildFailedError report is held back
    assert not losses(result.stdout)


def test_two_nodes_match_one(mlp_out: Path, mlp_run: subprocess.CompletedProcess) -> None:
    """Two launchers (one process each) rendezvous on 127.0.0.1: the losses of one machine."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([*PIPECC, "run", str(mlp_out), "--steps", "2",
                               "--timeout", "30", "--nnodes", "2", "--node-rank", str(node),
                               "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "1"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o + e for o, e in outputs)
    assert losses(outputs[0][0]) == []  # node 0 holds stage 0; the last stage prints
    assert losses(outputs[1][0]) == losses(mlp_run.stdout) != []


# ---------------------------------------------------------------------------- in process


def test_print_command(mlp_out: Path, capsys) -> None:
    assert cli.main(["run", str(mlp_out), "--steps", "3", "--verify", "--print-command"]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1
    assert f"{sys.executable} -m torch.distributed.run --nproc-per-node 2 --standalone " in out
    assert out.endswith(f"{mlp_out.resolve() / 'run_stage.py'} --steps 3 --verify")

    argv = ["run", str(mlp_out), "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29500", "--print-command"]
    assert cli.main(argv) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(commands) == 2
    for node, command in enumerate(commands):
        assert f"--nproc-per-node 1 --nnodes 2 --node-rank {node} " in command
        assert "--rdzv-endpoint 10.0.0.1:29500" in command


def test_bad_out_folder_is_one_line_error(tmp_path: Path, capsys) -> None:
    assert cli.main(["run", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pipecc: error: ") and len(err.strip().splitlines()) == 1
    assert cli.main(["run", str(tmp_path)]) == 1  # a folder, but not a compiled one
    err = capsys.readouterr().err
    assert "not a compiled folder" in err and "pipecc compile" in err and len(err.strip().splitlines()) == 1


def test_process_counts_must_fit_the_pipeline(mlp_out: Path, capsys) -> None:
    argv = ["run", str(mlp_out), "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1234",
            "--nproc-per-node", "2"]
    assert cli.main(argv) == 2
    assert "needs 2 processes" in capsys.readouterr().err
    assert cli.main(["run", str(mlp_out), "--nnodes", "2", "--node-rank", "0"]) == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err


def test_one_process_verify_and_tied_weights(gpt_out: Path, monkeypatch, capsys) -> None:
    """Both stages in this process (interleaved): the tied weight's two copies get the summed gradient."""
    monkeypatch.delenv("RANK", raising=False)
    argv = [str(gpt_out), "--schedule", "interleaved", "--steps", "1", "--verify"]
    assert dist.main(argv) == 0
    assert "verify: outputs, loss and" in capsys.readouterr().out
    monkeypatch.setattr(dist._TiedGradients, "reduce", lambda self: None)
    tied = "tied" in (gpt_out / "stage_0" / "ports.json").read_text() and \
        '"tied": []' not in (gpt_out / "stage_0" / "ports.json").read_text()
    if tied:  # without the sum the copies' gradients are partial: verify must say so
        assert dist.main(argv) == 1
        assert "gradient of wte.weight differs" in capsys.readouterr().err
