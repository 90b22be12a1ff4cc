"""Analysis must leave the user's model exactly as it found it.

Capturing a model runs its `forward` several times (once to check it, then 2^k + 1 times to
fit shapes, see `torch_capture`), and a forward has side effects: BatchNorm in training mode
counts `num_batches_tracked` and moves its running statistics, dropout draws from the RNG, and
a user's forward may update its own buffers. A user who calls `pipecc.compile(model, ...)` and
then trains must start from the state they had, so:

  * `fake_weights(module, mode)` runs a forward over fake copies of the parameters and
    buffers: the real tensors are never seen by the forward, so fake runs cannot change them
    (NOTE: under FakeTensorMode an in-place op with a Python scalar, such as BatchNorm's
    `num_batches_tracked.add_(1)`, does write to a real tensor; swapping the tensors out is
    what stops it);
  * `preserved_state(model, weights=...)` snapshots what a real run can change and puts it
    back: every buffer (persistent or not) and, with `weights=True`, every parameter (by
    value and by identity, so an optimizer built before `compile` keeps its tensors), the
    train/eval flag of every submodule and the RNG states (torch CPU and CUDA, Python's).
    Without `weights` a parameter changed in place cannot be restored and is an error;
  * `shape_safe_batchnorm(model)`: BatchNorm with `momentum=None` reads the batch count as a
    Python float, which fake tensors cannot give; its output shape does not depend on the
    momentum, so fake runs see momentum 0.0 (restored after).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import torch
from torch import nn

from pipecc.errors import PipeccError

_Slot = tuple[dict, str, torch.Tensor]  # (module._parameters or ._buffers, name, tensor)


def _slots(model: nn.Module) -> Iterator[tuple[str, str, _Slot]]:
    """Every parameter and buffer slot, shared ones included: (kind, qualified name, slot)."""
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for kind, table in (("parameter", mod._parameters), ("buffer", mod._buffers)):
            for name, t in table.items():
                if t is not None:
                    yield kind, f"{prefix}.{name}" if prefix else name, (table, name, t)


@contextlib.contextmanager
def fake_weights(model: nn.Module, mode: Any) -> Iterator[None]:
    """Within the block, `model`'s parameters and buffers are fake copies made by `mode`."""
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[_Slot] = []
    try:
        for _, _, (table, name, t) in _slots(model):
            if id(t) not in fakes:
                fakes[id(t)] = mode.from_tensor(t)
            swapped.append((table, name, t))
            table[name] = fakes[id(t)]
        yield
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write)."""
    try:
        return t._version
    except RuntimeError:  # inference tensors have none (and cannot be written outside it)
        return None


@contextlib.contextmanager
def preserved_state(model: nn.Module, *, weights: bool = False) -> Iterator[None]:
    """Restore buffers (and with `weights`, parameters), train flags and RNG states on exit."""
    modes = [(m, m.training) for m in model.modules()]
    rng = _rng_state()
    slots = list(_slots(model))
    saved: dict[int, torch.Tensor] = {}
    versions: dict[int, int] = {}
    for kind, _, (_, _, t) in slots:
        versions.setdefault(id(t), _version(t))
        if (kind == "buffer" or weights) and id(t) not in saved:
            saved[id(t)] = t.detach().clone()
    grads = {id(t): t.grad for kind, _, (_, _, t) in slots if kind == "parameter"}
    try:
        yield
    finally:
        changed = []
        with torch.no_grad():
            for kind, qualified, (table, name, t) in slots:
                table[name] = t  # the same tensor object, even if forward reassigned it
                if _version(t) == versions[id(t)]:  # None: an inference tensor, immutable here
                    continue
                if id(t) in saved:
                    t.copy_(saved[id(t)])
                    versions[id(t)] = _version(t)  # restored once, even when shared
                else:
                    changed.append(qualified)
                if kind == "parameter":
                    t.grad = grads[id(t)]
        for m, flag in modes:
            m.training = flag
        _set_rng_state(rng)
    if changed:
        raise PipeccError(f"the model's forward changed the parameter {changed[0]} in place while "
                          "pipecc analysed it; a forward must not modify its own parameters")


@contextlib.contextmanager
def shape_safe_batchnorm(model: nn.Module) -> Iterator[None]:
    """BatchNorm(momentum=None) with momentum 0.0 within the block (shapes are the same)."""
    changed = [m for m in model.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None]
    try:
        for m in changed:
            m.momentum = 0.0
        yield
    finally:
        for m in changed:
            m.momentum = None
