"""How figures are written in pipecc's text output: SI numbers, durations, shape lists and
plain-text tables. Every text view (`pipecc cost`, `plan`, `inspect`) and the HTML report share
these, so a number reads the same everywhere. `printable` / `terminal_text` escape control
characters in every human-readable output (names from model files and ONNX graphs may be
hostile)."""

from __future__ import annotations

import re

from pipecc.errors import printable

__all__ = ["count", "fit_table", "human", "printable", "seconds", "seconds_in_text", "shapes_text",
           "terminal_text", "text_table", "wrap", "WIDTH"]  # printable: from pipecc.errors

WIDTH = 100  # the columns a text view's lines fit (`wrap`); a table row longer than this is laid out anew


def count(n: int, noun: str, plural: str = "") -> str:
    """'1 stage', '2 stages', '1 micro-batch', '4 micro-batches': a number and its noun, in
    the singular for exactly one (plural: `plural`, else noun + "es" after ch/sh/s/x, + "s")."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {plural or noun + ('es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's')}"


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (SI prefixes; bytes use the same decimal prefixes)."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.3g}{prefix}{unit}"
    return f"{n:.3g}{unit}" if isinstance(n, float) else f"{n}{unit}"


def seconds(s: float) -> str:
    """0.0123 -> '12.3 ms' (s, ms or µs, three significant digits)."""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


# a duration as the planner's decision lines write it (plan.json keeps seconds): "0.002631 s"
_RAW_SECONDS = re.compile(r"(?<![\w.])(\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+) s\b")


def seconds_in_text(text: str) -> str:
    """`text` with every raw duration ("0.002631 s", "1.2e-05 s") written as `seconds` writes it
    ("2.63 ms"): the planner's decisions keep seconds for plan.json; a person reads one unit scale."""
    return _RAW_SECONDS.sub(lambda m: seconds(float(m.group(1))), text)


_UNITS = {"s", "ms", "µs", "B", "kB", "MB", "GB", "TB"}


def wrap(line: str, indent: int = 4, width: int = WIDTH) -> list[str]:
    """`line` broken at spaces into lines of at most `width` columns (a word longer than that
    stays whole; the line's own leading spaces kept), each after the first indented by `indent`."""
    out: list[str] = []
    lead = len(line) - len(line.lstrip(" "))
    current = " " * lead
    words: list[str] = []
    for word in line[lead:].split(" "):  # a unit stays with its number ("328 µs"), `a command` whole
        if words and (word.rstrip(",;:)") in _UNITS and words[-1][-1:].isdigit()
                      or words[-1].count("`") % 2 == 1):
            words[-1] += " " + word
        else:
            words.append(word)
    for word in words:
        if current.strip() and len(current) + 1 + len(word) > width:
            out.append(current)
            current = " " * indent + word
        else:
            current = f"{current} {word}" if current.strip() else current + word
    return [ln.rstrip() for ln in out + [current]]


def shapes_text(shapes: list[str]) -> str:
    """'3× float32[B, 128, 768]' for repeated shapes."""
    groups: dict[str, int] = {}
    for sh in shapes:
        groups[sh] = groups.get(sh, 0) + 1
    return ", ".join(f"{k}× {sh}" if k > 1 else sh for sh, k in groups.items()) or "-"


def fit_table(headers: list[str], rows: list[list[str]], moved: list[int], left: int = 2,
              right_from: int = 0, width: int = WIDTH) -> str:
    """`text_table`, or where a line of it is wider than `width`, the table without the columns
    `moved` (long names: node ranges, shards), each row followed by an indented line of theirs."""
    table = text_table(headers, rows, left, right_from)
    if max(len(line) for line in table.splitlines()) <= width:
        return table
    keep = [i for i in range(len(headers)) if i not in moved]
    lefts = [i for i in keep if i < left or (right_from > 0 and i >= right_from)]
    narrow = text_table([headers[i] for i in keep], [[r[i] for i in keep] for r in rows],
                        right_from=0, left=len(keep), align=[i in lefts for i in keep]).splitlines()
    lines = narrow[:2]
    for row, line in zip(rows, narrow[2:]):
        extra = "; ".join(f"{headers[i]} {row[i]}" for i in moved if row[i] not in ("", "-"))
        lines += [line] + (wrap(f"       {extra}", indent=9, width=width) if extra else [])
    return "\n".join(lines)


def text_table(headers: list[str], rows: list[list[str]], left: int = 2, right_from: int = 0,
               align: list[bool] | None = None) -> str:
    """A plain-text table: the first `left` columns and those from `right_from` on (when
    set) align left, the numbers between align right (`align`: each column's, True = left).
    Cells are escaped with `printable`, so a hostile name can neither drive the terminal nor
    break the columns."""
    headers = [printable(h) for h in headers]
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def is_left(i: int) -> bool:
        if align is not None:
            return align[i]
        return i < left or (right_from > 0 and i >= right_from)

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if is_left(i) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


# ----------------------------------------------------------------------------- terminal safety
# NOTE: names come from model files and ONNX graphs, which may be hostile: an ESC or CSI in a
# node name would drive the terminal (`\x1b[2J` clears it, `\r` overwrites a line). Every
# human-readable output escapes them with these two functions; JSON output needs nothing
# (json.dumps escapes control characters, and pipecc keeps ensure_ascii on).
def terminal_text(text: object) -> str:
    """Multi-line `text` for a terminal: as `printable`, but newlines stay newlines."""
    return "\n".join(printable(line) for line in str(text).split("\n"))
