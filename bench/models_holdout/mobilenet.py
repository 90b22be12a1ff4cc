"""A MobileNet-like net: depthwise-separable blocks (depthwise 3x3 + pointwise 1x1, BatchNorm,
ReLU6) with stride-2 stages (holdout style: many cheap, memory-bound nodes)."""
from __future__ import annotations

import torch
from torch import nn

# (output channels, stride) per depthwise-separable block, as in MobileNet v1 at width 1/4
BLOCKS = [(16, 1), (32, 2), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (128, 1), (128, 1),
          (128, 1), (128, 1), (256, 2), (256, 1)]


def _separable(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_in, 3, stride, 1, groups=c_in, bias=False),
                         nn.BatchNorm2d(c_in), nn.ReLU6(),
                         nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU6())


def build_model(width: float = 1.0, num_classes: int = 100, **_) -> nn.Sequential:
    stem = max(4, int(8 * width))
    layers: list[nn.Module] = [nn.Conv2d(3, stem, 3, 2, 1, bias=False), nn.BatchNorm2d(stem), nn.ReLU6()]
    c = stem
    for out, stride in BLOCKS:
        out = max(4, int(out * width))
        layers.append(_separable(c, out, stride))
        c = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes)]
    return nn.Sequential(*layers)


def example_inputs(batch_size: int = 1, image_size: int = 64, **_) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, image_size, image_size, generator=g),)
