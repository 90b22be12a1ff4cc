"""A tiny CNN for fast tests: conv, pooling, BatchNorm and one residual add in a few ops.

conv(3->c) ReLU maxpool -> conv(c->2c) BN ReLU -> [conv(2c->2c) BN] + skip, ReLU
-> global average pool -> flatten -> linear. Not taken from a paper; it exists so that the
compiler's tests see every common CNN op kind at a size that runs in milliseconds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TINY = dict(channels=8, image_size=16, num_classes=10)  # the defaults are already tiny
SEED = 0


class TinyCNN(nn.Module):
    def __init__(self, channels: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        c = channels
        self.conv1 = nn.Conv2d(3, c, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(c, 2 * c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * c)
        self.conv3 = nn.Conv2d(2 * c, 2 * c, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(2 * c)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(x + self.bn3(self.conv3(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(channels: int = 8, num_classes: int = 10, **_) -> TinyCNN:
    return TinyCNN(channels, num_classes)


def example_inputs(batch_size: int = 1, image_size: int = 16, **_) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return (torch.randn(batch_size, 3, image_size, image_size, generator=g),)


def example_target(batch_size: int = 1, num_classes: int = 10, **_) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(num_classes, (batch_size,), generator=g)


def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, target)
