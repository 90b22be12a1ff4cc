"""The model file's data, batch by batch, for ``pipecc run``: ``train_data(batch_size,
**model_args)`` (and ``val_data`` for ``--eval-every``) return iterables of ``(inputs, target)``
batches, typically a ``torch.utils.data.DataLoader``.

Every rank that needs the data draws the same batch at every step: the rank of stage 0 (the
inputs) and the rank of the last stage (the target); no other rank calls the hook. Each ``next``
(and each ``iter``, where a pass starts) runs under torch's RNG seeded from (the run's seed, the
step), then restored, so a loader that
shuffles with torch's global RNG (a ``DataLoader(shuffle=True)`` without a generator) or a
dataset that augments with it draws the same on every rank and after a resume, and the model's
own random draws (dropout) are not disturbed.

Passes: ``--steps N`` runs N steps, starting a new pass over the data whenever one ends (an
epoch); ``--epochs E`` runs E passes. A pass that yields no batch, a batch that is not an
``(inputs, target)`` pair, or a hook that raises is a one-line error naming the step, raised
before that step changes anything (the last checkpoint stays as it was). The ranks agree every
step whether a batch follows (``more``: one all-reduce of a flag), so the ranks that draw no
data stop with the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from pipecc.errors import PipeccError
from pipecc.runtime import wire

__all__ = ["Batches"]

STEP_SEED = 1_000_003  # the per-step seed: seed * STEP_SEED + step (distinct for every step of a seed)


class Batches:
    """One hook's batches (``train_data`` or ``val_data``) on this rank (module docstring)."""

    def __init__(self, module: Any, file: str, hook: str, batch_size: int, model_args: dict[str, Any],
                 draws: bool, seed: int, epochs: int | None = None, device: torch.device | None = None) -> None:
        self.module, self.file, self.hook = module, file, hook
        self.batch_size, self.model_args, self.draws, self.seed = batch_size, model_args, draws, seed
        self.epochs = epochs  # None: passes without end (--steps decides)
        self.device = device or torch.device("cpu")
        self.epoch, self.index = 0, 0  # the pass, the batch within it
        self._data: Any = None
        self._it: Iterator | None = None

    @staticmethod
    def defined(module: Any, hook: str) -> bool:
        return module is not None and callable(getattr(module, hook, None))

    def next(self, step: int) -> tuple[Any, Any] | None:
        """Step ``step``'s ``(inputs, target)`` (None on a rank that draws none); raises
        ``StopIteration`` on every rank when the last pass (``--epochs``) has ended."""
        batch = self._draw(step) if self.draws else None
        if not self.more(batch is not None or not self.draws):
            raise StopIteration
        return batch

    def more(self, here: bool) -> bool:
        """Whether every rank has a batch for this step (collective when distributed)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return here
        flag = torch.tensor([1 if here else 0], dtype=torch.int64, device=self.device)
        wire.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _draw(self, step: int) -> tuple[Any, Any] | None:
        where = f"step {step}: {self.hook} in {self.file}"
        fresh = False
        while True:
            try:
                # NOTE: iter() too: a DataLoader may draw its shuffle seed when its iterator is made
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed * STEP_SEED + step)
                    if self._it is None:
                        self._it = self._start(where)
                        fresh = True
                    batch = next(self._it)
            except StopIteration:
                if fresh and self.index == 0:
                    raise PipeccError(f"{where} yielded no batch (pass {self.epoch + 1}); it must give at least "
                                      "one (inputs, target) pair per pass") from None
                self.epoch, self.index, self._it = self.epoch + 1, 0, None
                if self.epochs is not None and self.epoch >= self.epochs:
                    return None
                continue
            except PipeccError:
                raise
            except Exception as e:
                raise PipeccError(f"{where} raised {type(e).__name__}: {_first_line(e)}") from None
            self.index += 1
            return _pair(batch, where)

    def _start(self, where: str) -> Iterator:
        if self._data is None:
            try:
                from pipecc.frontend.modelfile import _call_with_accepted  # torch and pipecc.errors only

                self._data = _call_with_accepted(getattr(self.module, self.hook), self.batch_size, **self.model_args)
            except Exception as e:
                raise PipeccError(f"{where} raised {type(e).__name__}: {_first_line(e)}") from None
        try:
            return iter(self._data)
        except TypeError:
            raise PipeccError(f"{where} returned {type(self._data).__name__}, which is not iterable; return a "
                              "DataLoader or another iterable of (inputs, target) batches") from None

    def fast_forward(self, steps: int) -> None:
        """Draw (and drop) the batches of the first ``steps`` steps: a resumed run continues the
        data where the checkpointed one stopped (every rank calls it)."""
        for step in range(steps):
            try:
                self.next(step)
            except StopIteration:
                return


def _pair(batch: Any, where: str) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"a {type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        raise PipeccError(f"{where} must yield (inputs, target) pairs, got {got}")
    inputs, target = batch
    leaves = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    if not leaves or not all(isinstance(v, torch.Tensor) for v in leaves):
        raise PipeccError(f"{where} yielded inputs that are not a tensor or a tuple of tensors "
                          f"({type(inputs).__name__})")
    return (tuple(leaves), target)


def _first_line(e: BaseException) -> str:
    try:
        text = str(e).strip().splitlines()
    except Exception:
        return type(e).__name__
    return text[0] if text else ""
