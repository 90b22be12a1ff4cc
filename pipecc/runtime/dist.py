"""Distributed pipeline runtime: one process per rank, stages exchange values point to point.

Launch one process per rank with ``pipecc run OUT`` (``pipecc.cli.run``), which starts torchrun on
``OUT/run_stage.py`` (by hand: ``torchrun --nproc-per-node P -m pipecc.runtime.dist OUT --steps N``).
Rank r holds the stages the schedule places on it: stage r for GPipe, 1F1B and inference,
stages r, r+P, r+2P, ... for interleaved 1F1B. ``PipelineRuntime`` executes the
rank's action list from ``pipecc.ir.schedule`` literally, so a schedule's memory behaviour is real:
GPipe stashes m microbatches per stage, 1F1B at most p - r.

Stages and ports. A stage is an ``nn.Module`` whose ``forward(*received)`` returns the tuple of
values it sends (the last stage: the model outputs). Its ports (``ports.json``) list what it
receives and sends; stage k's ``sends`` equal stage k+1's ``receives``, in order. The runtime
only talks to the neighbouring stage: a value that skips stages (a residual, token ids, a shape)
is relayed by every stage in between, which receives it and sends it on. Shapes in the spec are
for the full (compiled) batch of n samples; microbatch i gets ``n_i`` of them, the sizes of
``torch.tensor_split(range(n), m)``, so every rank derives every buffer's shape alone. A batch
dim (``batch_dim``, usually 0) of ``c * n`` rows (``shape_expr`` like ``2*B`` or ``B*S``)
gets ``c * n_i``; ``n`` is the extent of a dim whose ``shape_expr`` is ``B``, else that of the
first batched port. Stage 0 splits the model inputs so; ``batch_dim: null`` values go whole
to every microbatch.

Wire protocol (per SEND/RECV action, one microbatch):
  * tensor port: one message of the microbatch shape and spec dtype, received into a buffer
    allocated from the spec.
  * object port (``kind: "object"``, e.g. a Python int shape): JSON, not pickle — a peer cannot
    make us run code. Values are None/bool/int/float/str, torch.dtype, torch.device (it arrives
    as the receiver's own device) and lists, tuples, dicts of those (tuples survive). Two
    messages: an int64 length, then the UTF-8 bytes as uint8.
  * tuple port (``kind: "tuple"``, ``items``): travels as its leaves, in order.
  * backward: only ports with ``requires_grad`` and a floating dtype carry a gradient back
    (integer token ids never do); both sides decide this from the spec alone. A received input
    the stage did not use sends zeros.
  Messages go in port order, first every tensor and length, then the object payloads. Gloo
  matches them by tag (direction, receiving stage, microbatch, port); NCCL ignores tags and
  matches by order, which ``check_fifo`` verifies against the schedule before an NCCL run.
  At start-up neighbours swap a digest of their shared boundary, so two ``ports.json`` that
  disagree fail with a clear error instead of a mis-sized message.

Sends and receives. A SEND never blocks (``isend``; handle and tensor are kept until a later
receive proves the peer has the message, ``send_release``, or else to the end of ``step``); a
RECV waits with a deadline. That is the model ``pipecc.ir.schedule.validate`` proves deadlock-free,
so 1F1B, whose neighbours send in opposite directions at once, cannot deadlock.
No ``batch_isend_irecv``: on gloo it can hang. On NCCL a process group runs its p2p operations
in issue order on one stream and a send may wait for its receiver, which would let a pending
send hold up a receive; the runtime therefore gives every direction between two ranks its own
two-rank group (``directed_groups``), so each stream carries sends only or receives only.

Loss. On the last stage microbatch i's loss is ``loss_fn(outputs, target_i)`` (``outputs`` is the
single output, or the tuple when there are several; without ``loss_fn`` the first output is the
loss) times ``n_i / n``, the microbatch's share of the batch (``1/m`` for equal splits); the
target is split along dim 0 like the batch. When
``loss_fn`` is a per-sample mean, the accumulated gradients are those of the full-batch mean loss,
and ``step`` returns that full-batch loss.

Faults. Every wait has a deadline of ``timeout_s``; a dead or hung peer gives
``PipeccError("rank 1: timed out after 5.0 s waiting for RECV_F mb 2 from rank 0")`` (or "failed"
when the connection broke) instead of a hang. The process group is created with the same timeout.

Checkpoints: ``stage_<rank>.safetensors`` (module state as ``model.<stage>.<key>``, optimizer
tensors as ``optim.<path>``) and ``stage_<rank>.json`` (step, placement, the optimizer's
non-tensor state); no pickle anywhere.

This module imports torch, ``pipecc.ir.schedule`` and ``pipecc.errors`` (and safetensors when
checkpointing) — never the compiler; the one exception is the rank of an FPGA stage, whose
executable is its C simulation, built and called by ``pipecc.backends.fpga`` (``_load_fpga_stage``). The NCCL path is written to the same contract but is only
exercised on machines with several GPUs; the tests run gloo on CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecc.errors import PipeccError, UsageError
from pipecc.ir.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    gpipe,
    inference,
    interleaved_1f1b,
    one_f_one_b,
    parse,
    validate,
)

__all__ = [
    "PipelineRuntime",
    "Port",
    "RunConfig",
    "StagePorts",
    "build_schedule",
    "check_fifo",
    "directed_groups",
    "send_release",
    "init_distributed",
    "main",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "inference")
MAX_PORTS = 1024  # values crossing one stage boundary


# ---------------------------------------------------------------------------- ports


@dataclass(frozen=True)
class Port:
    """One value crossing a stage boundary, as ``ports.json`` describes it.

    ``kind`` is "tensor", "object" (JSON-able Python value) or "tuple" (``items`` are its
    elements, each a port; sent as its leaves). ``shape`` is at the compiled batch size;
    ``batch_dim`` is the dim that grows with the batch (its extent may be a multiple of it,
    e.g. B*S), or None when the value is the same for every microbatch.
    """

    name: str
    kind: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    requires_grad: bool = False
    batch_dim: int | None = None
    items: tuple[Port, ...] = ()
    batch_expr: str | None = None  # shape_expr[batch_dim] when the compiler wrote it

    @classmethod
    def from_json(cls, d: dict[str, Any], name: str | None = None) -> Port:
        name = str(d.get("name", name))
        kind = d.get("kind", "tensor")
        if kind == "tuple":
            return cls(name, kind, items=tuple(cls.from_json(item, f"{name}.{i}")
                                               for i, item in enumerate(d.get("items", ()))))
        if kind == "object":
            return cls(name, kind)
        if kind != "tensor":
            raise PipeccError(f"port {name!r}: kind must be 'tensor', 'object' or 'tuple', got {kind!r}")
        dtype = getattr(torch, str(d.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype):
            raise PipeccError(f"port {name!r}: unknown dtype {d.get('dtype')!r}")
        shape = tuple(int(n) for n in d.get("shape", ()))
        batch_dim = d.get("batch_dim")
        if batch_dim is not None and not 0 <= batch_dim < len(shape):
            raise PipeccError(f"port {name!r}: batch_dim {batch_dim} out of range for shape {list(shape)}")
        exprs = d.get("shape_expr")
        batch_expr = str(exprs[batch_dim]) if exprs and batch_dim is not None else None
        return cls(name, kind, shape, dtype, bool(d.get("requires_grad", False)), batch_dim, (), batch_expr)

    def leaves(self) -> list[Port]:
        return [leaf for item in self.items for leaf in item.leaves()] if self.kind == "tuple" else [self]

    @property
    def carries_grad(self) -> bool:
        """True when a gradient for this value travels back (both neighbours agree from the spec)."""
        return self.kind == "tensor" and self.requires_grad and self.dtype is not None and self.dtype.is_floating_point

    def extents(self, batch: int | None, m: int) -> list[int] | None:
        """The batch dim's extent in each microbatch, or None when the value is not batched."""
        if self.batch_dim is None:
            return None
        if batch is None:
            raise PipeccError(f"port {self.name!r} is batched but the stage's batch size is unknown")
        return microbatch_extents(self.shape[self.batch_dim], batch, m, self.name)

    def microbatch_shape(self, mb: int, batch: int | None, m: int) -> tuple[int, ...]:
        extents = self.extents(batch, m)
        if extents is None:
            return self.shape
        return (*self.shape[:self.batch_dim], extents[mb], *self.shape[self.batch_dim + 1:])


@dataclass(frozen=True)
class StagePorts:
    """A stage's ``ports.json``: what ``forward`` takes (``receives``) and returns (``sends``)."""

    receives: tuple[Port, ...]
    sends: tuple[Port, ...]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StagePorts:
        return cls(tuple(Port.from_json(p, f"in{i}") for i, p in enumerate(d.get("receives", ()))),
                   tuple(Port.from_json(p, f"out{i}") for i, p in enumerate(d.get("sends", ()))))

    @property
    def in_leaves(self) -> list[Port]:
        return [leaf for p in self.receives for leaf in p.leaves()]

    @property
    def out_leaves(self) -> list[Port]:
        return [leaf for p in self.sends for leaf in p.leaves()]

    @property
    def batch_size(self) -> int | None:
        """The compiled batch size: a batch dim whose expression is ``B`` if the compiler wrote
        expressions, else the first batched receive (or send); None when nothing is batched."""
        batched = [p for p in (*self.in_leaves, *self.out_leaves) if p.batch_dim is not None]
        for port in batched:
            if port.batch_expr == "B":
                return port.shape[port.batch_dim]
        return batched[0].shape[batched[0].batch_dim] if batched else None


def split_sizes(n: int, m: int, what: str = "batch") -> list[int]:
    """Microbatch sizes of ``torch.tensor_split(range(n), m)``: the first ``n % m`` get one more."""
    if n < m:
        raise PipeccError(f"{what}: batch of {n} cannot be split into {m} microbatches; use --microbatches <= {n}")
    return [n // m + (1 if i < n % m else 0) for i in range(m)]


def microbatch_extents(extent: int, batch: int, m: int, what: str) -> list[int]:
    """Per-microbatch extents of a dim of ``extent = c * batch`` rows: ``c`` times each batch split."""
    if extent % batch:
        raise PipeccError(f"port {what!r}: batch dim of {extent} is not a multiple of the batch size {batch}")
    return [extent // batch * n for n in split_sizes(batch, m, what)]


def flatten(values: Sequence[Any], ports: Sequence[Port], what: str) -> list[Any]:
    """The leaf values of ``values`` (tuple ports opened), in wire order."""
    if len(values) != len(ports):
        raise PipeccError(f"{what}: {len(values)} values, ports.json declares {len(ports)}")
    leaves: list[Any] = []
    for v, port in zip(values, ports):
        if port.kind == "tuple":
            if not isinstance(v, (tuple, list)):
                raise PipeccError(f"{what}: {port.name!r} should be a tuple, got {type(v).__name__}")
            leaves += flatten(v, port.items, what)
        else:
            leaves.append(v)
    return leaves


def unflatten(leaves: Sequence[Any], ports: Sequence[Port]) -> list[Any]:
    """``flatten``'s inverse: tuple ports become tuples again."""
    it = iter(leaves)

    def build(port: Port) -> Any:
        return tuple(build(item) for item in port.items) if port.kind == "tuple" else next(it)

    return [build(p) for p in ports]


# ---------------------------------------------------------------------------- JSON values


def to_json(value: Any, tensors: dict[str, torch.Tensor] | None = None, path: str = "") -> Any:
    """A JSON-able form of ``value`` that ``from_json`` inverts, tuples and int keys included.

    Tensors are moved into ``tensors`` under ``path`` and replaced by ``{"__tensor__": path}``;
    without ``tensors`` a tensor is an error (object ports carry no tensors).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise PipeccError(f"{path or 'value'}: a tensor inside an object port; declare it as a tensor port")
        tensors[path] = value.detach().cpu().clone(memory_format=torch.contiguous_format)
        return {"__tensor__": path}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, torch.Size)):
        return {"__tuple__": [to_json(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_json(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: to_json(v, tensors, f"{path}.{k}") for k, v in value.items()}
        return {"__items__": [[to_json(k), to_json(v, tensors, f"{path}.{k}")] for k, v in value.items()]}
    raise PipeccError(f"{path or 'value'}: {type(value).__name__} is not JSON-able (allowed: None, bool, int, "
                      "float, str, torch.device, torch.dtype and lists, tuples, dicts of them)")


def from_json(value: Any, tensors: dict[str, torch.Tensor] | None = None, device: torch.device | None = None) -> Any:
    """``to_json``'s inverse; a ``torch.device`` becomes ``device`` when given (the receiver's own)."""
    if isinstance(value, list):
        return [from_json(v, tensors, device) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            assert tensors is not None
            return tensors[value["__tensor__"]]
        if "__device__" in value:
            return device or torch.device(value["__device__"])
        if "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if "__tuple__" in value:
            return tuple(from_json(v, tensors, device) for v in value["__tuple__"])
        if "__items__" in value:
            return {from_json(k): from_json(v, tensors, device) for k, v in value["__items__"]}
        return {k: from_json(v, tensors, device) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------- schedules


@dataclass
class RunConfig:
    """How to run: schedule name (or schedule text, ``rank 0: ...``), microbatches, limits.

    ``timeout_s`` bounds every single wait for a peer, so it must exceed the longest legitimate
    one — in GPipe, rank 0 waits for its first gradient for nearly a whole iteration.
    """

    schedule: str
    microbatches: int
    timeout_s: float = 60.0
    backend: str | None = None  # None: nccl on CUDA, else gloo
    device: str | None = None  # None: cuda:LOCAL_RANK when CUDA is available, else cpu


def build_schedule(kind: str, world: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """The validated schedule for ``world`` ranks; ``kind`` is a name or the schedule's text form."""
    if kind.lstrip().startswith("rank "):
        schedule = parse(kind)
    elif kind in ("gpipe", "1f1b", "inference") and stages_per_rank != 1:
        raise PipeccError(f"schedule {kind!r} puts one stage on each rank, got {stages_per_rank} per rank; "
                          "use --schedule interleaved")
    elif kind == "gpipe":
        schedule = gpipe(world, microbatches)
    elif kind == "1f1b":
        schedule = one_f_one_b(world, microbatches)
    elif kind == "interleaved":
        try:
            schedule = interleaved_1f1b(world, microbatches, stages_per_rank)
        except ValueError as e:
            raise PipeccError(str(e)) from None
    elif kind == "inference":
        schedule = inference(world, microbatches)
    else:
        raise UsageError(f"unknown schedule {kind!r}; choose from {', '.join(SCHEDULES)} or give schedule text")
    try:
        validate(schedule)
    except ScheduleError as e:
        raise PipeccError(f"invalid schedule: {e.summary}") from None
    if schedule.num_ranks != world or schedule.num_microbatches != microbatches:
        raise PipeccError(f"schedule has {schedule.num_ranks} ranks and {schedule.num_microbatches} microbatches, "
                          f"the run {world} and {microbatches}")
    return schedule


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule with its backward actions removed (same placement and forward order)."""
    keep = (ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F)
    rows = tuple(tuple(a for a in row if a.kind in keep) for row in schedule.actions)
    result = Schedule(schedule.num_ranks, schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank, rows)
    validate(result)
    return result


def _peer(schedule: Schedule, a: Action) -> int:
    """The rank on the other end of a SEND/RECV."""
    neighbour = a.stage + 1 if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) else a.stage - 1
    return schedule.stage_to_rank[neighbour]


def check_fifo(schedule: Schedule) -> None:
    """Raise unless every rank receives from each peer in the order that peer sends (NCCL needs it)."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if a.kind.is_send:
                sent.setdefault((rank, _peer(schedule, a)), []).append(a.message())
            elif a.kind.is_recv:
                received.setdefault((_peer(schedule, a), rank), []).append(a.message())
    for pair, order in sent.items():
        if received.get(pair) != order:
            raise PipeccError(f"rank {pair[1]} receives from rank {pair[0]} in another order than it sends; "
                              "NCCL matches messages by order: use the gloo backend or reorder the schedule")


# ---------------------------------------------------------------------------- transport


class _Wire:
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
        tag = 0 if self.by_order else tag
        work = dist.isend(tensor, dst=peer, group=self.groups.get((self.rank, peer)), tag=tag)
        self.inflight.setdefault(key, []).append((work, tensor, f"{what} to rank {peer}"))
        self.peak_inflight = max(self.peak_inflight, len(self.inflight))

    def recv(self, buffers: Sequence[torch.Tensor], peer: int, tags: Sequence[int], what: str) -> None:
        """Receive into ``buffers`` from ``peer``; returns when all arrived, raises after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        group = self.groups.get((peer, self.rank))
        works = [dist.irecv(b, src=peer, group=group, tag=0 if self.by_order else t) for b, t in zip(buffers, tags)]
        for work in works:
            self._wait(work, deadline, f"{what} from rank {peer}")

    def release(self, keys: Sequence[Any]) -> None:
        """Wait for (already completed, see ``send_release``) sends and drop their tensors."""
        deadline = time.monotonic() + self.timeout_s
        for key in keys:
            for work, _, what in self.inflight.pop(key, ()):
                self._wait(work, deadline, what)

    def flush(self) -> None:
        """Wait until every send of this step completed."""
        self.release(list(self.inflight))

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        try:
            if self.nccl:
                # NOTE: NCCL's wait() only orders streams; poll so a dead peer cannot block us forever.
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    time.sleep(0.0002)
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except (RuntimeError, TimeoutError) as e:
            if isinstance(e, TimeoutError) or "timed out" in str(e).lower():
                raise PipeccError(f"rank {self.rank}: timed out after {self.timeout_s} s waiting for {what}") from None
            raise PipeccError(f"rank {self.rank}: {what} failed, the peer exited or crashed ({_gist(e)})") from None


def directed_groups(schedule: Schedule) -> dict[tuple[int, int], Any]:
    """NCCL: one two-rank process group per direction of every pair of ranks that exchange messages.

    NCCL runs a group's p2p operations in issue order on one stream and a send may wait for
    its receiver, so sends and receives sharing a stream can deadlock (1F1B sends forward
    while the peer sends backward; interleaved wraps around). With one group per direction a
    stream holds only sends (or only receives) between two ranks, matched in order
    (``check_fifo``): exactly the "buffered sends, blocking receives" model ``validate`` proves
    deadlock-free. Collective: every rank must call it, with the same schedule.
    """
    pairs = sorted({(rank, _peer(schedule, a)) for rank, row in enumerate(schedule.actions)
                    for a in row if a.kind.is_send})
    return {pair: dist.new_group(list(pair)) for pair in pairs}


def send_release(schedule: Schedule, rank: int) -> dict[Action, list[Action]]:
    """For each receive of ``rank``, the earlier sends that are certainly complete once it returns.

    A send to peer P is complete when P has received it, which is certain once we receive a
    message P sent after that receive. Releasing sends there, instead of at the end of the step,
    drops the sent activations when the schedule says so: 1F1B holds p - r of them, not m.
    """
    index = {(r, a): i for r, row in enumerate(schedule.actions) for i, a in enumerate(row)}
    receive_of = {a.message(): (r, a) for r, row in enumerate(schedule.actions) for a in row if a.kind.is_recv}
    send_of = {a.message(): (r, a) for r, row in enumerate(schedule.actions) for a in row if a.kind.is_send}
    released: dict[Action, list[Action]] = {}
    pending: list[Action] = []
    for a in schedule.actions[rank]:
        if a.kind.is_send:
            pending.append(a)
        elif a.kind.is_recv:
            peer, sent = send_of[a.message()]
            done = [s for s in pending if receive_of[s.message()][0] == peer
                    and index[receive_of[s.message()]] < index[(peer, sent)]]
            if done:
                released[a] = done
                pending = [s for s in pending if s not in done]
    return released


def _gist(error: BaseException) -> str:
    """The first sentence of a c10d/gloo error, without its ``[file.cc:123]`` prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().split("\n")[0])
    return text.split(". ")[0] or type(error).__name__


def encode_object(value: Any, what: str) -> torch.Tensor:
    data = json.dumps(to_json(value, path=what)).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_object(payload: torch.Tensor, device: torch.device) -> Any:
    """An object port's value; a device in it becomes the receiving rank's ``device``."""
    return from_json(json.loads(bytes(payload.cpu().tolist()).decode()), device=device)


# ---------------------------------------------------------------------------- runtime


def _describe(port: Port) -> str:
    return "object" if port.kind == "object" else f"{str(port.dtype).removeprefix('torch.')}{list(port.shape)}"


def _fingerprint(leaves: Sequence[Port]) -> torch.Tensor:
    """32 bytes identifying a boundary: names, kinds, shapes, dtypes, gradient flags, batch dims."""
    text = json.dumps([(p.name, _describe(p), p.requires_grad, p.batch_dim) for p in leaves])
    return torch.frombuffer(bytearray(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8)


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


class PipelineRuntime:
    """Runs this rank's stage(s) of a pipeline, following the schedule's action list literally.

    ``stage`` is one module, or a list (one per stage the schedule places on this rank, in
    stage order) with ``ports`` a matching list. ``step`` runs one training iteration and
    accumulates gradients into the stage parameters (it does not zero them; the caller runs
    ``optimizer.zero_grad()`` and ``optimizer.step()``). ``optimizer`` is only needed for
    checkpoints. ``world > 1`` initialises torch.distributed from the torchrun environment
    unless it already is. Internally values travel as leaves (tuple ports opened).
    """

    def __init__(self, stage: nn.Module | Sequence[nn.Module], ports: dict | Sequence[dict], rank: int,
                 world: int, config: RunConfig, loss_fn: Callable | None = None,
                 optimizer: torch.optim.Optimizer | None = None):
        self.modules = [stage] if isinstance(stage, nn.Module) else list(stage)
        port_list = [ports] if isinstance(ports, dict) else list(ports)
        if len(port_list) != len(self.modules):
            raise PipeccError(f"rank {rank}: {len(self.modules)} stage modules but {len(port_list)} port specs")
        self.ports = [StagePorts.from_json(p) for p in port_list]
        self.rank, self.world, self.config = rank, world, config
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.m = config.microbatches
        self.device = torch.device(config.device) if config.device else _default_device()
        self.backend = config.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend == "gloo" and self.device.type != "cpu":
            raise PipeccError(f"the gloo backend sends CPU tensors only, device is {self.device}; use --backend nccl")
        self.schedule = build_schedule(config.schedule, world, self.m, len(self.modules))
        if world > 1:
            init_distributed(config)
            if (dist.get_rank(), dist.get_world_size()) != (rank, world):
                raise PipeccError(f"runtime built for rank {rank} of {world}, process group says "
                                  f"{dist.get_rank()} of {dist.get_world_size()}")
        self.stage_ids = self.schedule.stages_of(rank)
        if len(self.stage_ids) != len(self.modules):
            raise PipeccError(f"rank {rank} holds stages {self.stage_ids} in this schedule but got "
                              f"{len(self.modules)} modules")
        self.last_stage = self.schedule.num_stages - 1
        for module in self.modules:
            module.to(self.device)
        if world > 1 and self.backend == "nccl":
            check_fifo(self.schedule)
            self._wire = _Wire(rank, config.timeout_s, nccl=True, groups=directed_groups(self.schedule), by_order=True)
        else:
            self._wire = _Wire(rank, config.timeout_s)
        self.peak_stash = 0  # most microbatches stashed at once during the last step
        self.keep_outputs = False  # True: step() keeps the last stage's outputs for last_outputs()
        if world > 1:
            self._handshake()

    # -- public API ----------------------------------------------------------------------

    @property
    def peak_sends(self) -> int:
        """Most sending actions whose tensors were held at once during the last step/infer."""
        return self._wire.peak_inflight

    def step(self, inputs: Sequence[Any] | None = None, target: Any = None) -> float | None:
        """One training iteration; the full-batch mean loss on the rank holding the last stage."""
        if not self.schedule.is_training:
            raise PipeccError(f"schedule {self.config.schedule!r} has no backward; use infer()")
        self._run(self.schedule, inputs, target, training=True)
        if self.last_stage in self.stage_ids:
            return float(sum(self._losses))
        return None

    def infer(self, inputs: Sequence[Any] | None = None) -> Any:
        """Forward the batch through the pipeline; the model outputs on the last rank, else None.

        Batched tensor outputs are concatenated over microbatches along their batch dim,
        other outputs come as a list of one value per microbatch.
        """
        with torch.no_grad():
            self._run(forward_only(self.schedule), inputs, None, training=False)
        return self.last_outputs()

    def last_outputs(self) -> Any:
        """The model outputs of the last ``infer`` (or ``step`` with ``keep_outputs`` set), merged
        over microbatches as ``infer`` returns them; None off the last rank or when none are kept."""
        if self.last_stage not in self.stage_ids or len(getattr(self, "_results", {})) != self.m:
            return None
        ports = self._ports(self.last_stage)
        merged = []
        for i, port in enumerate(ports.out_leaves):
            values = [self._results[mb][i] for mb in range(self.m)]
            merged.append(torch.cat(values, port.batch_dim) if port.kind == "tensor" and port.batch_dim is not None
                          else values)
        self._results = {}
        outs = unflatten(merged, ports.sends)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _handshake(self) -> None:
        """Check with every remote neighbour that both read the same boundary from ports.json.

        Neighbours that disagree would otherwise exchange messages of the wrong size, which
        gloo reports only as a closed connection.
        """
        for s in self.stage_ids:
            if s < self.last_stage and s + 1 not in self.stage_ids:
                peer = self.schedule.stage_to_rank[s + 1]
                digest = _fingerprint(self._ports(s).out_leaves).to(self.device)
                self._wire.send(digest, peer, self._tag(2, s + 1, 0, 0), "the port handshake", key=s)
        for s in self.stage_ids:
            if s > 0 and s - 1 not in self.stage_ids:
                peer = self.schedule.stage_to_rank[s - 1]
                got = torch.empty(32, dtype=torch.uint8, device=self.device)
                self._wire.recv([got], peer, [self._tag(2, s, 0, 0)], "the port handshake")
                if not torch.equal(got.cpu(), _fingerprint(self._ports(s).in_leaves)):
                    ports = ", ".join(f"{p.name}:{_describe(p)}" for p in self._ports(s).in_leaves)
                    raise PipeccError(f"rank {self.rank}: stage {s} receives ({ports}) but stage {s - 1} on rank "
                                      f"{peer} sends something else; are both from the same compilation?")
        self._wire.flush()

    # -- execution -----------------------------------------------------------------------

    def _run(self, schedule: Schedule, inputs: Sequence[Any] | None, target: Any, training: bool) -> None:
        self._inputs = self._split_inputs(inputs) if 0 in self.stage_ids else None
        self._targets = self._split_target(target) if training and self.last_stage in self.stage_ids else None
        # ("F"|"B", stage, mb) -> leaf values received (or handed over locally) / to send
        self._inbox: dict[tuple[str, int, int], list] = {}
        self._outbox: dict[tuple[str, int, int], list] = {}
        self._stash: dict[tuple[int, int], tuple[list, Any]] = {}  # (stage, mb) -> (input leaves, outputs)
        self._losses: list[torch.Tensor] = []
        self._results: dict[int, list] = {}
        self.peak_stash = self._wire.peak_inflight = 0
        release = send_release(schedule, self.rank)
        for action in schedule.actions[self.rank]:
            self._execute(action, training)
            self._wire.release(release.get(action, ()))
        self._wire.flush()
        leftover = self._stash or self._inbox or self._outbox
        assert not leftover, f"rank {self.rank}: schedule left {sorted(leftover)} unconsumed"
        self._inputs = self._targets = None

    def _execute(self, a: Action, training: bool) -> None:
        s, mb = a.stage, a.microbatch
        if a.kind is ActionKind.F:
            self._forward(s, mb, training)
        elif a.kind is ActionKind.B:
            self._backward(s, mb)
        elif a.kind is ActionKind.SEND_F:
            self._send(a, self._outbox.pop(("F", s, mb)), self._ports(s).out_leaves)
        elif a.kind is ActionKind.SEND_B:
            self._send(a, self._outbox.pop(("B", s, mb)), [p for p in self._ports(s).in_leaves if p.carries_grad])
        elif a.kind is ActionKind.RECV_F:
            leaves = self._recv(a, self._ports(s).in_leaves)
            if training:
                for v, port in zip(leaves, self._ports(s).in_leaves):
                    if port.carries_grad:
                        v.requires_grad_(True)
            self._inbox[("F", s, mb)] = leaves
        elif a.kind is ActionKind.RECV_B:
            self._inbox[("B", s, mb)] = self._recv(a, [p for p in self._ports(s).out_leaves if p.carries_grad])

    def _forward(self, s: int, mb: int, training: bool) -> None:
        ports = self._ports(s)
        leaves = self._inputs[mb] if s == 0 else self._inbox.pop(("F", s, mb))
        with torch.set_grad_enabled(training):
            outs = _as_tuple(self._module(s)(*unflatten(leaves, ports.receives)))
        out_leaves = flatten(outs, ports.sends, f"rank {self.rank} stage {s} output")
        self._check(s, mb, out_leaves, ports.out_leaves)
        if s == self.last_stage:
            if not training:
                self._results[mb] = out_leaves
                return
            if self.keep_outputs:
                self._results[mb] = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
            loss = self._loss(outs, mb)
            self._losses.append(loss.detach())
            self._stash[(s, mb)] = (leaves, loss)
        else:
            if training:
                self._stash[(s, mb)] = (leaves, out_leaves)
            if s + 1 in self.stage_ids:  # local neighbour: hand over detached copies, like a receive
                self._inbox[("F", s + 1, mb)] = [
                    o.detach().requires_grad_(training and p.carries_grad) if p.kind == "tensor" else o
                    for o, p in zip(out_leaves, ports.out_leaves)]
            else:
                self._outbox[("F", s, mb)] = out_leaves
        self.peak_stash = max(self.peak_stash, len(self._stash))

    def _backward(self, s: int, mb: int) -> None:
        in_leaves, outs = self._stash.pop((s, mb))
        ports = self._ports(s)
        if s == self.last_stage:
            torch.autograd.backward(outs)  # the scaled loss
        else:
            grads = iter(self._inbox.pop(("B", s, mb)))
            pairs = [(o, next(grads)) for o, p in zip(outs, ports.out_leaves) if p.carries_grad]
            pairs = [(o, g) for o, g in pairs if isinstance(o, torch.Tensor) and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if s == 0:
            return
        input_grads = [x.grad if x.grad is not None else torch.zeros_like(x)
                       for x, p in zip(in_leaves, ports.in_leaves) if p.carries_grad]
        if s - 1 in self.stage_ids:
            self._inbox[("B", s - 1, mb)] = input_grads
        else:
            self._outbox[("B", s, mb)] = input_grads

    def _loss(self, outs: tuple, mb: int) -> torch.Tensor:
        value = outs[0] if len(outs) == 1 else outs
        loss = self.loss_fn(value, self._targets[mb]) if self.loss_fn is not None else outs[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipeccError(f"rank {self.rank}: the loss must be a scalar tensor, got "
                              f"{getattr(loss, 'shape', type(loss).__name__)}; pass loss_fn")
        n = self._ports(self.last_stage).batch_size
        share = split_sizes(n, self.m)[mb] / n if n is not None else 1.0 / self.m
        return loss.reshape(()) * share

    # -- communication -------------------------------------------------------------------

    def _tag(self, direction: int, stage: int, mb: int, leaf: int) -> int:
        """The gloo tag of a leaf's first message (even; an object's payload gets tag + 1).

        Both ends compute it from (direction, receiving stage, mb, leaf) alone, so it must not
        depend on anything only one side knows. Unique within a step.
        """
        tag = (((direction * self.schedule.num_stages + stage) * self.m + mb) * MAX_PORTS + leaf) * 2
        if leaf >= MAX_PORTS or tag >= 2**31:
            raise PipeccError(f"too many ports ({leaf + 1}), stages or microbatches for 31-bit message tags")
        return tag

    def _send(self, a: Action, values: Sequence[Any], ports: Sequence[Port]) -> None:
        peer = _peer(self.schedule, a)
        forward = a.kind is ActionKind.SEND_F
        receiver = a.stage + 1 if forward else a.stage - 1
        what = f"{a.kind.value} mb {a.microbatch}"
        payloads = []
        for i, (v, port) in enumerate(zip(values, ports)):
            tag = self._tag(0 if forward else 1, receiver, a.microbatch, i)
            if port.kind == "tensor":
                self._wire.send(v, peer, tag, what, key=a)
            else:
                data = encode_object(v, f"{what} port {port.name!r}").to(self.device)
                length = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
                self._wire.send(length, peer, tag, what, key=a)
                payloads.append((data, tag + 1))
        for data, tag in payloads:
            self._wire.send(data, peer, tag, what, key=a)

    def _recv(self, a: Action, ports: Sequence[Port]) -> list[Any]:
        peer = _peer(self.schedule, a)
        direction = 0 if a.kind is ActionKind.RECV_F else 1
        what = f"{a.kind.value} mb {a.microbatch}" + (f" of stage {a.stage}" if len(self.stage_ids) > 1 else "")
        batch = self._ports(a.stage).batch_size
        first: list[torch.Tensor] = []
        for port in ports:
            if port.kind == "tensor":
                shape = port.microbatch_shape(a.microbatch, batch, self.m)
                first.append(torch.empty(shape, dtype=port.dtype, device=self.device))
            else:
                first.append(torch.empty(1, dtype=torch.int64, device=self.device))
        tags = [self._tag(direction, a.stage, a.microbatch, i) for i in range(len(ports))]
        self._wire.recv(first, peer, tags, what)
        objects = [i for i, p in enumerate(ports) if p.kind == "object"]
        if not objects:
            return first
        payloads = [torch.empty(int(first[i].item()), dtype=torch.uint8, device=self.device) for i in objects]
        self._wire.recv(payloads, peer, [tags[i] + 1 for i in objects], what)
        values: list[Any] = list(first)
        for i, data in zip(objects, payloads):
            values[i] = decode_object(data, self.device)
        return values

    # -- helpers ---------------------------------------------------------------------------

    def _module(self, stage: int) -> nn.Module:
        return self.modules[self.stage_ids.index(stage)]

    def _ports(self, stage: int) -> StagePorts:
        return self.ports[self.stage_ids.index(stage)]

    def _check(self, s: int, mb: int, leaves: Sequence[Any], ports: Sequence[Port]) -> None:
        """Fail early, naming the port, when an output does not match the spec its peer relies on."""
        batch = self._ports(s).batch_size
        for v, port in zip(leaves, ports):
            if port.kind != "tensor":
                continue
            shape = port.microbatch_shape(mb, batch, self.m)
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != port.dtype:
                got = f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor) \
                    else type(v).__name__
                raise PipeccError(f"rank {self.rank} stage {s} mb {mb}: output {port.name!r} is {got}, ports.json "
                                  f"says {list(shape)} {str(port.dtype).removeprefix('torch.')}")

    def _split_inputs(self, inputs: Sequence[Any] | None) -> list[list[Any]]:
        """Stage 0's inputs as leaves, one list per microbatch (batched leaves split, others shared)."""
        ports = self._ports(0)
        inputs = _as_tuple(inputs) if inputs is not None else ()
        if len(inputs) != len(ports.receives):
            raise PipeccError(f"rank {self.rank}: stage 0 takes {len(ports.receives)} inputs "
                              f"({', '.join(p.name for p in ports.receives)}), got {len(inputs)}")
        per_leaf = []
        for v, port in zip(flatten(inputs, ports.receives, "inputs"), ports.in_leaves):
            if port.kind == "tensor":
                v = v.to(self.device)
                if tuple(v.shape) != port.shape or v.dtype != port.dtype:
                    raise PipeccError(f"input {port.name!r} is {list(v.shape)} {v.dtype}, the compiled stage "
                                      f"expects {list(port.shape)} {port.dtype}")
            extents = port.extents(ports.batch_size, self.m)
            per_leaf.append(torch.split(v, extents, port.batch_dim) if extents else [v] * self.m)
        return [[values[mb] for values in per_leaf] for mb in range(self.m)]

    def _split_target(self, target: Any) -> list[Any]:
        """The target per microbatch: tensors (or a tuple/list of them) split along dim 0."""
        batch = self._ports(self.last_stage).batch_size

        def split(t: torch.Tensor) -> list[torch.Tensor]:
            t = t.to(self.device)
            if batch is None:
                return list(torch.tensor_split(t, self.m, dim=0))
            return list(torch.split(t, microbatch_extents(t.shape[0], batch, self.m, "target"), dim=0))

        if isinstance(target, torch.Tensor):
            return split(target)
        if isinstance(target, (tuple, list)) and target and all(isinstance(t, torch.Tensor) for t in target):
            parts = [split(t) for t in target]
            return [type(target)(p[i] for p in parts) for i in range(self.m)]
        return [target] * self.m

    # -- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, directory: str | os.PathLike, step: int) -> Path:
        """Write ``stage_<rank>.safetensors`` and ``stage_<rank>.json`` into ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for s, module in zip(self.stage_ids, self.modules):
            for key, t in module.state_dict().items():
                tensors[f"model.{s}.{key}"] = t.detach().cpu().clone(memory_format=torch.contiguous_format)
        meta: dict[str, Any] = {"format": "pipecc-checkpoint/1", "step": step, "rank": self.rank,
                                "world": self.world, "stages": self.stage_ids}
        if self.optimizer is not None:
            meta["optimizer"] = {"class": type(self.optimizer).__name__,
                                 "state": to_json(self.optimizer.state_dict(), tensors, "optim")}
        base = directory / f"stage_{self.rank}"
        save_file(tensors, f"{base}.safetensors.tmp")
        os.replace(f"{base}.safetensors.tmp", f"{base}.safetensors")
        Path(f"{base}.json.tmp").write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(f"{base}.json.tmp", f"{base}.json")
        return Path(f"{base}.safetensors")

    def load_checkpoint(self, directory: str | os.PathLike) -> int:
        """Restore module (and optimizer) state saved by ``save_checkpoint``; returns its step."""
        from safetensors.torch import load_file

        base = Path(directory) / f"stage_{self.rank}"
        if not Path(f"{base}.json").exists():
            raise PipeccError(f"no checkpoint for rank {self.rank} in {directory} (expected {base.name}.json)")
        meta = json.loads(Path(f"{base}.json").read_text())
        if (meta["world"], meta["stages"]) != (self.world, self.stage_ids):
            raise PipeccError(f"checkpoint {base}.json holds stages {meta['stages']} of a {meta['world']}-rank run, "
                              f"this rank runs stages {self.stage_ids} of {self.world}")
        # NOTE: on the CPU: load_state_dict copies into the parameters' devices, and optimizers
        # want their `step` counters on the CPU unless capturable.
        tensors = load_file(f"{base}.safetensors", device="cpu")
        for s, module in zip(self.stage_ids, self.modules):
            prefix = f"model.{s}."
            module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        if self.optimizer is not None:
            if "optimizer" not in meta:
                raise PipeccError(f"checkpoint {base}.json has no optimizer state")
            self.optimizer.load_state_dict(from_json(meta["optimizer"]["state"], tensors))
        return int(meta["step"])


# ---------------------------------------------------------------------------- process group


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(config: RunConfig) -> tuple[int, int]:
    """Join the process group torchrun describes (env://) unless already joined; (rank, world)."""
    if not dist.is_initialized():
        device = torch.device(config.device) if config.device else _default_device()
        backend = config.backend or ("nccl" if device.type == "cuda" else "gloo")
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            # NOTE: binding the device initialises the communicator now, while every rank is
            # here; directed_groups then splits its two-rank groups from it.
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()


# ---------------------------------------------------------------------------- command line


def _synthetic_inputs(ports: StagePorts, seed: int) -> tuple:
    """Seeded inputs matching stage 0's receives (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    values = []
    for port in ports.in_leaves:
        if port.kind != "tensor":
            raise PipeccError(f"input {port.name!r} is an object; the smoke run cannot invent it")
        if port.dtype.is_floating_point:
            values.append(torch.randn(port.shape, generator=gen).to(port.dtype))
        else:  # token ids and the like: 0/1 are valid for any vocabulary
            values.append(torch.randint(0, 2, port.shape, generator=gen).to(port.dtype))
    return tuple(unflatten(values, ports.receives))


def _mean_of_outputs(outputs: Any, target: Any) -> torch.Tensor:
    """Smoke-run loss: the sum over floating tensors in the outputs (nested tuples, lists and dict
    values too) of their mean."""
    if isinstance(outputs, torch.Tensor):
        return outputs.float().mean() if outputs.is_floating_point() else torch.zeros(())
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (tuple, list)):
        return sum((_mean_of_outputs(o, target) for o in outputs), torch.zeros(()))
    return torch.zeros(())


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipecc.runtime.dist OUT --steps N [--verify] [--schedule S]``, one process per rank.

    ``pipecc run OUT`` (``pipecc.cli.run``) starts this under torchrun through ``OUT/run_stage.py``.
    Under torchrun rank r loads its stages from ``OUT/stage_<i>/`` (through
    ``pipecc.runtime.local.load_stage``); without torchrun one process runs every stage (use
    ``--schedule interleaved`` when there are several). Schedule and micro-batches default to the
    compiled ones (``OUT/pipecc.json``). A pipeline compiled for CPUs only runs on the CPU over
    gloo even where CUDA is available; otherwise rank r uses cuda:LOCAL_RANK and NCCL.

    Data. When ``OUT/pipecc.json`` names a ``.py`` model file that exists, every rank imports it
    (without building the model) and calls ``example_inputs(batch_size, **model_args)`` and
    ``example_target(batch_size, **model_args)`` after seeding torch's RNG with ``--seed``, so
    every rank draws the same batch; the rank of stage 0 feeds the inputs (mapped to stage 0's
    receives through ``model_inputs``), the last rank uses the target and the file's
    ``loss_fn(outputs, target)`` on the outputs rebuilt in the model's structure. Without a
    ``loss_fn`` (or ``example_target``) the loss is the mean of the outputs, with a note. Without a
    usable model file (an ONNX model, a folder moved to another machine, no ``pipecc.json``) the
    run uses seeded random inputs of the compiled shapes and that smoke loss.

    Steps. Each step zeroes the gradients, runs ``PipelineRuntime.step``, sums the gradients of
    tied weights (a parameter used by stages on several ranks) across those ranks, and steps
    the optimizer (``--optimizer sgd|adam``, ``--lr``). The last rank prints
    ``step i: loss X, Y samples/s``: samples/s is the batch size divided by the wall time of
    the iteration on the last rank, from its ``zero_grad`` to its ``optimizer.step`` (a local
    ``time.perf_counter`` timer, no barrier: the ranks are coupled by their messages, so in
    steady state every rank's iteration takes the pipeline's period; step 0 includes start-up
    and, with ``--verify``, excludes the comparison).

    ``--verify`` (see ``_Verifier``): the first training step is checked against the original
    computation in one process: every rank builds the original model from the model file,
    loads the weights of ALL stages into it (memory: a full model copy plus all stage weights
    per rank, fine for test-sized models, costly for large ones), runs the full batch with the
    same loss and compares its own stages' parameter gradients (``--rtol``/``--atol``), the last
    rank also the outputs and the loss. A mismatch prints ``pipecc: error: verify: rank R stage
    S gradient of NAME differs: ...`` and exits 1. With BatchNorm and several micro-batches (or
    active dropout) train-mode numerics legitimately differ from one full-batch pass, so only
    eval-mode outputs are compared, before training. Without a model file, ``--verify`` checks
    the pipeline's forward against all stages chained on the last rank.

    Inference-only folders (``pipecc.json``: ``"inference_only": true`` — the plan has FPGA
    stages, which have no backward pass — or schedule "inference", compiled with --inference;
    also ``--schedule inference``) run ``--steps`` forward passes (``PipelineRuntime.infer``,
    stages in eval mode) under the inference schedule, and the last rank prints
    ``step i: forward only, Y samples/s``. A rank holding a stage with ``hls/`` runs it through
    its C simulation (``FpgaPipelineStage``, built with g++ on first use). ``--verify`` compares
    the first pass's outputs with the original model's eval-mode forward (``verify: outputs match
    the single-process run (forward only)``). ``--optimizer``/``--lr`` there are a usage error,
    and so is a training ``--schedule`` for a folder with FPGA stages.
    """
    args = _parser().parse_args(argv)
    try:
        return run_compiled(args)
    except _PeerFailed:
        return 1  # another rank reported the problem
    except PipeccError as e:
        message = str(e)
        rank = os.environ.get("RANK")
        if rank is not None and not re.search(r"\brank \d+", message):
            message = f"rank {rank}: {message}"
        print(f"pipecc: error: {message}", file=sys.stderr, flush=True)
        return e.exit_code


class _PeerFailed(PipeccError):
    """Raised on the ranks that agree to stop because another rank's check failed."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipecc.runtime.dist")
    parser.add_argument("out", type=Path, help="a compiled folder (pipecc compile -o OUT)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--schedule", help=f"{', '.join(SCHEDULES)} or schedule text (default: the compiled one)")
    parser.add_argument("--microbatches", type=int, help="default: the compiled number")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a peer")
    parser.add_argument("--backend", choices=("gloo", "nccl"))
    parser.add_argument("--optimizer", choices=("sgd", "adam"), help="default sgd (training only)")
    parser.add_argument("--lr", type=float, help="default 1e-3 (training only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", action="store_true", help="compare with the original model in one process")
    parser.add_argument("--rtol", type=float, default=1e-4, help="--verify: relative tolerance")
    parser.add_argument("--atol", type=float, default=1e-5, help="--verify: absolute tolerance")
    return parser


def _stage_dirs(out: Path) -> list[Path]:
    dirs = sorted((p for p in out.glob("stage_*") if p.is_dir() and p.name[6:].isdigit()),
                  key=lambda p: int(p.name[6:]))
    if not dirs:
        raise PipeccError(f"{out} holds no stage_<i>/ folders; run `pipecc compile` first")
    if [int(p.name[6:]) for p in dirs] != list(range(len(dirs))):
        raise PipeccError(f"{out}: stage folders {[p.name for p in dirs]} are not stage_0 .. stage_{len(dirs) - 1}")
    return dirs


def _read_marker(out: Path) -> dict[str, Any] | None:
    """``OUT/pipecc.json`` as a dict, or None when there is none."""
    path = out / "pipecc.json"
    if not path.exists():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PipeccError(f"{path} is unreadable ({e}); compile again") from None
    if not isinstance(marker, dict):
        raise PipeccError(f"{path} is not a pipecc marker; compile again")
    return marker


def _compiled_device(meta: dict[str, Any] | None) -> str | None:
    """"cpu" when the pipeline was compiled for CPUs (and FPGA cards, whose stages run as a C
    simulation on the host CPU) only: then it runs on the CPU, over gloo, even where CUDA is
    available; None otherwise: the runtime's default, cuda:LOCAL_RANK with NCCL."""
    devices = (meta or {}).get("devices") or []
    if devices and all(isinstance(d, dict) and d.get("kind") in ("cpu", "fpga") for d in devices):
        return "cpu"
    return None


TRAINING_SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _fpga_stages(meta: dict[str, Any] | None, stage_dirs: Sequence[Path]) -> list[int]:
    """The stages that run on an FPGA card: ``pipecc.json``'s ``fpga_stages``, else those with ``hls/``."""
    listed = (meta or {}).get("fpga_stages") or {}
    try:
        found = {int(k) for k in listed}
    except (TypeError, ValueError):
        found = set()
    return sorted(found | {i for i, d in enumerate(stage_dirs) if (d / "hls").is_dir()})


def inference_only(meta: dict[str, Any] | None, stage_dirs: Sequence[Path] = ()) -> tuple[bool, bool, str]:
    """(runs forward only, can never train, why) for a compiled folder.

    A folder with FPGA stages (``pipecc.json``: ``"inference_only": true``, or a ``stage_<i>/hls/``)
    can never train: the C simulation has no backward pass. One compiled with ``--inference``
    (schedule "inference") runs forward only unless a training schedule is asked for.
    """
    fpga = _fpga_stages(meta, stage_dirs)
    if fpga or (meta or {}).get("inference_only"):
        why = f"FPGA stages: {fpga}" if fpga else str((meta or {}).get("inference_only_reason")
                                                       or "compiled inference-only")
        return True, True, why
    if (meta or {}).get("schedule") == "inference":
        return True, False, "compiled with --inference"
    return False, False, ""


def _load_fpga_stage(stage_dir: Path, index: int) -> nn.Module:
    """Stage ``index``'s executable when it runs on an FPGA card: its C simulation.

    NOTE: the runtime never imports the compiler (pipecc.backends, passes, cost) for CPU/GPU
    stages, whose executable is the generated ``stage.py``. An FPGA stage's executable is the
    HLS project in ``stage_<i>/hls/`` built with g++ into a shared library and called through
    ctypes (the C-sim bridge), which only the FPGA backend can build and call; so this branch,
    taken only by the rank that holds an FPGA stage, imports it, lazily.
    """
    hls = stage_dir / "hls"
    try:
        from pipecc.backends.fpga import pipeline as fpga
        from pipecc.backends.fpga import toolchain_problem
    except ImportError as e:
        raise PipeccError(f"stage {index} runs on an FPGA ({hls}) but the FPGA backend cannot be imported "
                          f"({e})") from None
    problem = toolchain_problem()
    if problem:
        raise PipeccError(f"stage {index} runs on an FPGA through its C simulation, which cannot be built "
                          f"here: {problem}")
    usable = getattr(fpga, "_usable_hls", None)  # a temporary copy when hls/ is read-only
    where, keep = usable(hls) if usable is not None else (hls, None)
    return fpga.FpgaPipelineStage(where, index, keep=keep)


def _make_optimizer(kind: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer | None:
    if not params:
        return None
    return torch.optim.Adam(params, lr=lr) if kind == "adam" else torch.optim.SGD(params, lr=lr)


def run_compiled(args: argparse.Namespace) -> int:
    """The body of ``main``: load this rank's stages and data, verify, train."""
    stage_dirs = _stage_dirs(args.out)
    meta = _read_marker(args.out)
    try:
        from pipecc.runtime.local import load_stage  # lazy: the stage loader lives with the local runtime
    except ImportError:
        raise PipeccError("pipecc.runtime.local.load_stage is missing; cannot load compiled stages") from None
    forward, never_trains, why = inference_only(meta, stage_dirs)
    if args.schedule in TRAINING_SCHEDULES and never_trains:
        raise UsageError(f"{args.out} is an inference-only pipeline ({why}): FPGA stages have no backward "
                         f"pass, so it runs forward passes only; --schedule {args.schedule} would train it")
    forward = forward and args.schedule not in TRAINING_SCHEDULES or args.schedule == "inference"
    why = why or "--schedule inference"
    if forward and (args.optimizer is not None or args.lr is not None):
        asked = " and ".join(f for f, v in (("--optimizer", args.optimizer), ("--lr", args.lr)) if v is not None)
        raise UsageError(f"{args.out} is an inference-only pipeline ({why}): it runs forward passes only, "
                         f"so {asked} would train it")
    schedule_name = args.schedule or (meta or {}).get("schedule") or "1f1b"
    m = args.microbatches or int((meta or {}).get("microbatches") or 4)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_guess = int(os.environ["WORLD_SIZE"]) if under_torchrun else 1
    if forward:
        # one stage per rank: the inference schedule; several (one process): interleaved, which
        # infer() runs without its backward actions
        schedule_name = "inference" if len(stage_dirs) == world_guess else "interleaved"
    config = RunConfig(schedule_name, m, args.timeout, args.backend, _compiled_device(meta))
    rank, world = init_distributed(config) if under_torchrun else (0, 1)
    if len(stage_dirs) % world:
        raise PipeccError(f"{len(stage_dirs)} stages do not divide over {world} ranks")
    schedule = build_schedule(schedule_name, world, m, len(stage_dirs) // world)
    loaded = [load_stage(stage_dirs[s]) for s in schedule.stages_of(rank)]
    modules, ports = [mod for mod, _ in loaded], [p for _, p in loaded]
    specs = [json.loads((d / "ports.json").read_text()) for d in stage_dirs]
    data = _RunData.load(meta, specs, args.seed)
    if forward:
        for i, s in enumerate(schedule.stages_of(rank)):
            if (stage_dirs[s] / "hls").is_dir():
                modules[i] = _load_fpga_stage(stage_dirs[s], s)
        return _run_forward(args, meta, stage_dirs, specs, data, modules, ports, rank, world, config,
                            load_stage, why)
    params = [p for mod in modules for p in mod.parameters()]
    optimizer = _make_optimizer(args.optimizer or "sgd", params, 1e-3 if args.lr is None else args.lr)
    runtime = PipelineRuntime(modules, ports, rank, world, config, data.loss_fn, optimizer)
    is_last = runtime.last_stage in runtime.stage_ids
    if is_last and data.note:
        print(data.note, flush=True)
    tied = _TiedGradients(runtime, modules, specs)
    inputs = data.inputs if 0 in runtime.stage_ids else None
    target = data.target if is_last else None
    batch = int((meta or {}).get("batch_size") or StagePorts.from_json(specs[0]).batch_size or 0)

    verifier = None
    if args.verify and data.module is None:
        outputs = runtime.infer(inputs)
        if outputs is not None:
            _verify(outputs, data.inputs, [load_stage(d)[0].to(runtime.device) for d in stage_dirs])
    elif args.verify:
        verifier = _Verifier(runtime, data, meta or {}, stage_dirs, load_stage, args.rtol, args.atol)
        if verifier.eval_only:
            verifier.check_eval_outputs(inputs)
            verifier = None

    def train_step(i: int, update: bool) -> None:
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad()
        runtime.keep_outputs = verifier is not None and i == 0
        loss = runtime.step(inputs, target)
        tied.reduce()
        if verifier is not None and i == 0:
            paused = time.perf_counter()
            verifier.check_step(loss)
            start += time.perf_counter() - paused
        if optimizer is not None and update:
            optimizer.step()
        elapsed = time.perf_counter() - start
        if loss is not None and update:
            rate = f", {batch / elapsed:.1f} samples/s" if batch and elapsed > 0 else ""
            print(f"step {i}: loss {loss:.6g}{rate}", flush=True)

    if verifier is not None and args.steps < 1:
        train_step(0, update=False)  # --verify --steps 0: check one step, train none
    for i in range(args.steps):
        train_step(i, update=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _run_forward(args: argparse.Namespace, meta: dict[str, Any] | None, stage_dirs: list[Path],
                 specs: list[dict[str, Any]], data: _RunData, modules: list[nn.Module], ports: list[dict],
                 rank: int, world: int, config: RunConfig, load_stage: Callable, why: str) -> int:
    """An inference-only folder: ``--steps`` forward passes (eval mode) of the model's example
    inputs; ``--verify`` compares the first one's outputs with the original model's forward."""
    for module in modules:
        module.eval()  # inference semantics: what an FPGA stage computes (BatchNorm folded, no dropout)
    runtime = PipelineRuntime(modules, ports, rank, world, config)
    is_last = runtime.last_stage in runtime.stage_ids
    inputs = data.inputs if 0 in runtime.stage_ids else None
    batch = int((meta or {}).get("batch_size") or StagePorts.from_json(specs[0]).batch_size or 0)
    if is_last:
        print(f"inference-only pipeline ({why}): running forward passes", flush=True)
    verifier = None
    if args.verify and data.module is not None:
        verifier = _Verifier(runtime, data, meta or {}, stage_dirs, load_stage, args.rtol, args.atol)

    def check(outputs: Any) -> None:
        if verifier is not None:
            verifier.check_forward(outputs)
        elif outputs is not None:  # no model file: against all (torch) stages chained here
            _verify(outputs, data.inputs, [load_stage(d)[0].eval().to(runtime.device) for d in stage_dirs])

    for i in range(args.steps):
        start = time.perf_counter()
        outputs = runtime.infer(inputs)
        elapsed = time.perf_counter() - start
        if args.verify and i == 0:
            check(outputs)
        if is_last:
            rate = f", {batch / elapsed:.1f} samples/s" if batch and elapsed > 0 else ""
            print(f"step {i}: forward only{rate}", flush=True)
    if args.verify and args.steps < 1:
        check(runtime.infer(inputs))  # --verify --steps 0: check one forward pass
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _verify(outputs: Any, inputs: tuple, modules: list[nn.Module]) -> None:
    """Without a model file: the pipeline's forward against all stages chained in this process."""
    values: Any = inputs
    with torch.no_grad():
        for module in modules:
            values = _as_tuple(module(*_as_tuple(values)))
    expected = values[0] if len(values) == 1 else values
    try:
        torch.testing.assert_close(outputs, expected)
    except AssertionError as e:
        raise PipeccError(f"verify: pipeline outputs differ from the chained stages: {str(e).splitlines()[0]}") from None
    print("verify: pipeline outputs match the chained stages", flush=True)


# ---------------------------------------------------------------------------- the model's data


def _build_output(tree: dict[str, Any] | None, env: dict[str, Any]) -> Any:
    """The model's output structure from its JSON tree (``model_output``) and the port values."""
    if tree is None:
        return next(iter(env.values())) if len(env) == 1 else tuple(env.values())
    if "port" in tree:
        return env[tree["port"]]
    if "tuple" in tree:
        return tuple(_build_output(t, env) for t in tree["tuple"])
    if "list" in tree:
        return [_build_output(t, env) for t in tree["list"]]
    if "dict" in tree:
        return {k: _build_output(t, env) for k, t in tree["dict"]}
    return tree.get("const")


def _output_ports(tree: dict[str, Any] | None, value: Any, found: dict[str, Any]) -> dict[str, Any]:
    """``_build_output``'s inverse: port name -> the part of the model output ``value`` it holds."""
    if tree is None or "port" in tree:
        found.setdefault(tree["port"] if tree else "output", value)
    elif "tuple" in tree or "list" in tree:
        for t, v in zip(tree.get("tuple", tree.get("list", ())), value):
            _output_ports(t, v, found)
    elif "dict" in tree:
        for k, t in tree["dict"]:
            _output_ports(t, value[k], found)
    return found


@dataclass
class _RunData:
    """What a run feeds the pipeline: stage 0's inputs, the target, the loss (see ``main``)."""

    inputs: tuple  # stage 0's receives, full batch
    target: Any
    loss_fn: Callable  # what PipelineRuntime calls: (last stage's sends, target) -> scalar
    model_loss: Callable  # (model outputs, target) -> scalar
    model_inputs: tuple = ()  # the model's positional inputs (for --verify)
    module: Any = None  # the imported model file; None: synthetic data
    note: str | None = None
    model_output: dict[str, Any] | None = None
    send_names: tuple[str, ...] = ()

    @classmethod
    def load(cls, meta: dict[str, Any] | None, specs: list[dict[str, Any]], seed: int) -> _RunData:
        first = StagePorts.from_json(specs[0])
        if meta is None:
            return cls(_synthetic_inputs(first, seed), None, _mean_of_outputs, _mean_of_outputs)
        raw_path = str(meta.get("model_path") or "")
        path = Path(raw_path)
        if not raw_path:
            why = "pipecc.json names no model file"
        elif path.suffix != ".py":
            why = f"the model file {path.name} is not a .py model file"
        elif not path.is_file():
            why = f"the model file {raw_path} is not on this machine"
        else:
            why = ""
        if why:
            note = f"note: {why}; training on seeded random inputs with the mean of the outputs as the loss"
            return cls(_synthetic_inputs(first, seed), None, _mean_of_outputs, _mean_of_outputs, note=note)
        from pipecc.frontend.modelfile import _call_with_accepted, import_model_file  # torch and pipecc.errors only

        module = import_model_file(path)
        model_args = dict(meta.get("model_args") or {})
        batch = int(meta.get("batch_size") or first.batch_size or 1)

        def call(name: str) -> Any:
            try:
                return _call_with_accepted(getattr(module, name), batch, **model_args)
            except Exception as e:
                raise PipeccError(f"{name} in {path.name} failed: {type(e).__name__}: {e}") from None

        torch.manual_seed(seed)  # every rank draws the same batch, even from an unseeded example_inputs
        raw = call("example_inputs")
        model_inputs = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
        target = call("example_target") if callable(getattr(module, "example_target", None)) else None
        user_loss = getattr(module, "loss_fn", None)
        note = None
        if not callable(user_loss):
            note, model_loss = f"note: {path.name} defines no loss_fn; the loss is the mean of the outputs", \
                _mean_of_outputs
        elif target is None:
            note, model_loss = f"note: {path.name} defines loss_fn but no example_target; the loss is the mean " \
                "of the outputs", _mean_of_outputs
        else:
            model_loss = user_loss
        tree = meta.get("model_output") or specs[-1].get("model_output")
        send_names = tuple(str(p.get("name")) for p in specs[-1].get("sends", ()))

        def loss_fn(value: Any, tgt: Any) -> torch.Tensor:
            sends = (value,) if len(send_names) == 1 else tuple(value)
            return model_loss(_build_output(tree, dict(zip(send_names, sends))), tgt)

        inputs = _stage0_inputs(model_inputs, meta.get("model_inputs") or specs[0].get("model_inputs") or [],
                                first, path.name)
        return cls(inputs, target, loss_fn, model_loss, model_inputs, module, note, tree, send_names)


def _stage0_inputs(values: tuple, model_inputs: list[dict[str, Any]], first: StagePorts, file: str) -> tuple:
    """The model's positional inputs mapped to stage 0's receives (by ``model_inputs`` names)."""
    index = {str(d["name"]): int(d["index"]) for d in model_inputs}
    args = {str(d["name"]): str(d.get("arg", d["name"])) for d in model_inputs}
    chosen = []
    for i, port in enumerate(first.receives):
        k = index.get(port.name, i if not index else None)
        if k is None:
            raise PipeccError(f"stage 0 receives {port.name!r}, which is none of the model inputs in pipecc.json")
        if k >= len(values):
            raise PipeccError(f"example_inputs in {file} returned {len(values)} values; the compiled model takes "
                              f"input {args.get(port.name, port.name)!r} at position {k}")
        chosen.append(values[k])
    return tuple(chosen)


class _TiedGradients:
    """Sums the gradient of each tied weight (one parameter used by several stages; every
    holding stage has its own copy, ``ports.json``'s ``tied``) over the holders, so every copy
    gets the original parameter's gradient and the copies stay equal under the optimizer.

    Construction is collective (``dist.new_group`` for every tied weight spanning ranks, in
    the same order on every rank).
    """

    def __init__(self, runtime: PipelineRuntime, modules: Sequence[nn.Module], specs: list[dict[str, Any]]):
        holders: dict[str, list[int]] = {}
        for k, spec in enumerate(specs):
            for name in spec.get("tied", ()) or ():
                holders.setdefault(str(name), []).append(k)
        self.entries: list[tuple[str, Any, list[nn.Parameter]]] = []
        for name in sorted(holders):
            ranks = sorted({runtime.schedule.stage_to_rank[k] for k in holders[name]})
            group = dist.new_group(ranks) if len(ranks) > 1 and runtime.world > 1 else None
            local = [p for s, module in zip(runtime.stage_ids, modules) if s in holders[name]
                     for p in _named_param(module, name)]
            if local and (len(local) > 1 or group is not None):
                self.entries.append((name, group, local))

    def reduce(self) -> None:
        for _, group, params in self.entries:
            total = sum((p.grad if p.grad is not None else torch.zeros_like(p)) for p in params).detach().clone()
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in params:
                p.grad = total.clone()


def _named_param(module: nn.Module, name: str) -> list[nn.Parameter]:
    """The parameter of a generated stage module that holds the original parameter ``name``."""
    cls = type(module)
    names: dict[str, str] = getattr(cls, "PARAM_NAMES", {})
    aliases: dict[str, tuple[str, ...]] = getattr(cls, "PARAM_ALIASES", {})
    params = dict(module.named_parameters())
    return [params[attr] for attr, n in names.items()
            if attr in params and (n == name or name in aliases.get(attr, ()))]


# ---------------------------------------------------------------------------- --verify


class _Verifier:
    """``--verify`` against the original model in this process (see ``main``); collective."""

    def __init__(self, runtime: PipelineRuntime, data: _RunData, meta: dict[str, Any], stage_dirs: list[Path],
                 load_stage: Callable, rtol: float, atol: float):
        from pipecc.runtime.stagefile import assemble_owner

        self.runtime, self.data, self.rtol, self.atol = runtime, data, rtol, atol
        self.is_last = runtime.last_stage in runtime.stage_ids
        file = Path(str(meta.get("model_path"))).name
        try:
            model = data.module.build_model(**dict(meta.get("model_args") or {}))
        except Exception as e:
            raise PipeccError(f"verify: build_model in {file} failed: {type(e).__name__}: {e}") from None
        if not isinstance(model, nn.Module):
            raise PipeccError(f"verify: build_model in {file} returned {type(model).__name__}, not an nn.Module")
        state = assemble_owner([load_stage(d)[0] for d in stage_dirs]).state_dict()
        wanted = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        wanted += [n for n, _ in model.named_buffers(remove_duplicate=False) if _persistent_buffer(model, n)]
        missing = [n for n in wanted if n not in state]
        if missing:
            raise PipeccError(f"verify: the compiled stages hold no tensor for {missing[0]!r} of the model built from "
                              f"{file}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + "; was OUT compiled from this file and these --model-arg values?")
        try:
            model.load_state_dict(state, strict=False)
        except RuntimeError as e:
            raise PipeccError(f"verify: the stage weights do not fit the model built from {file}: "
                              f"{str(e).strip().splitlines()[-1].strip()}") from None
        self.model = model.to(runtime.device)
        self.eval_only = self._eval_only_reason(model, runtime.m)

    @staticmethod
    def _eval_only_reason(model: nn.Module, m: int) -> str | None:
        if m > 1 and any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in model.modules()):
            return (f"the model has BatchNorm, which in train mode normalises each of the {m} micro-batches "
                    "with its own statistics (legitimately unlike one full-batch pass)")
        if any(isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0 for mod in model.modules()):
            return "the model has dropout, whose random masks differ between the two runs"
        return None

    def _inputs(self) -> tuple:
        return tuple(v.to(self.runtime.device) if isinstance(v, torch.Tensor) else v for v in self.data.model_inputs)

    def _target(self) -> Any:
        t = self.data.target
        if isinstance(t, torch.Tensor):
            return t.to(self.runtime.device)
        if isinstance(t, (tuple, list)):
            return type(t)(x.to(self.runtime.device) if isinstance(x, torch.Tensor) else x for x in t)
        return t

    def check_eval_outputs(self, inputs: Any) -> None:
        """BatchNorm with micro-batches, dropout: eval-mode outputs only, before training."""
        for module in self.runtime.modules:
            module.eval()
        try:
            outputs = self.runtime.infer(inputs)
        finally:
            for module in self.runtime.modules:
                module.train()
        if self.is_last:
            print(f"verify: {self.eval_only}; compared eval-mode outputs only", flush=True)
        self.check_forward(outputs, "verify: eval-mode outputs match the single-process run")

    def check_forward(self, outputs: Any,
                      done: str = "verify: outputs match the single-process run (forward only)") -> None:
        """Inference-only runs: the pipeline's outputs (``infer``) against the model's eval-mode forward."""
        failures: list[str] = []
        if self.is_last:
            self.model.eval()
            with torch.no_grad():
                expected = self.model(*self._inputs())
            failures += self._compare_outputs(outputs, expected)
        self._agree(failures, 0)
        if self.is_last:
            print(done, flush=True)
        del self.model

    def check_step(self, loss: float | None) -> None:
        """After the pipeline's first step (before the optimizer's): outputs, loss, gradients."""
        model = self.model
        model.train()
        model.zero_grad(set_to_none=True)
        outputs = model(*self._inputs())
        ref_loss = self.data.model_loss(outputs, self._target())
        ref_loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
        failures: list[str] = []
        count = 0
        for s, module in zip(self.runtime.stage_ids, self.runtime.modules):
            names: dict[str, str] = getattr(type(module), "PARAM_NAMES", {})
            shards: dict[str, tuple] = getattr(type(module), "SHARDS", {})
            for attr, p in module.named_parameters():
                if not p.requires_grad:
                    continue
                if attr in shards:
                    name, dim, start, size = shards[attr]
                    label = f"{name} (slice {start}:{start + size} of dim {dim})"
                    ref = grads.get(name)
                    ref = ref.narrow(dim, start, size) if ref is not None else None
                elif attr in names:
                    name = label = names[attr]
                    ref = grads.get(name)
                else:
                    continue
                if name not in grads:
                    failures.append(f"verify: rank {self.runtime.rank} stage {s} parameter {attr} maps to {name!r}, "
                                    "which the original model does not have")
                    continue
                count += 1
                got = p.grad if p.grad is not None else torch.zeros_like(p)
                ref = ref if ref is not None else torch.zeros_like(p)
                problem = self._differs(got, ref.to(got.device))
                if problem:
                    failures.append(f"verify: rank {self.runtime.rank} stage {s} gradient of {label} "
                                    f"differs: {problem}")
        if self.is_last:
            got_loss = float(loss) if loss is not None else float("nan")
            want = float(ref_loss.detach())
            if not abs(got_loss - want) <= self.atol + self.rtol * abs(want):
                failures.append(f"verify: rank {self.runtime.rank} stage {self.runtime.last_stage} loss {got_loss:.8g} "
                                f"differs from the single-process {want:.8g}")
            failures += self._compare_outputs(self.runtime.last_outputs(), outputs)
        total = self._agree(failures, count)
        if self.is_last:
            print(f"verify: outputs, loss and {total} gradients match the single-process run", flush=True)
        del self.model
        model.zero_grad(set_to_none=True)

    def _compare_outputs(self, sends: Any, expected: Any) -> list[str]:
        names = self.data.send_names
        got = dict(zip(names, (sends,) if len(names) == 1 else tuple(sends)))
        want = _output_ports(self.data.model_output, expected, {})
        failures = []
        for name, value in got.items():
            if name not in want:
                continue
            ref = want[name]
            if isinstance(value, list) and not isinstance(ref, list):
                value = value[0]  # an unbatched output: one value per micro-batch
            if isinstance(value, torch.Tensor) and isinstance(ref, torch.Tensor):
                problem = self._differs(value, ref.detach().to(value.device))
            else:
                problem = None if value == ref else f"{value!r} != {ref!r}"
            if problem:
                failures.append(f"verify: rank {self.runtime.rank} stage {self.runtime.last_stage} output {name} "
                                f"differs: {problem}")
        return failures

    def _differs(self, got: torch.Tensor, want: torch.Tensor) -> str | None:
        """None when close, else a one-line summary (how many elements, the largest difference)."""
        if got.shape != want.shape:
            return f"shape {list(got.shape)} vs {list(want.shape)} in the single-process run"
        got, want = got.detach().double(), want.detach().double()
        if torch.allclose(got, want, rtol=self.rtol, atol=self.atol, equal_nan=True):
            return None
        diff = (got - want).abs()
        bad = ~torch.isclose(got, want, rtol=self.rtol, atol=self.atol, equal_nan=True)
        worst = int(torch.argmax(torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)))
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape)) if got.dim() else ()
        return (f"{int(bad.sum())} of {got.numel()} elements, largest difference {float(diff.flatten()[worst]):.3g} "
                f"at {list(where)} ({float(got.flatten()[worst]):.6g} vs {float(want.flatten()[worst]):.6g}; "
                f"rtol {self.rtol:g}, atol {self.atol:g})")

    def _agree(self, failures: list[str], count: int) -> int:
        """Every rank learns whether all passed (so all stop together); returns the gradient count."""
        flags = torch.tensor([0.0 if failures else 1.0, float(count)], dtype=torch.float64,
                             device=self.runtime.device)
        if self.runtime.world > 1:
            dist.all_reduce(flags)
        if failures:
            more = f" (and {len(failures) - 1} more mismatches)" if len(failures) > 1 else ""
            raise PipeccError(failures[0] + more)
        if int(flags[0]) != self.runtime.world:
            raise _PeerFailed("verify failed on another rank")
        return int(flags[1])


def _persistent_buffer(model: nn.Module, qualified: str) -> bool:
    owner_name, _, last = qualified.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return last not in owner._non_persistent_buffers_set


if __name__ == "__main__":
    sys.exit(main())
