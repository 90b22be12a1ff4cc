"""A small U-Net: an encoder-decoder whose skip connections cross many layers (holdout style).

Every decoder level concatenates the encoder output of the same resolution, so a cut in the
middle must carry several tensors: what a comm-blind plan gets wrong.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, channels: int = 16, depth: int = 3, classes: int = 2) -> None:
        super().__init__()
        widths = [channels * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([_block(3 if i == 0 else widths[i - 1], widths[i]) for i in range(depth)])
        self.bottom = _block(widths[depth - 1], widths[depth])
        self.up = nn.ModuleList([nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
                                 for i in reversed(range(depth))])
        self.dec = nn.ModuleList([_block(2 * widths[i], widths[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def build_model(channels: int = 16, depth: int = 3, classes: int = 2, **_) -> UNet:
    return UNet(channels, depth, classes)


def example_inputs(batch_size: int = 1, image_size: int = 64, **_) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, image_size, image_size, generator=g),)
