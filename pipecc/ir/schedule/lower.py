"""The lowering: a compute schedule -> the schedule a run executes, with its collectives.

A compute schedule is a generator's rows (``pipecc.ir.schedule.generators``: F, B or I and W)
with the point-to-point SEND/RECV each needs (``pipecc.ir.schedule.sendrecv.add_send_recv``),
after the techniques' compute transforms (UMPIPE's chunks, BPipe's stash transfers,
``transforms``). ``lower`` adds what runs across the
copies of a stage: the replica groups' gradient all-reduce (REDUCE after each stage's last
gradient action, ``gradient_reduce``) and Bi-Partition's weight refresh (REFRESH after the last F
of each worker holding a segment's replica, ``weight_refresh``), as torch.distributed.pipelining
lowers its compute actions once (``_add_send_recv``, ``_add_reduce_grad``).

It is the one place they are added, used twice with the same result: by compile, which writes
the lowered schedule to ``OUT/schedule.txt`` (``pipecc.techniques.schedule_of``, through the
replicas' and Bi-Partition's ``lower``), and by the runtime for a schedule it builds at run time
(``--schedule``/``--microbatches``: by name or from text, ``pipecc.runtime.engine``). A schedule
that is already lowered (a compiled ``schedule.txt``) lowers to itself, the same object, so the
runtime executes it as written.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipecc.ir.schedule.actions import Schedule
from pipecc.ir.schedule.transforms import gradient_reduce, weight_refresh

__all__ = ["lower", "with_collectives"]


def lower(schedule: Schedule, *, replicas: int = 1, refresh_stages: Sequence[int] = ()) -> Schedule:
    """``schedule`` with its collectives: ``gradient_reduce`` when its stages have ``replicas``
    > 1, then ``weight_refresh`` of ``refresh_stages`` (Bi-Partition's replica-holding workers).
    A stage that has its REDUCE (REFRESH) already keeps it where it is; a schedule that lacks
    none is returned itself (unchanged, not validated again). Inference schedules get none."""
    if replicas > 1:
        schedule = gradient_reduce(schedule)
    return weight_refresh(schedule, refresh_stages)


def with_collectives(schedule: Schedule, replicas: int = 1, refresh_stages: Sequence[int] = ()) -> Schedule:
    """``lower`` with positional arguments (the name the package exported before ``lower``)."""
    return lower(schedule, replicas=replicas, refresh_stages=refresh_stages)
