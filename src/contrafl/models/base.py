"""The model contract every algorithm relies on.

A federated model is ``features`` (the base encoder, returning a flat representation
``h``) → optional projection head ``l1 → ReLU → l2`` (output ``z``) → classifier ``l3`` on
``z``; this is MOON's ``ModelFedCon`` (classifier on the projection output), with the same
parameter names so that state dicts line up with the reference code. Without a projection
head ``z = h`` (MOON's ``ModelFedCon_noheader``). The projection head may have another
hidden width and a BatchNorm after ``l1`` (``l1 → BN → ReLU → l2``, the SimCLR/BYOL
projector of FedU2's code), no biases and a BatchNorm without affine parameters after
``l2`` (``l1 → BN → ReLU → l2 → BN``, Orchestra's projector).

What an algorithm adds on top is a :class:`Heads`: an optional SimSiam-style prediction
MLP (``Linear → BN → ReLU → Linear``, used by FedSiam-DA and the self-supervised
methods; ``Linear → ReLU → Linear`` without the BatchNorm, FedX's) mapping ``z`` to ``p``, named linear heads on ``z`` (FedU2's rotation
classifier), and whether there is a classifier at all (self-supervised methods train
none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F


class ModelOutput(NamedTuple):
    """What every model returns: representation, projection, logits (``None`` without a
    classifier), prediction (``None`` without a predictor) and the outputs of the extra
    heads by name."""

    h: torch.Tensor
    z: torch.Tensor
    logits: torch.Tensor | None
    p: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class Heads:
    """The heads an algorithm needs on the projection ``z``.

    Attributes:
        predictor_hidden: hidden width of the prediction MLP ``p = pred(z)``; ``None``
            for none.
        predictor_bn: a BatchNorm between the predictor's first linear layer and its
            ReLU (``False``: ``Linear → ReLU → Linear``).
        classifier: the classifier ``l3`` (self-supervised methods have none).
        extra: ``(name, outputs)`` of linear heads on ``z``, e.g. ``(("rotation", 4),)``.
    """

    predictor_hidden: int | None = None
    classifier: bool = True
    extra: tuple[tuple[str, int], ...] = ()
    predictor_bn: bool = True


class FedModel(nn.Module):
    """Encoder + projection head + classifier (+ predictor, + extra heads).

    Args:
        features: base encoder mapping a batch to ``[B, feature_dim]``.
        feature_dim: width of the representation ``h``.
        num_classes: number of classifier outputs.
        projection_dim: output width of the 2-layer projection head
            (``feature_dim → projection_hidden → projection_dim``); ``None`` for no head.
        dropout: dropout on ``z`` before the classifier (training only).
        heads: the algorithm's heads (:class:`Heads`).
        projection_hidden: hidden width of the projection head (``None``: ``feature_dim``).
        projection_bn: a BatchNorm ``l1_bn`` between ``l1`` and the ReLU.
        projection_bias: biases in ``l1`` and ``l2``.
        projection_out_bn: a BatchNorm ``l2_bn`` without affine parameters after ``l2``.
    """

    def __init__(
        self,
        features: nn.Module,
        feature_dim: int,
        num_classes: int,
        projection_dim: int | None = 256,
        dropout: float = 0.0,
        heads: Heads = Heads(),
        projection_hidden: int | None = None,
        projection_bn: bool = False,
        projection_bias: bool = True,
        projection_out_bn: bool = False,
    ) -> None:
        super().__init__()
        self.features = features
        self.feature_dim = feature_dim
        self.projection_dim = projection_dim
        out_dim = feature_dim
        if projection_dim is not None:
            hidden = projection_hidden or feature_dim
            self.l1 = nn.Linear(feature_dim, hidden, bias=projection_bias)
            self.l1_bn = nn.BatchNorm1d(hidden) if projection_bn else None
            self.l2 = nn.Linear(hidden, projection_dim, bias=projection_bias)
            self.l2_bn = nn.BatchNorm1d(projection_dim, affine=False) if projection_out_bn else None
            out_dim = projection_dim
        self.out_dim = out_dim
        self.dropout = dropout
        self.l3 = nn.Linear(out_dim, num_classes) if heads.classifier else None
        self.predictor = None
        if heads.predictor_hidden is not None:
            hidden = heads.predictor_hidden
            norm = [nn.BatchNorm1d(hidden)] if heads.predictor_bn else []
            self.predictor = nn.Sequential(
                nn.Linear(out_dim, hidden), *norm, nn.ReLU(inplace=True), nn.Linear(hidden, out_dim)
            )
        self.heads = nn.ModuleDict({name: nn.Linear(out_dim, n) for name, n in heads.extra}) if heads.extra else None

    def forward(self, x: torch.Tensor) -> ModelOutput:
        """``h = encoder(x)``, ``z = projection(h)`` (``h`` without one), ``logits = classifier(dropout(z))``,
        and the predictor's and extra heads' outputs on ``z``."""
        h = self.features(x)
        z = self.project(h) if self.projection_dim is not None else h
        logits = None
        if self.l3 is not None:
            logits = self.l3(F.dropout(z, self.dropout, self.training) if self.dropout else z)
        p = self.predictor(z) if self.predictor is not None else None
        extra = {name: head(z) for name, head in self.heads.items()} if self.heads is not None else None
        return ModelOutput(h, z, logits, p, extra)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """``z = l2(relu(l1(h)))``, with ``l1_bn`` after ``l1`` and ``l2_bn`` after
        ``l2`` when present."""
        a = self.l1(h)
        if self.l1_bn is not None:
            a = self.l1_bn(a)
        z = self.l2(F.relu(a))
        return self.l2_bn(z) if self.l2_bn is not None else z


def smallest_batch(model: nn.Module) -> int:
    """The fewest samples a training batch of ``model`` needs: 2 with BatchNorm layers,
    whose training-mode forward normalises each feature over the batch (PyTorch refuses a
    batch of one sample for ``BatchNorm1d``; FedU2's clients skip such a batch,
    ``fedU2/fedbyol_client.py:70``), else 1."""
    return 2 if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) else 1
