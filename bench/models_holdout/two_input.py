"""A two-input model (holdout style): an image tower and a token tower fused late.

Both inputs enter at stage 0, and the token tower's output crosses every cut until the fusion.
"""
from __future__ import annotations

import torch
from torch import nn


class TwoTower(nn.Module):
    def __init__(self, channels: int = 16, vocab: int = 1000, dim: int = 128, classes: int = 10) -> None:
        super().__init__()
        c = channels
        self.image = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                   nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                   nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * c, dim))
        self.embed = nn.Embedding(vocab, dim)
        self.text = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.head = nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU(), nn.Linear(dim, classes))

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        text = self.text(self.embed(tokens)).mean(dim=1)
        return self.head(torch.cat([self.image(image), text], dim=1))


def build_model(channels: int = 16, vocab: int = 1000, dim: int = 128, classes: int = 10, **_) -> TwoTower:
    return TwoTower(channels, vocab, dim, classes)


def example_inputs(batch_size: int = 1, image_size: int = 32, seq_len: int = 16, vocab: int = 1000,
                   **_) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, image_size, image_size, generator=g),
            torch.randint(0, vocab, (batch_size, seq_len), generator=g))
