"""Hangs, exits and leftovers (issue 33): `--timeout` holds when every rank hangs in model code;
a thread the model starts and never ends does not keep `pipecc` alive after its work; a killed
run's torchrun log folder is removed by the next run; a checkpoint's latest.json linked to
/dev/zero and a compiled folder's pipecc.json as a FIFO are refused, not read for ever; a rank that
hangs in its checkpoint save is the one named."""
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


# ---------------------------------------------------------------------------- a hang in a checkpoint save
# Before: rank 1 hung writing its checkpoint, and the run was reported as "rank 0: RuntimeError:
# [...gloo...] Timed out waiting 10000ms for recv operation" (the meeting after the save).

def test_the_meeting_after_a_save_names_the_rank_whose_files_are_missing(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch

    from pipecc.errors import PipeccError
    from pipecc.runtime import checkpoints
    from pipecc.runtime.launcher import root_cause
    target = tmp_path / "step_3"
    target.mkdir()
    (target / "stage_0.sha256").write_text("{}")
    runtime = SimpleNamespace(global_world=2, global_rank=0, device=torch.device("cpu"))
    ckpt = checkpoints.RunCheckpoints(tmp_path, runtime, "f", None)

    def timed_out(*_a, **_k):
        raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                           "waiting 10000ms for recv operation to complete")
    monkeypatch.setattr(checkpoints.dist, "all_reduce", timed_out)
    with pytest.raises(PipeccError) as caught:
        ckpt._agree(0, saved=(target, 3))
    assert str(caught.value) == "rank 0: timed out after 10 s waiting for checkpoint step 3 from rank 1"
    assert root_cause([str(caught.value)]) == \
        "rank 1 hung: rank 0 timed out after 10 s waiting for checkpoint step 3 from it"
    # the hung rank's own line (its save bounded by --timeout) is the one reported when it came
    own = "rank 1: writing checkpoint step 3 into DIR did not return within 10 s (--timeout): it hangs, or needs " \
          "a larger --timeout"
    assert root_cause([str(caught.value), own]) == own


HANGING_SAVE = '''
import os, sys, time
from pathlib import Path
from types import SimpleNamespace
os.environ["PIPECC_MODEL_CODE_TIMEOUT_S"] = "1"
os.environ["RANK"] = "1"
from pipecc.runtime import checkpoints
def stalled(directory, step):
    time.sleep(3600)
runtime = SimpleNamespace(global_world=2, global_rank=1, save_checkpoint=stalled)
checkpoints.RunCheckpoints(Path(sys.argv[1]), runtime, "f", None).save(1)
'''


def test_a_save_that_hangs_ends_its_rank_in_one_line(tmp_path):
    """A rank of `pipecc run` whose checkpoint save does not return within --timeout writes one
    line naming the save and exits (no torchrun: the rank's side alone)."""
    result = subprocess.run([sys.executable, "-c", HANGING_SAVE, str(tmp_path)], capture_output=True, text=True,
                            env=_env(), timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"pipecc: error: rank 1: writing checkpoint step 1 into {tmp_path / 'step_1'} did not return within 1 s "
        "(--timeout): it hangs, or needs a larger --timeout"]


STALLED_SAVE_SITE = '''
import os
if os.environ.get("RANK") == "1":  # rank 1 of the run: its checkpoint save never returns (a stalled disk)
    import time
    from pipecc.runtime import rank_checkpoint
    def stalled(*_a, **_k):
        while True:
            time.sleep(0.05)
    rank_checkpoint.save_checkpoint = stalled
'''


@pytest.mark.slow  # a torchrun launch
def test_a_rank_hanging_in_its_final_save_is_the_one_named(mlp_copy, tmp_path):
    out = mlp_copy  # tests/conftest.py: the shared tiny MLP folder, a copy
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STALLED_SAVE_SITE)
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([*PIPECC, "run", str(out), "--steps", "1", "--checkpoint-dir", str(tmp_path / "ck"),
                             "--timeout", "8"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("pipecc: error: run failed: rank 1") and "checkpoint step 1" in lines[0], lines[0]
    assert "Timed out waiting" not in lines[0]
