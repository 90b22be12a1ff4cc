"""Small models for tests/test_train_eval.py: dropout in train/eval mode and --verify's cases.

`variant`:
  * `dropout` (default): torch.fx cannot trace it (a branch on a shape), so pipecc captures it
    with torch.export, whose graph holds the train flag of `nn.Dropout`, `F.dropout(...,
    self.training)` and BatchNorm as constants;
  * `nograd`: with a `torch.no_grad()` block in forward (which torch.fx would trace through,
    so pipecc captures it with torch.export) and dropout;
  * `noise`: adds `torch.randn_like` noise in forward;
  * `unused`: has a layer forward never calls;
  * `nan`: its outputs (so its loss and gradients) are NaN;
  * `bf16`: the `dropout` model in bfloat16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = ("dropout", "nograd", "noise", "unused", "nan", "bf16")


class Net(nn.Module):
    def __init__(self, variant: str = "dropout", batchnorm: bool = False) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant = variant
        self.a = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.3)
        self.norm = nn.BatchNorm1d(32) if batchnorm else nn.Identity()
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 5)
        if variant == "unused":
            self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant != "nograd" and x.shape[0] > 0:  # torch.fx cannot trace this branch
            x = x * 1.0
        h = self.norm(self.drop(torch.relu(self.a(x))))
        if self.variant == "noise":
            h = h + 0.1 * torch.randn_like(h)
        if self.variant == "nograd":
            with torch.no_grad():
                h = self.b(h)
        else:
            h = self.b(h)
        out = self.c(F.dropout(torch.tanh(h), 0.2, self.training))
        return out * float("nan") if self.variant == "nan" else out


def build_model(variant: str = "dropout", batchnorm: bool = False, **_) -> nn.Module:
    torch.manual_seed(0)
    model = Net(variant, batchnorm)
    return model.to(torch.bfloat16) if variant == "bf16" else model


def example_inputs(batch_size: int = 1, variant: str = "dropout", **_) -> tuple[torch.Tensor]:
    x = torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(0))
    return (x.to(torch.bfloat16) if variant == "bf16" else x,)


def example_target(batch_size: int = 1, **_) -> torch.Tensor:
    return torch.randint(5, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), target)
