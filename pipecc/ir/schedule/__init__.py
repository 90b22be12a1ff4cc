"""Pipeline schedules as data: a tiny IR with a text form, generators, transforms and a validator.

A schedule says, for every rank, the ordered list of actions it executes in one training (or
inference) iteration; it is the contract between the planner, the compiled folder
(``OUT/schedule.txt``) and the runtime, which executes it literally. The modules, bottom up:

    chunks      unequal micro-batches' chunk arithmetic (UMPIPE)
    actions     ``ActionKind``, ``Action``, ``Schedule`` (what each action means)
    text        the round-tripping text form (``format``/``parse``), ``ScheduleError``'s grid
    sendrecv    ``add_send_recv``: a compute schedule's SEND/RECV, by one rule for every schedule
    generators  gpipe, 1f1b, interleaved 1F1B, ZB-H1, ZB-V, inference: compute actions
                (``gpipe_compute``, ...), and those lowered by ``add_send_recv`` (``gpipe``, ...)
    progress    ``advance``: every rank's row run until it blocks (validate, transforms, simulator)
    validate    the rules every schedule is checked against (complete, matched, deadlock-free)
    transforms  the collectives (``gradient_reduce``, ``weight_refresh``), ``forward_only``; UMPIPE's
                row orders are its package's (``pipecc.techniques.umpipe.schedule``), BPipe's stash
                transfers too (``pipecc.techniques.bpipe.schedule``)
    lower       the collectives a run needs (``lower``: REDUCE, REFRESH), added once, at compile
                and for a schedule the runtime builds by name
    registry    every schedule by name (``REGISTRY``) and ``schedule_for``, plan fields -> schedule
                (compute actions, ``add_send_recv``, BPipe's transfers, validated)

This package is the schedule IR's interface: it exports the public names of its modules.
It must stay free of torch and of ``pipecc.passes``: both the planner's simulator and the
distributed runtime import it.
"""

from __future__ import annotations

from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.ir.schedule.chunks import chunk_bounds, overlapping
from pipecc.ir.schedule.generators import (gpipe, gpipe_compute, inference, inference_compute, interleaved_1f1b,
                                           interleaved_1f1b_compute, one_f_one_b, one_f_one_b_compute, zb_h1,
                                           zb_h1_compute, zb_v, zb_v_compute)
from pipecc.ir.schedule.progress import advance
from pipecc.ir.schedule.registry import (REGISTRY, SCHEDULES, SPLIT_BACKWARD_COST, TRAINING_SCHEDULES, VIRTUAL,
                                         ZERO_BUBBLE, ScheduleKind, by_name, compute_by_name, schedule_for)
from pipecc.ir.schedule.sendrecv import add_send_recv
from pipecc.ir.schedule.text import ScheduleError, format, format_grid, parse, parse_action
from pipecc.ir.schedule.transforms import forward_only, gradient_reduce, weight_refresh, without_collectives
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
    "add_send_recv",
    "advance",
    "by_name",
    "chunk_bounds",
    "compute_by_name",
    "format",
    "format_grid",
    "forward_only",
    "gpipe",
    "gpipe_compute",
    "gradient_reduce",
    "inference",
    "inference_compute",
    "interleaved_1f1b",
    "interleaved_1f1b_compute",
    "lower",
    "one_f_one_b",
    "one_f_one_b_compute",
    "overlapping",
    "parse",
    "parse_action",
    "schedule_for",
    "validate",
    "weight_refresh",
    "with_collectives",
    "without_collectives",
    "zb_h1",
    "zb_h1_compute",
    "zb_v",
    "zb_v_compute",
]
