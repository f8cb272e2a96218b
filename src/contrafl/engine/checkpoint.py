"""Durable, safe files for checkpoints and client states.

:func:`save_atomic` writes through a temporary file in the same directory, ``fsync`` s it
and renames it over the target, so a reader (or a run resumed after ``kill -9``) sees
either the previous file or the new one, never a torn one. :func:`load_safe` reads with
``torch.load(weights_only=True)``: only tensors and plain containers (dict, list, tuple,
numbers, strings) are rebuilt, so a crafted file cannot execute code on loading; any
problem with the file is one :class:`~contrafl.errors.CheckpointError` line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .run_dir import write_atomic


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` that survives a crash at any point."""
    write_atomic(path, lambda f: torch.save(obj, f))


def load_safe(path: Path, what: str, map_location: Any = None) -> Any:
    """Load a file written by :func:`save_atomic` without executing code from it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist; resume from a run directory that has a checkpoint")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # pickle, zip and torch errors of a bad file
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            reason = "it contains objects other than tensors and plain containers (refused: loading could run code)"
        raise CheckpointError(
            f"{what} {path} cannot be loaded: {reason[:200]}; it is corrupted or was not written by contrafl "
            "(remove it to start the run again)"
        ) from None
