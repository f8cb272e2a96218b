"""The algorithm registry."""

from __future__ import annotations

from ..registry import Registry
from .base import Algorithm

ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", "contrafl.algorithms", Algorithm)
"""The algorithms by name (``algorithm=NAME``): :class:`~contrafl.algorithms.base.Algorithm` subclasses;
plugins join from the entry-point group ``contrafl.algorithms``."""
