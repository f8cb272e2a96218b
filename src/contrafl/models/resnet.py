"""CIFAR ResNets as in MOON's ``resnetcifar.py`` (also FedU2's ResNet-18).

The torchvision architecture with a CIFAR stem: ``conv 3×3, stride 1, padding 1`` + BN +
ReLU and no max-pool, then four stages of 64, 128, 256, 512 planes (strides 1, 2, 2, 2),
global average pooling and flattening; the classifier ``fc`` is dropped. Bottlenecks are
v1.5 (the stride sits on the 3×3 convolution). Works for any input size (32×32 gives a 4×4
final map, Tiny-ImageNet's 64×64 an 8×8 one) and any number of input channels.

The encoder is an ``nn.Sequential`` of the reference network's children, as MOON builds it
(``nn.Sequential(*list(resnet.children())[:-1])``), so state-dict keys match the reference:
``0`` stem conv, ``1`` stem BN, ``3``–``6`` stages, ``7`` pooling (``8`` is the parameter-free
flattening).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import params as P
from .registry import MODELS, ModelSpec


def conv3x3(in_planes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1 and no bias."""
    return nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution without bias (the shortcut's projection)."""
    return nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`` with 3×3 convolutions."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_planes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """``1×1 (planes) → 3×3 (planes, stride) → 1×1 (4·planes)`` with BN and ReLU, plus the
    shortcut (ResNet v1.5)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv1x1(in_planes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x))``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


def _shortcut(in_planes: int, out_planes: int, stride: int) -> nn.Sequential | None:
    """Projection shortcut ``1×1 conv + BN`` where the shape changes, identity elsewhere."""
    if stride == 1 and in_planes == out_planes:
        return None
    return nn.Sequential(conv1x1(in_planes, out_planes, stride), nn.BatchNorm2d(out_planes))


def resnet_cifar(
    block: type[BasicBlock | Bottleneck], layers: tuple[int, int, int, int], in_channels: int
) -> tuple[nn.Sequential, int]:
    """The CIFAR ResNet encoder and its representation width ``512 · block.expansion``.

    Initialisation as the reference: Kaiming-normal (fan-out, ReLU gain) convolutions,
    BatchNorm ``γ = 1, β = 0``, no zero-initialised residual branches.
    """
    stages = []
    in_planes = 64
    for planes, blocks, stride in zip((64, 128, 256, 512), layers, (1, 2, 2, 2)):
        stage = [block(in_planes, planes, stride)]
        in_planes = planes * block.expansion
        stage += [block(in_planes, planes) for _ in range(blocks - 1)]
        stages.append(nn.Sequential(*stage))
    encoder = nn.Sequential(
        conv3x3(in_channels, 64),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        *stages,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    for m in encoder.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return encoder, in_planes


def resnet18(input_shape: tuple[int, ...], options: P.NoOptions) -> tuple[nn.Module, int]:
    """ResNet-18 (BasicBlock ``[2, 2, 2, 2]``), 512-d representation."""
    return resnet_cifar(BasicBlock, (2, 2, 2, 2), input_shape[0])


def resnet50(input_shape: tuple[int, ...], options: P.NoOptions) -> tuple[nn.Module, int]:
    """ResNet-50 (Bottleneck v1.5 ``[3, 4, 6, 3]``), 2048-d representation."""
    return resnet_cifar(Bottleneck, (3, 4, 6, 3), input_shape[0])


MODELS.add(
    "resnet18",
    ModelSpec(
        "resnet18", "CIFAR ResNet-18 (3x3 stem, no max-pool), 512-d representation", resnet18
    ),
)
MODELS.add(
    "resnet50",
    ModelSpec(
        "resnet50", "CIFAR ResNet-50 (3x3 stem, no max-pool), 2048-d representation", resnet50
    ),
)
