"""A residual MLP backbone: a linear layer, then blocks ``h + fc2(relu(fc1(norm(h))))``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from contrafl import params as P
from contrafl.models.registry import ModelSpec


@dataclass(frozen=True)
class ResMLPOptions:
    """Options of ``resmlp`` (``model.OPTION=VALUE``)."""

    width: int = P.param(64, P.Interval(1, None), "width of the representation")
    blocks: int = P.param(2, P.Interval(0, None), "number of residual blocks")


class Block(nn.Module):
    """``h + fc2(relu(fc1(LayerNorm(h))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.relu(self.fc1(self.norm(h))))


def resmlp(input_shape: tuple[int, ...], options: ResMLPOptions) -> tuple[nn.Module, int]:
    """The encoder (inputs of any shape are flattened) and the width of its features."""
    layers = [nn.Flatten(), nn.Linear(math.prod(input_shape), options.width)]
    layers += [Block(options.width) for _ in range(options.blocks)]
    return nn.Sequential(*layers), options.width


RESMLP = ModelSpec(
    name="resmlp",
    summary="residual MLP: a linear layer to model.width, then model.blocks residual blocks",
    features=resmlp,
    options=ResMLPOptions,
    inputs="vector",
)
