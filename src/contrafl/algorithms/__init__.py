"""Federated algorithms: one module per algorithm, registered in :data:`ALGORITHMS`."""

from . import ditto, fedala, fedamp, fedavg, fedcrl, fedgh, fedpac, fedper, fedprox, fedproto, fedrep, fedsiam_da, fedssc, lgfedavg, moon, perfedavg, pfedme, scaffold, solo, ssl, fedu2, ldawa, fedx, feddecorr, fedu, fedema, orchestra  # noqa: F401  (registration)
from .base import Algorithm
from .registry import ALGORITHMS

__all__ = ["ALGORITHMS", "Algorithm"]
