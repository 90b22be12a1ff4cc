"""Every schedule by its name, and the one function from a plan's fields to its action list.

``REGISTRY`` is the one list of schedule names: argparse's choices (``pipecc.cli``), the
planner's candidates (``passes.balance``), the report and the runtime derive theirs from it
(``SCHEDULES``, ``TRAINING_SCHEDULES``, ``ZERO_BUBBLE``, ``VIRTUAL``). ``schedule_for`` turns a
plan's fields (schedule name, stages, ranks, micro-batches, UMPIPE sizes, BPipe thresholds)
into the final, validated ``Schedule``: the planner's simulator, the report's timeline, the
compiled folder's ``schedule.txt`` and ``pipecc run --schedule`` all build it there.

ZB-V (``generators.zb_v``) is not listed: it is a schedule object only, not planned or compiled.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache

from pipecc.ir.schedule.actions import Schedule
from pipecc.ir.schedule.generators import (gpipe_compute, inference_compute, interleaved_1f1b_compute,
                                           one_f_one_b_compute, zb_h1_compute)
from pipecc.ir.schedule.sendrecv import add_send_recv
from pipecc.ir.schedule.validate import validate

__all__ = ["REGISTRY", "SCHEDULES", "SPLIT_BACKWARD_COST", "TRAINING_SCHEDULES", "UNEVEN", "VIRTUAL", "ZERO_BUBBLE",
           "ScheduleKind", "by_name", "compute_by_name", "schedule_for"]


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule name and what callers ask of it before building one.

    ``build(ranks, microbatches, virtual_stages)`` makes its compute actions (no SEND/RECV:
    ``add_send_recv`` adds them); ``training``: it has
    backward actions (the planner's candidates, a folder that can train); ``virtual_stages``:
    a rank may hold several stages; ``split_backward``: its backward is split into I and W
    (zero-bubble: priced at ``SPLIT_BACKWARD_COST``, refused by backends without the split)."""

    name: str
    build: Callable[[int, int, int], Schedule]
    training: bool
    virtual_stages: bool = False
    split_backward: bool = False
    summary: str = ""


def _one_per_rank(generator: Callable[[int, int], Schedule]) -> Callable[[int, int, int], Schedule]:
    return lambda ranks, microbatches, virtual: generator(ranks, microbatches)


# NOTE: the order is the one every listing shows (and the planner tries under --schedule auto)
REGISTRY: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("gpipe", _one_per_rank(gpipe_compute), training=True,
                 summary="all forwards, then all backwards; stashes every micro-batch"),
    ScheduleKind("1f1b", _one_per_rank(one_f_one_b_compute), training=True,
                 summary="PipeDream-flush: warm-up forwards, then one forward one backward"),
    ScheduleKind("interleaved", interleaved_1f1b_compute, training=True, virtual_stages=True,
                 summary="Megatron's interleaved 1F1B: several stages per rank"),
    ScheduleKind("inference", _one_per_rank(inference_compute), training=False,
                 summary="forwards only"),
    ScheduleKind("zb-h1", _one_per_rank(zb_h1_compute), training=True, split_backward=True,
                 summary="zero-bubble H1: 1F1B with each backward split into I and W"),
)}
SCHEDULES = tuple(REGISTRY)  # every name, as plans, `pipecc run --schedule` and the simulator spell it
TRAINING_SCHEDULES = tuple(n for n, k in REGISTRY.items() if k.training)  # what --schedule auto tries
ZERO_BUBBLE = tuple(n for n, k in REGISTRY.items() if k.split_backward)  # backward split into I and W
VIRTUAL = tuple(n for n, k in REGISTRY.items() if k.virtual_stages)  # may hold several stages per rank
# the schedules that run unequal micro-batches (UMPIPE): their row orders with per-stage sizes
UNEVEN = ("gpipe", "1f1b")

# What pipecc's runtime pays for the split: its I and W together cost SPLIT_BACKWARD_COST times
# one plain backward B, each part scaled alike. Measured on CPU (one thread, middle stages of
# Linear+ReLU chains, best of 30; pipecc.techniques.zero_bubble.runtime's docstring): I + W = 1.14-1.29 B
# through torch's split, whose graph analysis and hooks run in Python per micro-batch; the
# paper's split costs 1.0 B. The planner, the report's timeline and `run --json`'s predictions
# all use it; re-measure on another machine (`pipecc run --json` shows backward_s per stage).
SPLIT_BACKWARD_COST = 1.2


def compute_by_name(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The compute actions (no SEND/RECV) of the schedule called `name` over `num_ranks` ranks
    (`virtual_stages` stages per rank for a schedule that holds several; the others hold one
    stage per rank).

    Raises ValueError for an unknown name or a stage count the schedule cannot hold.
    """
    kind = REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    if virtual_stages != 1 and not kind.virtual_stages:
        raise ValueError(f"schedule {name!r} puts one stage on each rank, got {virtual_stages} per "
                         "rank; use the interleaved schedule")
    return kind.build(num_ranks, num_microbatches, virtual_stages)


def by_name(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """``compute_by_name`` with its SEND/RECV (``add_send_recv``), unvalidated.

    Raises ValueError for an unknown name or a stage count the schedule cannot hold.
    """
    return add_send_recv(compute_by_name(name, num_ranks, num_microbatches, virtual_stages))


def schedule_for(name: str, num_stages: int, num_microbatches: int, *, num_ranks: int | None = None,
                 microbatch_sizes: Sequence[Sequence[int]] | None = None,
                 bpipe_thresholds: Sequence[int | None] | None = None, bpipe_policy: str = "jit") -> Schedule:
    """The validated schedule of a plan: `name` over `num_stages` stages on `num_ranks` ranks
    (default one per stage; several stages per rank only for a schedule in ``VIRTUAL``): the
    generator's compute actions, their SEND/RECV added by ``add_send_recv``, then BPipe's stash
    transfers.

    ``microbatch_sizes`` (UMPIPE, one list per stage): ``gpipe_uneven`` for gpipe,
    ``one_f_one_b_uneven`` for 1f1b (one stage per rank; both in
    ``pipecc.techniques.umpipe.schedule``); `num_microbatches` is then the
    longest list's length and not read. ``bpipe_thresholds``
    (BPipe, one entry per stage, None for a stage that does not evict): ``bpipe(one_f_one_b(p,
    m), thresholds, bpipe_policy)`` (1f1b, one stage per rank; all None: plain 1F1B), where
    ``one_f_one_b`` is ``add_send_recv(one_f_one_b_compute(p, m))``. The
    inference schedule is the name "inference".

    Raises ValueError (``ScheduleError`` when the result breaks a rule) for what cannot be
    built. The same fields give the same (immutable) object: the planner asks again and again.
    """
    ranks = num_stages if num_ranks is None else num_ranks
    sizes = None if microbatch_sizes is None else tuple(tuple(int(b) for b in row) for row in microbatch_sizes)
    thresholds = None if bpipe_thresholds is None else tuple(bpipe_thresholds)
    return _build(name, num_stages, num_microbatches, ranks, sizes, thresholds, bpipe_policy)


@cache
def _technique_hook(hook: str) -> Callable[..., Schedule]:
    """The technique schedule part's ``hook`` (``pipecc.techniques.parts("schedule")``, the first
    that defines it): how ``schedule_for`` builds a technique's plan field (``sized_rows``:
    UMPIPE's ``microbatch_sizes``; ``thresholds_refusal``, ``with_thresholds``: BPipe's
    ``bpipe_thresholds``). Looked up once per hook (the planner builds schedules again and again)."""
    # NOTE: the one lazy import the IR keeps, through importlib: the techniques' rules import this
    # registry (UNEVEN, schedule_for), so a written import of pipecc.techniques here would close the
    # cycle registry -> pipecc.techniques -> its rules -> registry that tests/test_layering.py's
    # cycle check counts; by the time a schedule is built this module has loaded, so the cycle is
    # harmless at run time (importing a technique's schedule module by name ran the same rules)
    techniques = importlib.import_module("pipecc.techniques")
    for part in techniques.parts("schedule"):
        found = getattr(part, hook, None)
        if found is not None:
            return found
    raise ValueError(f"no technique's schedule part defines {hook}")


@lru_cache(maxsize=512)
def _build(name: str, num_stages: int, num_microbatches: int, ranks: int,
           sizes: tuple[tuple[int, ...], ...] | None, thresholds: tuple[int | None, ...] | None,
           policy: str) -> Schedule:
    if ranks < 1 or num_stages % ranks:
        raise ValueError(f"{num_stages} stages do not divide over {ranks} ranks")
    virtual = num_stages // ranks
    if sizes is not None:
        if name not in UNEVEN:
            raise ValueError(f"unequal micro-batch sizes run under the gpipe or 1f1b schedule only, not {name!r}")
        if len(sizes) != num_stages:
            raise ValueError(f"microbatch_sizes has {len(sizes)} stage lists for {num_stages} stages")
        if name == "1f1b" and ranks != num_stages:
            raise ValueError(f"unequal micro-batch sizes under 1f1b put one stage on each rank, not "
                             f"{num_stages} stages on {ranks} ranks")
        # NOTE: UMPIPE's row orders are lowered by the same add_send_recv, inside them
        schedule = _technique_hook("sized_rows")(name, sizes, ranks)
    else:
        if thresholds is not None:  # BPipe's rule, before the base schedule's own refusals
            why = _technique_hook("thresholds_refusal")(name, virtual)
            if why is not None:
                raise ValueError(why)
        schedule = add_send_recv(compute_by_name(name, ranks, num_microbatches, virtual))
        if thresholds is not None:
            schedule = _technique_hook("with_thresholds")(schedule, thresholds, policy)
    validate(schedule)
    return schedule
