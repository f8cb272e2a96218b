"""Backbones and heads. Every model returns ``ModelOutput(h, z, logits, p, extra)``.

Importing this package registers every backbone in :data:`MODELS`.
"""

from . import cnn, mlp, resnet  # noqa: F401  (registration)
from .base import FedModel, Heads, ModelOutput
from .build import build_model
from .registry import MODELS

__all__ = ["MODELS", "FedModel", "Heads", "ModelOutput", "build_model"]
