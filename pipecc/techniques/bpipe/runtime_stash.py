"""BPipe's saved-tensor store: what autograd saves during one stage forward, held so that it can
leave the rank (eviction to the partner stage) and come back before the backward.

Capture (``SavedTensors.capture``). The stage forward of an evictor stage runs under
``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``. ``pack`` files every saved tensor
in this (stage, micro-batch)'s store and returns a small handle; autograd keeps only the
handle, so the store holds the only reference to the activation. ``unpack`` (during the
backward) returns the tensor from the store. Kept out of the store, returned as they are:

  * parameters and buffers, and views of them (autograd saves the weights of a matmul too):
    matched by their storage (``module_storages``); they must never move;
  * tensors without bytes (an empty storage).

De-duplication. A tensor saved by several operations (the input of a linear layer and its
activation, views of one buffer) is one *storage*: the store keeps each storage once, and per
saved tensor its view (dtype, storage offset, size, stride). Eviction moves storages, as raw
bytes, and restoring rebuilds every view on the returned bytes (``Tensor.set_``), so the
unpacked tensors equal the saved ones bit for bit, whatever their dtype or layout of strides.

Eviction (``evict``) hands out the storages as flat uint8 tensors and drops the store's
references; the transport copies them into one payload (``pack_stash``), so they go as soon
as the caller drops the list, and the wire keeps the payload only until the send completed
(``pipecc.runtime.wire.Wire.release``). Storages the engine keeps anyway (the stage's input
leaves and sent outputs, ``resident``) stay: moving them would free nothing. ``restore`` takes
the returned bytes back; ``unpack`` on an evicted store is an error naming the action missing.

Transport (``send_stash``/``recv_stash``): one packed payload per transfer, so a stash of any
number of storages costs two messages out (an int64 byte count, then the payload) and one
back (the payload: the evictor knows its size), instead of a length, a JSON header and one
message per storage each way. ``pack_stash`` lays the payload out as an int64
layout header (the storage count, then every storage's byte count) and the storages, each
starting on an ``ALIGN``-byte boundary; ``unpack_stash`` returns the storages as views of the
payload (no copy), so ``SavedTensors.unpack`` rebuilds every view at its byte offset. The
receiver allocates from the byte count, so no shape travels in ``ports.json``. The acceptor
keeps the payload whole (``recv_packed``) and sends it back as it came. The evictor's RECV_R is
a prefetch (``Prefetch``): it knows the payload's size and layout, so it posts its receive at
once and waits only right before the backward of that micro-batch, then checks the layout
header against what it sent. Tags: leaf 0 carries the byte count, tag + 1 the payload.
NOTE: why pack. With 4 gloo ranks on 2 CPUs (bench_papers_run's bpipe case, cProfile) posting
one send costs its rank ~0.7 ms and one receive ~0.3-0.5 ms, far more than moving a stash of
a few KB, so a transfer costs what its message count does; packing costs one copy of the
stash bytes on the evictor (memory bandwidth, small next to any link).

Imports torch, ``pipecc.errors`` and ``pipecc.runtime.wire``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipecc.errors import PipeccError
from pipecc.runtime.wire import ALIGN, Wire, pack_tensors, packed_layout, packed_views  # ALIGN: where every storage starts

__all__ = ["ALIGN", "Prefetch", "SavedTensors", "layout",
           "module_storages", "pack_stash", "recv_packed", "recv_stash", "send_stash", "storage_key", "unpack_stash"]


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Where a tensor's bytes live: (device, storage data pointer); views of one buffer share it."""
    return (str(t.device), t.untyped_storage().data_ptr())


def module_storages(modules: Sequence[nn.Module]) -> frozenset[tuple[str, int]]:
    """The storages of the modules' parameters and buffers, which the store never takes."""
    found = set()
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            found.add(storage_key(t))
    return frozenset(found)


@dataclass(frozen=True)
class _View:
    """How to rebuild one saved tensor on its storage's bytes."""

    storage: int  # index into SavedTensors.storages
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class SavedTensors:
    """The saved activations of one (stage, micro-batch): storages kept once, views to rebuild.

    ``skip`` holds the storages never taken (``module_storages``). ``what`` names the store in
    errors (``"stage 0 mb 3"``).
    """

    def __init__(self, skip: frozenset[tuple[str, int]], what: str):
        self.skip, self.what = skip, what
        self.storages: list[torch.Tensor | None] = []  # flat uint8 over each storage; None while away
        self.keys: list[tuple[str, int]] = []  # storage_key of each, at capture time
        self.sizes: list[int] = []  # byte count of each (known while it is away)
        self.views: list[_View] = []
        self.originals: list[torch.Tensor | None] = []  # the saved tensors (detached) until eviction
        self._index: dict[tuple[str, int], int] = {}
        self.away: list[int] = []  # indices of the storages now on the partner
        self.moves = 0  # completed evictions (a test counts them)

    # -- autograd hooks ------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Run the stage forward inside: every tensor autograd saves goes through this store."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def pack(self, t: torch.Tensor) -> Any:
        if t.layout is not torch.strided or t.untyped_storage().nbytes() == 0:
            return t  # NOTE: sparse/empty: not ours to move (none in pipecc's stages today)
        key = storage_key(t)
        if key in self.skip:
            return t  # a parameter or buffer (or a view of one): stays, never moves
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.storages)
            self.storages.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()))
            self.keys.append(key)
            self.sizes.append(t.untyped_storage().nbytes())
        self.views.append(_View(index, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride())))
        self.originals.append(t.detach())
        return _Handle(len(self.views) - 1)

    def unpack(self, handle: Any) -> torch.Tensor:
        if not isinstance(handle, _Handle):
            return handle
        original = self.originals[handle.index]
        if original is not None:
            return original
        view = self.views[handle.index]
        data = self.storages[view.storage]
        if data is None:
            raise PipeccError(f"{self.what}: its saved activations are still on the partner stage when the "
                              "backward needs them (the schedule has no RECV_R before B)")
        # NOTE: a returned storage is a slice of the packed payload (``unpack_stash``), ALIGN-aligned
        base = data.storage_offset() // view.dtype.itemsize
        return torch.empty(0, dtype=view.dtype, device=data.device).set_(
            data.untyped_storage(), base + view.offset, view.size, view.stride)

    # -- eviction ------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the storages held here now."""
        return sum(s.numel() for s in self.storages if s is not None)

    def evict(self, resident: frozenset[tuple[str, int]] = frozenset()) -> list[torch.Tensor]:
        """The storages to send (flat uint8), dropping this store's references to them.

        Storages in ``resident`` (kept by the engine anyway) stay here."""
        if self.away:
            raise PipeccError(f"{self.what}: evicted twice (the schedule sends its stash out again before "
                              "it came back)")
        self.away = [i for i, key in enumerate(self.keys) if key not in resident]
        out = []
        for i in self.away:
            out.append(self.storages[i])
            self.storages[i] = None
        self.originals = [None if v.storage in self.away else t for v, t in zip(self.views, self.originals)]
        self.moves += 1
        return out

    def restore(self, buffers: Sequence[torch.Tensor]) -> None:
        """Take back what ``evict`` handed out, in the same order; ``unpack`` then rebuilds the views."""
        sizes = [t.numel() for t in buffers]
        if sizes != self.away_sizes:
            raise PipeccError(f"{self.what}: the partner returned storages of {sizes} bytes, "
                              f"{self.away_sizes} were evicted")
        for i, t in zip(self.away, buffers):
            self.storages[i] = t
        self.away = []

    @property
    def away_sizes(self) -> list[int]:
        """Byte counts of the evicted storages, in eviction order (the header the partner returns)."""
        return [self.sizes[i] for i in self.away]


@dataclass(frozen=True)
class _Handle:
    """What autograd keeps for a saved activation: its index in the store."""

    index: int


# ---------------------------------------------------------------------------- transport




def _specs(sizes: Sequence[int]) -> list[tuple[tuple[int], torch.dtype]]:
    """A stash payload as `wire.packed_layout` sees it: the int64 header (count, then the byte
    counts) and the storages, each a flat uint8 tensor."""
    return [((8 * (1 + len(sizes)),), torch.uint8), *(((int(n),), torch.uint8) for n in sizes)]


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of storages of ``sizes`` bytes in a packed payload, and its total size."""
    offsets, total = packed_layout(_specs(sizes))
    return offsets[1:], total


def pack_stash(buffers: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flat uint8 payload holding ``buffers`` (flat uint8 storages) and their layout header."""
    sizes = [int(b.numel()) for b in buffers]
    header = torch.tensor([len(sizes), *sizes], dtype=torch.int64).view(torch.uint8)
    return pack_tensors([header, *buffers], device)


def header_sizes(payload: torch.Tensor) -> list[int] | None:
    """The storage byte counts a payload's layout header announces (None when malformed)."""
    if payload.numel() < 8:
        return None
    count = int(payload[:8].cpu().view(torch.int64)[0])
    if count < 0 or 8 * (1 + count) > payload.numel():
        return None
    sizes = [int(n) for n in payload[:8 * (1 + count)].cpu().view(torch.int64)[1:]]
    if any(n < 0 for n in sizes) or layout(sizes)[1] != payload.numel():
        return None
    return sizes


def unpack_stash(payload: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """The storages of a packed payload, as views of it (in order)."""
    return packed_views(payload, _specs(sizes))[1:]


def send_stash(wire: Wire, stash: Sequence[torch.Tensor] | torch.Tensor, peer: int, tag_of: Callable[[int], int],
               what: str, key: Any, device: torch.device, counted: bool = True) -> None:
    """Post a stash to ``peer``: storages (packed here) or a payload ``pack_stash`` made; non-blocking,
    ``wire`` keeps the payload until ``release(key)``. ``tag_of(0)`` is the transfer's even tag.
    ``counted``: the byte count goes first (SEND_S: the acceptor cannot know it); a return
    (SEND_R) sends the payload alone, whose size the evictor knows (``Prefetch``)."""
    payload = stash if isinstance(stash, torch.Tensor) else pack_stash(stash, device)
    if counted:
        wire.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), peer, tag_of(0), what, key=key)
    wire.send(payload, peer, tag_of(0) + 1, what, key=key)


class Prefetch:
    """A return the evictor posted at RECV_R: one receive of the payload, whose size and layout
    it knows (the storages it sent); ``wait`` completes it right before the backward that
    needs it and checks the layout header against what it sent."""

    def __init__(self, wire: Wire, peer: int, tag_of: Callable[[int], int], what: str, device: torch.device,
                 sizes: Sequence[int]):
        self.wire, self.peer, self.what = wire, peer, what
        self.sizes = [int(n) for n in sizes]
        self.payload = torch.empty(layout(self.sizes)[1], dtype=torch.uint8, device=device)
        self.posted = wire.post([self.payload], peer, [tag_of(0) + 1], what)

    def wait(self) -> list[torch.Tensor]:
        self.wire.wait(self.posted)
        if header_sizes(self.payload) != self.sizes:
            raise PipeccError(f"{self.what}: rank {self.peer} returned another stash than the one sent to it")
        return unpack_stash(self.payload, self.sizes)


def recv_packed(wire: Wire, peer: int, tag_of: Callable[[int], int], what: str, device: torch.device) -> torch.Tensor:
    """Receive a stash's packed payload from ``peer`` (the acceptor keeps it whole)."""
    length = torch.empty(1, dtype=torch.int64, device=device)
    wire.recv([length], peer, [tag_of(0)], what)
    if int(length.item()) < 8:
        raise PipeccError(f"{what}: malformed stash header from rank {peer}")
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    wire.recv([payload], peer, [tag_of(0) + 1], what)
    if header_sizes(payload) is None:
        raise PipeccError(f"{what}: malformed stash header from rank {peer}")
    return payload


def recv_stash(wire: Wire, peer: int, tag_of: Callable[[int], int], what: str,
               device: torch.device) -> list[torch.Tensor]:
    """Receive a stash from ``peer``: its storages, as views of the payload."""
    payload = recv_packed(wire, peer, tag_of, what, device)
    return unpack_stash(payload, header_sizes(payload) or [])


# ---------------------------------------------------------------------------- the folder's pairs
