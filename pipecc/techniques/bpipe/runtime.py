"""BPipe's actions in the executor: ``StashMoves`` runs SEND_S, RECV_S, SEND_R and RECV_R and holds
their per-step state (the stash format, its transfer and capture: ``pipecc.techniques.bpipe.runtime_stash``).

A micro-batch the schedule evicts (it has a ``SEND_S`` on this rank) runs its forward under
saved-tensor hooks that file every saved activation in its store (``capture``); SEND_S packs the
store's storages into one payload, sends it to the partner stage p-1-s and drops them (the wire
lets go of the payload once the send completed, ``Wire.collect``); the partner keeps them from
RECV_S to SEND_R; RECV_R posts their receive (a prefetch) and the micro-batch's backward waits
for it first (``before``), so ``unpack`` finds them. Inputs and outputs of the stage
stay (the stage runner holds them). Only then are the sends RECV_R proves complete released
(``Schedule.send_release``: ``after``).

``StashMoves`` sees its rank through a ``RankContext`` (``pipecc.runtime.context``: the wire, the
timer, the schedule) and the stages' stashes through ``runner_of``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from pipecc.errors import PipeccError
from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.runtime.context import RankContext
from pipecc.runtime.handlers import Handler, RankParts
from pipecc.runtime.messages import message_tag
from pipecc.techniques.bpipe.runtime_stash import (Prefetch, SavedTensors, module_storages, recv_packed, send_stash,
                                                   storage_key)

if TYPE_CHECKING:  # NOTE: typing only; the runtime gives the runners
    from pipecc.runtime.stage_runner import StageRunner


__all__ = ["StashMoves", "handler"]


class StashMoves(Handler):
    """The stash transfers of the rank ``ctx``'s stages (no-ops on a schedule without them);
    ``runner_of(s)`` is stage ``s``'s ``StageRunner``."""

    def __init__(self, ctx: RankContext, runner_of: Callable[[int], StageRunner]) -> None:
        self.ctx, self.runner_of = ctx, runner_of
        self.evicted: dict[int, list[int]] = {}  # stage -> bytes of each SEND_S of the last step
        self.reset(None, (), False)

    kinds = tuple(kind for kind in ActionKind if kind.is_stash)

    def reset(self, schedule: Schedule | None, row: Sequence[Action], training: bool) -> None:
        """Per step: (stage, mb) -> the saved activations of an evicted micro-batch (this rank's
        stage); (evictor stage, mb) -> the partner's storages this rank keeps for it."""
        self.saved: dict[tuple[int, int], SavedTensors] = {}
        self.foreign: dict[tuple[int, int], torch.Tensor] = {}  # packed payloads (stash.pack)
        self.returning: dict[tuple[int, int], Prefetch] = {}  # RECV_R posted, B not yet run
        self.deferred: dict[tuple[int, int], list[Action]] = {}  # RECV_R's releases, until it arrived
        self.moving: list[Action] = []  # SEND_S/SEND_R whose buffers may still be on their way
        rank = self.ctx.rank
        self.evicting = {(a.stage, a.microbatch) for a in schedule.actions[rank]
                         if a.kind is ActionKind.SEND_S} if training and schedule is not None else set()
        self.evicted = {}

    @property
    def leftover(self) -> list:
        return sorted([*self.saved, *self.foreign, *self.returning])

    def capture(self, s: int, mb: int, module: torch.nn.Module) -> contextlib.AbstractContextManager | None:
        """F of an evicted micro-batch: the context that files its saved activations (else None)."""
        if (s, mb) not in self.evicting:
            return None
        store = self.saved[(s, mb)] = SavedTensors(module_storages([module]),
                                                   f"rank {self.ctx.global_rank} stage {s} mb {mb}")
        return store.capture()

    def backward_done(self, s: int, mb: int) -> None:
        """After B: its saved activations were unpacked."""
        self.saved.pop((s, mb), None)

    def before(self, action: Action) -> None:
        """Before a backward action: the prefetched stash must be here; waiting for it is a
        receive wait (timed as RECV_R), and only then are the sends RECV_R proves complete released."""
        key = (action.stage, action.microbatch)
        if action.kind.is_backward and key in self.returning:
            self.ctx.timed(Action(ActionKind.RECV_R, *key), partial(self._returned, *key))
            self.ctx.wire.release(self.deferred.pop(key, ()))

    def after(self, action: Action, releases: list[Action]) -> bool:
        """The sends a RECV_R proves complete are released once it arrived (it is only posted):
        it takes them (True); the stash sends that completed meanwhile drop their buffers."""
        taken = action.kind is ActionKind.RECV_R
        if taken:
            self.deferred[(action.stage, action.microbatch)] = releases
        if self.moving:
            self.moving = self.ctx.wire.collect(self.moving)
        return taken

    def run(self, a: Action, training: bool) -> None:
        """SEND_S evicts (stage, mb)'s saved activations to the partner, RECV_S keeps the
        evictor's, SEND_R sends them back, RECV_R posts their return."""
        ctx = self.ctx
        s, mb = a.stage, a.microbatch
        evictor = s if a.kind in (ActionKind.SEND_S, ActionKind.RECV_R) else ctx.schedule.partner[s]
        peer = ctx.peer(a)
        direction = 3 if a.kind in (ActionKind.SEND_S, ActionKind.RECV_S) else 4

        def tag_of(i: int) -> int:
            return message_tag(ctx.schedule, direction, evictor, mb, i)

        what = f"{a.kind.value} mb {mb} of stage {evictor}"
        if a.kind is ActionKind.SEND_S:
            store = self.saved.get((s, mb))
            if store is None:
                raise PipeccError(f"rank {ctx.global_rank}: {a} before {s}F{mb} (nothing captured to evict)")
            leaves, outs = self.runner_of(s).stash[mb]
            resident = frozenset(storage_key(t) for t in (*leaves, *outs) if isinstance(t, torch.Tensor))
            buffers = store.evict(resident)
            self.evicted.setdefault(s, []).append(sum(b.numel() for b in buffers))
            if ctx.state.timer is not None:
                ctx.state.timer.note_eviction(s, self.evicted[s][-1])
            send_stash(ctx.wire, buffers, peer, tag_of, what, a, ctx.device)
            self.moving.append(a)
        elif a.kind is ActionKind.RECV_S:
            self.foreign[(evictor, mb)] = recv_packed(ctx.wire, peer, tag_of, what, ctx.device)  # kept whole
        elif a.kind is ActionKind.SEND_R:
            send_stash(ctx.wire, self.foreign.pop((evictor, mb)), peer, tag_of, what, a, ctx.device, counted=False)
            self.moving.append(a)
        else:  # RECV_R: a prefetch, completed right before B (``before_backward``)
            self.returning[(s, mb)] = Prefetch(ctx.wire, peer, tag_of, what, ctx.device, self.saved[(s, mb)].away_sizes)

    def _returned(self, s: int, mb: int) -> None:
        """Wait for the stash RECV_R posted and put it back into (s, mb)'s store."""
        self.saved[(s, mb)].restore(self.returning.pop((s, mb)).wait())


def handler(parts: RankParts) -> StashMoves:
    """BPipe's share of the rank (`pipecc.runtime.handlers`)."""
    return StashMoves(parts.ctx, parts.runner)
