"""Statistics of a comparison: bootstrap intervals over seeds, paired differences, and
the cost of reaching a target.

Intervals are scipy's bootstrap (:func:`scipy.stats.bootstrap`: BCa, 9,999 resamples,
a fixed seed so that a table is the same every time it is printed) of the mean. With
``n`` seeds a bootstrap interval of the mean lies within the range of the ``n`` values
and covers less than its nominal level for small ``n`` (with 3 seeds it is about the
range): the tables print ``n`` beside every interval, and a single seed has no interval
(:data:`UNKNOWN`). Values that are all equal have the interval ``[v, v]`` (BCa is
undefined there; the percentile interval is that point).

A paired difference compares two configurations on the seeds both ran: the same seed
gives both the same partition, initial model and client sampling, so ``d_s = a_s - b_s``
removes what the seeds share, and its interval is the bootstrap interval of the mean of
``d_s``. It "excludes 0" when both ends have the same sign.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 9999
SEED = 0  # of the resampling: a table prints the same interval every time

UNKNOWN = "n=1: interval unknown"


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values with its bootstrap interval ``[low, high]`` (None for
    ``n = 1``)."""

    mean: float
    n: int
    low: float | None
    high: float | None

    @property
    def known(self) -> bool:
        return self.low is not None

    @property
    def excludes_zero(self) -> bool:
        return self.known and (self.low > 0 or self.high < 0)  # type: ignore[operator]

    def text(self, scale: float = 100.0, signed: bool = False) -> str:
        """``61.78 [60.91, 62.50]`` (``+1.20 [...]`` when ``signed``), or the mean and
        ``(n=1: interval unknown)``."""
        fmt = "{:+.2f}" if signed else "{:.2f}"
        mean = fmt.format(scale * self.mean)
        if not self.known:
            return f"{mean} ({UNKNOWN})"
        return f"{mean} [{fmt.format(scale * self.low)}, {fmt.format(scale * self.high)}]"  # type: ignore[operator]


def interval(values: Sequence[float]) -> Interval | None:
    """The mean of ``values`` with its :data:`CONFIDENCE` bootstrap interval (module
    docstring); None for no values."""
    data = np.asarray([float(v) for v in values], dtype=np.float64)
    if data.size == 0:
        return None
    mean = float(data.mean())
    if data.size == 1:
        return Interval(mean, 1, None, None)
    if np.all(data == data[0]):
        return Interval(mean, int(data.size), mean, mean)
    from scipy.stats import bootstrap

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BCa's degenerate cases are caught below
        result = bootstrap(
            (data,), np.mean, confidence_level=CONFIDENCE, n_resamples=RESAMPLES, method="BCa",
            rng=np.random.default_rng(SEED),
        )
        low, high = result.confidence_interval
        if not (math.isfinite(low) and math.isfinite(high)):
            result = bootstrap(
                (data,), np.mean, confidence_level=CONFIDENCE, n_resamples=RESAMPLES, method="percentile",
                rng=np.random.default_rng(SEED),
            )
            low, high = result.confidence_interval
    return Interval(mean, int(data.size), float(low), float(high))


def paired_difference(values: Mapping[int, float], baseline: Mapping[int, float]) -> Interval | None:
    """The mean of ``values[s] - baseline[s]`` over the seeds ``s`` both have, with its
    bootstrap interval; None when they share no seed."""
    seeds = sorted(set(values) & set(baseline))
    return interval([values[s] - baseline[s] for s in seeds])


@dataclass(frozen=True)
class Reached:
    """Per seed, what a run spent until its metric first reached a target: rounds,
    bytes sent both ways, and seconds of its rounds (None: not reached)."""

    rounds: list[int | None]
    bytes: list[int | None]
    seconds: list[float | None]

    def cell(self, kind: str) -> str:
        """The mean over the seeds that reached it and ``(k/n seeds)`` when not all
        did; ``not reached`` when none did."""
        values = [v for v in getattr(self, kind) if v is not None]
        if not values:
            return "not reached"
        mean = sum(values) / len(values)
        text = {"rounds": f"{mean:.1f}", "bytes": f"{mean / 2**20:,.1f}", "seconds": f"{mean:.1f}"}[kind]
        total = len(getattr(self, kind))
        return text if len(values) == total else f"{text} ({len(values)}/{total} seeds)"


def reached(runs: Sequence[tuple[Sequence[Mapping], Mapping[int, float]]], key: str, target: float) -> Reached:
    """:class:`Reached` of each run ``(metrics rows, {round: seconds})``: the first round
    whose ``key`` is at least ``target``, the bytes of ``bytes_down`` and ``bytes_up`` of
    the rounds up to it, and the sum of their seconds (None where a run has no timing
    of one of them)."""
    rounds: list[int | None] = []
    sent: list[int | None] = []
    seconds: list[float | None] = []
    for rows, times in runs:
        total, at = 0, None
        for i, row in enumerate(rows):
            total += sum(row.get("bytes_down", {}).values()) + sum(row.get("bytes_up", {}).values())
            value = row.get(key)
            if value is not None and value >= target:
                at = i
                break
        if at is None:
            rounds.append(None), sent.append(None), seconds.append(None)
            continue
        done = [int(row["round"]) for row in rows[: at + 1]]
        rounds.append(done[-1])
        sent.append(total)
        seconds.append(sum(times[t] for t in done) if all(t in times for t in done) else None)
    return Reached(rounds, sent, seconds)
