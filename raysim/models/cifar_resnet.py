"""CRD's CIFAR-style ResNets (ResNet8x4, ResNet32x4: AugFL's client model and teacher, AugFL, Sec. VI).

The architecture of the CRD repository's `models/resnet.py` (RepDistiller): a 3x3 stem of 32 channels, three stages
of 64/128/256 channels (strides 1, 2, 2) of `blocks` basic blocks each (a 1x1 projection on the first block of a
stage), global average pooling and a linear classifier on the 256-d features. Parameter names and order are CRD's
(conv1, bn1, layer1.0.conv1, ..., fc), and so are the parameter counts.

Two departures:
- GroupNorm(2) where CRD has BatchNorm, by default (the zoo's convention for federated use, as FedSLR's ResNet-18:
  a client's network is then a function of its parameters alone, and averaging it averages everything it is).
  GroupNorm has the same affine parameters (weight and bias per channel), so the counts are CRD's. `norm="batch"`
  builds CRD's BatchNorm network (resnet8x4_bn, resnet32x4_bn), whose running statistics the vector carries after
  the parameters (raysim.models.spec.ParamSpec.statistics).
- Adaptive average pooling to 1x1 where CRD pools with a fixed 8x8 window: the same on 32x32 input (an 8x8 map), and
  the network also takes other image sizes (Fashion-MNIST's 28x28 gives a 7x7 map).
Initialization is torch's default (raysim.models.zoo.reset_parameters), as for every zoo model.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

Norm = Literal["group", "batch"]
"""GroupNorm(GROUPS) or BatchNorm2d after each convolution."""

GROUPS = 2
"""GroupNorm's groups, as FedSLR's ResNet-18-GN (FedSLR, Sec. 6.1)."""

WIDTHS = (32, 64, 128, 256)
"""CRD's `num_filters` for the x4 networks: the stem's channels, then each stage's."""


def _norm(channels: int, norm: Norm) -> nn.Module:
    return nn.GroupNorm(GROUPS, channels) if norm == "group" else nn.BatchNorm2d(channels)


def _conv3x3(inputs: int, outputs: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inputs, outputs, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (projected by a 1x1 convolution when the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1, norm: Norm = "group"):
        super().__init__()
        self.conv1 = _conv3x3(inputs, outputs, stride)
        self.bn1 = _norm(outputs, norm)
        self.conv2 = _conv3x3(outputs, outputs)
        self.bn2 = _norm(outputs, norm)
        projection = stride != 1 or inputs != outputs
        self.downsample = (
            nn.Sequential(nn.Conv2d(inputs, outputs, kernel_size=1, stride=stride, bias=False), _norm(outputs, norm))
            if projection
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        residual = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + residual)


class CifarResNet(nn.Module):
    """CRD's ResNet of depth 6 * blocks + 2 with widths `WIDTHS`; `fc`'s input is the features (256-d)."""

    def __init__(self, blocks: int, channels: int, outputs: int, norm: Norm = "group"):
        super().__init__()
        stem, *stages = WIDTHS
        self.conv1 = nn.Conv2d(channels, stem, kernel_size=3, padding=1, bias=False)
        self.bn1 = _norm(stem, norm)
        inputs = stem
        layers = []
        for index, width in enumerate(stages):
            first = BasicBlock(inputs, width, stride=1 if index == 0 else 2, norm=norm)
            rest = (BasicBlock(width, width, norm=norm) for _ in range(blocks - 1))
            layers.append(nn.Sequential(first, *rest))
            inputs = width
        self.layer1, self.layer2, self.layer3 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))
