"""The model registry: :class:`ModelSpec` entries by name, and the options every model shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from .. import params as P
from ..errors import ConfigError
from ..registry import Registry


@dataclass(frozen=True)
class HeadOptions:
    """Options shared by every model (``model.<option>=...``)."""

    projection: bool = P.param(True, None, "use the 2-layer projection head (MOON Table 7 ablation)")
    projection_dim: int = P.param(256, P.Interval(1, None), "output width of the projection head")
    projection_hidden: int | None = P.param(None, P.Interval(1, None), "hidden width of the projection head (auto: the representation's)")
    projection_bn: bool = P.param(False, None, "BatchNorm after the projection head's first layer (SimCLR/BYOL projector)")
    projection_bias: bool = P.param(True, None, "biases in the projection head's linear layers (Orchestra's projector has none)")
    projection_out_bn: bool = P.param(False, None, "BatchNorm without affine parameters after the projection head (Orchestra's projector)")
    dropout: float = P.param(0.0, P.Interval(0, 1, "left"), "dropout on z before the classifier")


@dataclass(frozen=True)
class ModelSpec:
    """A registered backbone.

    Attributes:
        name: registry name.
        summary: one line for ``contrafl list``.
        features: ``(input_shape, options) -> (encoder, feature_dim)``; the encoder maps a
            batch of inputs to a flat ``[B, feature_dim]`` representation.
        options: dataclass of backbone-specific options.
        inputs: ``"image"`` (``[C, H, W]`` inputs), ``"vector"`` (``[D]`` inputs, images
            are flattened) or ``"any"`` (the backbone takes any shape, or checks it).
        make_options: ``options -> instance``: validates the backbone's options itself
            instead of :attr:`options` (a user factory, whose signature decides).
        takes_num_classes: ``features`` also takes ``num_classes=...``.
    """

    name: str
    summary: str
    features: Callable[..., tuple[nn.Module, int]]
    options: type = P.NoOptions
    inputs: str = "image"
    make_options: Callable[[Mapping[str, Any]], Any] | None = None
    takes_num_classes: bool = False


MODELS: Registry[ModelSpec] = Registry("model", "contrafl.models", ModelSpec)
"""The backbones by name (``model=NAME``); plugins join from the entry-point group ``contrafl.models``."""


def split_options(spec: ModelSpec, options: Mapping[str, Any] | None) -> tuple[HeadOptions, Any]:
    """Validate ``model.*`` options into head options and backbone options."""
    options = dict(options or {})
    head_keys = {f.name for f in dataclasses.fields(HeadOptions)}
    if spec.make_options is not None:
        head = P.build(HeadOptions, {k: v for k, v in options.items() if k in head_keys}, "model")
        return head, spec.make_options({k: v for k, v in options.items() if k not in head_keys})
    own_keys = {f.name for f in dataclasses.fields(spec.options)}
    unknown = [k for k in options if k not in head_keys | own_keys]
    if unknown:
        valid = sorted(head_keys | own_keys)
        raise ConfigError(
            f"unknown option 'model.{unknown[0]}'{P.suggest(unknown[0], valid)} for model "
            f"'{spec.name}'; valid options are: {', '.join(valid)}"
        )
    head = P.build(HeadOptions, {k: v for k, v in options.items() if k in head_keys}, "model")
    own = P.build(spec.options, {k: v for k, v in options.items() if k in own_keys}, "model")
    return head, own
