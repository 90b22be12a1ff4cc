"""A compiled folder's schedule: ``OUT/schedule.txt``, the plan's action list in the schedule IR's
text form (``pipecc.ir.schedule.text``), written by compile and executed by the runtime.

The folder carries its schedule so that what runs is what was planned, validated and
reported, not a second build from the schedule's name: ``read_schedule_file`` parses it,
validates it and checks it against the folder (its stage count and micro-batches, as
``pipecc.json`` records them; a replicated folder's every stage its REDUCE). Every problem is one line naming the fix: a folder without the
file was compiled by an older pipecc (compile again); one that does not parse, breaks a
schedule rule or does not fit the folder was edited or damaged.

Imports only ``pipecc.ir.schedule`` and ``pipecc.errors``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError
from pipecc.ir.schedule.actions import ActionKind, Schedule
from pipecc.ir.schedule.text import ScheduleError, parse
from pipecc.ir.schedule.validate import validate

__all__ = ["SCHEDULE_FILE", "read_schedule_file"]

SCHEDULE_FILE = "schedule.txt"


def read_schedule_file(out: Path, num_stages: int, meta: dict[str, Any] | None) -> Schedule:
    """``OUT/schedule.txt``, parsed and validated, once it fits the folder: ``num_stages``
    stages and ``pipecc.json``'s micro-batches (its ``microbatch_sizes`` when the batch is split
    unequally). PipeccError, one line, otherwise."""
    path = Path(out) / SCHEDULE_FILE
    if not path.is_file():
        raise PipeccError(f"{out} has no {SCHEDULE_FILE} (compiled by an older pipecc, which did not write the "
                          "schedule into the folder); compile it again")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PipeccError(f"{path} is unreadable ({e}); compile again") from None
    try:
        schedule = parse(text)
    except ValueError as e:
        raise PipeccError(f"{path}: {e}; fix it or compile again") from None
    try:
        validate(schedule)
    except ScheduleError as e:
        raise PipeccError(f"{path} is not a valid schedule: {e.summary}; fix it or compile again") from None
    problem = _mismatch(schedule, num_stages, meta or {})
    if problem:
        raise PipeccError(f"{path} does not match the folder: {problem}; fix it or compile again")
    return schedule


def _mismatch(schedule: Schedule, num_stages: int, meta: dict[str, Any]) -> str:
    """Why ``schedule`` cannot run this folder's stages and micro-batches ("" when it can)."""
    if schedule.num_stages != num_stages:
        return f"it has {schedule.num_stages} stages, the folder {num_stages}"
    reduced = {a.stage for row in schedule.actions for a in row if a.kind is ActionKind.REDUCE}
    replicas = meta.get("replicas")
    if schedule.is_training and isinstance(replicas, int) and replicas > 1 and len(reduced) < num_stages:
        missing = min(set(range(num_stages)) - reduced)
        return (f"stage {missing} has no REDUCE action (the gradient all-reduce of its {replicas} replicas, "
                "pipecc.json's replicas)")
    sizes = meta.get("microbatch_sizes")
    if sizes:
        wanted = tuple(tuple(row) for row in sizes) if isinstance(sizes, list) else None
        if schedule.microbatch_sizes != wanted:
            return f"its micro-batch sizes {schedule.microbatch_sizes} are not pipecc.json's {sizes}"
        return ""
    if schedule.microbatch_sizes is not None:
        return "it splits the batch unequally, the folder into equal micro-batches"
    m = meta.get("microbatches")
    if isinstance(m, int) and not isinstance(m, bool) and schedule.num_microbatches != m:
        return f"it has {schedule.num_microbatches} micro-batches, the folder {m}"
    return ""
