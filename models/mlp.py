"""A plain multi-layer perceptron classifier: `depth` Linear layers with ReLU between them.

The simplest model in the zoo: a straight chain, so every cut point is a valid stage boundary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TINY = dict(in_features=16, hidden=32, depth=3, num_classes=5)
SEED = 0


def build_model(in_features: int = 64, hidden: int = 128, depth: int = 4,
                num_classes: int = 10, **_) -> nn.Sequential:
    """`depth` Linear layers in all (depth >= 1): in -> hidden -> ... -> hidden -> classes."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    widths = [in_features] + [hidden] * (depth - 1) + [num_classes]
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        if i > 0:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def example_inputs(batch_size: int = 1, in_features: int = 64, **_) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return (torch.randn(batch_size, in_features, generator=g),)


def example_target(batch_size: int = 1, num_classes: int = 10, **_) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(num_classes, (batch_size,), generator=g)


def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, target)
