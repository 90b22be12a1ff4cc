"""Progress on a terminal and explanations with `-v`, both on stderr.

    from pipecc import progress
    progress.configure(quiet=args.quiet, verbose=args.verbose)   # once, in the CLI
    with progress.step("tracing gpt"):                            # a spinner and the elapsed time
        ...
    with progress.step("writing weights", total=8) as s:         # a counter: 3/8
        for ...: s.advance()
    progress.explain("split lm_head: ...")                        # only with -v
    progress.notice("kept notes.txt in OUT: pipecc did not write it")   # always, in the CLI

Progress lines appear only when stderr is a terminal and `--quiet` is not set: piped or
captured output (tests, `--json`, CI logs) never sees a spinner. A finished step leaves one
line (`✓ tracing gpt  1.2 s`) so a long compile reads as a log afterwards; a failed step
leaves `✗ ...`. Steps nest: the inner label is shown after the outer one.

`explain` is different: `-v` is an explicit request, so it prints whether or not stderr is
a terminal (still stderr: stdout stays for results and JSON). `notice` is for what the user
must hear even with `--quiet` (pipecc kept or replaced files it did not write); it prints
once the CLI has configured the reporter, never for library callers that did not.

Labels and messages may carry names from model files: they are escaped
(`pipecc.report.formatting.printable`) so they cannot drive the terminal.

NOTE: the state is one `Progress` object per process, replaced by `configure`; nothing is
set at import beyond a quiet default, and library callers that never configure see nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import IO, Iterator

from pipecc.report.formatting import printable, terminal_text

__all__ = ["Progress", "Step", "configure", "current", "explain", "notice", "step"]

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
REDRAW_S = 0.1


class Step:
    """One running step; `advance()` moves its counter (when it has a total)."""

    def __init__(self, label: str, total: int | None) -> None:
        self.label, self.total, self.done = printable(label), total, 0
        self.start = time.monotonic()

    def advance(self, n: int = 1) -> None:
        self.done += n

    def text(self) -> str:
        count = f" {self.done}/{self.total}" if self.total else ""
        return f"{self.label}{count}"


class Progress:
    """Draws the running steps on `stream` when it is a terminal and `quiet` is off."""

    def __init__(self, stream: IO[str] | None = None, *, quiet: bool = False,
                 verbose: bool = False, force: bool | None = None, notices: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.verbose = verbose
        self.notices = notices
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = (tty if force is None else force) and not quiet
        self._stack: list[Step] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._frame = 0

    # ------------------------------------------------------------------ steps
    @contextmanager
    def step(self, label: str, total: int | None = None) -> Iterator[Step]:
        s = Step(label, total)
        if not self.enabled:
            yield s
            return
        with self._lock:
            self._stack.append(s)
            self._draw()
        self._ensure_thread()
        ok = False
        try:
            yield s
            ok = True
        finally:
            with self._lock:
                self._stack.remove(s)
                mark = "✓" if ok else "✗"
                self._write(f"\r\033[K{mark} {self._path(s)}  {time.monotonic() - s.start:.1f} s\n")
                self._draw()

    def explain(self, message: str) -> None:
        """A decision, said in words; only with `-v`."""
        if not self.verbose:
            return
        with self._lock:
            if self.enabled and self._stack:
                self._write("\r\033[K")
            self._write(f"  {terminal_text(message)}\n")
            self._draw()

    def notice(self, message: str) -> None:
        """Something the user must hear (see the module docstring); not silenced by quiet."""
        if not self.notices:
            return
        with self._lock:
            if self.enabled and self._stack:
                self._write("\r\033[K")
            self._write(f"pipecc: {terminal_text(message)}\n")
            self._draw()

    # ------------------------------------------------------------------ drawing
    def _path(self, s: Step) -> str:
        outer = [o.label for o in self._stack if o is not s]
        return " › ".join(outer + [s.text()])

    def _draw(self) -> None:
        """Redraw the status line of the innermost step (caller holds the lock)."""
        if not self.enabled or not self._stack:
            return
        s = self._stack[-1]
        spin = SPINNER[self._frame % len(SPINNER)]
        self._write(f"\r\033[K{spin} {self._path(s)}  {time.monotonic() - s.start:.1f} s")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed terminal must not fail the compile
            self.enabled = False

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._spin, name="pipecc-progress", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while True:
            time.sleep(REDRAW_S)
            with self._lock:
                if not self._stack:
                    self._thread = None
                    return
                self._frame += 1
                self._draw()


_current = Progress(quiet=True)


def configure(*, quiet: bool = False, verbose: bool = False, stream: IO[str] | None = None,
              force: bool | None = None) -> Progress:
    """Set the process's progress reporter (the CLI calls this once per command); notices
    are on from here."""
    global _current
    _current = Progress(stream, quiet=quiet, verbose=verbose, force=force, notices=True)
    return _current


def current() -> Progress:
    return _current


def step(label: str, total: int | None = None):
    """`with progress.step("planning"):` on the configured reporter."""
    return _current.step(label, total)


def explain(message: str) -> None:
    _current.explain(message)


def notice(message: str) -> None:
    _current.notice(message)
