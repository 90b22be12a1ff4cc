"""What a rank's stage runners and action handlers are given instead of the runtime: a
``RankContext`` (frozen: who the rank is, the schedule it runs, where and in what precision, its
mailbox and the techniques' handlers) and, in it, the ``RankState`` that changes between and
during steps (the wire, the step's split batch and target, what the runtime's caller sets).

``PipelineRuntime`` (``pipecc.runtime.engine``) builds one context per rank and hands it to each
``StageRunner`` and to ``Messages``, ``StashMoves`` and ``WeightRefresh``; their other
collaborators (the stage runners of the rank, the message tag) come as explicit arguments. The
runtime's attributes of the same names read and write the state (``Shared``), so
``runtime.loss_scale = 2.0`` (fp16's scaler) or a test's ``runtime._wire = Wire(...)`` (NCCL's
wire on gloo) reach every runner and handler. The runtime's own read-only facts of the rank
(``rank``, ``stage_ids``, ``schedule``, ``device``, ...) are this context's, and ``TraceRecorder``
(``pipecc.runtime.trace``) is given the context too.

Imports torch, ``pipecc.ir.schedule`` and ``pipecc.runtime`` modules below the executor only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pipecc.ir.schedule.actions import Action, Schedule
from pipecc.runtime.handlers import Handler
from pipecc.techniques.replicas.runtime import Replicas
from pipecc.runtime.wire import Wire, peer_rank

if TYPE_CHECKING:  # NOTE: typing only; the runtime sets the timer
    from pipecc.runtime.timing import ActionTimer

__all__ = ["Mailbox", "RankContext", "RankState", "Shared"]


@dataclass
class Mailbox:
    """A rank's values in flight, per step: ``inbox[("F"|"B", stage, mb)]`` what arrived (or a
    local neighbour handed over) for ``stage``; ``outbox[...]`` what ``stage``'s next SEND takes."""

    inbox: dict[tuple[str, int, int], list] = field(default_factory=dict)
    outbox: dict[tuple[str, int, int], list] = field(default_factory=dict)

    def clear(self) -> None:
        self.inbox, self.outbox = {}, {}


@dataclass
class RankState:
    """What changes on a rank: the wire (a test may swap it), what the runtime's caller sets
    between steps, and the split batch and target while a step runs."""

    wire: Wire
    loss_scale: float = 1.0  # fp16: the scaled loss's factor (pipecc.runtime.distributed's scaler)
    keep_outputs: bool = False  # True: step() keeps the last stage's outputs for last_outputs()
    # Bi-Partition: True when the caller runs after_optimizer_step after every step (dist.py's
    # training loop): the replicas' refresh receive is then posted during the step (REFRESH)
    refresh_follows: bool = False
    timer: ActionTimer | None = None  # set: every action runs through it (pipecc run --json)
    inputs: list[list[Any]] | None = None  # stage 0's split batch, during a step
    targets: list[Any] | None = None  # the last stage's split target, during a training step


@dataclass(frozen=True)
class RankContext:
    """A rank as its stage runners and action handlers see it (module docstring)."""

    rank: int  # the pipeline rank: the schedule's row
    global_rank: int  # in the process group (replicas: ``Replicas.rank_of``); errors name it
    stage_ids: tuple[int, ...]  # the rank's stages, ascending
    schedule: Schedule  # as the rank runs it (its collectives included)
    device: torch.device
    amp_dtype: torch.dtype | None  # mixed precision's autocast dtype; None: float32
    replicas: Replicas
    loss_fn: Callable | None
    mailbox: Mailbox
    # the techniques' handlers (`pipecc.runtime.handlers`), which the stage runners ask; NOTE: the
    # engine fills the list once the runners they are built from exist
    handlers: list[Handler]
    state: RankState

    @property
    def wire(self) -> Wire:
        """The wire every message of the rank goes through (``state.wire``, read at each use)."""
        return self.state.wire

    @property
    def m(self) -> int:
        """Micro-batches per step (unequal sizes: the most chunks of any stage)."""
        return self.schedule.num_microbatches

    @property
    def last_stage(self) -> int:
        return self.schedule.num_stages - 1

    @property
    def world(self) -> int:
        """The number of pipeline ranks (the schedule's rows)."""
        return self.schedule.num_ranks

    def split_of(self, stage: int) -> int | tuple[int, ...]:
        """How ``stage`` splits the batch: its chunk sizes (unequal micro-batches), else m."""
        sizes = self.schedule.microbatch_sizes
        return self.m if sizes is None else sizes[stage]

    def peer(self, a: Action) -> int:
        """The process-group rank on the other end of a SEND/RECV (the same replica's)."""
        return self.replicas.rank_of(peer_rank(self.schedule, a))

    def autocast(self) -> Any:
        """The context a stage's forward and loss run in: torch.autocast in the run's precision,
        else nothing."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def timed(self, action: Action, execute: Callable[[], None]) -> None:
        """Run ``execute`` (the action's work), through the timer when one is set."""
        timer = self.state.timer
        if timer is None:
            execute()
        else:
            timer.run(action, execute)


class Shared:
    """A ``PipelineRuntime`` attribute that lives in its ``RankState`` (``runtime.ctx.state``), so
    what the runtime's caller sets reaches the runners: ``loss_scale = Shared()`` in the class
    makes ``runtime.loss_scale`` read and write ``runtime.ctx.state.loss_scale``."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.ctx.state, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.ctx.state, self.name, value)
