"""`pipecc run` on bad inputs (issue #14): every case ends with exactly one `pipecc: error: ...`
line (exit 1, 2 for usage) and no traceback, or runs correctly.

One table, three ways through it: `pipecc run` in process (the checks made before torchrun
starts: nothing is launched), the worker itself (`pipecc.runtime.dist.main` with every stage in
this process, as torchrun started by hand would run it: the same damage must still be one line
per rank), and one real launch for what only a worker can find (a stage.py that fails to import).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import PIPECC, ROOT, compile_mlp, copy_folder, rehash
from pipecc import cli
from pipecc.runtime import dist
from pipecc.runtime.trust import HASH_KEY, file_sha256

pytestmark = pytest.mark.xdist_group(name="bad_inputs_run")


@pytest.fixture(scope="module")
def mlp_out(mlp_folder: Path, tmp_path_factory) -> Path:
    """The shared tiny MLP folder (tests/conftest.py), a copy."""
    return copy_folder(mlp_folder, tmp_path_factory.mktemp("bad_run") / "mlp")


# ---------------------------------------------------------------------------- damage


def _marker(out: Path, **changes) -> None:
    marker = json.loads((out / "pipecc.json").read_text())
    for key, value in changes.items():
        if value is None:
            marker.pop(key, None)
        else:
            marker[key] = value
    (out / "pipecc.json").write_text(json.dumps(marker))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path: Path) -> None:
    path.write_bytes(b"\xff" * 8 + path.read_bytes()[8:])


def _tamper_shape(path: Path) -> None:
    spec = json.loads(path.read_text())
    spec["receives"][0]["shape"] = [7, *spec["receives"][0]["shape"]]
    path.write_text(json.dumps(spec))


def _plant(out: Path) -> None:
    """pipecc.json's model_path edited to name another file, which must never run."""
    planted = out / "planted.py"
    planted.write_text((ROOT / "models" / "mlp.py").read_text() +
                       f"\nopen({str(out / 'PLANTED_RAN')!r}, 'w').write('ran')\n")
    _marker(out, model_path=str(planted))


@dataclass(frozen=True)
class Case:
    name: str
    damage: Callable[[Path], None]
    argv: tuple[str, ...]
    code: int
    message: str  # regex the one error line must match (after "pipecc: error: ")
    worker: bool = True  # the worker (dist.main) must give one line for it too


CASES = [
    Case("weights missing", lambda o: (o / "stage_1" / "weights.safetensors").unlink(), (), 1,
         r"stage_1/weights.safetensors is missing; compile the folder again"),
    Case("weights truncated", lambda o: _truncate(o / "stage_1" / "weights.safetensors"), (), 1,
         r"stage_1/weights.safetensors is not a readable safetensors file \(.*\): it is corrupt or truncated"),
    Case("weights corrupt", lambda o: _garble(o / "stage_0" / "weights.safetensors"), (), 1,
         r"stage_0/weights.safetensors is not a readable safetensors file"),
    Case("ports.json not JSON", lambda o: (o / "stage_1" / "ports.json").write_text("{"), (), 1,
         r"stage_1/ports.json is not valid JSON .*; compile the folder again"),
    Case("ports.json not a spec", lambda o: (o / "stage_0" / "ports.json").write_text("[1]"), (), 1,
         r"stage_0/ports.json is not a valid port spec"),
    Case("ports.json tampered", lambda o: _tamper_shape(o / "stage_1" / "ports.json"), (), 1,
         r"stage_1/ports.json does not fit .*stage_0/ports.json \(stage 1 receives .*\): one was changed"),
    Case("more micro-batches than the batch", lambda o: None, ("-m", "1000"), 2,
         r"--microbatches 1000 is more than the batch of 8 rows .*; give --microbatches 8 or fewer"),
    Case("model hash not recorded", lambda o: _marker(o, **{HASH_KEY: None}), (), 1,
         r"pipecc.json records no model_sha256 for the model file .*mlp.py .* so pipecc will not import "
         r"that file: compile again"),
    Case("model_path edited to a planted file", _plant, (), 1,
         r"the model file .*planted.py is not the one this folder was compiled from .* will not import it"),
    Case("verify without the model file", lambda o: _marker(o, model_path=str(o / "gone.py")), ("--verify",), 1,
         r"cannot verify: the model file .*gone.py is missing.* give --verify-stages-only"),
    Case("--resume without --checkpoint-dir", lambda o: None, ("--resume",), 2,
         r"--resume needs --checkpoint-dir DIR"),
    Case("--resume with an empty --checkpoint-dir", lambda o: (o / "ckpt").mkdir(),
         ("--checkpoint-dir", "{out}/ckpt", "--resume"), 1, r"--resume: .*ckpt holds no checkpoint"),
    # the two stage.py rows re-record the folder's hashes: an edit alone is refused by hash (test_trust)
    Case("stage.py fails to import", lambda o: ((o / "stage_0" / "stage.py").write_text("import no_such_module\n"),
                                                rehash(o)),
         (), 1, r"stage_0/stage.py fails to import \(ModuleNotFoundError: No module named 'no_such_module'\)"),
    Case("stage.py raises in forward", lambda o: _raise_in_forward(o / "stage_1" / "stage.py"), (), 1,
         r"ValueError: planted \(rerun with --debug for the traceback\)"),
]
def _swap_ports(out: Path) -> None:
    a, b = out / "stage_0" / "ports.json", out / "stage_1" / "ports.json"
    text = a.read_text()
    a.write_text(b.read_text())
    b.write_text(text)


def _plan(out: Path, **changes) -> None:
    plan = json.loads((out / "plan.json").read_text())
    plan.update(changes)
    (out / "plan.json").write_text(json.dumps(plan, indent=1))


def _deep_plan(out: Path) -> None:
    (out / "plan.json").write_text("[" * 100000 + "]" * 100000)


# issue #22 item 7: edited pipecc.json fields and swapped ports.json, refused before any rank runs
CASES += [
    Case("pipecc.json num_stages a string", lambda o: _marker(o, num_stages="2"), (), 1,
         r"pipecc.json: num_stages is '2', not a positive whole number; it was edited"),
    Case("pipecc.json batch_size a word", lambda o: _marker(o, batch_size="eight"), (), 1,
         r"pipecc.json: batch_size is 'eight', not a positive whole number"),
    Case("pipecc.json batch_size 0", lambda o: _marker(o, batch_size=0), (), 1,
         r"batch_size is 0, not a positive whole number"),
    Case("pipecc.json micro-batches not dividing the batch", lambda o: _marker(o, microbatches=3), (), 1,
         r"pipecc.json: microbatches 3 does not divide batch_size 8"),
    Case("pipecc.json replicas it was not compiled with", lambda o: _marker(o, replicas=2), (), 1,
         r"replicas is 2, but the folder was compiled with 1 \(plan.json\)"),
    # issue 32: pipecc.json's micro-batch count is the fact; plan.json's copy must agree
    Case("plan.json micro-batches edited", lambda o: _plan(o, microbatches=8), (), 1,
         r"pipecc.json: microbatches is \d+, but the folder was compiled with 8 \(plan.json\); it was edited"),
    Case("pipecc.json devices []", lambda o: _marker(o, devices=[]), (), 1,
         r"devices is \[\], not the list of the plan's devices"),
    Case("pipecc.json version 99", lambda o: _marker(o, version=99), (), 1,
         r"pipecc.json is format version 99, this pipecc reads version 1"),
    Case("ports.json stage indices swapped", _swap_ports, (), 1,
         r"stage_0/ports.json: it says stage 1 but is stage_0's; compile the folder again"),
    # the worker reads plan.json for predictions only (none then); `pipecc run` refuses it
    Case("plan.json nested 100000 deep", _deep_plan, (), 1, r"plan.json nests too deeply to read", worker=False),
    # issue 33: run_stage.py started by hand ran a folder whose pipecc.json was deleted (no hashes checked)
    Case("pipecc.json missing", lambda o: (o / "pipecc.json").unlink(), (), 1,
         r"is not a (compiled folder|folder written by `pipecc compile`) \(no pipecc.json\)"),
]
# issue #34: the training options (train_data's own rows: tests/test_train_script.py)
CASES += [
    Case("--steps with --epochs", lambda o: None, ("--epochs", "2"), 2, r"give --steps N or --epochs E, not both",
         worker=False),
    Case("--epochs 0", lambda o: None, ("--epochs", "0"), 2, r"--epochs must be >= 1, got 0|--epochs.*0"),
    Case("--eval-every 0", lambda o: None, ("--eval-every", "0"), 2, r"--eval-every.*0"),
    Case("--clip-grad-norm -1", lambda o: None, ("--clip-grad-norm", "-1"), 2, r"--clip-grad-norm.*-1"),
    Case("--precision with --verify", lambda o: None, ("--precision", "bf16", "--verify"), 2,
         r"--verify compares float32 runs; run it without --precision bf16 first"),
]
PREFLIGHT = [c for c in CASES if not c.name.startswith("stage.py")]  # found before torchrun starts


def _raise_in_forward(path: Path) -> None:
    text, n = re.subn(r"(def forward\(self[^\n]*\n)", r"\1        raise ValueError('planted')\n", path.read_text())
    assert n == 1
    path.write_text(text)
    rehash(path.parent.parent)


def damaged(mlp_out: Path, tmp_path: Path, case: Case) -> tuple[Path, list[str]]:
    out = tmp_path / "out"
    shutil.copytree(mlp_out, out)
    case.damage(out)
    return out, [a.replace("{out}", str(out)) for a in case.argv]


def one_error_line(err: str, case: Case) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipecc: error: "), err[-3000:]
    assert re.search(case.message, lines[0]), lines[0]
    assert "Traceback" not in err


# ---------------------------------------------------------------------------- the table


@pytest.mark.parametrize("case", PREFLIGHT, ids=[c.name for c in PREFLIGHT])
def test_run_refuses_before_launching(mlp_out: Path, tmp_path: Path, case: Case, capsys) -> None:
    out, argv = damaged(mlp_out, tmp_path, case)
    assert cli.main(["run", str(out), "--steps", "1", *argv]) == case.code
    captured = capsys.readouterr()
    one_error_line(captured.err, case)
    assert captured.out == ""  # nothing was started
    assert not (out / "PLANTED_RAN").exists()


@pytest.mark.parametrize("case", [c for c in CASES if c.worker], ids=[c.name for c in CASES if c.worker])
def test_worker_gives_one_line(mlp_out: Path, tmp_path: Path, case: Case, monkeypatch, capsys) -> None:
    """torchrun started by hand skips `pipecc run`'s checks: the worker must still give one line."""
    monkeypatch.delenv("RANK", raising=False)
    out, argv = damaged(mlp_out, tmp_path, case)
    argv = [a if a != "-m" else "--microbatches" for a in argv]
    assert dist.main([str(out), "--steps", "1", "--schedule", "interleaved", *argv]) == case.code
    one_error_line(capsys.readouterr().err, case)
    assert not (out / "PLANTED_RAN").exists()


def test_worker_debug_shows_the_traceback(mlp_out: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    out, _ = damaged(mlp_out, tmp_path, next(c for c in CASES if c.name == "stage.py raises in forward"))
    with pytest.raises(ValueError, match="planted"):
        dist.main([str(out), "--steps", "1", "--schedule", "interleaved", "--debug"])


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_launch_with_a_broken_stage_is_one_line(mlp_out: Path, tmp_path: Path) -> None:
    """A real launch: rank 0 cannot import its stage.py; rank 1 waits for it. One line, no traceback."""
    case = next(c for c in CASES if c.name == "stage.py fails to import")
    out, _ = damaged(mlp_out, tmp_path, case)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([*PIPECC, "run", str(out), "--steps", "1", "--timeout", "20"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    one_error_line(result.stderr, Case(case.name, case.damage, (), 1, r"^pipecc: error: run failed: rank 0: \S*" +
                                       case.message))


def test_verify_stages_only_needs_no_model_file(mlp_out: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "out"
    shutil.copytree(mlp_out, out)
    _marker(out, model_path=str(out / "gone.py"))
    monkeypatch.delenv("RANK", raising=False)
    assert dist.main([str(out), "--steps", "1", "--schedule", "interleaved", "--verify-stages-only"]) == 0
    captured = capsys.readouterr()
    assert "verify: pipeline outputs match the chained stages" in captured.out
    assert "the model file" in captured.out and "gone.py is missing" in captured.out  # the note on the data


def test_compile_records_the_model_hash(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_mlp(out, microbatches=None)
    marker = json.loads((out / "pipecc.json").read_text())
    assert marker.get(HASH_KEY) == file_sha256(ROOT / "models" / "mlp.py")


def test_help_says_a_folder_is_code(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "A compiled folder is code, like a pickle" in text and "Only run folders you trust" in text
    assert "--verify-stages-only" in text and "--checkpoint-dir" in text and "--resume" in text


def test_a_peers_socket_log_is_held_back(capsys) -> None:
    """torch's C++ "Connection closed by peer" log from the rank left waiting is a consequence of
    another rank's failure: held back (shown with --verbose), so the run still ends in one line."""
    from pipecc.runtime.launcher import _Watch
    gloo = ("[E1201 15:19:06.208584802 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with "
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:20175. This is typically caused by a remote worker crashing.\n")
    watch = _Watch(verbose=False)
    watch.line(gloo)
    watch.line("pipecc: error: rank 0: stage_0/stage.py fails to import\n")
    watch.line("an ordinary worker line\n")
    err = capsys.readouterr().err
    assert "Connection closed" not in err and "an ordinary worker line" in err
    assert watch.held == [gloo] and watch.errors == ["rank 0: stage_0/stage.py fails to import"]
    loud = _Watch(verbose=True)
    loud.line(gloo)
    assert "Connection closed by peer" in capsys.readouterr().err


COMPLEX = """import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(4, 8, dtype=torch.complex64), nn.Linear(8, 3, dtype=torch.complex64))


def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 4, dtype=torch.complex64),)


def example_target(batch_size=1):
    return torch.zeros(batch_size, 3)


def loss_fn(outputs, target):
    return (outputs.abs() - target).pow(2).mean()
"""


def test_a_complex_model_trains_every_stage(tmp_path: Path, monkeypatch, capsys) -> None:
    """Issue #24 item 2: a gradient crosses a cut for complex tensors too, so stage 0 trains;
    --verify compares both parts of every complex gradient with the single-process run."""
    (tmp_path / "model.py").write_text(COMPLEX)
    out = tmp_path / "out"
    assert cli.main(["compile", str(tmp_path / "model.py"), "-d", "cpu,cpu", "--replicas", "1", "--use-all-devices", "-b", "4",
                     "-m", "2", "-o", str(out), "-q"]) == 0
    monkeypatch.delenv("RANK", raising=False)
    assert dist.main([str(out), "--steps", "1", "--schedule", "interleaved", "--verify"]) == 0
    captured = capsys.readouterr()
    assert "verify: outputs, loss and 4 gradients match" in captured.out, captured
    assert "discards the imaginary part" not in captured.err


HALF = """import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(torch.{dtype})


def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 4).to(torch.{dtype}),)
"""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_models_train_on_the_cpu(dtype: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """Issue #22 item 7: float16 and bfloat16 models on CPUs compile, train and verify (with the
    dtype's tolerance), rather than failing in a rank."""
    (tmp_path / "model.py").write_text(HALF.format(dtype=dtype))
    out = tmp_path / "out"
    assert cli.main(["compile", str(tmp_path / "model.py"), "-d", "cpu,cpu", "--replicas", "1", "--use-all-devices", "-b", "4",
                     "-m", "2", "-o", str(out), "-q"]) == 0
    monkeypatch.delenv("RANK", raising=False)
    assert dist.main([str(out), "--steps", "2", "--schedule", "interleaved", "--verify"]) == 0
    assert "verify: outputs, loss and 4 gradients match" in capsys.readouterr().out


def test_a_checkpoint_with_a_field_removed_is_one_line(mlp_out: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """Issue #24 item 8: a corrupt checkpoint (here: "world" removed and the sha256 written
    again, as a hand edit would) gave a raw `KeyError: 'world'`; now one line naming it."""
    import hashlib
    monkeypatch.delenv("RANK", raising=False)
    ckpt = tmp_path / "ckpt"
    base = [str(mlp_out), "--schedule", "interleaved", "--checkpoint-dir", str(ckpt)]
    assert dist.main([*base, "--steps", "1"]) == 0
    step = json.loads((ckpt / "latest.json").read_text())["step"]
    folder = ckpt / f"step_{step}"
    meta = json.loads((folder / "stage_0.json").read_text())
    del meta["world"]
    (folder / "stage_0.json").write_text(json.dumps(meta))
    sums = json.loads((folder / "stage_0.sha256").read_text())
    sums["stage_0.json"] = hashlib.sha256((folder / "stage_0.json").read_bytes()).hexdigest()
    (folder / "stage_0.sha256").write_text(json.dumps(sums))
    capsys.readouterr()
    assert dist.main([*base, "--steps", "2", "--resume"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be loaded (KeyError: 'world')" in err[0] and "Traceback" not in err[0], err


def test_two_ranks_glued_error_lines_are_told_apart() -> None:
    """Issue #24 item 8: two ranks' lines once arrived as one; each error is its own."""
    from pipecc.runtime.launcher import _Watch
    watch = _Watch(verbose=False)
    watch.line("pipecc: error: rank 0: timed out after 5 s waiting for RECV_F mb 0 from rank 1"
               "pipecc: error: rank 1: ValueError: planted\n")
    assert watch.errors == ["rank 0: timed out after 5 s waiting for RECV_F mb 0 from rank 1",
                            "rank 1: ValueError: planted"]


# ---------------------------------------------------------------------------- time limits (#22 item 5, #24 item 6)
# NOTE: no wall-clock asserts: each test proves the run ended, by the mechanism's own line, and
# left no process; the communicate() limits are hang guards far above the normal figures.
HANG_GUARD_S = 240


def _launch(*argv: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([*PIPECC, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
@pytest.mark.parametrize("steps", ["1000000", "2"])
def test_a_stopped_agent_ends_the_run_and_leaves_nothing(mlp_out: Path, steps: str) -> None:
    """SIGSTOP on the torchrun agent: it reaps and reports nothing. While its workers train (a
    million steps) the run ends after --timeout; once they ended (2 steps), at once. Nothing is
    left running either way."""
    import signal
    import time
    from pipecc.runtime.launcher import ProcessTree
    proc = _launch("run", str(mlp_out), "--steps", steps, "--timeout", "5")
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 0"):
            break
    tree = ProcessTree(proc.pid)
    tree.refresh()
    # pipecc's only child, started before the workers: the earliest start (pids wrap, so not the smallest pid)
    agent = min(tree.known, key=lambda pid: int(tree.known[pid]))
    os.kill(agent, signal.SIGSTOP)
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    done = "while its workers ran" if steps != "2" else "after its workers ended"
    assert proc.returncode == 1 and err.strip().splitlines() == [
        f"pipecc: error: run failed: the torchrun agent (pid {agent}) was stopped (SIGSTOP) {done}; every "
        "process of the run was stopped"], err[-3000:]
    deadline = time.monotonic() + 30
    while tree.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tree.alive() == []


@pytest.mark.slow  # a torchrun launch
def test_a_missing_node_ends_the_run_in_one_line(mlp_out: Path) -> None:
    """`--nnodes 2` with the second node never started: torchrun waited 600+ s and printed its
    DistStoreError traceback; now --timeout bounds the rendezvous and the line says what to do."""
    from helpers import free_port
    endpoint = f"127.0.0.1:{free_port()}"
    proc = _launch("run", str(mlp_out), "--steps", "1", "--timeout", "5", "--nnodes", "2", "--node-rank", "0",
                   "--rdzv-endpoint", endpoint, "--nproc-per-node", "1")
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("pipecc: error: run failed: ") and "within 5 s" in lines[0], lines[0]
    assert f"--nnodes 2 --node-rank R --rdzv-endpoint {endpoint}` on every other node" in lines[0]


def test_a_send_that_times_out_names_the_rank_it_waited_for() -> None:
    """Issue #24 item 6: "rank 2: timed out ... waiting for SEND_B mb 3 to rank 1" was reported
    as the cause when rank 1 hung; a send that times out points at its receiver like a receive
    points at its sender."""
    from pipecc.runtime.launcher import root_cause
    errors = ["rank 2: timed out after 3.0 s waiting for SEND_B mb 3 to rank 1",
              "rank 0: timed out after 3.0 s waiting for RECV_B mb 0 from rank 1"]
    assert root_cause(errors) == "rank 1 hung: rank 2 timed out after 3.0 s waiting for SEND_B mb 3 to it"
    chained = ["rank 3: timed out after 3.0 s waiting for RECV_F mb 0 from rank 2",
               "rank 2: timed out after 3.0 s waiting for SEND_B mb 3 to rank 1"]
    assert root_cause(chained).startswith("rank 1 hung: rank 2 timed out")


def test_a_stopped_process_and_the_agent_get_sigkill_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #24 item 6: with --timeout 3 a hung run ended 1.7-2.3 s late. Two of the causes:
    SIGTERM to a stopped rank (it cannot act on it) and to the torchrun agent (it stops its
    workers itself and tears torch down) each waited out the grace period. Both get SIGKILL in
    the first round now; a running worker still gets SIGTERM first."""
    import signal
    import sys
    import time
    from pipecc.runtime import launcher
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while launcher._stat(stopped.pid)[1] not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.02)
        tree = launcher.ProcessTree(agent.pid)
        tree.known = {p.pid: launcher._stat(p.pid)[2] for p in (stopped, running)}
        monkeypatch.setattr(tree, "refresh", lambda: None)
        sent: list[tuple[int, int]] = []
        real_kill = launcher._kill
        monkeypatch.setattr(launcher, "_kill", lambda pid, sig: (sent.append((pid, sig)), real_kill(pid, sig)))
        # they are this test's children, not the tree's: reap them as they die
        monkeypatch.setattr(tree, "alive", lambda: [q.pid for q in (stopped, running) if q.poll() is None])
        tree.stop(agent)
        first = {pid: sig for pid, sig in sent[:3]}
        assert first == {stopped.pid: signal.SIGKILL, running.pid: signal.SIGTERM, agent.pid: signal.SIGKILL}, sent
        assert agent.returncode == -signal.SIGKILL and stopped.wait() == -signal.SIGKILL
        assert running.wait() == -signal.SIGTERM
    finally:
        for p in (agent, stopped, running):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_pipecc_run_as_a_program_exits_without_finalising(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue #24 item 6: tearing torch down at exit took 0.3-2.8 s (quiet / loaded machine) after a
    run had already failed; `pipecc run` as a program ends with os._exit once its output is
    flushed. Another command, or main() called in-process with its argv, returns as before."""
    import sys
    from pipecc.cli import app
    codes: list[int] = []

    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited
    monkeypatch.setattr(app.os, "_exit", fake_exit)
    monkeypatch.setattr(sys, "argv", ["pipecc", "run", str(tmp_path / "nothing")])
    with pytest.raises(Exited):
        app.main()
    assert codes == [1]
    assert app.main(["run", str(tmp_path / "nothing")]) == 1 and codes == [1]
    monkeypatch.setattr(sys, "argv", ["pipecc", "inspect", str(tmp_path / "nothing")])
    assert app.main() == 1 and codes == [1]


def test_a_hung_rank_that_saw_the_agent_go_is_still_the_one_named() -> None:
    """The agent is killed at once when a run is stopped, so a hung rank's lifeline thread may
    still print that the agent is gone: that line is the stop's, and rank 1 is still the one
    that hung (test_run_cmd's hung-rank launch saw it)."""
    from pipecc.runtime.launcher import root_cause
    errors = ["rank 0: timed out after 6.0 s waiting for RECV_B mb 0 from rank 1",
              "rank 1: the torchrun agent (pid 4242) is gone; stopping"]
    assert root_cause(errors) == "rank 1 hung: rank 0 timed out after 6.0 s waiting for RECV_B mb 0 from it"
