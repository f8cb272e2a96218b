"""Small convolutional encoders: MOON's ``simple-cnn`` and PFLlib's ``FedAvgCNN``.

Both are two blocks ``conv(5×5, no padding) → max-pool(2) → ReLU`` followed by fully
connected layers. The reference code applies the ReLU before the pooling; since ReLU is
monotone, ``relu(maxpool(x)) == maxpool(relu(x))`` with identical values and gradients, and
pooling first applies the ReLU to 4x fewer elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .. import params as P
from ..errors import ConfigError
from .layers import max_pool2x2
from .registry import MODELS, ModelSpec
from . import stacked

KERNEL = 5


def _flat_dim(name: str, input_shape: tuple[int, ...], channels: int) -> int:
    """Width of the flattened output of the two conv/pool blocks.

    Each block maps a side ``n`` to ``(n - 4) // 2`` (5×5 convolution without padding,
    then 2×2 pooling), e.g. 32 → 14 → 5 and 28 → 12 → 4.
    """

    def side(n: int) -> int:
        return ((n - KERNEL + 1) // 2 - KERNEL + 1) // 2

    _, height, width = input_shape
    if min(side(height), side(width)) < 1:
        raise ConfigError(
            f"model '{name}' needs images of at least 16x16 pixels but the dataset gives "
            f"{height}x{width}; choose model=resnet18 or model=mlp"
        )
    return channels * side(height) * side(width)


class SimpleCNNHeader(nn.Module):
    """MOON's ``SimpleCNN_header`` (parameter names as in the reference):
    ``conv1(C→6) → pool → ReLU → conv2(6→16) → pool → ReLU → fc1(→120) → ReLU → fc2(→84) →
    ReLU``. PyTorch's default initialisation."""

    def __init__(self, in_channels: int, flat: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, KERNEL)
        self.conv2 = nn.Conv2d(6, 16, KERNEL)
        self.fc1 = nn.Linear(flat, 120)
        self.fc2 = nn.Linear(120, 84)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The 84-d representation of images ``x [B, C, H, W]``."""
        x = F.relu(max_pool2x2(self.conv1(x)))
        x = F.relu(max_pool2x2(self.conv2(x)))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.relu(self.fc2(x))


class FedAvgCNN(nn.Module):
    """PFLlib's ``FedAvgCNN`` without its classifier, as used by FedCRL:
    ``conv1(C→32) → pool → ReLU → conv2(32→64) → pool → ReLU → fc1(→dim) → ReLU``."""

    def __init__(self, in_channels: int, flat: int, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, KERNEL)
        self.conv2 = nn.Conv2d(32, 64, KERNEL)
        self.fc1 = nn.Linear(flat, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The ``dim``-wide representation of images ``x [B, C, H, W]``."""
        x = F.relu(max_pool2x2(self.conv1(x)))
        x = F.relu(max_pool2x2(self.conv2(x)))
        return F.relu(self.fc1(x.flatten(1)))


def stacked_cnn(encoder: nn.Module, state: stacked.State, x: torch.Tensor) -> torch.Tensor:
    """``SimpleCNNHeader`` or ``FedAvgCNN`` of K clients at once (:mod:`.stacked`):
    ``x [K, B, C, H, W]`` to ``[K, B, d]``."""
    K = x.shape[0]
    h = stacked.pool_relu(stacked.conv(stacked.images(x), state, "conv1", encoder.conv1, K))
    h = stacked.flatten(stacked.pool_relu(stacked.conv(h, state, "conv2", encoder.conv2, K)), K)
    h = F.relu(stacked.linear(h, state, "fc1"))
    return F.relu(stacked.linear(h, state, "fc2")) if isinstance(encoder, SimpleCNNHeader) else h


stacked.register(SimpleCNNHeader, stacked_cnn)
stacked.register(FedAvgCNN, stacked_cnn)


@dataclass(frozen=True)
class FedAvgCNNOptions:
    """Options of ``fedavg_cnn``."""

    dim: int = P.param(128, P.Interval(1, None), "width d of the representation (FedCRL: 128)")


def moon_cnn(input_shape: tuple[int, ...], options: P.NoOptions) -> tuple[nn.Module, int]:
    """``SimpleCNNHeader`` for ``input_shape``; representation width 84."""
    return SimpleCNNHeader(input_shape[0], _flat_dim("moon_cnn", input_shape, 16)), 84


def fedavg_cnn(input_shape: tuple[int, ...], options: FedAvgCNNOptions) -> tuple[nn.Module, int]:
    """``FedAvgCNN`` for ``input_shape``; representation width ``options.dim``."""
    flat = _flat_dim("fedavg_cnn", input_shape, 64)
    return FedAvgCNN(input_shape[0], flat, options.dim), options.dim


MODELS.add(
    "moon_cnn",
    ModelSpec("moon_cnn", "MOON's simple-cnn: 2 conv + 2 fc layers, 84-d representation", moon_cnn),
)
MODELS.add(
    "fedavg_cnn",
    ModelSpec(
        "fedavg_cnn",
        "PFLlib's FedAvgCNN (FedCRL): 2 conv + 1 fc layer, representation width model.dim",
        fedavg_cnn,
        FedAvgCNNOptions,
    ),
)
