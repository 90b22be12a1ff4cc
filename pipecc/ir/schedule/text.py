"""The schedule IR's text form, which round-trips: ``parse(format(s)) == s`` and
``format(parse(t)) == t`` for canonical text; and the grid ``ScheduleError`` prints.

An action is ``{stage}{kind}{microbatch}`` (``0F3``, ``2RECV_B1``, ``1I0``); a schedule is one
line per rank, ``rank 0: 0F0 0SEND_F0 0F1 ...``; the collectives read ``1REDUCE3`` (all-reduce
stage 1's gradients after its B of micro-batch 3) and ``0REFRESH3``. An unequal (UMPIPE) schedule starts with a line
``sizes: 1 3 4 | 4 4`` (stage lists separated by ``|``); a BPipe schedule has a line
``partner: 3 2 1 0`` (``-``: none) before the rows. A compiled folder carries its schedule in
this form (``OUT/schedule.txt``), which the runtime parses, validates and executes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipecc.ir.schedule.actions import Action, ActionKind, Schedule, header_lines
from pipecc.ir.schedule.chunks import check_size_lists

__all__ = ["ScheduleError", "format", "format_grid", "parse", "parse_action"]

_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|SEND_S|RECV_S|SEND_R|RECV_R|REDUCE|REFRESH|F|B|I|W)(\d+)")
_ROW_RE = re.compile(r"rank (\d+):(.*)")
_SIZES_RE = re.compile(r"sizes:(.*)")
_PARTNER_RE = re.compile(r"partner:(.*)")


class ScheduleError(ValueError):
    """A schedule broke a rule. The message is a one-line summary, then the grid.

    ``marks`` lists the offending ``(rank, step)`` cells, marked ``>..<`` in the grid.
    """

    def __init__(self, summary: str, schedule: Schedule, marks: list[tuple[int, int]]):
        self.summary = summary
        self.marks = marks
        super().__init__(f"{summary}\n{format_grid(schedule, marks)}")



def parse_action(text: str) -> Action:
    """``"2RECV_B1"`` -> ``Action(RECV_B, 2, 1)``; ``ValueError`` on anything else."""
    match = _ACTION_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. '0F3' or '1SEND_B2')")
    return Action(ActionKind(match.group(2)), int(match.group(1)), int(match.group(3)))


def parse(text: str) -> Schedule:
    """Parse the text form: one ``rank N: a a a`` line per rank, ranks 0, 1, ... in order.

    Blank lines are ignored. Placement and sizes are inferred (``Schedule.from_actions``).
    An unequal schedule starts with a line ``sizes: 1 3 4 | 4 4`` (stage 0's chunk sizes,
    then stage 1's, ...); a BPipe schedule has a line ``partner: 3 2 1 0`` (``-``: no partner)
    before the rows.
    """
    rows: list[list[Action]] = []
    sizes: list[list[int]] | None = None
    partner: list[int | None] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        sized = _SIZES_RE.fullmatch(line.strip())
        if sized is not None:
            if rows or sizes is not None or partner is not None:
                raise ValueError(f"the 'sizes:' line must come first, once: {line!r}")
            try:
                sizes = [[int(tok) for tok in part.split()] for part in sized.group(1).split("|")]
            except ValueError:
                raise ValueError(f"not a sizes line: {line!r} (expected e.g. 'sizes: 1 3 | 4')") from None
            check_size_lists(sizes)
            continue
        paired = _PARTNER_RE.fullmatch(line.strip())
        if paired is not None:
            if rows or partner is not None:
                raise ValueError(f"the 'partner:' line must come before the rows, once: {line!r}")
            try:
                partner = [None if tok == "-" else int(tok) for tok in paired.group(1).split()]
            except ValueError:
                raise ValueError(f"not a partner line: {line!r} (expected e.g. 'partner: 3 2 1 0', "
                                 "'-' for no partner)") from None
            continue
        match = _ROW_RE.fullmatch(line.strip())
        if match is None:
            raise ValueError(f"not a schedule row: {line!r} (expected 'rank N: ...')")
        if int(match.group(1)) != len(rows):
            raise ValueError(f"expected 'rank {len(rows)}:', got {line!r}")
        rows.append([parse_action(tok) for tok in match.group(2).split()])
    return Schedule.from_actions(rows, sizes, partner)



def format(schedule: Schedule) -> str:  # noqa: A001 - the IR's name for it; shadows only here
    """The canonical text form, ``parse``'s inverse. No trailing newline."""
    return str(schedule)



def format_grid(schedule: Schedule, marks: Sequence[tuple[int, int]] = ()) -> str:
    """The schedule as an aligned grid, one row per rank, marked cells as ``>0B1<``."""
    marked = set(marks)
    width = max((len(row) for row in schedule.actions), default=0)
    cells = [
        [(f">{a}<" if (r, i) in marked else f" {a} ") for i, a in enumerate(row)] + [""] * (width - len(row))
        for r, row in enumerate(schedule.actions)
    ]
    col = [max([len(str(i)) + 2] + [len(row[i]) for row in cells]) for i in range(width)]
    label = max(len(f"rank {schedule.num_ranks - 1}:"), len("step"))
    label += 1
    lines = header_lines(schedule)
    lines.append("step".ljust(label) + "".join(f" {i} ".ljust(col[i]) for i in range(width)).rstrip())
    for r, row in enumerate(cells):
        lines.append(f"rank {r}:".ljust(label) + "".join(c.ljust(col[i]) for i, c in enumerate(row)).rstrip())
    return "\n".join(lines)

