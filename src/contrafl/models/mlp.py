"""Multilayer perceptron encoder for tabular, synthetic and small image data.

``h = relu(W_k · … relu(W_1 · flatten(x)))`` with one hidden layer per width in
``model.hidden``. With no hidden layers ``h = flatten(x)``, so that ``model.hidden=[]
model.projection=false`` is multinomial logistic regression ``softmax(W x + b)``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from torch import nn

from .. import params as P
from .registry import MODELS, ModelSpec


@dataclass(frozen=True)
class PositiveInts:
    """Check: a (possibly empty) sequence of positive integers."""

    def __call__(self, value: tuple[int, ...]) -> bool:
        return all(v >= 1 for v in value)

    def __str__(self) -> str:
        return "a list of positive integers such as [200,200] (or [] for none)"


@dataclass(frozen=True)
class MLPOptions:
    """Options of ``mlp``."""

    hidden: tuple[int, ...] = P.param((200, 200), PositiveInts(), "widths of the hidden layers")


def mlp(input_shape: tuple[int, ...], options: MLPOptions) -> tuple[nn.Module, int]:
    """``flatten → (fc_i → ReLU)`` for each hidden width; inputs of any shape are flattened
    (keys ``fc1``, ``fc2``, … as in MOON's ``MLP_header``)."""
    layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
    width = math.prod(input_shape)
    for i, out in enumerate(options.hidden, start=1):
        layers[f"fc{i}"] = nn.Linear(width, out)
        layers[f"relu{i}"] = nn.ReLU()
        width = out
    return nn.Sequential(layers), width


MODELS.add(
    "mlp",
    ModelSpec(
        "mlp",
        "fully connected ReLU network with hidden widths model.hidden (inputs flattened)",
        mlp,
        MLPOptions,
        inputs="vector",
    ),
)
