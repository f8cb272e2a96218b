"""The time left in a suite or a sweep, run by run.

The runs of a suite or sweep differ in cost per round (FedU2's round can take ten of
FedAvg's) and come method after method, so one pace for every round left misleads:
after a cheap method's runs it promises the costly ones at the cheap pace. Here each run
still to come takes

* its set-up and whatever else it spends beyond its rounds: the mean of that
  (``overhead``) over the runs ended so far (before any, the current run's so far), plus
* its rounds left at its calibrated pace: the seconds per round of its configuration's
  estimate (:func:`calibrate`, :func:`~contrafl.engine.estimate.estimate`: a few timed
  local steps) times ``ratio``, the seconds that the rounds run so far took over the
  seconds their estimates gave them (it corrects what the estimate leaves out, as a
  distributed executor's exchanges, and a busy machine). A run without an estimate
  takes the mean seconds per round of the runs seen so far.

A running run takes its rounds left at its own pace
(:func:`~contrafl.engine.progress.pace_of`), and the runs to come go to the first of
``workers`` slots to free up, in their order (a sweep runs several at a time). Timings
stay out of every run's metrics: the calibration runs on a simulation of its own,
dropped after it.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from ..config import Config
from ..words import count


@dataclass
class RunTimes:
    """What a suite's or sweep's ETA knows of one of its runs.

    Attributes:
        rounds: the run's rounds.
        estimate: the calibration's seconds for the whole run (from round 1), None
            where there is none.
        before: rounds done before this call (a resumed run).
        done: rounds done by this call.
        pace: seconds a round of the run takes at its own pace, None before its first.
        overhead: seconds of the run beyond its ``done`` rounds at ``pace`` (set-up, a
            first round's warm-up, its summary): the whole run's once it ended, so far
            while it runs.
        state: ``pending``, ``running`` or ``ended``.
    """

    rounds: int
    estimate: float | None = None
    before: int = 0
    done: int = 0
    pace: float | None = None
    overhead: float | None = None
    state: Literal["pending", "running", "ended"] = "pending"

    def left(self) -> int:
        return max(self.rounds - self.before - self.done, 0)


def seconds_left(runs: list[RunTimes], workers: int = 1) -> float | None:
    """Seconds until the last of ``runs`` ends (see the module's docstring), ``workers``
    of them at a time; None before any round is done."""
    spent = rounds = spent_calibrated = estimated = 0.0
    for run in runs:
        if run.done and run.pace is not None:
            spent += run.pace * run.done
            rounds += run.done
            if run.estimate:
                spent_calibrated += run.pace * run.done
                estimated += run.estimate / run.rounds * run.done
    if not rounds:
        return None
    per_round = spent / rounds
    ratio = spent_calibrated / estimated if estimated else None
    ended = [r.overhead for r in runs if r.state == "ended" and r.overhead is not None]
    so_far = [r.overhead for r in runs if r.state == "running" and r.overhead is not None]
    overheads = ended or so_far
    overhead = sum(overheads) / len(overheads) if overheads else 0.0

    def modelled(run: RunTimes) -> float:
        pace = ratio * run.estimate / run.rounds if ratio is not None and run.estimate else per_round
        return run.left() * pace

    slots = [r.left() * r.pace if r.pace is not None else modelled(r) for r in runs if r.state == "running"]
    slots += [0.0] * max(workers - len(slots), 0)
    heapq.heapify(slots)
    for run in runs:
        if run.state == "pending":
            heapq.heappush(slots, heapq.heappop(slots) + overhead + modelled(run))
    return max(slots)


def calibrate(config: Config, threads: int | None = None) -> float | None:
    """Seconds a new run of ``config`` takes by :func:`~contrafl.engine.estimate.estimate`,
    timed on a simulation made for it alone and dropped after (``threads`` torch threads
    when given: a sweep's run has its share of the cores); None where the estimate gives
    none, or where the run cannot be set up (it says why when it starts)."""
    import torch

    from ..engine.estimate import estimate
    from ..engine.setup import prepare
    from ..engine.simulation import Simulation

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        sim = Simulation(prepare(config))
        try:
            planned = estimate(sim)
        finally:
            sim.store.close()
    except Exception:  # the run itself reports it
        return None
    finally:
        torch.set_num_threads(before)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return None if planned is None else planned.seconds


def calibrate_each(
    configs: Mapping[str, Config],
    what: str,
    say: Callable[[str], object],
    threads: int | None = None,
) -> dict[str, float | None]:
    """The estimate (:func:`calibrate`) of a run of each of ``configs`` (by name, ``what``
    names them: ``method``, ``cell``), and ``say`` told how many it timed; none where
    there is only one configuration: its runs cost the same, and the pace of its rounds
    predicts them."""
    if len(configs) < 2:
        return {}
    start = time.perf_counter()
    estimates = {name: calibrate(config, threads) for name, config in configs.items()}
    timed = sum(s is not None for s in estimates.values())
    if timed:
        say(f"ETA: timed a few local steps of a run of each of {count(timed, what)} ({time.perf_counter() - start:.1f}s)")
    return estimates
