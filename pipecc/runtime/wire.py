"""The transport between ranks: point-to-point messages over torch.distributed, and what the
schedule tells it (message order for NCCL, when a send is certainly complete, the process groups).

Wire protocol (per SEND/RECV action, one microbatch):
  * tensor port: one message of the microbatch shape and spec dtype, received into a buffer
    allocated from the spec.
  * object port (``kind: "object"``, e.g. a Python int shape): JSON, not pickle — a peer cannot
    make us run code (``encode_object``; the values ``pipecc.runtime.ports.to_json`` allows, a
    torch.device arrives as the receiver's own device). Two messages: an int64 length, then the
    UTF-8 bytes as uint8.
  * tuple port (``kind: "tuple"``, ``items``): travels as its leaves, in order.
  * backward: only ports with ``requires_grad`` and a floating dtype carry a gradient back
    (integer token ids never do); both sides decide this from the spec alone. A received input
    the stage did not use sends zeros.
  * BPipe stash (SEND_S/RECV_S evictor -> partner, SEND_R/RECV_R back): an int64 byte count,
    then one uint8 payload packing the storages and their layout (``pipecc.techniques.bpipe.runtime_stash``); the
    peer is the partner stage's rank (``Schedule.partner``), the message key the evictor's.
  * Bi-Partition message carrying a segment's saved tensors (``pipecc.techniques.bipartition.runtime_segments``): all
    its tensor leaves, values and saved tensors, travel as one uint8 payload (``pack_tensors``,
    each leaf ALIGN-aligned; both ends know every shape), on the first tensor leaf's tag; the
    receiver's leaves are views of it (``packed_views``). Object ports go as usual.
  Messages go in port order, first every tensor and length, then the object payloads. Gloo
  matches them by tag (direction, receiving stage, microbatch, port); NCCL ignores tags and
  matches by order, which ``check_fifo`` verifies against the schedule before an NCCL run.
  At start-up neighbours swap a digest of their shared boundary (``fingerprint``), so two
  ``ports.json`` that disagree fail with a clear error instead of a mis-sized message.

Sends and receives. A SEND never blocks (``isend``; handle and tensor are kept until a later
receive proves the peer has the message, ``Schedule.send_release``, or else to the end of ``step``); a
RECV waits with a deadline. That is the model ``pipecc.ir.schedule.validate`` proves deadlock-free,
so 1F1B, whose neighbours send in opposite directions at once, cannot deadlock.
On gloo a GPU rank's messages and collectives go through host memory (``Wire`` stages its sends
and receives; ``all_reduce``, ``broadcast`` and ``all_gather`` below copy), so a GPU stage and a CPU
stage form one pipeline (a heterogeneous folder such as ``h200@cuda:0,cpu``).
No ``batch_isend_irecv``: on gloo it can hang. On NCCL a process group runs its p2p operations
in issue order on one stream and a send may wait for its receiver, which would let a pending
send hold up a receive; the runtime therefore gives every direction between two ranks its own
two-rank group (``directed_groups``), so each stream carries sends only or receives only.

Imports torch, ``pipecc.ir.schedule``, ``pipecc.errors`` and ``pipecc.runtime.ports``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipecc.errors import PipeccError
from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.runtime.ports import Port, boundary_digest, from_json, to_json

__all__ = [
    "ALIGN",
    "Wire",
    "all_gather",
    "all_reduce",
    "broadcast",
    "check_fifo",
    "decode_object",
    "directed_groups",
    "encode_object",
    "fingerprint",
    "pack_tensors",
    "packed_layout",
    "packed_views",
    "peer_rank",
    "wait_until",
]


# ---------------------------------------------------------------------------- the schedule's messages


def peer_rank(schedule: Schedule, a: Action) -> int:
    """The rank on the other end of a SEND/RECV: the neighbouring stage's, or for a BPipe stash
    transfer (SEND_S, RECV_S, SEND_R, RECV_R) the partner stage's (``Schedule.partner``)."""
    if a.kind.is_stash:
        partner = schedule.partner[a.stage] if schedule.partner is not None else None
        if partner is None:
            raise PipeccError(f"{a}: stage {a.stage} has no BPipe partner in the schedule")
        return schedule.stage_to_rank[partner]
    neighbour = a.stage + 1 if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) else a.stage - 1
    return schedule.stage_to_rank[neighbour]


def check_fifo(schedule: Schedule) -> None:
    """Raise unless every rank receives from each peer in the order that peer sends (NCCL needs it),
    BPipe's stash messages included."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if a.kind.is_send:
                sent.setdefault((rank, peer_rank(schedule, a)), []).append(schedule.message(a))
            elif a.kind.is_recv:
                received.setdefault((peer_rank(schedule, a), rank), []).append(schedule.message(a))
    for pair, order in sent.items():
        if received.get(pair) != order:
            raise PipeccError(f"rank {pair[1]} receives from rank {pair[0]} in another order than it sends; "
                              "NCCL matches messages by order: use the gloo backend or reorder the schedule")


# ---------------------------------------------------------------------------- transport


def wait_until(work: Any, deadline: float, nccl: bool) -> None:
    """``work.wait()``, given up at ``deadline`` (``time.monotonic``): raises TimeoutError then,
    RuntimeError when the work failed (a peer exited or crashed)."""
    if nccl:
        # NOTE: NCCL's wait() only orders streams; poll so a dead peer cannot block us forever.
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(0.0002)
        work.wait()
    else:
        work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


class Wire:
    """One rank's messages: sends never block, receives wait with a deadline.

    ``groups[(src, dst)]`` is the process group carrying src -> dst traffic: None (the default
    group, messages matched by tag) on gloo; on NCCL one two-rank group per direction, so a
    send still waiting for its receiver never holds up a receive (see the module docstring).
    Sent tensors stay referenced until ``flush`` has seen their sends complete.
    """

    def __init__(self, rank: int, timeout_s: float, nccl: bool = False,
                 groups: dict[tuple[int, int], Any] | None = None, by_order: bool = False):
        self.rank, self.timeout_s, self.nccl, self.groups = rank, timeout_s, nccl, groups or {}
        self.by_order = by_order  # tag every message 0, as NCCL effectively does (tests run it on gloo)
        # sending action -> [(work, tensor kept alive until the send completed, what)]
        self.inflight: dict[Any, list[tuple[Any, torch.Tensor, str]]] = {}
        self.peak_inflight = 0  # most sending actions not yet known complete, this step

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str, key: Any) -> None:
        """Post a send for action ``key``; its tensor stays referenced until ``release(key)``."""
        tensor = tensor.detach().contiguous()
        if not self.nccl and tensor.device.type != "cpu":
            tensor = tensor.to("cpu")  # gloo sends host memory: a GPU stage beside a CPU one
        tag = 0 if self.by_order else tag
        work = dist.isend(tensor, dst=peer, group=self.groups.get((self.rank, peer)), tag=tag)
        self.inflight.setdefault(key, []).append((work, tensor, f"{what} to rank {peer}"))
        self.peak_inflight = max(self.peak_inflight, len(self.inflight))

    def recv(self, buffers: Sequence[torch.Tensor], peer: int, tags: Sequence[int], what: str) -> None:
        """Receive into ``buffers`` from ``peer``; returns when all arrived, raises after ``timeout_s``."""
        self.wait(self.post(buffers, peer, tags, what))

    def post(self, buffers: Sequence[torch.Tensor], peer: int, tags: Sequence[int], what: str) -> list:
        """Post receives into ``buffers`` without waiting (a prefetch); ``wait`` completes them."""
        group = self.groups.get((peer, self.rank))
        posted = []
        for b, t in zip(buffers, tags):
            # gloo receives into host memory; a GPU buffer gets its bytes in ``wait``
            landing = b if self.nccl or b.device.type == "cpu" else torch.empty_like(b, device="cpu")
            work = dist.irecv(landing, src=peer, group=group, tag=0 if self.by_order else t)
            posted.append((work, f"{what} from rank {peer}", None if landing is b else (landing, b)))
        return posted

    def wait(self, posted: Sequence[tuple[Any, str, Any]]) -> None:
        """Wait for receives ``post`` returned; the deadline counts from now."""
        deadline = time.monotonic() + self.timeout_s
        for work, what, staged in posted:
            self._wait(work, deadline, what)
            if staged is not None:
                staged[1].copy_(staged[0])

    def release(self, keys: Sequence[Any]) -> None:
        """Wait for (already completed, see ``Schedule.send_release``) sends and drop their tensors."""
        deadline = time.monotonic() + self.timeout_s
        for key in keys:
            for work, _, what in self.inflight.pop(key, ()):
                self._wait(work, deadline, what)

    def collect(self, keys: Sequence[Any]) -> list[Any]:
        """Drop the tensors of those sends among ``keys`` that completed (never waits); the keys
        still in flight. BPipe's stash sends go so, as soon as they are done: the schedule's next
        message from the partner may be far away, and the evicted bytes must not stay."""
        pending = []
        for key in keys:
            if all(work.is_completed() for work, _, _ in self.inflight.get(key, ())):
                self.inflight.pop(key, None)
            else:
                pending.append(key)
        return pending

    def flush(self) -> None:
        """Wait until every send of this step completed."""
        self.release(list(self.inflight))

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        try:
            wait_until(work, deadline, self.nccl)
        except (RuntimeError, TimeoutError) as e:
            if isinstance(e, TimeoutError) or "timed out" in str(e).lower():
                raise PipeccError(f"rank {self.rank}: timed out after {self.timeout_s} s waiting for {what}") from None
            raise PipeccError(f"rank {self.rank}: {what} failed, the peer exited or crashed ({_gist(e)})") from None


def _through_host(tensor: torch.Tensor, group: Any) -> bool:
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> None:
    """``dist.all_reduce`` in place; on gloo a GPU tensor goes through a host copy."""
    if not _through_host(tensor, group):
        dist.all_reduce(tensor, op=op, group=group)
        return
    host = tensor.cpu()
    dist.all_reduce(host, op=op, group=group)
    tensor.copy_(host)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """``dist.broadcast`` in place; on gloo a GPU tensor goes through a host copy."""
    if not _through_host(tensor, group):
        dist.broadcast(tensor, src, group=group)
        return
    host = tensor.cpu()
    dist.broadcast(host, src, group=group)
    tensor.copy_(host)


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    """``dist.all_gather``; on gloo GPU tensors go through host copies."""
    if not _through_host(tensor, group):
        dist.all_gather(outputs, tensor, group=group)
        return
    host = [torch.empty_like(o, device="cpu") for o in outputs]
    dist.all_gather(host, tensor.cpu(), group=group)
    for o, h in zip(outputs, host):
        o.copy_(h)


def directed_groups(schedule: Schedule, replicas: int = 1, replica: int = 0) -> dict[tuple[int, int], Any]:
    """NCCL: one two-rank process group per direction of every pair of ranks that exchange messages.

    NCCL runs a group's p2p operations in issue order on one stream and a send may wait for
    its receiver, so sends and receives sharing a stream can deadlock (1F1B sends forward
    while the peer sends backward; interleaved wraps around). With one group per direction a
    stream holds only sends (or only receives) between two ranks, matched in order
    (``check_fifo``): exactly the "buffered sends, blocking receives" model ``validate`` proves
    deadlock-free. Collective: every rank must call it, with the same schedule.

    With ``replicas`` (PP x DP, ``pipecc.techniques.replicas.runtime``) the schedule's ranks are pipeline
    ranks and every replica gets its own groups, keyed by global ranks (j * replicas + r); the
    result holds those of replica ``replica``.
    """
    pairs = sorted({(rank, peer_rank(schedule, a)) for rank, row in enumerate(schedule.actions)
                    for a in row if a.kind.is_send})
    groups: dict[tuple[int, int], Any] = {}
    for r in range(replicas):
        for src, dst in pairs:
            pair = (src * replicas + r, dst * replicas + r)
            group = dist.new_group(list(pair))
            if r == replica:
                groups[pair] = group
    return groups


def _gist(error: BaseException) -> str:
    """The first sentence of a c10d/gloo error, without its ``[file.cc:123]`` prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().split("\n")[0])
    return text.split(". ")[0] or type(error).__name__


ALIGN = 64  # bytes: where every tensor in a packed payload starts (any dtype's alignment)


def packed_layout(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of tensors of these (shape, dtype) in one packed payload, and its size."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        total += -(-n // ALIGN) * ALIGN
    return offsets, total


def packed_views(payload: torch.Tensor, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
    """The tensors of a packed uint8 payload, as views of it (no copy)."""
    offsets, _ = packed_layout(specs)
    out = []
    for start, (shape, dtype) in zip(offsets, specs):
        numel = 1
        for d in shape:
            numel *= int(d)
        out.append(payload[start:start + numel * dtype.itemsize].view(dtype).view(tuple(shape)))
    return out


def pack_tensors(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One uint8 payload holding ``tensors`` (copied, any strides) at ``packed_layout``'s offsets."""
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    payload = torch.empty(packed_layout(specs)[1], dtype=torch.uint8, device=device)
    for view, t in zip(packed_views(payload, specs), tensors):
        view.copy_(t.detach())
    return payload


def encode_object(value: Any, what: str) -> torch.Tensor:
    data = json.dumps(to_json(value, path=what)).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_object(payload: torch.Tensor, device: torch.device) -> Any:
    """An object port's value; a device in it becomes the receiving rank's ``device``."""
    return from_json(json.loads(bytes(payload.cpu().tolist()).decode()), device=device)


def fingerprint(leaves: Sequence[Port]) -> torch.Tensor:
    """32 bytes identifying a boundary (``ports.boundary_digest``) as a tensor, to exchange."""
    return torch.frombuffer(bytearray(boundary_digest(leaves)), dtype=torch.uint8)
