"""VGG-16 (Simonyan & Zisserman 2014, "Very Deep Convolutional Networks", configuration D).

Layout as torchvision's `vgg16` / `vgg16_bn`: 13 3x3 convolutions in five blocks with max
pooling, `AdaptiveAvgPool2d((7, 7))` so any image size works, and a 3-layer classifier.
At the defaults it has torchvision's 138,357,544 parameters. Dropout is left out so the
forward pass is deterministic (the compiler compares stage outputs with the original).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Configuration D: output channels of each conv, "M" = 2x2 max pool.
CONFIG_D = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
TINY = dict(width=0.125, image_size=32, num_classes=10, fc_dim=32)
SEED = 0


class VGG(nn.Module):
    def __init__(self, width: float = 1.0, num_classes: int = 1000, fc_dim: int = 4096,
                 batch_norm: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for item in CONFIG_D:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            c_out = max(1, round(int(item) * width))
            layers.append(nn.Conv2d(c_in, c_out, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(c_out))
            layers.append(nn.ReLU())
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(c_in * 7 * 7, fc_dim), nn.ReLU(),
            nn.Linear(fc_dim, fc_dim), nn.ReLU(),
            nn.Linear(fc_dim, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def build_model(width: float = 1.0, num_classes: int = 1000, fc_dim: int = 4096,
                batch_norm: bool = False, **_) -> VGG:
    """`width` scales every conv's channel count (1.0 -> 64..512)."""
    return VGG(width, num_classes, fc_dim, batch_norm)


def example_inputs(batch_size: int = 1, image_size: int = 224, **_) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return (torch.randn(batch_size, 3, image_size, image_size, generator=g),)


def example_target(batch_size: int = 1, num_classes: int = 1000, **_) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(num_classes, (batch_size,), generator=g)


def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, target)
