"""Temporary folders a killed ``pipecc run`` leaves: named with the pid of the run that made
them (``pipecc-torchrun-<pid>-*``), removed by a later run once that process is gone (a
``kill -9`` runs no cleanup of its own).

Imports the standard library only."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

PREFIX = "pipecc-torchrun-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def make_log_dir() -> str:
    """A fresh folder for torchrun's logs of this run, its name recording this process's pid;
    the folders of earlier runs whose process is gone are removed first."""
    clean_stale()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def clean_stale(base: str | None = None) -> list[str]:
    """Remove ``PREFIX<pid>-*`` folders in the temporary folder whose process is gone; the names removed."""
    root = Path(base or tempfile.gettempdir())
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        path = root / name
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid():
                shutil.rmtree(path)
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
