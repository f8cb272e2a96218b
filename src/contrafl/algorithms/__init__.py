"""Federated algorithms: one module per algorithm, registered in :data:`ALGORITHMS`."""

from . import fedavg, fedcrl, fedprox, fedproto, fedsiam_da, fedssc, moon, scaffold, solo  # noqa: F401  (registration)
from .base import Algorithm
from .registry import ALGORITHMS

__all__ = ["ALGORITHMS", "Algorithm"]
