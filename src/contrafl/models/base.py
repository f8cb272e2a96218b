"""The model contract every algorithm relies on.

A federated model is ``features`` (the base encoder, returning a flat representation
``h``) → optional projection head ``l1 → ReLU → l2`` (output ``z``) → classifier ``l3`` on
``z``; this is MOON's ``ModelFedCon`` (classifier on the projection output), with the same
parameter names so that state dicts line up with the reference code. Without a projection
head ``z = h`` (MOON's ``ModelFedCon_noheader``). An optional SimSiam-style prediction MLP
(``Linear → BN → ReLU → Linear``, used by FedSiam-DA) maps ``z`` to ``p``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F


class ModelOutput(NamedTuple):
    """What every model returns: representation, projection, logits, prediction."""

    h: torch.Tensor
    z: torch.Tensor
    logits: torch.Tensor
    p: torch.Tensor | None = None


class FedModel(nn.Module):
    """Encoder + projection head + classifier (+ predictor).

    Args:
        features: base encoder mapping a batch to ``[B, feature_dim]``.
        feature_dim: width of the representation ``h``.
        num_classes: number of classifier outputs.
        projection_dim: output width of the 2-layer projection head
            (``feature_dim → feature_dim → projection_dim``); ``None`` for no head.
        dropout: dropout on ``z`` before the classifier (training only).
        predictor_hidden: hidden width of the prediction MLP; ``None`` for no predictor.
    """

    def __init__(
        self,
        features: nn.Module,
        feature_dim: int,
        num_classes: int,
        projection_dim: int | None = 256,
        dropout: float = 0.0,
        predictor_hidden: int | None = None,
    ) -> None:
        super().__init__()
        self.features = features
        self.feature_dim = feature_dim
        self.projection_dim = projection_dim
        out_dim = feature_dim
        if projection_dim is not None:
            self.l1 = nn.Linear(feature_dim, feature_dim)
            self.l2 = nn.Linear(feature_dim, projection_dim)
            out_dim = projection_dim
        self.out_dim = out_dim
        self.dropout = dropout
        self.l3 = nn.Linear(out_dim, num_classes)
        self.predictor = None
        if predictor_hidden is not None:
            self.predictor = nn.Sequential(
                nn.Linear(out_dim, predictor_hidden),
                nn.BatchNorm1d(predictor_hidden),
                nn.ReLU(inplace=True),
                nn.Linear(predictor_hidden, out_dim),
            )

    def forward(self, x: torch.Tensor) -> ModelOutput:
        h = self.features(x)
        z = self.l2(F.relu(self.l1(h))) if self.projection_dim is not None else h
        logits = self.l3(F.dropout(z, self.dropout, self.training) if self.dropout else z)
        p = self.predictor(z) if self.predictor is not None else None
        return ModelOutput(h, z, logits, p)
