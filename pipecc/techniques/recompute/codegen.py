"""Activation recomputation in the torch backend: a recomputing stage's generated stage.py
(`CHECKPOINTED`, the forward wrapper `backends.torch.codegen` writes the stage with) and, in the
drop-in module (`pipelined_module`), a stage module wrapped to run under torch.utils.checkpoint
the same way (`Recomputed`). The torch backend asks them through its hooks, `forward_wrapper`
and `wrap_module`, with the stage's plan entry."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipecc.ir.plan import StagePlan

__all__ = ["CHECKPOINTED", "CheckpointedForward", "Recomputed", "forward_wrapper", "wrap_module"]


class CheckpointedForward:
    """A stage's forward run under torch.utils.checkpoint, as the generated code writes it: its
    straight-line code in `body` (`stage_forward`), and `forward` calling it under
    `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: backward keeps only the
    stage's inputs and re-runs `stage_forward`, with the RNG state restored (same dropout masks).
    The torch backend's forward-wrapper hook (`backends.torch.codegen`: `body`, `imports`,
    `header`, `forward`)."""

    body = "stage_forward"  # the straight-line code's method (an attribute name kept free)
    imports = ("import torch.utils.checkpoint",)
    header = ("", "Recomputes its activations in backward (torch.utils.checkpoint; pipecc --recompute).")

    def forward(self, signature: str, arg_names: Sequence[str]) -> list[str]:
        """The class's `forward`, indented as a method: `body` under checkpoint."""
        call = ", ".join([f"self.{self.body}", *arg_names, "use_reentrant=False"])
        return [f"    def forward({signature}) -> tuple:",
                "        # Activation recomputation (pipecc --recompute): backward keeps only this",
                "        # stage's inputs and re-runs stage_forward to rebuild its activations, one",
                "        # more forward for less memory; checkpoint restores the RNG state for the",
                "        # re-run, so dropout draws the same masks.",
                f"        return torch.utils.checkpoint.checkpoint({call})"]


CHECKPOINTED = CheckpointedForward()


class Recomputed(torch.nn.Module):
    """A stage module run under torch.utils.checkpoint (non-reentrant): backward keeps only its
    inputs and re-runs it, with the RNG state restored. The generated stage.py does the same."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: object) -> tuple:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, *args, use_reentrant=False)


def forward_wrapper(planned: StagePlan) -> CheckpointedForward | None:
    """The forward wrapper a stage's stage.py is written with (the torch backend's hook):
    `CHECKPOINTED` for a stage that recomputes its activations, else None."""
    return CHECKPOINTED if planned.recompute else None


def wrap_module(module: torch.nn.Module, planned: StagePlan) -> torch.nn.Module | None:
    """The drop-in module's stage (the torch backend's hook): `module` run under checkpoint
    (`Recomputed`) for a stage that recomputes its activations, else None (`module` as it is)."""
    return Recomputed(module) if planned.recompute else None
