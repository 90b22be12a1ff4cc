"""One run per ``--checkpoint-dir``: an ``fcntl.flock`` on ``DIR/.pipecc-run.lock``, held for the run.

Two runs writing one checkpoint folder replace each other's checkpoints (or die on a half-read
file), so the second one is refused in one line that names the first: the holder writes its
pid, command and start time into the lock file. The lock is the kernel's, not the file's: a
holder that died (kill -9, a crash) releases it with its last open descriptor, so a lock file
left behind never blocks a later run.

Who holds it: ``pipecc run`` (the launcher, on node 0, for the whole torchrun launch; it tells
its ranks so through ``LOCK_ENV``), or the worker itself when it runs without that launcher
(one process, or rank 0 of a torchrun started by hand). A folder that does not exist yet is
created only once the run's checks have passed (``create``), so a refused run writes nothing.

Imports ``pipecc.errors`` only (no torch: the launcher takes the lock before it imports torch).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import sys
import time
from pathlib import Path

from pipecc.errors import PipeccError

__all__ = ["LOCK_ENV", "LOCK_NAME", "CheckpointLock"]

LOCK_NAME = ".pipecc-run.lock"
LOCK_ENV = "PIPECC_CHECKPOINT_LOCK"  # the checkpoint folder whose lock the launcher holds for its ranks


class CheckpointLock:
    """The lock of one checkpoint folder, held while this object lives (or until ``release``)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path
        self.dir_fd: int | None = None  # the folder's own descriptor, flocked too

    @classmethod
    def take(cls, directory: str | Path, create: bool = True) -> CheckpointLock | None:
        """Hold ``directory``'s lock; None when the folder does not exist and ``create`` is False.

        Raises a one-line ``PipeccError`` naming the holder when another live run has it.
        """
        directory = Path(directory)
        if not directory.is_dir():
            if not create:
                return None
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PipeccError(f"cannot create --checkpoint-dir {directory} ({e.strerror or e})") from None
        path = directory / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise PipeccError(f"cannot open {path} to lock --checkpoint-dir ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise PipeccError(f"--checkpoint-dir {directory} is in use by another run ({holder}); wait for it to "
                              "end, or give another --checkpoint-dir") from None
        except OSError as e:
            os.close(fd)
            raise PipeccError(f"cannot lock {path} ({e.strerror or e})") from None
        # NOTE: the folder is locked too: a run whose lock file was deleted still holds the folder's
        # lock (an flock on the folder's own descriptor), so deleting the file lets no second run in
        try:
            dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(dir_fd)
            os.close(fd)
            raise PipeccError(f"--checkpoint-dir {directory} is in use by another run (its {LOCK_NAME} was removed "
                              "while it ran); wait for it to end, or give another --checkpoint-dir") from None
        except OSError as e:
            os.close(fd)
            raise PipeccError(f"cannot lock {directory} ({e.strerror or e})") from None
        lock = cls(fd, path)
        lock.dir_fd = dir_fd
        lock._announce()
        return lock

    def _announce(self) -> None:
        """Write who holds the lock, for the run it refuses to name."""
        assert self.fd is not None
        text = json.dumps({"pid": os.getpid(), "command": shlex.join(sys.argv),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}) + "\n"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)

    def release(self) -> None:
        for name in ("dir_fd", "fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                os.close(fd)  # closing the last descriptor releases the flock
                setattr(self, name, None)

    def __del__(self) -> None:
        self.release()


def _holder(fd: int) -> str:
    """'pid P, `COMMAND`, started T' from a held lock file (what its holder wrote)."""
    try:
        info = json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8", "replace") or "{}")
    except ValueError:
        info = None
    if not isinstance(info, dict) or "pid" not in info:
        return "its holder has not written its details yet"
    return f"pid {info.get('pid')}, `{info.get('command', '?')}`, started {info.get('started', '?')}"
