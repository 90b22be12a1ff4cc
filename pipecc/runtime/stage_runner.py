"""One stage of a rank: ``StageRunner`` runs its F and B actions and owns what they keep between
actions, the stage's stash (per micro-batch: the input leaves and the outputs, or the scaled loss
on the last stage) and, on the last stage, the micro-batch losses and kept outputs.

The executor (``pipecc.runtime.engine.PipelineRuntime``) holds one runner per stage the schedule
places on its rank and hands each action to its handler (``PipelineRuntime._handlers``); F and B
are the runner's. A runner sees its rank through a ``RankContext`` (``pipecc.runtime.context``),
not the runtime. What a stage exchanges with its neighbours goes through the rank's mailbox
(``Mailbox``: received or locally handed-over values, values waiting for their SEND): a local
neighbour's values are put straight into the inbox, detached, as a receive would deliver them.

Technique hooks, each with its own module: BPipe's capture of an evicted micro-batch's saved
activations (``capture`` from ``pipecc.techniques.bpipe.runtime``, given to ``forward`` by the
executor, which also tells BPipe when B is done), Bi-Partition's programs (a
``pipecc.techniques.bipartition.runtime.BipartitionRunner``, the runtime part's ``stage_runner``,
overrides the computation and the ports its messages carry), the zero-bubble I and W
(``pipecc.techniques.zero_bubble.runtime.ZeroBubble``, which uses ``output_grads`` and
``hand_down``), unequal micro-batches' re-slicing (``pipecc.techniques.umpipe.runtime``, whose
handler answers ``forward_leaves`` and ``input_grads``: the runner asks the rank's handlers,
``RankContext.handlers``, through ``pipecc.runtime.handlers.first_answer``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipecc.errors import PipeccError
from pipecc.runtime.context import Mailbox, RankContext
from pipecc.runtime.handlers import first_answer
from pipecc.runtime.ports import Port, StagePorts, as_tuple, flatten, split_sizes, unflatten
from pipecc.runtime.loss_reduction import MEAN, MEAN_LOSS, SUM, split_words, step_factors, weight


__all__ = ["Mailbox", "StageRunner"]  # Mailbox: pipecc.runtime.context's, named here as before


class StageRunner:
    """Stage ``stage`` of the rank ``ctx``: its module, its ports, and its per-step state (``reset``)."""

    def __init__(self, ctx: RankContext, stage: int, module: nn.Module, ports: StagePorts) -> None:
        self.ctx, self.stage, self.module, self.ports = ctx, stage, module, ports
        self.first, self.last = stage == 0, stage == ctx.last_stage
        self.reset()

    def reset(self) -> None:
        """Per step: nothing stashed, no losses, no kept outputs."""
        self.stash: dict[int, tuple[list, Any]] = {}  # mb -> (input leaves, outputs | scaled loss)
        self.losses: list[torch.Tensor] = []
        self.results: dict[int, list] = {}
        self.factors_for: Any = None  # the targets ``factors`` were found for (step_factors)
        self.factors: list[float] | None = None

    @property
    def leftover(self) -> list[tuple[int, int]]:
        """(stage, mb) still stashed: a schedule that left work undone."""
        return [(self.stage, mb) for mb in self.stash]

    # -- the ports of the stage's messages (Bi-Partition's runner adds its own) ----------------

    def grad_sends(self) -> list[Port]:
        """The ports of the gradient message this stage sends upstream (SEND_B)."""
        return [p for p in self.ports.in_leaves if p.carries_grad]

    def grad_receives(self) -> list[Port]:
        """The ports of the gradient message this stage receives from downstream (RECV_B)."""
        return [p for p in self.ports.out_leaves if p.carries_grad]

    def forward_extra(self, mb: int, training: bool) -> list[torch.Tensor]:
        """Buffers after the usual ports of a forward message (none; Bi-Partition's saved tensors)."""
        return []

    def backward_extra(self, mb: int) -> list[torch.Tensor]:
        """Buffers after the usual ports of a backward message (none; Bi-Partition's)."""
        return []

    # -- F -----------------------------------------------------------------------------------

    def input_leaves(self, mb: int, training: bool) -> list[Any]:
        """F's input: stage 0's split batch, a technique's (the re-sliced upstream chunks of
        unequal sizes) or what the inbox holds."""
        ctx = self.ctx
        if self.first:
            return ctx.state.inputs[mb]
        leaves = first_answer(ctx.handlers, "forward_leaves", self.stage, mb, training)
        if leaves is not None:
            return leaves
        return ctx.mailbox.inbox.pop(("F", self.stage, mb))

    def compute(self, mb: int, leaves: list[Any], training: bool,
                capture: contextlib.AbstractContextManager | None) -> tuple[tuple, list[Any], list[Any]]:
        """The stage's forward: (outputs, their leaves, extra buffers for the message)."""
        with torch.set_grad_enabled(training), capture or contextlib.nullcontext():
            outs = as_tuple(self.module(*unflatten(leaves, self.ports.receives)))
        return outs, flatten(outs, self.ports.sends, f"rank {self.ctx.global_rank} stage {self.stage} output"), []

    def forward(self, mb: int, training: bool, capture: contextlib.AbstractContextManager | None = None) -> None:
        """F: run the stage on micro-batch ``mb``; stash what B needs, hand the outputs on (or,
        on the last stage, keep the scaled loss or the outputs)."""
        ctx, s = self.ctx, self.stage
        leaves = self.input_leaves(mb, training)
        with ctx.autocast():  # mixed precision: the forward and the loss, as in an autocast region
            outs, out_leaves, extra = self.compute(mb, leaves, training, capture)
            self.check(mb, out_leaves, self.ports.out_leaves)
            if self.last and training:
                loss = self.loss(outs, mb)
        if self.last:
            if not training:
                self.results[mb] = out_leaves
                return
            if ctx.state.keep_outputs:
                self.results[mb] = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
            self.losses.append(loss.detach().float())
            # fp16: the backward runs on the scaled loss (pipecc.runtime.distributed unscales the gradients)
            scale = ctx.state.loss_scale
            self.stash[mb] = (leaves, loss * scale if scale != 1.0 else loss)
        else:
            if training:
                self.stash[mb] = (leaves, out_leaves)
            if s + 1 in ctx.stage_ids:  # local neighbour: hand over detached copies, like a receive
                ctx.mailbox.inbox[("F", s + 1, mb)] = [
                    o.detach().requires_grad_(training and p.carries_grad) if p.kind == "tensor" else o
                    for o, p in zip(out_leaves, self.ports.out_leaves)] + list(extra)
            else:
                ctx.mailbox.outbox[("F", s, mb)] = [*out_leaves, *extra]

    def loss(self, outs: tuple, mb: int) -> torch.Tensor:
        """Micro-batch ``mb``'s loss times its share of the batch (and the replica's weight)."""
        ctx = self.ctx
        value = outs[0] if len(outs) == 1 else outs
        loss = ctx.loss_fn(value, ctx.state.targets[mb]) if ctx.loss_fn is not None else outs[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipeccError(f"rank {ctx.global_rank}: the loss must be a scalar tensor, got "
                              f"{getattr(loss, 'shape', type(loss).__name__)}; pass loss_fn")
        # how the model file's loss_fn combines over parts of the batch (pipecc.runtime.loss_reduction,
        # found at compile; rundata puts it on the loss function): a sum adds the parts' losses
        reduction = getattr(ctx.loss_fn, "reduction", MEAN_LOSS)
        n = self.ports.batch_size
        sizes = ctx.schedule.microbatch_sizes
        if sizes is not None:  # b_k / B (n: the sizes' sum, check_sizes)
            part, whole = sizes[self.stage][mb], sum(sizes[0])
        else:
            part, whole = (split_sizes(n, ctx.m)[mb], n) if n is not None else (1, ctx.m)
        if reduction.kind not in (MEAN, SUM) and (ctx.m > 1 or ctx.replicas.count > 1):
            raise PipeccError(f"rank {ctx.global_rank}: " + reduction.message(split_words(ctx.m, ctx.replicas.count)))
        if reduction.kind not in (MEAN, SUM):  # the whole batch in one micro-batch
            return loss.reshape(())
        exact = self.step_factors(value, mb, reduction.kind, sizes[self.stage] if sizes is not None else
                                  split_sizes(n, ctx.m) if n is not None else None)
        if exact is not None:  # this step's targets weigh the micro-batches (ignore_index, class weights)
            return loss.reshape(()) * exact[mb] if exact[mb] else self.zero_loss(outs, loss)
        if reduction.kind == SUM:
            return loss.reshape(())
        return loss.reshape(()) * (weight(MEAN, part, whole) * ctx.replicas.weight)

    def step_factors(self, value: Any, mb: int, kind: str, parts: list[int] | None) -> list[float] | None:
        """This step's factors on the micro-batch losses when its targets make them other than
        the analysed ones (``loss_reduction.step_factors``), found once per step; None otherwise."""
        ctx = self.ctx
        if self.factors_for is not ctx.state.targets:
            self.factors_for, self.factors = ctx.state.targets, None
            if parts is not None and ctx.state.targets is not None and ctx.loss_fn is not None:
                targets, sizes, first = list(ctx.state.targets), list(parts), 0
                if ctx.replicas.count > 1:  # the batch's factors need every replica's targets
                    targets, sizes, first = self.every_replica(targets, sizes)
                try:
                    found = step_factors(ctx.loss_fn, value, first + mb, targets, sizes, kind)
                except PipeccError as exc:
                    raise PipeccError(f"rank {ctx.global_rank}: {exc}") from None
                self.factors = None if found is None else found[first:first + len(parts)]
        return self.factors

    def every_replica(self, targets: list[Any], sizes: list[int]) -> tuple[list[Any], list[int], int]:
        """Every replica's micro-batch targets and sizes, replica by replica (collective over the
        replicas of this pipeline rank), and where this replica's start."""
        import torch.distributed as dist
        ctx = self.ctx
        gathered: list[Any] = [None] * ctx.replicas.count
        mine = ([_on_cpu(t) for t in targets], sizes)
        dist.all_gather_object(gathered, mine, group=ctx.replicas.group(ctx.rank))
        every_target = [t for g in gathered for t in g[0]]
        every_size = [n for g in gathered for n in g[1]]
        return every_target, every_size, sum(len(g[1]) for g in gathered[:ctx.replicas.index])

    @staticmethod
    def zero_loss(outs: tuple, loss: torch.Tensor) -> torch.Tensor:
        """A zero loss with zero gradients for a micro-batch whose targets all count for nothing
        (its own loss is 0/0, NaN, and would make every gradient NaN)."""
        zero = torch.zeros((), device=loss.device)
        for o in as_tuple(outs):
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad:
                zero = zero + o.float().sum() * 0.0
        return zero

    def check(self, mb: int, leaves: Sequence[Any], ports: Sequence[Port]) -> None:
        """Fail early, naming the port, when an output does not match the spec its peer relies on."""
        batch = self.ports.batch_size
        for v, port in zip(leaves, ports):
            if port.kind != "tensor":
                continue
            shape = port.microbatch_shape(mb, batch, self.ctx.split_of(self.stage))
            # mixed precision: a float32 port may hold the autocast dtype (it travels in it)
            amp = self.ctx.amp_dtype is not None and port.dtype == torch.float32 and isinstance(v, torch.Tensor) \
                and v.dtype in (torch.float32, self.ctx.amp_dtype)
            if not isinstance(v, torch.Tensor) or not port.matches(v.shape, shape) or (v.dtype != port.dtype
                                                                                       and not amp):
                got = f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor) \
                    else type(v).__name__
                raise PipeccError(f"rank {self.ctx.global_rank} stage {self.stage} mb {mb}: output {port.name!r} is "
                                  f"{got}, ports.json says {list(shape)} {str(port.dtype).removeprefix('torch.')}")

    # -- B -----------------------------------------------------------------------------------

    def output_grads(self, mb: int, outs: Any) -> tuple[list, list | None]:
        """The backward's roots and their gradients: the scaled loss on the last stage (no
        gradient), else the outputs that carry one with the gradients received for them."""
        if self.last:
            return [outs], None
        grads = iter(self.ctx.mailbox.inbox.pop(("B", self.stage, mb)))
        pairs = [(o, next(grads)) for o, p in zip(outs, self.ports.out_leaves) if p.carries_grad]
        pairs = [(o, g) for o, g in pairs if isinstance(o, torch.Tensor) and o.requires_grad]
        # mixed precision: a gradient travels in the wire dtype; autograd wants the output's
        return [o for o, _ in pairs], [g.to(o.dtype) if g.dtype != o.dtype else g for o, g in pairs]

    def backward(self, mb: int) -> None:
        """B: input and weight gradients of micro-batch ``mb``; the input gradients go upstream."""
        in_leaves, outs = self.stash.pop(mb)
        roots, grads = self.output_grads(mb, outs)
        if self.last:
            torch.autograd.backward(roots)  # the scaled loss
        elif roots:
            torch.autograd.backward(roots, grads)
        if self.first:
            return
        # a technique's (unequal sizes: the upstream chunks whose gradient is complete), else this chunk's
        ready = first_answer(self.ctx.handlers, "input_grads", self.stage, mb)
        if ready is None:
            ready = [(mb, [x.grad if x.grad is not None else torch.zeros_like(x)
                           for x, p in zip(in_leaves, self.ports.in_leaves) if p.carries_grad])]
        for j, input_grads in ready:
            self.hand_down(j, input_grads)

    def hand_down(self, mb: int, input_grads: list) -> None:
        """The gradient of the stage's inputs for upstream chunk ``mb``: into a local upstream
        stage's inbox, else the outbox of this stage's SEND_B."""
        if self.stage - 1 in self.ctx.stage_ids:
            self.ctx.mailbox.inbox[("B", self.stage - 1, mb)] = input_grads
        else:
            self.ctx.mailbox.outbox[("B", self.stage, mb)] = input_grads


def _on_cpu(value: Any) -> Any:
    """A target (a tensor, or a tuple/list of them) on the CPU, to send to the other replicas."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_on_cpu(v) for v in value)
    return value
