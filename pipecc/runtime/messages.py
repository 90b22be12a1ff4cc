"""The executor's message actions: ``Messages`` runs SEND_F, RECV_F, SEND_B and RECV_B for a rank's
stage runners, numbers every message (``tag``) and checks, before the first step, that each
remote neighbour reads the same boundary from ports.json (``handshake``).

A message carries a boundary's leaves: tensors as they are, objects as a length and a JSON
payload (``pipecc.runtime.wire``). A message with Bi-Partition's saved tensors (``SAVED`` ports
after the usual ones) sends all its tensors as one packed payload (``wire.pack_tensors``,
``recv_packed``: one message, as the planner charges a boundary). The ports each message carries
are the stage runner's (``StageRunner.grad_sends`` and friends; a Bi-Partition runner has its
own). A ``Messages`` sees its rank through a ``RankContext`` (``pipecc.runtime.context``) and its
stage runners through ``runner_of``; the wire is the context's at the time of the call (a test
may swap the runtime's).

Variable lengths (a folder compiled with ``--length``): a message whose tensor leaves have dynamic
dims (``Port.dynamic``: the declared length symbol in their ``shape_expr``) is preceded by one
int64 header holding those leaves' shapes (``SHAPES``, its own tag), so the receiver allocates
buffers of the batch's length; a folder without a declared length sends no header.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipecc.errors import PipeccError
from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.runtime.context import RankContext
from pipecc.runtime.ports import Port, describe
from pipecc.runtime.wire import decode_object, encode_object, fingerprint, pack_tensors, packed_layout, packed_views

if TYPE_CHECKING:  # NOTE: typing only; the runtime gives the runners
    from pipecc.runtime.stage_runner import StageRunner


__all__ = ["MAX_PORTS", "Messages", "SAVED", "message_tag"]

MAX_PORTS = 1024  # values crossing one stage boundary
# a tensor a stage runner sends after its ports (a Bi-Partition worker's segments' saved tensors): the
# wire's view of it (sent by shape, received into buffers); a message with one goes as one packed payload
SAVED = Port("saved", "tensor")
SHAPES = 5  # the tag direction of a variable-length message's shape header (``tag``)


def message_tag(schedule: Schedule, direction: int, stage: int, mb: int, leaf: int) -> int:
    """The gloo tag of a leaf's first message (even; an object's payload gets tag + 1).

    Both ends compute it from (direction, receiving stage, mb, leaf) alone, so it must not
    depend on anything only one side knows. Unique within a step: the schedule's
    ``num_microbatches`` is the largest chunk count of any stage (unequal sizes: ``mb`` is the
    upstream stage's chunk). Directions: 0 forward, 1 backward, 2 the handshake, 3 BPipe's
    eviction and Bi-Partition's refresh, 4 BPipe's return, 5 (``SHAPES``) a shape header, whose
    ``leaf`` is the direction of the message it describes.
    """
    tag = (((direction * schedule.num_stages + stage) * schedule.num_microbatches + mb) * MAX_PORTS + leaf) * 2
    if leaf >= MAX_PORTS or tag >= 2**31:
        raise PipeccError(f"too many ports ({leaf + 1}), stages or microbatches for 31-bit message tags")
    return tag


class Messages:
    """SEND/RECV of activations and gradients for the stages of the rank ``ctx``; ``runner_of(s)``
    is stage ``s``'s ``StageRunner``."""

    def __init__(self, ctx: RankContext, runner_of: Callable[[int], StageRunner]) -> None:
        self.ctx, self.runner_of = ctx, runner_of

    def tag(self, direction: int, stage: int, mb: int, leaf: int) -> int:
        """``message_tag`` in the rank's schedule."""
        return message_tag(self.ctx.schedule, direction, stage, mb, leaf)

    # -- the action handlers ------------------------------------------------------------------

    def send_forward(self, a: Action, training: bool) -> None:
        values = self.ctx.mailbox.outbox.pop(("F", a.stage, a.microbatch))
        ports = self.runner_of(a.stage).ports.out_leaves
        self.send(a, values, [*ports, *[SAVED] * (len(values) - len(ports))])  # Bi-Partition: saved after

    def send_backward(self, a: Action, training: bool) -> None:
        values = self.ctx.mailbox.outbox.pop(("B", a.stage, a.microbatch))
        ports = self.runner_of(a.stage).grad_sends()
        self.send(a, values, [*ports, *[SAVED] * (len(values) - len(ports))])

    def recv_forward(self, a: Action, training: bool) -> None:
        runner = self.runner_of(a.stage)
        extra = runner.forward_extra(a.microbatch, training)
        leaves = self.recv(a, runner.ports.in_leaves, extra)
        if training:
            for v, port in zip(leaves, runner.ports.in_leaves):
                if port.carries_grad:
                    v.requires_grad_(True)
        self.ctx.mailbox.inbox[("F", a.stage, a.microbatch)] = leaves

    def recv_backward(self, a: Action, training: bool) -> None:
        runner = self.runner_of(a.stage)
        self.ctx.mailbox.inbox[("B", a.stage, a.microbatch)] = self.recv(a, runner.grad_receives(),
                                                                         runner.backward_extra(a.microbatch))

    # -- the wire ------------------------------------------------------------------------------

    def send(self, a: Action, values: Sequence[Any], ports: Sequence[Port]) -> None:
        ctx = self.ctx
        peer = ctx.peer(a)
        forward = a.kind is ActionKind.SEND_F
        receiver = a.stage + 1 if forward else a.stage - 1
        what = f"{a.kind.value} mb {a.microbatch}"
        payloads = []
        dynamic = [i for i, port in enumerate(ports) if port.dynamic and port.kind == "tensor"]
        if dynamic:  # variable lengths: the shapes first, so the receiver can allocate
            header = torch.tensor([d for i in dynamic for d in values[i].shape], dtype=torch.int64,
                                  device=ctx.device)
            ctx.wire.send(header, peer, self.tag(SHAPES, receiver, a.microbatch, 0 if forward else 1), what, key=a)
        packed = any(p is SAVED for p in ports)  # Bi-Partition: its tensors go as one payload (wire.pack_tensors)
        if packed:
            tensors = [i for i, port in enumerate(ports) if port.kind == "tensor"]
            ctx.wire.send(pack_tensors([_as_wire(values[i], ports[i], ctx) for i in tensors], ctx.device), peer,
                          self.tag(0 if forward else 1, receiver, a.microbatch, tensors[0]), what, key=a)
        for i, (v, port) in enumerate(zip(values, ports)):
            tag = self.tag(0 if forward else 1, receiver, a.microbatch, i)
            if port.kind == "tensor":
                if not packed:
                    ctx.wire.send(_as_wire(v, port, ctx), peer, tag, what, key=a)
            else:
                data = encode_object(v, f"{what} port {port.name!r}").to(ctx.device)
                length = torch.tensor([data.numel()], dtype=torch.int64, device=ctx.device)
                ctx.wire.send(length, peer, tag, what, key=a)
                payloads.append((data, tag + 1))
        for data, tag in payloads:
            ctx.wire.send(data, peer, tag, what, key=a)

    def recv(self, a: Action, ports: Sequence[Port], extra: Sequence[torch.Tensor] = ()) -> list[Any]:
        ctx = self.ctx
        peer = ctx.peer(a)
        direction = 0 if a.kind is ActionKind.RECV_F else 1
        what = f"{a.kind.value} mb {a.microbatch}" + (f" of stage {a.stage}" if len(ctx.stage_ids) > 1 else "")
        batch = self.runner_of(a.stage).ports.batch_size
        shapes = self.recv_shapes(a, ports, peer, direction, what)
        first: list[torch.Tensor] = []
        for i, port in enumerate(ports):
            if port.kind == "tensor":  # RECV_F: an upstream chunk (unequal sizes: its own size)
                shape = shapes.get(i) or port.microbatch_shape(a.microbatch, batch, ctx.split_of(
                    a.stage - 1 if a.kind is ActionKind.RECV_F else a.stage))
                first.append(torch.empty(shape, dtype=_wire_dtype(ctx, port), device=ctx.device))
            else:
                first.append(torch.empty(1, dtype=torch.int64, device=ctx.device))
        tags = [self.tag(direction, a.stage, a.microbatch, i) for i in range(len(ports) + len(extra))]
        if extra:  # Bi-Partition's saved tensors: every tensor leaf arrives in one payload (``send``)
            first, extra = self.recv_packed(first, ports, extra, peer, tags, what)
        else:
            ctx.wire.recv([*first, *extra], peer, tags, what)
        objects = [i for i, p in enumerate(ports) if p.kind == "object"]
        if not objects:
            return [*first, *extra]
        payloads = [torch.empty(int(first[i].item()), dtype=torch.uint8, device=ctx.device) for i in objects]
        ctx.wire.recv(payloads, peer, [tags[i] + 1 for i in objects], what)
        values: list[Any] = list(first)
        for i, data in zip(objects, payloads):
            values[i] = decode_object(data, ctx.device)
        return [*values, *extra]

    def recv_shapes(self, a: Action, ports: Sequence[Port], peer: int, direction: int,
                    what: str) -> dict[int, tuple[int, ...]]:
        """The shapes of the message's dynamic tensor leaves, from its header (``send``); {}
        when it has none (a fixed-length folder: no header travels)."""
        dynamic = [i for i, port in enumerate(ports) if port.dynamic and port.kind == "tensor"]
        if not dynamic:
            return {}
        ctx = self.ctx
        header = torch.empty(sum(len(ports[i].shape) for i in dynamic), dtype=torch.int64, device=ctx.device)
        ctx.wire.recv([header], peer, [self.tag(SHAPES, a.stage, a.microbatch, direction)], what)
        dims = [int(d) for d in header.cpu()]
        out = {}
        for i in dynamic:
            n = len(ports[i].shape)
            out[i], dims = tuple(dims[:n]), dims[n:]
        return out

    def recv_packed(self, first: list[torch.Tensor], ports: Sequence[Port], extra: Sequence[torch.Tensor], peer: int,
                    tags: Sequence[int], what: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Receive a message whose tensor leaves (``first``'s tensor ports, then ``extra``) travel
        packed, with the object ports' lengths; returns the leaves as views of the payload."""
        ctx = self.ctx
        leaves = [i for i, p in enumerate(ports) if p.kind == "tensor"]
        objects = [i for i, p in enumerate(ports) if p.kind != "tensor"]
        tensors = [first[i] for i in leaves] + list(extra)
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        payload = torch.empty(packed_layout(specs)[1], dtype=torch.uint8, device=ctx.device)
        ctx.wire.recv([payload, *[first[i] for i in objects]], peer,
                      [tags[leaves[0] if leaves else len(ports)], *[tags[i] for i in objects]], what)
        views = packed_views(payload, specs)
        for i, v in zip(leaves, views):
            first[i] = v
        return first, views[len(leaves):]

    def handshake(self) -> None:
        """Check with every remote neighbour that both read the same boundary from ports.json.

        Neighbours that disagree would otherwise exchange messages of the wrong size, which
        gloo reports only as a closed connection.
        """
        ctx = self.ctx
        for s in ctx.stage_ids:
            if s < ctx.last_stage and s + 1 not in ctx.stage_ids:
                peer = ctx.replicas.rank_of(ctx.schedule.stage_to_rank[s + 1])
                digest = fingerprint(self.runner_of(s).ports.out_leaves).to(ctx.device)
                ctx.wire.send(digest, peer, self.tag(2, s + 1, 0, 0), "the port handshake", key=s)
        for s in ctx.stage_ids:
            if s > 0 and s - 1 not in ctx.stage_ids:
                peer = ctx.replicas.rank_of(ctx.schedule.stage_to_rank[s - 1])
                got = torch.empty(32, dtype=torch.uint8, device=ctx.device)
                ctx.wire.recv([got], peer, [self.tag(2, s, 0, 0)], "the port handshake")
                if not torch.equal(got.cpu(), fingerprint(self.runner_of(s).ports.in_leaves)):
                    ports = ", ".join(f"{p.name}:{describe(p)}" for p in self.runner_of(s).ports.in_leaves)
                    raise PipeccError(f"rank {ctx.global_rank}: stage {s} receives ({ports}) but stage {s - 1} "
                                      f"on rank {peer} sends something else; are both from the same compilation?")
        ctx.wire.flush()


def _as_wire(value: Any, port: Port, ctx: RankContext) -> Any:
    """A tensor leaf as it travels: in the run's wire dtype (mixed precision: float32 ports in the
    autocast dtype, ``_wire_dtype``)."""
    if port is SAVED or not isinstance(value, torch.Tensor):
        return value
    dtype = _wire_dtype(ctx, port)
    return value.to(dtype) if value.dtype != dtype else value


def _wire_dtype(ctx: RankContext, port: Port) -> torch.dtype:
    """The dtype a leaf travels in: the autocast dtype for a float32 port under mixed precision,
    else the port's."""
    amp = ctx.amp_dtype
    return amp if amp is not None and port.dtype == torch.float32 else port.dtype
