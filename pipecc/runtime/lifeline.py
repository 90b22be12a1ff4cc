"""A worker stops when the processes that started it are gone.

torchrun starts each worker in a session of its own, so when the torchrun agent is killed
(``kill -9``, an OOM kill) nothing signals the workers: they would train on, orphaned. And when
``pipecc run`` itself is killed, torchrun does not notice either. So every worker started by
``pipecc run`` (``pipecc.runtime.dist.main`` under torchrun) runs ``start``: a daemon thread that
checks twice a second that its parent is still the process that started it (the agent) and that
the launcher named by ``$PIPECC_LAUNCHER`` (``pid:start time``, set by ``pipecc run``) is alive.
When either is gone it prints one ``pipecc: error:`` line and ends the process at once
(``os._exit``: a rank blocked in a receive cannot be interrupted any other way; checkpoints
are written to a temporary name and renamed, so none is left half-written).

Imports nothing of pipecc.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["ENV", "launcher_id", "start", "started_at"]

ENV = "PIPECC_LAUNCHER"
INTERVAL_S = 0.5
EXIT_CODE = 1


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat from the state on (empty when unknown)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    # NOTE: the command name (field 2) may hold spaces and parentheses; fields resume after the last ')'
    return text.rpartition(")")[2].split()


def started_at(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), None if unknown."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else None


def launcher_id(pid: int | None = None) -> str:
    """``$PIPECC_LAUNCHER``'s value for process ``pid`` (default: this one)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{started_at(pid) or ''}"


def _alive(ident: str) -> bool:
    pid_text, _, start = ident.partition(":")
    try:
        pid = int(pid_text)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError, OSError):
        return True  # unknown or not ours to signal: never stop a run on a guess
    fields = _stat(pid)
    if len(fields) <= 19:
        return True  # no /proc here: os.kill said it exists
    return fields[0] != "Z" and (not start or fields[19] == start)  # a zombie has exited


def _gone(parent: int, launcher: str | None) -> str | None:
    if os.getppid() != parent:
        return f"the torchrun agent (pid {parent}) is gone"
    if launcher and not _alive(launcher):
        return f"pipecc run (pid {launcher.partition(':')[0]}) is gone"
    return None


def start(what: str = "this worker", on_lost: Callable[[str], None] | None = None) -> threading.Thread:
    """Watch the parent (and ``$PIPECC_LAUNCHER``) from a daemon thread; see the module doc.

    ``on_lost(why)`` replaces the default, which prints ``pipecc: error: WHAT: WHY; stopping``
    and exits the process with code 1.
    """
    parent, launcher = os.getppid(), os.environ.get(ENV) or None

    def lost(why: str) -> None:
        try:
            sys.stderr.write(f"pipecc: error: {what}: {why}; stopping\n")
            sys.stderr.flush()
        finally:
            os._exit(EXIT_CODE)

    def watch() -> None:
        while True:
            time.sleep(INTERVAL_S)
            why = _gone(parent, launcher)
            if why:
                (on_lost or lost)(why)
                return

    thread = threading.Thread(target=watch, name="pipecc-lifeline", daemon=True)
    thread.start()
    return thread
