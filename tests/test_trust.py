"""Trust in a compiled folder (issues #22 items 3-4, #24 items 3 and 5): the model file that runs
is exactly the one hashed, checkpoints are checked before they are trusted, and one
``--checkpoint-dir`` serves one run at a time.

Each row fails on the old behaviour: a planted ``__pycache__`` bytecode ran instead of the
hashed source, a swap of ``model.py`` between the hash and the import ran unhashed code,
``inspect --onnx`` imported an edited model file, flipped checkpoint bytes / NaN state / an
edited optimizer class resumed silently, changed run options and ``--steps`` below the
checkpoint's step said nothing, and two runs shared one checkpoint folder. In-process where
that proves the same thing (the worker, ``pipecc.runtime.dist.main``, runs every stage in this
process); one real launch for the ranks torchrun starts.
"""

from __future__ import annotations

import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import MLP_ARGS, PIPECC, ROOT
import pipecc
from pipecc import cli
from pipecc.errors import PipeccError
from pipecc.runtime import dist, modelfuncs, trust
from pipecc.runtime.trust import HASH_KEY, file_sha256

pytestmark = pytest.mark.xdist_group(name="trust")

MARK = "PLANTED_RAN"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """A folder compiled from a copy of models/mlp.py that lives beside it (so it can be edited)."""
    base = tmp_path_factory.mktemp("trust")
    model = base / "src" / "model.py"
    model.parent.mkdir()
    shutil.copy(ROOT / "models" / "mlp.py", model)
    out = base / "out"
    argv = ["compile", str(model), "--devices", "2xcpu", "--replicas", "1", "--use-all-devices", "-o", str(out), "-b", "8", "-m", "2",
            "-q", *[a for arg in MLP_ARGS for a in ("--model-arg", arg)]]
    assert cli.main(argv) == 0
    return base


@pytest.fixture
def folder(compiled: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(OUT, its model.py): a private copy whose pipecc.json names the copied model file."""
    shutil.copytree(compiled / "src", tmp_path / "src")
    out = tmp_path / "out"
    shutil.copytree(compiled / "out", out)
    marker = json.loads((out / "pipecc.json").read_text())
    marker["model_path"] = str(tmp_path / "src" / "model.py")
    (out / "pipecc.json").write_text(json.dumps(marker))
    return out, tmp_path / "src" / "model.py"


def _evil(model: Path) -> str:
    """The real source plus a side effect: a marker file beside the model when it runs."""
    return model.read_text() + f"\nopen({str(model.parent / MARK)!r}, 'w').write('ran')\n"


def plant_pyc(model: Path) -> Path:
    """A ``__pycache__`` bytecode of other source whose header carries model.py's mtime and size:
    CPython's timestamp-based pycs store the source's mtime and size, and the import system runs
    such a pyc instead of the source when both match."""
    other = model.parent / "other_src.py"
    other.write_text(_evil(model))
    cache_tag = sys.implementation.cache_tag
    pyc = model.parent / "__pycache__" / f"{model.stem}.{cache_tag}.pyc"
    py_compile.compile(str(other), cfile=str(pyc), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    other.unlink()
    st = model.stat()
    data = bytearray(pyc.read_bytes())
    data[8:12] = (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
    data[12:16] = (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    pyc.write_bytes(bytes(data))
    return pyc


def _worker(out: Path, *argv: str) -> int:
    return dist.main([str(out), "--steps", "1", "--schedule", "interleaved", *argv])


def one_line(err: str, pattern: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipecc: error: "), err[-3000:]
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------- the model file: hashed bytes run


def test_a_planted_pyc_never_runs_in_the_worker(folder, monkeypatch, capsys) -> None:
    out, model = folder
    plant_pyc(model)
    monkeypatch.delenv("RANK", raising=False)
    assert _worker(out) == 0, capsys.readouterr().err
    assert not (model.parent / MARK).exists()  # the real source ran, not the planted bytecode


def test_a_planted_pyc_never_runs_for_a_stages_model_function(folder, monkeypatch) -> None:
    out, model = folder
    plant_pyc(model)
    monkeypatch.setattr(modelfuncs, "_IMPORTED", {})
    fn = modelfuncs.model_function(out / "stage_0" / "stage.py", "build_model")
    assert callable(fn) and not (model.parent / MARK).exists()


def test_a_planted_pyc_never_runs_under_torchrun(folder) -> None:
    """`pipecc run` (torchrun, one process per rank): the ranks run the verified source."""
    out, model = folder
    plant_pyc(model)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([*PIPECC, "run", str(out), "--steps", "1", "--timeout", "60"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (model.parent / MARK).exists()


class _SwapAfterHash:
    """``hashlib`` for ``pipecc.runtime.trust`` whose digests, once read, swap model.py for other
    code: the file changes between the hash and whatever runs next."""

    def __init__(self, model: Path) -> None:
        import hashlib
        self.model, self.evil, self.real, self.swapped = model, _evil(model), hashlib, False

    def sha256(self, *args):
        digest = self.real.sha256(*args)
        outer = self

        class Spy:
            def update(self, data):
                digest.update(data)

            def hexdigest(self):
                value = digest.hexdigest()
                if not outer.swapped:
                    outer.swapped = True
                    outer.model.write_text(outer.evil)
                return value
        return Spy()


def test_a_swap_after_the_hash_runs_the_hashed_bytes(folder, monkeypatch, capsys) -> None:
    out, model = folder
    swap = _SwapAfterHash(model)
    monkeypatch.setattr(trust, "hashlib", swap)
    monkeypatch.delenv("RANK", raising=False)
    assert _worker(out) == 0, capsys.readouterr().err
    assert swap.swapped and MARK in model.read_text()  # the file was swapped after it was hashed
    assert not (model.parent / MARK).exists()  # ... and the hashed bytes ran, not the swapped ones


def test_a_swap_after_the_hash_runs_the_hashed_bytes_for_a_stage(folder, monkeypatch) -> None:
    out, model = folder
    monkeypatch.setattr(trust, "hashlib", _SwapAfterHash(model))
    monkeypatch.setattr(modelfuncs, "_IMPORTED", {})
    assert callable(modelfuncs.model_function(out / "stage_1" / "stage.py", "example_inputs"))
    assert not (model.parent / MARK).exists()


def test_the_model_source_is_the_bytes_hashed(folder) -> None:
    out, model = folder
    meta = json.loads((out / "pipecc.json").read_text())
    path, source = trust.model_source(meta, out)
    assert path == model and source == model.read_bytes()
    assert meta[HASH_KEY] == file_sha256(model)


def test_inspect_onnx_refuses_an_edited_model_file(folder, tmp_path, capsys) -> None:
    out, model = folder
    model.write_text(_evil(model))
    onnx_dir = tmp_path / "onnx"
    assert cli.main(["inspect", str(out), "--onnx", str(onnx_dir)]) == 1
    one_line(capsys.readouterr().err, r"the model file .*model.py is not the one this folder was compiled from")
    assert not (model.parent / MARK).exists() and not onnx_dir.exists()


# ------------------------------------------------------------------- the folder: stage code and weights by hash


def test_a_planted_stage_pyc_never_runs_and_no_bytecode_is_written(folder, monkeypatch, capsys) -> None:
    """A ``stage_0/__pycache__/stage.*.pyc`` of other code whose header fits stage.py: the
    import system would run it; the loader compiles the checked source from memory instead."""
    out, _ = folder
    pyc = plant_pyc(out / "stage_0" / "stage.py")
    monkeypatch.delenv("RANK", raising=False)
    assert _worker(out, "--verify") == 0, capsys.readouterr().err
    assert not (out / "stage_0" / MARK).exists()  # the reviewed stage.py ran, not the planted bytecode
    assert [p.name for p in pyc.parent.iterdir()] == [pyc.name]  # and nothing was written beside it
    assert not (out / "stage_1" / "__pycache__").exists()


def _flip_weight(out: Path) -> None:
    """One weight set to 6e37 in stage 0's safetensors (a readable file, a wrong value)."""
    from safetensors.torch import load_file, save_file
    path = out / "stage_0" / "weights.safetensors"
    tensors = load_file(str(path))
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name].view(-1)[0] = 6e37
    save_file(tensors, str(path))


def _edit_stage(out: Path) -> None:
    path = out / "stage_1" / "stage.py"
    path.write_text(path.read_text() + f"\nopen({str(out / MARK)!r}, 'w').write('ran')\n")


def _drop_sums(out: Path) -> None:
    marker = json.loads((out / "pipecc.json").read_text())
    marker.pop("sha256")
    (out / "pipecc.json").write_text(json.dumps(marker))


FOLDER_REFUSED = [
    ("a weight flipped to 6e37", _flip_weight, r"stage_0/weights.safetensors is not the file the compile wrote"),
    ("an edited stage.py", _edit_stage, r"stage_1/stage.py is not the file the compile wrote"),
    ("the hashes removed from pipecc.json", _drop_sums, r"records no sha256 of the stage code and weights"),
    ("an empty run_stage.py", lambda out: (out / "run_stage.py").write_text(""),
     r"run_stage.py is not the file the compile wrote"),
]


@pytest.mark.parametrize("case", FOLDER_REFUSED, ids=[c[0] for c in FOLDER_REFUSED])
def test_a_changed_folder_is_refused_by_run_and_load(case, folder, monkeypatch, capsys) -> None:
    _, damage, message = case
    out, _ = folder
    damage(out)
    assert cli.main(["run", str(out), "--steps", "1", "--verify"]) == 1  # before any process starts
    one_line(capsys.readouterr().err, message)
    monkeypatch.delenv("RANK", raising=False)
    assert _worker(out, "--verify") == 1  # the worker started by hand checks alike
    one_line(capsys.readouterr().err, message)
    with pytest.raises(PipeccError, match=message):
        pipecc.load(out)
    assert not (out / MARK).exists()


# ------------------------------------------------------------------- checkpoints: checked on resume

CKPT_STEPS = ("--optimizer", "adam", "--lr", "0.01")


def _saved(out: Path, tmp_path: Path, monkeypatch, capsys) -> Path:
    """A checkpoint folder after 2 Adam steps (checkpoints at steps 1 and 2), written by the worker."""
    monkeypatch.delenv("RANK", raising=False)
    ckpt = tmp_path / "ckpt"
    assert dist.main([str(out), "--steps", "2", "--schedule", "interleaved", "--checkpoint-dir", str(ckpt),
                      "--checkpoint-every", "1", *CKPT_STEPS]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return ckpt


def _resume(out: Path, ckpt: Path, *argv: str, options: tuple[str, ...] = CKPT_STEPS) -> int:
    return dist.main([str(out), "--schedule", "interleaved", "--checkpoint-dir", str(ckpt), "--resume", *options,
                      *(argv or ("--steps", "3"))])


def _rehash(step_dir: Path) -> None:
    """Rewrite stage_0.sha256 to fit edited files: what only the checks after the checksum can catch."""
    sums = {name: file_sha256(step_dir / name) for name in ("stage_0.safetensors", "stage_0.json")}
    (step_dir / "stage_0.sha256").write_text(json.dumps(sums))


def _flip_bytes(ckpt: Path) -> None:
    path = ckpt / "step_2" / "stage_0.safetensors"
    data = bytearray(path.read_bytes())
    data[-100:-36] = bytes(b ^ 0x5A for b in data[-100:-36])  # 64 bytes of tensor data
    path.write_bytes(bytes(data))


def _set_nan(ckpt: Path, prefix: str) -> None:
    from safetensors.torch import load_file, save_file
    path = ckpt / "step_2" / "stage_0.safetensors"
    tensors = load_file(str(path))
    name = next(k for k, v in tensors.items() if k.startswith(prefix) and v.is_floating_point() and v.numel() > 1)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(path))
    _rehash(ckpt / "step_2")


def _edit_optimizer_class(ckpt: Path, rehash: bool) -> None:
    path = ckpt / "step_2" / "stage_0.json"
    meta = json.loads(path.read_text())
    assert meta["optimizer"]["class"] == "Adam"
    meta["optimizer"]["class"] = "SGD"
    path.write_text(json.dumps(meta))
    if rehash:
        _rehash(ckpt / "step_2")


def _mix_steps(ckpt: Path) -> None:
    """step_2 holding step 1's files of rank 0, each with its own (matching) checksum."""
    for suffix in (".safetensors", ".json", ".sha256"):
        shutil.copy(ckpt / "step_1" / f"stage_0{suffix}", ckpt / "step_2" / f"stage_0{suffix}")


def _downgrade(ckpt: Path) -> None:
    """latest.json edited back to the old format, the checksums deleted, a byte flipped."""
    latest = json.loads((ckpt / "latest.json").read_text())
    latest["format"] = "pipecc-run-checkpoint/1"
    latest.pop("run")
    (ckpt / "latest.json").write_text(json.dumps(latest))
    for sums in ckpt.glob("step_*/stage_*.sha256"):
        sums.unlink()
    _flip_bytes(ckpt)


RESUME_REFUSED = [
    ("ranks' files from different steps", _mix_steps, (), r"stage_0.json holds rank 0's state after step 1, not "
     r"rank 0's after step 2: the checkpoint mixes files of different steps"),
    ("downgraded to the old format without checksums", _downgrade, (),
     r"is of the old format pipecc-run-checkpoint/1 \(no checksums\)"),
    ("64 flipped bytes in a stage's tensors", _flip_bytes, (),
     r"--resume: .*step_2/stage_0.safetensors does not match the sha256 written with it"),
    ("NaN optimizer state", lambda c: _set_nan(c, "optim"), (), r"NaN or Inf in the optimizer state"),
    ("NaN weights", lambda c: _set_nan(c, "model."), (), r"NaN or Inf in stage 0's"),
    ("optimizer class edited", lambda c: _edit_optimizer_class(c, rehash=False), (),
     r"stage_0.json does not match the sha256 written with it"),
    ("optimizer class edited, checksum refitted", lambda c: _edit_optimizer_class(c, rehash=True), (),
     r"holds SGD optimizer state, this run's optimizer is Adam"),
    ("checksums removed", lambda c: (c / "step_2" / "stage_0.sha256").unlink(), (),
     r"stage_0.sha256 is missing or unreadable"),
    ("another --optimizer", lambda c: None, ("--steps", "3", "--optimizer", "sgd"),
     r"trained with --optimizer adam, this run asks --optimizer sgd"),
    ("another --seed", lambda c: None, ("--steps", "3", "--seed", "7"),
     r"trained with --seed 0, this run asks --seed 7"),
    ("--steps below the checkpoint's step", lambda c: None, ("--steps", "1"),
     r"is at step 2, already past --steps 1; give --steps 3 or more"),
    ("--steps at the checkpoint's step", lambda c: None, ("--steps", "2"),
     r"already past --steps 2 \(nothing left to train\)"),
]


@pytest.mark.parametrize("case", RESUME_REFUSED, ids=[c[0] for c in RESUME_REFUSED])
def test_a_resume_refuses_what_it_cannot_trust(folder, tmp_path, monkeypatch, capsys, case) -> None:
    _, damage, argv, message = case
    out, _ = folder
    ckpt = _saved(out, tmp_path, monkeypatch, capsys)
    damage(ckpt)
    before = sorted(p.name for p in (ckpt / "step_2").iterdir())
    assert _resume(out, ckpt, *argv) == 1
    one_line(capsys.readouterr().err, message)
    assert sorted(p.name for p in (ckpt / "step_2").iterdir()) == before
    assert not (ckpt / "step_3").exists()


PREFLIGHT_REFUSED = [c for c in RESUME_REFUSED if c[0].startswith(("another", "--steps"))]


@pytest.mark.parametrize("case", PREFLIGHT_REFUSED, ids=[c[0] for c in PREFLIGHT_REFUSED])
def test_pipecc_run_refuses_changed_options_before_launching(folder, tmp_path, monkeypatch, capsys, case) -> None:
    _, _, argv, message = case
    out, _ = folder
    ckpt = _saved(out, tmp_path, monkeypatch, capsys)
    options = dict(zip(CKPT_STEPS[::2], CKPT_STEPS[1::2]))
    options.update(zip(argv[::2], argv[1::2]))
    assert cli.main(["run", str(out), "--checkpoint-dir", str(ckpt), "--resume",
                     *[a for kv in options.items() for a in kv]]) == 1
    captured = capsys.readouterr()
    one_line(captured.err, message)
    assert captured.out == ""  # nothing was launched


@pytest.mark.parametrize("argv, note", [
    (("--lr", "0.5"), r"note: resuming with --lr 0.5; the checkpoint was trained with --lr 0.01"),
    (("--microbatches", "1"), r"note: resuming with --microbatches 1; the checkpoint was trained with "
                              r"--microbatches 2 .*not bit-identical"),
])
def test_a_resume_with_another_lr_or_microbatches_says_so(folder, tmp_path, monkeypatch, capsys, argv, note) -> None:
    out, _ = folder
    ckpt = _saved(out, tmp_path, monkeypatch, capsys)
    options = dict(zip(CKPT_STEPS[::2], CKPT_STEPS[1::2]))
    options.update(zip(argv[::2], argv[1::2]))
    assert _resume(out, ckpt, "--steps", "3", options=tuple(a for kv in options.items() for a in kv)) == 0
    text = capsys.readouterr().out
    assert re.search(note, text), text
    assert "step 2: loss" in text and (ckpt / "step_3").is_dir()
    saved = json.loads((ckpt / "step_3" / "stage_0.json").read_text())["optimizer"]["state"]["param_groups"]
    assert saved[0]["lr"] == (0.5 if argv[0] == "--lr" else 0.01)  # the steps after the resume used it


def test_an_old_format_checkpoint_is_not_exported_either(folder, tmp_path, monkeypatch, capsys) -> None:
    """Before issue 33 an old-format checkpoint loaded unchecked, with a note: a downgraded one too."""
    out, _ = folder
    ckpt = _saved(out, tmp_path, monkeypatch, capsys)
    _downgrade(ckpt)
    assert cli.main(["export-checkpoint", str(ckpt), str(tmp_path / "m.safetensors")]) == 1
    one_line(capsys.readouterr().err, r"is of the old format .*export it with the pipecc that wrote it")
    assert not (tmp_path / "m.safetensors").exists()


def test_checkpoints_record_checksums_and_options(folder, tmp_path, monkeypatch, capsys) -> None:
    out, _ = folder
    ckpt = _saved(out, tmp_path, monkeypatch, capsys)
    latest = json.loads((ckpt / "latest.json").read_text())
    assert latest["run"] == {"optimizer": "adam", "lr": 0.01, "seed": 0, "microbatches": 2}
    sums = json.loads((ckpt / "step_2" / "stage_0.sha256").read_text())
    assert sums == {n: file_sha256(ckpt / "step_2" / n) for n in ("stage_0.safetensors", "stage_0.json")}
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["latest.json", "step_1",
                                                                                     "step_2"]


# ------------------------------------------------------------------- one run per checkpoint folder

HOLD = ("import sys, time; from pipecc.runtime.ckptlock import CheckpointLock; "
        "lock = CheckpointLock.take(sys.argv[1]); print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path/ckpt``'s lock, as a first run would."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(ckpt)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield ckpt, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_run_on_a_locked_checkpoint_dir_is_refused(folder, holder, capsys) -> None:
    out, _ = folder
    ckpt, proc = holder
    lock_text = (ckpt / ".pipecc-run.lock").read_text()
    assert cli.main(["run", str(out), "--steps", "1", "--checkpoint-dir", str(ckpt)]) == 1
    captured = capsys.readouterr()
    one_line(captured.err, rf"--checkpoint-dir .*ckpt is in use by another run \(pid {proc.pid}, `.*`, started .*\)")
    assert captured.out == ""
    assert [p.name for p in ckpt.iterdir()] == [".pipecc-run.lock"]  # nothing written
    assert (ckpt / ".pipecc-run.lock").read_text() == lock_text


def test_deleting_the_lock_file_lets_no_second_run_in(folder, holder, capsys) -> None:
    """The folder itself is locked too: a removed lock file (before issue 33: two runs wrote one
    checkpoint folder) still refuses the second run."""
    out, _ = folder
    ckpt, proc = holder
    (ckpt / ".pipecc-run.lock").unlink()
    assert cli.main(["run", str(out), "--steps", "1", "--checkpoint-dir", str(ckpt)]) == 1
    one_line(capsys.readouterr().err, r"--checkpoint-dir .*ckpt is in use by another run \(its .pipecc-run.lock was "
             r"removed while it ran\)")
    assert not any(p.name.startswith("step_") for p in ckpt.iterdir())


def test_the_worker_refuses_a_locked_checkpoint_dir(folder, holder, monkeypatch, capsys) -> None:
    out, _ = folder
    ckpt, proc = holder
    monkeypatch.delenv("RANK", raising=False)
    assert _worker(out, "--checkpoint-dir", str(ckpt)) == 1
    one_line(capsys.readouterr().err, rf"is in use by another run \(pid {proc.pid},")
    assert [p.name for p in ckpt.iterdir()] == [".pipecc-run.lock"]


def test_a_stale_lock_does_not_block(folder, holder, monkeypatch, capsys) -> None:
    out, _ = folder
    ckpt, proc = holder
    proc.kill()
    proc.wait()  # the holder is dead; its lock file, naming it, is left behind
    assert str(proc.pid) in (ckpt / ".pipecc-run.lock").read_text()
    monkeypatch.delenv("RANK", raising=False)
    assert _worker(out, "--checkpoint-dir", str(ckpt)) == 0, capsys.readouterr().err
    assert (ckpt / "latest.json").is_file()
    assert str(os.getpid()) in (ckpt / ".pipecc-run.lock").read_text()


def test_a_refused_run_creates_no_checkpoint_dir(folder, tmp_path, capsys) -> None:
    out, _ = folder
    assert cli.main(["run", str(out), "--steps", "1", "--checkpoint-dir", str(tmp_path / "new"), "-m", "1000"]) == 2
    capsys.readouterr()
    assert not (tmp_path / "new").exists()
