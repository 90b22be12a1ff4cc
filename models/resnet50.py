"""ResNet-50 (He et al. 2015, "Deep Residual Learning for Image Recognition").

Bottleneck blocks [3, 4, 6, 3] with expansion 4, laid out as torchvision's `resnet50`
("v1.5": the stride-2 of a downsampling block sits on its 3x3 conv). At the defaults it has
torchvision's 25,557,032 parameters. `width` is the stem's channel count (64 in the paper).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXPANSION = 4
TINY = dict(width=8, layers=(1, 1, 1, 1), image_size=32, num_classes=10)
SEED = 0


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand, plus a projected or identity skip."""

    def __init__(self, c_in: int, planes: int, stride: int) -> None:
        super().__init__()
        c_out = planes * EXPANSION
        self.conv1 = nn.Conv2d(c_in, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.downsample(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 64, layers: tuple[int, ...] = (3, 4, 6, 3),
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages: list[nn.Module] = []
        c_in = width
        for i, n_blocks in enumerate(layers):
            planes = width * 2**i
            blocks = []
            for j in range(n_blocks):
                blocks.append(Bottleneck(c_in, planes, stride=2 if i > 0 and j == 0 else 1))
                c_in = planes * EXPANSION
            stages.append(nn.Sequential(*blocks))
        self.layers = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layers(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(width: int = 64, layers: tuple[int, ...] = (3, 4, 6, 3),
                num_classes: int = 1000, **_) -> ResNet:
    return ResNet(width, tuple(layers), num_classes)


def example_inputs(batch_size: int = 1, image_size: int = 224, **_) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return (torch.randn(batch_size, 3, image_size, image_size, generator=g),)


def example_target(batch_size: int = 1, num_classes: int = 1000, **_) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(num_classes, (batch_size,), generator=g)


def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, target)
