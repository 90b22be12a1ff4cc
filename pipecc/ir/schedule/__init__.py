"""Pipeline schedules as data: a tiny IR with a text form, generators, transforms and a validator.

A schedule says, for every rank, the ordered list of actions it executes in one training (or
inference) iteration; it is the contract between the planner, the compiled folder
(``OUT/schedule.txt``) and the runtime, which executes it literally. The modules, bottom up:

    chunks      unequal micro-batches' chunk arithmetic (UMPIPE)
    actions     ``ActionKind``, ``Action``, ``Schedule`` (what each action means)
    text        the round-tripping text form (``format``/``parse``), ``ScheduleError``'s grid
    generators  gpipe, 1f1b, interleaved 1F1B, ZB-H1, ZB-V, inference
    progress    ``advance``: every rank's row run until it blocks (validate, transforms, simulator)
    validate    the rules every schedule is checked against (complete, matched, deadlock-free)
    transforms  ``gpipe_uneven``, ``one_f_one_b_uneven`` (UMPIPE), the collectives
                (``gradient_reduce``, ``weight_refresh``), ``forward_only``; BPipe's stash transfers
                are its package's (``pipecc.techniques.bpipe.schedule``)
    lower       the collectives a run needs (``lower``: REDUCE, REFRESH), added once, at compile
                and for a schedule the runtime builds by name
    registry    every schedule by name (``REGISTRY``) and ``schedule_for``, plan fields -> schedule

This package is the schedule IR's interface: it exports the public names of its modules.
It must stay free of torch and of ``pipecc.passes``: both the planner's simulator and the
distributed runtime import it.
"""

from __future__ import annotations

from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.ir.schedule.chunks import chunk_bounds, overlapping
from pipecc.ir.schedule.generators import gpipe, inference, interleaved_1f1b, one_f_one_b, zb_h1, zb_v
from pipecc.ir.schedule.progress import advance
from pipecc.ir.schedule.registry import (REGISTRY, SCHEDULES, SPLIT_BACKWARD_COST, TRAINING_SCHEDULES, VIRTUAL,
                                         ZERO_BUBBLE, ScheduleKind, by_name, schedule_for)
from pipecc.ir.schedule.text import ScheduleError, format, format_grid, parse, parse_action
from pipecc.ir.schedule.transforms import (forward_only, gpipe_uneven, gradient_reduce, one_f_one_b_uneven,
                                           weight_refresh, without_collectives)
from pipecc.ir.schedule.lower import lower, with_collectives
from pipecc.ir.schedule.validate import validate

__all__ = [
    "Action",
    "ActionKind",
    "REGISTRY",
    "SCHEDULES",
    "SPLIT_BACKWARD_COST",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "TRAINING_SCHEDULES",
    "VIRTUAL",
    "ZERO_BUBBLE",
    "advance",
    "by_name",
    "chunk_bounds",
    "format",
    "format_grid",
    "forward_only",
    "gpipe",
    "gpipe_uneven",
    "gradient_reduce",
    "inference",
    "interleaved_1f1b",
    "lower",
    "one_f_one_b",
    "one_f_one_b_uneven",
    "overlapping",
    "parse",
    "parse_action",
    "schedule_for",
    "validate",
    "weight_refresh",
    "with_collectives",
    "without_collectives",
    "zb_h1",
    "zb_v",
]
