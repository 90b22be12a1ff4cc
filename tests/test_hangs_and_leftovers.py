"""Hangs, exits and leftovers (issue 33): `--timeout` holds when every rank hangs in model code;
a thread the model starts and never ends does not keep `pipecc` alive after its work; a killed
run's torchrun log folder is removed by the next run; a checkpoint's latest.json linked to
/dev/zero and a compiled folder's pipecc.json as a FIFO are refused, not read for ever."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import PIPECC, ROOT, run_cli
from pipecc import cli
from pipecc.runtime import leftovers

pytestmark = pytest.mark.xdist_group(name="hangs")

HANGS_IN_RANKS = '''
import os, time, torch
from torch import nn
def build_model(**_):
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
def example_inputs(batch_size=1, **_):
    if os.environ.get("RANK") is not None:  # every rank of `pipecc run`; not the compile
        while True:
            time.sleep(0.05)
    return (torch.randn(batch_size, 4),)
'''

ENDLESS_THREAD = '''
import threading, time, torch
from torch import nn
threading.Thread(target=lambda: [time.sleep(0.05) for _ in iter(int, 1)]).start()
def build_model(**_):
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
def example_inputs(batch_size=1, **_):
    return (torch.randn(batch_size, 4),)
'''


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_timeout_holds_when_every_rank_hangs_in_model_code(tmp_path, capsys):
    model = tmp_path / "m.py"
    model.write_text(HANGS_IN_RANKS)
    out = tmp_path / "out"
    assert cli.main(["compile", str(model), "-b", "4", "-d", "cpu,cpu", "--replicas", "1", "-o", str(out), "-q"]) == 0
    result = subprocess.run([*PIPECC, "run", str(out), "--steps", "1", "--timeout", "4"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=300)  # a guard: the run must end by itself
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "example_inputs in m.py did not return within 4 s (--timeout)" in lines[0], lines


def test_a_thread_the_model_never_ends_does_not_keep_pipecc_alive(tmp_path):
    model = tmp_path / "m.py"
    model.write_text(ENDLESS_THREAD)
    result = subprocess.run([*PIPECC, "plan", str(model), "-b", "4", "-d", "cpu,cpu"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=300)  # a guard: it must exit by itself
    assert result.returncode == 0, result.stderr[-2000:]
    assert "stage" in result.stdout


def test_a_killed_runs_log_folder_is_removed_by_the_next(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = Path(tempfile.mkdtemp(prefix=f"{leftovers.PREFIX}{dead.pid}-", dir=tmp_path))
    (gone / "error.json").write_text("{}")
    live = Path(tempfile.mkdtemp(prefix=f"{leftovers.PREFIX}{os.getpid()}-", dir=tmp_path))
    other = tmp_path / "pipecc-torchrun-notapid"
    other.mkdir()
    assert leftovers.clean_stale(str(tmp_path)) == [gone.name]
    assert not gone.exists() and live.is_dir() and other.is_dir()


def test_latest_json_linked_to_dev_zero_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest.json").symlink_to("/dev/zero")
    code, out, err = run_cli(["export-checkpoint", str(ckpt), str(tmp_path / "m.safetensors")], capsys)
    assert code == 1 and err.count("\n") == 1 and "is not a regular file" in err, err


def test_pipecc_json_as_a_fifo_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "pipecc.json")
    for argv in (["run", str(out), "--steps", "1"], ["inspect", str(out)]):
        code, _, err = run_cli(argv, capsys)
        assert code == 1 and err.count("\n") == 1 and err.startswith("pipecc: error: "), err


def test_a_profile_fit_of_1e308_is_refused_not_searched_for_minutes(tmp_path, capsys):
    import json
    model = ROOT / "models" / "mlp.py"
    prof = tmp_path / "prof.json"
    assert cli.main(["profile", str(model), "-b", "4", "-d", "cpu", "--repeat", "1", "--warmup", "0", "--no-link",
                     "--no-cache", "--no-fixed-costs", "-o", str(prof), "--json"]) == 0
    data = json.loads(prof.read_text())
    data["targets"][0]["nodes"][0]["fit"]["fwd"]["a"] = 1e308
    prof.write_text(json.dumps(data))
    capsys.readouterr()
    code, out, err = run_cli(["plan", str(model), "-b", "4", "-d", "cpu", "--profile", str(prof)], capsys)
    assert code == 1 and err.count("\n") == 1 and "has a fit of 1e+308 s, beyond any measurement" in err, err


def test_kill_9_of_pipecc_run_takes_the_agent_and_ranks_with_it(tmp_path):
    """`pipecc run` killed with SIGKILL runs no cleanup: its torchrun agent dies with it (the
    kernel's parent-death signal) and the ranks follow (their lifeline); nothing keeps running."""
    import signal
    import time
    model = tmp_path / "m.py"
    model.write_text(HANGS_IN_RANKS)
    out = tmp_path / "out"
    assert cli.main(["compile", str(model), "-b", "4", "-d", "cpu,cpu", "--replicas", "1", "-o", str(out), "-q"]) == 0
    run = subprocess.Popen([*PIPECC, "run", str(out), "--steps", "1", "--timeout", "120"], cwd=ROOT, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = str(out / "run_stage.py")

    def ranks_and_agent() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and int(pid) != run.pid:
                found.append(int(pid))
        return found
    for _ in range(600):  # until the agent and its ranks run (a guard, not a timing assertion)
        if len(ranks_and_agent()) >= 2:
            break
        time.sleep(0.1)
    assert len(ranks_and_agent()) >= 2  # the agent and its rank(s)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    for _ in range(600):
        if not ranks_and_agent():
            break
        time.sleep(0.1)
    assert ranks_and_agent() == []
