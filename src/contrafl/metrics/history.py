"""Summaries of a run's per-round metrics."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence


def rounds_to_reach(history: Iterable[Mapping], target: float, key: str = "test_acc") -> int | None:
    """The first round whose ``key`` is at least ``target`` (MOON Table 2), or None."""
    for row in history:
        value = row.get(key)
        if value is not None and value >= target:
            return int(row["round"])
    return None


def last_row(history: Sequence[Mapping], key: str) -> Mapping | None:
    """The last row in which ``key`` was evaluated, or None."""
    return next((row for row in reversed(history) if row.get(key) is not None), None)


def last_value(history: Sequence[Mapping], key: str = "test_acc") -> float | None:
    """The last evaluated value of ``key`` (the final accuracy by default), or None."""
    row = last_row(history, key)
    return None if row is None else row[key]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation (``numpy.std``), as MOON reports SOLO."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / n)
