"""Models by the name ``model=`` gives: a registered backbone (built-in or plugin) or the
user's own encoder factory, with the heads every algorithm needs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .base import FedModel, Heads
from .custom import user_spec
from .registry import MODELS, ModelSpec, split_options


def model_spec(name: str) -> ModelSpec:
    """The model ``model=name`` names: a registered one (built-in or plugin), or with a
    ``:`` the encoder of the user's factory ``MODULE:FACTORY`` / ``FILE.py:FACTORY``
    (:mod:`contrafl.models.custom`)."""
    if ":" in name:
        return user_spec(name)
    return MODELS.get(name)


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    options: Mapping[str, Any] | None = None,
    heads: Heads = Heads(),
) -> FedModel:
    """Build a :class:`FedModel` for inputs of ``input_shape``.

    The caller controls the random initialisation (seed the global RNG first).
    """
    spec = model_spec(name)
    head, own = split_options(spec, options)
    if spec.inputs == "image" and len(input_shape) != 3:
        raise ConfigError(
            f"model '{name}' needs image inputs [C, H, W] but the dataset gives samples of "
            f"shape {list(input_shape)}; choose a vector model such as model=mlp"
        )
    extra = {"num_classes": num_classes} if spec.takes_num_classes else {}
    encoder, feature_dim = spec.features(tuple(input_shape), own, **extra)
    return FedModel(
        encoder,
        feature_dim,
        num_classes,
        projection_dim=head.projection_dim if head.projection else None,
        dropout=head.dropout,
        heads=heads,
        projection_hidden=head.projection_hidden,
        projection_bn=head.projection_bn,
        projection_bias=head.projection_bias,
        projection_out_bn=head.projection_out_bn,
    )
