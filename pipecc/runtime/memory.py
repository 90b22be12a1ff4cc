"""Measured memory of a run (``pipecc run --json --memory``): each rank's peak bytes during its
timed steps, next to plan.json's ``peak_memory_bytes``.

Two meters, one interface (``begin_step`` / ``end_step`` / ``summary``), picked by the rank's
device (``memory_meter``):

* **CUDA** (``CudaMemory``): the caching allocator's own counters,
  ``torch.cuda.reset_peak_memory_stats`` at the start of a timed step and
  ``torch.cuda.max_memory_allocated`` at its end: every tensor the process holds on its GPU.
* **CPU** (``LiveTensorBytes``): torch has no allocator statistics for the CPU, so the meter
  counts live tensor bytes itself. It is a ``TorchDispatchMode``: every ATen op the rank runs
  (forward, autograd's backward, the optimizer, the wire's receive buffers) passes through
  ``__torch_dispatch__``, which records the storage of each tensor the op returns, once, with
  its ``nbytes``, and a weak reference whose callback subtracts them when the storage dies. A
  view shares its base's storage and costs nothing more; an in-place op returns a storage
  already counted. Tensors that exist before the meter starts are added explicitly (``track``):
  the rank's parameters, buffers, gradients and optimizer state, and the batch it feeds. The
  count is exact for what it sees: the bytes of the storages alive at each moment, the same
  figure the CUDA allocator reports less its rounding to 512-byte blocks and its cached free
  blocks. What it does not see: memory a kernel allocates for itself outside a tensor (oneDNN
  scratch space, gloo's transport buffers) and Python objects. It changes no numerics (every op
  runs unchanged, the mode only reads the results' storages) but costs a Python call per op:
  4.5x the time of ops of a few microseconds (64-wide Linear layers at batch 8), 1.2x at
  512-wide, batch 64, 1.04x at 1024-wide, batch 256 (docs/memory.md), so ``--memory`` is a
  flag and its run's times are not the ones to calibrate with.

``static_bytes`` (both meters) is what the rank's stages hold for the whole iteration, counted
at the end of each timed step (after the optimizer step): its parameters, their gradients, the
optimizer's state and the modules' buffers, each storage once. The planner's counterpart is
``StageMemory.static``: parameters times (2 + optimizer states).

The figures of the run document (``pipecc.runtime.timing``): per stage row ``peak_memory_bytes``
(the rank's largest peak over its timed steps; a rank holding several stages reports the same
figure for each, as plan.json does), ``peak_memory_at`` (CPU: the schedule action the peak was
reached in, e.g. "1B3" for stage 1's backward of micro-batch 3, or "between actions": zero_grad,
the optimizer step; null on CUDA, whose allocator does not say), ``static_memory_bytes`` (at the
end of the last timed step) and ``predicted_peak_memory_bytes`` (plan.json's ``peak_memory_bytes``
summed over the rank's stages: a stage's own figure with one stage per rank; interleaved plans
give each of a device's stages its share); the document's
``memory_source`` says which meter measured ("cuda-allocator", "live-tensors") or null without
``--memory``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CudaMemory", "LiveTensorBytes", "held_tensors", "memory_meter", "static_bytes"]

CUDA_SOURCE, CPU_SOURCE = "cuda-allocator", "live-tensors"
BETWEEN = "between actions"  # peak_at outside every schedule action: zero_grad, the optimizer step


def _storage(t: torch.Tensor) -> Any | None:
    """The tensor's untyped storage, None for one without (a sparse or meta tensor, or a fake
    one: a trace's, e.g. `runtime.loss_targets`, whose storage is on the meta device)."""
    try:
        if t.is_meta or t.layout != torch.strided:
            return None
        st = t.untyped_storage()
        return None if st.device.type == "meta" else st
    except (RuntimeError, NotImplementedError):
        return None


def held_tensors(modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What a rank's stages hold for the whole iteration: parameters, their gradients, buffers
    and the optimizer's state tensors."""
    out: list[torch.Tensor] = []
    for module in modules:
        for p in module.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out.extend(module.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def static_bytes(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (on ``device`` when given)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if device is not None and t.device.type != device.type:
            continue
        st = _storage(t)
        if st is not None:
            seen.setdefault(st.data_ptr() or id(st), st.nbytes())
    return sum(seen.values())


class LiveTensorBytes(TorchDispatchMode):
    """Live tensor bytes of this thread's ops while entered (module docstring): ``live_bytes``
    now, ``peak_bytes`` the most since the last ``reset_peak``. Only tensors on ``device``'s
    type count (default: the CPU)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device_type = torch.device(device).type
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase: Any = None  # what runs now (a schedule action), set by the caller
        self.peak_phase: Any = None  # what ran when the peak was reached
        self._live: dict[int, tuple[int, weakref.ref]] = {}  # id(storage) -> (nbytes, weak ref)

    def track(self, tensors: Iterable[Any]) -> None:
        """Count ``tensors`` (anything else is skipped) from now until their storage dies."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self._add(t)

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_phase = self.live_bytes, self.phase

    def _add(self, t: torch.Tensor) -> None:
        st = _storage(t)
        if st is None:
            return
        key, n = id(st), st.nbytes()
        known = self._live.get(key)
        if known is not None:
            if known[0] == n:
                return
            self.live_bytes += n - known[0]  # resized in place (an out= op, a resize_)
            self._live[key] = (n, known[1])
        else:
            self._live[key] = (n, weakref.ref(st, lambda _ref, key=key: self._free(key)))
            self.live_bytes += n
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_phase = self.live_bytes, self.phase

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self._add(t)
        return out


class _Meter:
    """A rank's memory over its timed steps: ``begin_step``/``end_step`` around each step,
    ``summary`` for the run document (``peak_bytes``, ``static_bytes``, ``source``)."""

    source = ""

    def __init__(self, device: torch.device, modules: list[nn.Module]) -> None:
        self.device, self.modules = device, modules
        self.optimizer: torch.optim.Optimizer | None = None  # set by the training loop
        self.peak: int | None = None
        self.peak_at: str | None = None
        self.static: int | None = None
        self._counting = False

    def begin_step(self, counting: bool) -> None:
        self._counting = counting

    def end_step(self) -> None:
        if self._counting:
            step_peak, at = self._step_peak()
            if self.peak is None or step_peak > self.peak:
                self.peak, self.peak_at = step_peak, at
            self.static = static_bytes(held_tensors(self.modules, self.optimizer), self.device)
        self._counting = False

    def during(self, action: Any, execute: Callable[[], None]) -> Callable[[], None]:
        """``execute`` (a schedule action's work) wrapped so that a peak inside it names it."""
        return execute

    def _step_peak(self) -> tuple[int, str | None]:
        """This step's peak bytes and where it was reached (None: not known)."""
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak, "static_bytes": self.static, "peak_at": self.peak_at, "source": self.source}

    def __enter__(self) -> "_Meter":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class CudaMemory(_Meter):
    """The CUDA caching allocator's peak over each timed step (module docstring)."""

    source = CUDA_SOURCE

    def begin_step(self, counting: bool) -> None:
        super().begin_step(counting)
        if counting:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _step_peak(self) -> tuple[int, str | None]:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device)), None


class CpuMemory(_Meter):
    """``LiveTensorBytes`` over the training loop (entered with ``with``), its peak per timed step."""

    source = CPU_SOURCE

    def __init__(self, device: torch.device, modules: list[nn.Module], feeds: Iterable[Any] = ()) -> None:
        super().__init__(device, modules)
        self.mode = LiveTensorBytes(device)
        self._feeds = list(feeds)

    def __enter__(self) -> "CpuMemory":
        self.mode.__enter__()
        self.mode.track(held_tensors(self.modules, self.optimizer))
        self.mode.track(t for t in tree_flatten(self._feeds)[0] if isinstance(t, torch.Tensor))
        self._feeds = []
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)

    def begin_step(self, counting: bool) -> None:
        super().begin_step(counting)
        if counting:
            self.mode.reset_peak()

    def during(self, action: Any, execute: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            self.mode.phase = action
            try:
                execute()
            finally:
                self.mode.phase = None
        return run

    def _step_peak(self) -> tuple[int, str | None]:
        phase = self.mode.peak_phase
        return int(self.mode.peak_bytes), str(phase) if phase is not None else BETWEEN


def memory_meter(device: torch.device, modules: list[nn.Module], feeds: Iterable[Any] = ()) -> _Meter:
    """The meter for ``device``: the CUDA allocator's on a GPU, ``LiveTensorBytes`` on the CPU.
    ``feeds``: tensors the rank holds from before the loop (the batch it feeds), counted too."""
    if device.type == "cuda":
        return CudaMemory(device, modules)
    return CpuMemory(device, modules, feeds)
