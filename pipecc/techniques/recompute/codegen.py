"""Activation recomputation in the torch backend's drop-in module (`pipelined_module`): a stage
module wrapped to run under torch.utils.checkpoint, as a recomputing stage's generated stage.py
does (`backends.torch.codegen`)."""

from __future__ import annotations

import torch

__all__ = ["Recomputed"]


class Recomputed(torch.nn.Module):
    """A stage module run under torch.utils.checkpoint (non-reentrant): backward keeps only its
    inputs and re-runs it, with the RNG state restored. The generated stage.py does the same."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: object) -> tuple:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, *args, use_reentrant=False)
