"""Which model file a run may import: only the one the folder was compiled from, by hash.

A compiled folder is code, like a pickle: its ``stage.py`` files run when a stage loads, and
``pipecc.json`` names a ``.py`` model file that ``pipecc run`` imports for its data, loss and
``--verify``. Only run folders you trust. What pipecc can check, it does: the model file is
imported only when its sha256 equals ``pipecc.json``'s ``model_sha256``, which ``pipecc compile``
records (``file_sha256`` of the file it compiled). An edited ``model_path`` pointing at another
file, an edited model file, or a folder from a pipecc that recorded no hash is refused with a
one-line error that says to compile again.

The bytes hashed are the bytes run: ``model_source`` reads the file once, hashes those bytes and
hands them on; ``pipecc.frontend.modelfile.import_model_file`` compiles them from memory into a
fresh module, so neither an edit between the check and the import nor a planted
``__pycache__/*.pyc`` (which the import system would take for the file when its recorded
mtime and size match) can run code that was not hashed. What the hash does not cover: the
modules ``model.py`` itself imports, and the folder's ``stage.py`` files (see docs/safety.md and the
README's "a compiled folder is code").

Imports hashlib and ``pipecc.errors`` only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError

__all__ = ["HASH_KEY", "file_sha256", "model_file", "model_source", "verify_problem"]

HASH_KEY = "model_sha256"  # pipecc.json: hex sha256 of the model file's bytes at compile time


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_file(meta: dict[str, Any] | None, out: str | Path | None = None) -> tuple[Path | None, str]:
    """(the ``.py`` model file a run may import, "") or (None, why there is none to import).

    ``meta`` is the ``pipecc.json`` of the compiled folder ``out``. Raises ``PipeccError`` when
    the file is there but is not the one recorded by hash: the run must not fall back to random
    data then, the folder or the file was changed. A check only: to import the file, take
    ``model_source``'s bytes (the file may change after this returns).
    """
    path, source = model_source(meta, out)
    return (path, "") if isinstance(source, bytes) else (None, source)


def model_source(meta: dict[str, Any] | None, out: str | Path | None = None) -> tuple[Path | None, bytes | str]:
    """(the model file, the bytes of it that hash to the recorded sha256) or (None, why there is none).

    Read once: the bytes returned are the bytes hashed, to be compiled from memory (never
    re-read from the path, never taken from a bytecode cache). Raises as ``model_file`` does.
    """
    where = f"{out}/pipecc.json" if out is not None else "pipecc.json"
    raw = str((meta or {}).get("model_path") or "")
    if meta is None:
        return None, f"there is no {where}"
    if not raw:
        return None, f"{where} names no model file"
    path = Path(raw)
    if path.suffix != ".py":
        return None, f"the model file {path.name} is not a .py model file"
    if not path.is_file():
        return None, f"the model file {raw} is missing"
    recorded = meta.get(HASH_KEY)
    fix = f"compile again (`pipecc compile {raw} --devices ... -o {out if out is not None else 'OUT'}`)"
    if not isinstance(recorded, str) or not recorded:
        raise PipeccError(f"{where} records no {HASH_KEY} for the model file {raw} (a folder from an older "
                          f"pipecc), so pipecc will not import that file: {fix}")
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        raise PipeccError(f"cannot read the model file {raw} ({e.strerror or e})") from None
    digest = hashlib.sha256()
    digest.update(source)
    if digest.hexdigest() != recorded.lower():
        raise PipeccError(f"the model file {raw} is not the one this folder was compiled from (its sha256 "
                          f"differs from {where}'s {HASH_KEY}), so pipecc will not import it: {fix}")
    return path, source


def verify_problem(meta: dict[str, Any] | None, out: str | Path | None = None) -> str | None:
    """Why ``--verify`` cannot compare with the original model (None when it can)."""
    path, why = model_file(meta, out)
    if path is not None:
        return None
    fix = "restore it, or give" if why.endswith(" is missing") else "give"
    return (f"cannot verify: {why}, and --verify compares with the original model; {fix} --verify-stages-only "
            "to compare the pipeline with its own stages chained in one process")
