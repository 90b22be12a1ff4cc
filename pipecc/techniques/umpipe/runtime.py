"""Unequal micro-batches per stage (UMPIPE, PAPERS-SPEC.md 1.7): the re-slicing inbox.

With ``Schedule.microbatch_sizes`` every stage splits the batch into its own chunks, contiguous
sample intervals in order. A stage sends each chunk whole (message ``(F, s+1, j)``, ``j`` the
sending stage's chunk); the receiving stage ``s+1`` keeps the received chunks ("producer
buffers", the leaves that ``RECV_F`` made ``requires_grad``) and builds its chunk ``k`` as the
``torch.cat`` of ``narrow`` slices of the buffers that overlap chunk ``k``'s samples, under grad,
so that the backward of chunk ``k`` accumulates into each buffer's ``.grad`` exactly the rows it
used. A buffer's gradient is complete (and is sent upstream, under the buffer's own chunk
index: ``(B, s, j)``) once every chunk of ``s+1`` that overlaps it has run its backward — which,
with in-order backwards (GPipe's and 1F1B's rows alike), is right after the backward of the last
of them. A buffer
that matches a chunk exactly is passed through as is, so aligned stages run as before.

Rows. A batch dim of ``c * B`` rows (``B*S``) holds ``c`` consecutive rows per sample, as the
runtime's equal split assumes (``pipecc.runtime.ports``); a value without batch dim is the same
in every chunk and is taken from the first overlapping buffer (its gradient goes there, which
sums to the same parameter gradient upstream).

Any row order that runs each stage's forwards and backwards in chunk order works: the GPipe
and 1F1B orders run with unequal sizes (``pipecc.ir.schedule.UNEVEN``), one B per chunk (tied
mode: forward chunks are backward chunks); ``pipecc.runtime.engine`` refuses zero-bubble and
replicas with them.
Imports torch, ``pipecc.ir.schedule`` and ``pipecc.runtime.ports``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipecc.errors import PipeccError
from pipecc.ir.schedule.actions import Schedule
from pipecc.ir.schedule.chunks import chunk_bounds, overlapping
from pipecc.runtime.handlers import Handler, RankParts
from pipecc.runtime.ports import StagePorts

__all__ = ["Reslicer", "check", "check_sizes", "handler"]


def check(schedule: Schedule, modules: Sequence[Any], ports: Sequence[StagePorts], replicas: Any) -> None:
    """What a rank cannot run with unequal sizes (`pipecc.runtime.handlers`' ``check``): replicated
    stages, and sizes that do not fit the stages' batch (``check_sizes``)."""
    if schedule.microbatch_sizes is None:
        return
    if replicas.count > 1:
        raise PipeccError("unequal micro-batch sizes cannot run with replicated stages (--replicas > 1); "
                          "compile with --replicas 1 or equal micro-batches")
    check_sizes(schedule.microbatch_sizes, schedule.num_stages, ports[0].batch_size)


def check_sizes(sizes: Sequence[Sequence[int]], num_stages: int, batch: int | None) -> None:
    """One-line ``PipeccError`` unless ``sizes`` has one list of positive ints per stage, each
    summing to the compiled ``batch``."""
    if len(sizes) != num_stages:
        raise PipeccError(f"microbatch_sizes lists {len(sizes)} stages, the pipeline has {num_stages}: "
                          "give one size list per stage")
    for s, row in enumerate(sizes):
        if not row or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in row):
            raise PipeccError(f"microbatch_sizes of stage {s} must be positive integers, got {list(row)}")
        if batch is None:
            raise PipeccError("unequal micro-batch sizes need batched ports, and this stage has none; "
                              "compile with equal micro-batches")
        if sum(row) != batch:
            raise PipeccError(f"microbatch_sizes of stage {s} sum to {sum(row)}, the batch is {batch} rows; "
                              "give sizes that sum to the batch")


class Reslicer:
    """One rank's re-slicing state for its stages ``s > 0`` of an unequal schedule.

    ``forward_leaves`` hands ``F(s, k)`` its input leaves; ``backward_done`` says, after
    ``B(s, k)``, which upstream chunks' input gradients are now complete. ``inbox`` is the
    engine's: ``("F", s, j)`` -> the leaves of upstream chunk ``j`` as received (or handed over).
    """

    def __init__(self, schedule: Schedule, stage_ids: Sequence[int], ports: Sequence[StagePorts]):
        self.sizes = schedule.microbatch_sizes
        self._ports = {s: p for s, p in zip(stage_ids, ports)}
        self._needs: dict[int, list[list[int]]] = {}  # [s][k] -> upstream chunks chunk k reads
        self._covers: dict[int, list[list[int]]] = {}  # [s][j] -> chunks of s overlapping upstream j
        if self.sizes is not None:
            for s in stage_ids:
                if s > 0:
                    self._needs[s] = overlapping(self.sizes[s - 1], self.sizes[s])
                    self._covers[s] = overlapping(self.sizes[s], self.sizes[s - 1])
        self.reset()

    def reset(self) -> None:
        """Forget the last step's state (the engine calls it at the start of every run)."""
        self._held: dict[tuple[int, int], list[Any]] = {}  # (s, j) -> upstream chunk j's leaves
        self._done: set[tuple[int, int]] = set()  # (s, k) whose backward ran

    def active(self, stage: int) -> bool:
        """True when ``stage``'s inputs go through the re-slicing inbox."""
        return stage in self._needs

    @property
    def leftover(self) -> list[tuple[int, int]]:
        """Upstream chunks still held (empty after a complete step)."""
        return sorted(self._held)

    def forward_leaves(self, s: int, k: int, inbox: dict, training: bool) -> list[Any]:
        """The input leaves of ``F(s, k)``: upstream chunks taken from ``inbox`` when first
        needed, then sliced and concatenated (inside autograd when ``training``)."""
        needs = self._needs[s][k]
        for j in needs:
            if (s, j) not in self._held:
                self._held[(s, j)] = inbox.pop(("F", s, j))
        up, own = chunk_bounds(self.sizes[s - 1]), chunk_bounds(self.sizes[s])
        lo, hi = own[k], own[k + 1]
        if len(needs) == 1 and (up[needs[0]], up[needs[0] + 1]) == (lo, hi):
            leaves = list(self._held[(s, needs[0])])
        else:
            ports = self._ports[s]
            batch = ports.batch_size
            leaves = []
            with torch.set_grad_enabled(training):
                for i, port in enumerate(ports.in_leaves):
                    first = self._held[(s, needs[0])][i]
                    if port.kind != "tensor" or port.batch_dim is None:
                        leaves.append(first)
                        continue
                    if batch is None or port.shape[port.batch_dim] % batch:
                        raise PipeccError(f"stage {s} port {port.name!r}: batch dim of {port.shape[port.batch_dim]} "
                                          f"rows is not a multiple of the batch size {batch}")
                    rows = port.shape[port.batch_dim] // batch  # rows per sample
                    pieces = []
                    for j in needs:
                        a, b = max(lo, up[j]), min(hi, up[j + 1])
                        buf = self._held[(s, j)][i]
                        pieces.append(buf.narrow(port.batch_dim, (a - up[j]) * rows, (b - a) * rows))
                    leaves.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, port.batch_dim))
        if not training:  # nothing flows back: drop each upstream chunk after its last reader
            for j in needs:
                if self._covers[s][j][-1] == k:
                    del self._held[(s, j)]
        return leaves

    def backward_done(self, s: int, k: int) -> list[tuple[int, list[torch.Tensor]]]:
        """After ``B(s, k)``: ``(j, gradients)`` for every upstream chunk ``j`` whose
        overlapping chunks of ``s`` have all run their backward, in order; the gradients of its
        leaves that carry one (zeros for an input the stage did not use), as ``SEND_B`` sends them."""
        self._done.add((s, k))
        ready = []
        for j in self._needs[s][k]:
            if (s, j) in self._held and all((s, i) in self._done for i in self._covers[s][j]):
                leaves = self._held.pop((s, j))
                grads = [x.grad if x.grad is not None else torch.zeros_like(x)
                         for x, p in zip(leaves, self._ports[s].in_leaves) if p.carries_grad]
                ready.append((j, grads))
        return ready


class _Reslicing(Handler):
    """UMPIPE's share of the rank (`pipecc.runtime.handlers`): the rank's re-slicing inbox, which
    gives the stage runners F's input leaves and B's completed upstream chunks, reset before a
    step, checked after it."""

    def __init__(self, reslice: Reslicer, mailbox: Any) -> None:
        self.reslice = reslice
        # the rank's `pipecc.runtime.context.Mailbox`, whose inbox the messages fill
        self.mailbox = mailbox

    def reset(self, schedule: Any, row: Any, training: bool) -> None:
        self.reslice.reset()

    def forward_leaves(self, stage: int, microbatch: int, training: bool) -> list[Any] | None:
        if not self.reslice.active(stage):
            return None
        return self.reslice.forward_leaves(stage, microbatch, self.mailbox.inbox, training)

    def input_grads(self, stage: int, microbatch: int) -> list[tuple[int, list]] | None:
        """Unequal sizes: the upstream chunks whose gradient is complete."""
        if not self.reslice.active(stage):
            return None
        return self.reslice.backward_done(stage, microbatch)

    @property
    def leftover(self) -> list:
        return self.reslice.leftover


def handler(parts: RankParts) -> Handler:
    ctx = parts.ctx
    ports = [parts.runner(s).ports for s in ctx.stage_ids]
    return _Reslicing(Reslicer(ctx.schedule, ctx.stage_ids, ports), ctx.mailbox)
