"""`pipecc run`'s step lines as a person reads them: a progress bar on a terminal, a line per
N steps in a log.

The last rank prints ``step i: loss X, Y samples/s`` (``step i: forward only, Y samples/s``
for inference) after every step (`pipecc.runtime.dist`). That is right for a test that reads
every loss and wrong for a person: ``--steps 1000`` scrolled 1000 lines past. The launcher
(`pipecc.runtime.launcher.supervise`) hands every line the ranks write to stdout to
`RunProgress.line` first:

* on a terminal (the stream the step lines go to is a tty, `-q` not given) each step line
  redraws one bar in place: ``step 120/1000 [###.......] loss 6.84  31.2 samples/s  1m05s  ETA 7m56s`` (elapsed, then the
  time left at the mean pace so far; ``--epochs``: no bar and no ETA, the steps are unknown);
  any other output first clears it (the next step draws it again), and the run's end leaves
  the bar's last state as one line;
* elsewhere (a pipe, a file, CI, the tests) the step lines stay as they are, but only every
  N-th is kept, N = ceil(steps / MAX_LINES), with the first and the last step always kept:
  up to MAX_LINES steps print every line, as before; `-v` keeps every line.

Only the last rank's step lines are matched; every other line passes through untouched.
"""

from __future__ import annotations

import math
import re
import time
from typing import IO

__all__ = ["MAX_LINES", "RunProgress", "STEP_LINE"]

MAX_LINES = 20
BAR_WIDTH = 24
STEP_LINE = re.compile(r"^step (\d+): (?:loss (\S+)|forward only)(?:, (\S+) samples/s)?\s*$")


class RunProgress:
    """Filter for the step lines of one run of `total` steps written to `stream`."""

    def __init__(self, total: int, stream: IO[str], *, quiet: bool = False, verbose: bool = False,
                 tty: bool | None = None) -> None:
        self.total, self.stream, self.verbose = total, stream, verbose
        is_tty = bool(getattr(stream, "isatty", lambda: False)()) if tty is None else tty
        self.bar = is_tty and not quiet
        self.every = max(1, math.ceil(total / MAX_LINES)) if total > 0 else 1
        self.start: float | None = None
        self.shown = False  # the bar is drawn on the current line

    def line(self, text: str) -> bool:
        """True when `text` was handled here (drawn or left out); False: write it as it is."""
        found = STEP_LINE.match(text)
        if found is None:
            return False
        i = int(found.group(1))
        if not self.bar:
            return not (self.verbose or i % self.every == 0 or i >= self.total - 1)
        now = time.monotonic()
        if self.start is None:
            self.start = now
        self._draw(i, found.group(2), found.group(3), now - self.start)
        return True

    def interrupt(self) -> None:
        """Other output is about to be written: take the bar off its line."""
        if self.shown:
            self._write("\r\x1b[K")
            self.shown = False

    def close(self) -> None:
        """The run ended: keep the bar's last state as a line of its own."""
        if self.shown:
            self._write("\n")
            self.shown = False

    def _draw(self, i: int, loss: str | None, rate: str | None, elapsed: float) -> None:
        done = min(i + 1, self.total) if self.total else i + 1
        if self.total:  # --epochs: the steps are not known in advance, so no bar and no ETA
            filled = round(BAR_WIDTH * done / self.total)
            parts = [f"step {done}/{self.total}", "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"]
        else:
            parts = [f"step {done}"]
        parts.append(f"loss {loss}" if loss is not None else "forward only")
        if rate is not None:
            parts.append(f"{rate} samples/s")
        parts.append(_clock(elapsed))
        if self.total and i > 0 and done < self.total:  # the steps since the first, at their mean pace
            parts.append("ETA " + _clock(elapsed / i * (self.total - done)))
        self._write("\r\x1b[K" + "  ".join(parts))
        self.shown = True

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass


def _clock(seconds: float) -> str:
    """1m05s, 12s: the time since the first step ended."""
    whole = int(seconds)
    return f"{whole // 60}m{whole % 60:02d}s" if whole >= 60 else f"{whole}s"
