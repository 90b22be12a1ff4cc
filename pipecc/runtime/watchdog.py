"""A bound on model-file code a rank runs outside the pipeline's waits (``pipecc run --timeout``).

``--timeout`` bounds every wait for a peer; when *every* rank is inside model-file code (its
import, ``example_inputs``, ``example_target``) no rank waits for anyone, so no wait times out
and the run would hang for ever. A checkpoint save that hangs (a stalled disk) is bounded the
same way (``checkpoints.RunCheckpoints.save``), so the run names the rank that hung rather than
the rank left waiting for it. ``bounded(what)`` gives that code the same ``--timeout``: past
it the rank writes one ``pipecc: error: rank R: ...`` line and exits (a thread cannot be
interrupted inside C code; the process can), and ``pipecc run``'s supervisor stops the others.

Active only in ranks ``pipecc run`` starts (it sets ``ENV`` to the timeout in seconds): a run
in the caller's own process (``pipecc.runtime.dist.main`` in tests) is never exited.

Imports the standard library only."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

ENV = "PIPECC_MODEL_CODE_TIMEOUT_S"


def limit_s() -> float | None:
    """The bound from ``ENV`` (None: unbounded, not a rank of ``pipecc run``)."""
    try:
        value = float(os.environ.get(ENV, ""))
    except ValueError:
        return None
    return value if value > 0 else None


@contextlib.contextmanager
def bounded(what: str) -> Iterator[None]:
    """Run the block; when it has not ended after ``limit_s()`` seconds, end the process with
    one error line naming ``what`` (e.g. "example_inputs in model.py")."""
    seconds = limit_s()
    if seconds is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        rank = os.environ.get("RANK")
        prefix = f"rank {rank}: " if rank is not None else ""
        try:
            sys.stderr.write(f"pipecc: error: {prefix}{what} did not return within {seconds:g} s (--timeout): it "
                             "hangs, or needs a larger --timeout\n")
            sys.stderr.flush()
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="pipecc-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()
