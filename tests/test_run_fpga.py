"""`pipecc run OUT` on inference-only folders: a mixed cpu,u250,cpu MLP whose FPGA stage runs
through its C simulation (a shared library built with g++) inside the torchrun pipeline, and a
CPU-only folder compiled with --inference. Both run forward passes only (`step i: forward only,
Y samples/s`); --verify compares the outputs with the original model's forward.

Two torchrun launches (the mixed MLP with --verify, the tiny CPU MLP); everything else runs in
process. The mixed model is tests/test_fpga_pipeline.py's: in=64, hidden=256, depth=6, batch 2,
where the cost model puts a Linear(256, 256) + ReLU on the u250.
"""
from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import pytest

from helpers import MLP_TINY, ROOT, rehash
from helpers import pipecc_here as pipecc  # in this process: only torchrun and its ranks start
from pipecc import cli
from pipecc.backends.fpga import toolchain_problem
from pipecc.runtime import dist

pytestmark = pytest.mark.xdist_group(name="run_fpga")
PROBLEM = toolchain_problem()
needs_gxx = pytest.mark.skipif(PROBLEM is not None, reason=f"FPGA C simulation: {PROBLEM}")

KW = dict(in_features=64, hidden=256, depth=6)
TINY = dict(MLP_TINY)
STEP = re.compile(r"^step (\d+): forward only, (\S+) samples/s$", re.MULTILINE)
VERIFIED = "verify: outputs match the single-process run (forward only)"


def compile_mlp(out: Path, devices: str, kw: dict, batch: int) -> Path:
    argv = ["compile", str(ROOT / "models" / "mlp.py"), "-b", str(batch), "--inference", "--devices", devices,
            "--replicas", "1", "--use-all-devices", "-o", str(out), "-q", *[f"--model-arg={k}={v}" for k, v in kw.items()]]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def mixed_out(tmp_path_factory) -> Path:
    out = compile_mlp(tmp_path_factory.mktemp("run_fpga") / "mixed", "cpu,u250,cpu", KW, 2)
    marker = json.loads((out / "pipecc.json").read_text())
    assert marker["inference_only"] is True and list(marker["fpga_stages"]) == ["1"]
    return out


@pytest.fixture(scope="module")
def cpu_out(tmp_path_factory) -> Path:
    return compile_mlp(tmp_path_factory.mktemp("run_fpga") / "cpu", "2xcpu", TINY, 4)


# ---------------------------------------------------------------------------- launches


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
@needs_gxx
def test_mixed_fpga_pipeline_runs_and_verifies(mixed_out: Path) -> None:
    result = pipecc("run", str(mixed_out), "--steps", "2", "--verify")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "inference-only pipeline (FPGA stages: [1]): running forward passes" in result.stdout
    assert re.search(f"^{re.escape(VERIFIED)}$", result.stdout, re.MULTILINE), result.stdout
    steps = STEP.findall(result.stdout)
    assert [int(i) for i, _ in steps] == [0, 1], result.stdout
    assert all(float(rate) > 0 for _, rate in steps)
    assert "pipecc: error" not in result.stderr
    assert (mixed_out / "stage_1" / "hls" / "csim_build").is_dir()  # rank 1 ran the C simulation


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_cpu_inference_folder_runs_forward_only(cpu_out: Path) -> None:
    result = pipecc("run", str(cpu_out), "--steps", "2", "--verify", "--timeout", "30")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "inference-only pipeline (compiled with --inference): running forward passes" in result.stdout
    assert VERIFIED in result.stdout
    assert [int(i) for i, _ in STEP.findall(result.stdout)] == [0, 1], result.stdout
    assert "loss" not in result.stdout


# ---------------------------------------------------------------------------- in process


def test_training_options_say_inference_only(mixed_out: Path, cpu_out: Path, capsys) -> None:
    assert cli.main(["run", str(mixed_out), "--optimizer", "adam"]) == 2
    err = capsys.readouterr().err
    assert "is an inference-only pipeline (FPGA stages: [1]" in err and "--optimizer" in err
    assert len(err.strip().splitlines()) == 1
    assert cli.main(["run", str(mixed_out), "--schedule", "1f1b"]) == 2
    err = capsys.readouterr().err
    assert "inference-only" in err and "backward" in err and "--schedule 1f1b" in err
    assert cli.main(["run", str(mixed_out), "--schedule", "zb-h1"]) == 2  # zero-bubble: one line too
    err = capsys.readouterr().err
    assert "inference-only" in err and "--schedule zb-h1" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["run", str(cpu_out), "--lr", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "inference-only pipeline (compiled with --inference)" in err and "--schedule gpipe" in err

    assert cli.main(["run", str(mixed_out), "--steps", "3", "--verify", "--print-command"]) == 0
    command = capsys.readouterr().out.strip()
    assert "--nproc-per-node 3 --standalone" in command and command.endswith("--steps 3 --verify")


def test_one_process_verify_catches_a_planted_bug(cpu_out: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """Without torchrun every stage runs in this process; a stage computing something else fails."""
    monkeypatch.delenv("RANK", raising=False)
    assert dist.main([str(cpu_out), "--steps", "1", "--verify"]) == 0
    out = capsys.readouterr().out
    assert VERIFIED in out and "step 0: forward only" in out
    assert dist.main([str(cpu_out), "--optimizer", "adam"]) == 2
    assert "inference-only" in capsys.readouterr().err

    buggy = tmp_path / "buggy"
    shutil.copytree(cpu_out, buggy)
    last = buggy / "stage_1" / "stage.py"
    source, n = re.subn(r"return \((\w+),\)", r"return (\1 * 1.01,)", last.read_text())
    assert n == 1, "the generated last stage no longer ends in `return (x,)`"
    last.write_text(source)
    rehash(buggy)  # the edit on purpose: re-recorded, so verify (not the folder's hash check) must catch it
    assert dist.main([str(buggy), "--steps", "1", "--verify"]) == 1
    captured = capsys.readouterr()
    assert re.search(r"pipecc: error: verify: rank 0 stage 1 output \S+ differs: ", captured.err), captured.err
    assert "step 0" not in captured.out


@needs_gxx
def test_csim_library_is_rebuilt_unless_this_machine_built_it(mixed_out: Path, tmp_path: Path,
                                                              monkeypatch) -> None:
    """A shipped csim_build/ (another machine's key) or a swapped library is rebuilt, never loaded."""
    csim = importlib.import_module("pipecc.backends.fpga.csim")  # the module; the package's `csim` is a function
    hls = tmp_path / "hls"
    shutil.copytree(mixed_out / "stage_1" / "hls", hls)
    monkeypatch.setenv("PIPECC_CACHE_DIR", str(tmp_path / "machine_a"))
    csim.build(hls)
    assert csim.build(hls).cached  # built here: reused
    monkeypatch.setenv("PIPECC_CACHE_DIR", str(tmp_path / "machine_b"))  # the folder shipped to another machine
    shipped = csim.build(hls)
    assert not shipped.cached
    assert (tmp_path / "machine_b" / "csim-build.key").stat().st_mode & 0o077 == 0  # the key is private
    stamp = (hls / "csim_build" / "stamp").read_text()
    assert stamp == csim._stamp(stamp.split()[0], shipped.exe, shipped.lib)  # what build() checks to reuse
    with open(shipped.lib, "ab") as f:  # the library swapped after the build
        f.write(b"\0")
    assert stamp != csim._stamp(stamp.split()[0], shipped.exe, shipped.lib)  # so build() would rebuild it
