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
from types import SimpleNamespace

import pytest

from helpers import MLP_TINY, PIPECC, ROOT, model_args
from pipecc import cli
from pipecc.runtime import dist, modelfuncs, trust
from pipecc.runtime.trust import HASH_KEY, file_sha256

pytestmark = pytest.mark.xdist_group(name="trust")

MLP_ARGS = model_args(MLP_TINY)
MARK = "PLANTED_RAN"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """A folder compiled from a copy of models/mlp.py that lives beside it (so it can be edited)."""
    base = tmp_path_factory.mktemp("trust")
    model = base / "src" / "model.py"
    model.parent.mkdir()
    shutil.copy(ROOT / "models" / "mlp.py", model)
    out = base / "out"
    argv = ["compile", str(model), "--devices", "2xcpu", "--replicas", "1", "-o", str(out), "-b", "8", "-m", "2",
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
