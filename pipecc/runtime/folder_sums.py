"""The sha256 of a compiled folder's code and weights, recorded at compile and checked at load.

``pipecc compile`` records in ``pipecc.json`` (``"sha256"``: relative path -> hex digest) every
file a run executes or loads: ``run_stage.py``, each stage's ``*.py``, ``*.safetensors`` and
``ports.json``, and an FPGA stage's HLS project (``hls/``: the sources and data the C simulation
builds and reads; not what it writes there, ``csim_build/`` and its outputs). A run (``pipecc
run``, ``pipecc.load``, ``inspect --onnx``) refuses a folder that records none (compiled before
the hashes, or the field was deleted), and each loader reads a file once, checks the bytes
against the record and uses those same bytes: stage code is compiled from memory (never imported
through the import system, so a planted ``__pycache__/*.pyc`` never runs in its place and no
bytecode is written into the folder), weights are parsed from the bytes hashed (a weight flipped
to 6e37 is refused, not trained).

What the hashes prove is that the folder is the one the compile wrote, as long as
``pipecc.json`` is: whoever can edit the folder can edit the record too (a compiled folder is
code: run only folders you trust; docs/safety.md).

The marker itself is read by ``pipecc.runtime.folder`` (the one reader of a compiled folder),
which hands the record here. Imports hashlib and ``pipecc.errors`` only."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from pipecc.errors import PipeccError

KEY = "sha256"
MARKER = "pipecc.json"
MARKER_MAX_BYTES = 64 << 20  # a pipecc.json larger than this is not one pipecc wrote
RECOMPILE = "compile the folder again"
HLS_WRITTEN = ("tb_data/csim_output.bin", "csim_fifo.txt")  # what the C simulation writes into hls/


def recorded_files(root: Path) -> list[str]:
    """The files of the compiled folder ``root`` whose sha256 the compile records (sorted)."""
    found = ["run_stage.py"] if (root / "run_stage.py").is_file() else []
    for stage in sorted(root.glob("stage_*")):
        if not stage.is_dir():
            continue
        for path in sorted(stage.rglob("*")):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" in path.parts or "/csim_build/" in f"/{rel}/" or not path.is_file():
                continue
            if "/hls/" in f"/{rel}":  # an FPGA stage's HLS project (the C simulation builds and runs it)
                inside = rel.split("/hls/", 1)[1]
                if inside not in HLS_WRITTEN and not inside.startswith("csim_build/"):
                    found.append(rel)
                continue
            if path.suffix in (".py", ".safetensors") or path.name == "ports.json":
                found.append(rel)
    return found


def record(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of ``recorded_files(root)`` (at compile)."""
    return {rel: sha256_bytes((root / rel).read_bytes()) for rel in recorded_files(root)}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (a FIFO, device or folder there is refused, not
    read: reading one could hang); ``limit``: refused when larger."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise PipeccError(f"{path} is missing; {RECOMPILE}") from None
    except OSError as exc:
        raise PipeccError(f"cannot read {path} ({exc.strerror or exc}); {RECOMPILE}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PipeccError(f"{path} is not a regular file; {RECOMPILE}")
        if limit is not None and st.st_size > limit:
            raise PipeccError(f"{path} is {st.st_size} bytes, more than pipecc writes there; {RECOMPILE}")
        os.set_blocking(fh.fileno(), True)
        return fh.read()


def require(root: str | Path, marker: dict[str, Any] | None) -> None:
    """Refuse, in one line, a folder whose ``pipecc.json`` records no sha256 of its code and
    weights, and one whose ``run_stage.py`` is not the one recorded (the run starts it)."""
    root = Path(root)
    sums = (marker or {}).get(KEY)
    if not isinstance(sums, dict) or not sums:
        raise PipeccError(f"{root / MARKER} records no sha256 of the stage code and weights (compiled by an "
                          f"older pipecc, or the record was removed), so they cannot be checked; {RECOMPILE}")
    if (root / "run_stage.py").exists() or "run_stage.py" in sums:
        check(root, "run_stage.py", read_regular(root / "run_stage.py"), sums)


def check(root: Path, rel: str, data: bytes, sums: dict[str, Any] | None) -> None:
    """Refuse ``data`` (the bytes read from ``root/rel``) unless its sha256 is the one recorded.
    ``sums``: the record (``pipecc.json``'s, as ``pipecc.runtime.folder`` reads it; each stage
    file's through ``folder.read_checked``). A folder recording no sums (None) is not checked
    here: the run's entry points refused it (``require``); a compile loads its own stages before
    it records them."""
    if not isinstance(sums, dict):
        return
    want = sums.get(rel)
    if want is None:
        raise PipeccError(f"{root / rel} is not among the files {root / MARKER} records; it was added or "
                          f"renamed after compile; {RECOMPILE}")
    if sha256_bytes(data) != want:
        raise PipeccError(f"{root / rel} is not the file the compile wrote (its sha256 differs from "
                          f"{MARKER}'s): it was changed or is damaged; {RECOMPILE}")


def locate(path: Path) -> tuple[Path, str] | None:
    """(the compiled folder, ``path`` relative to it) for a file inside ``stage_<i>/``, or None."""
    path = Path(os.path.abspath(path))
    for parent in path.parents:
        if parent.name.startswith("stage_") and parent.name[len("stage_"):].isdigit():
            root = parent.parent
            return root, PurePosixPath(*path.relative_to(root).parts).as_posix()
    return None
