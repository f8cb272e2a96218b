"""Runs grouped by configuration over seeds: a suite's method, a sweep's cell, or the
runs of one set of settings; what every table and figure of a comparison is made of."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import fingerprint
from .spec import SUITE_RECORD, SWEEP_RECORD, Suite, Sweep, run_path, split_method
from .report import ATTACK_METRICS, METRICS, Metric, algorithm_label, configuration_labels, count_states, find_runs, read_run, run_metric

PROBE_FILES = ("knn", "linear", "finetune-1%", "finetune-10%", "finetune")
"""Files of a run's ``representation/`` (``contrafl eval-repr``, a suite's probes) whose
accuracy the self-supervised table shows (those present)."""


@dataclass
class Run:
    path: Path
    name: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def status(self) -> str:
        return self.summary.get("status", "unknown")

    @property
    def metric(self) -> Metric | None:
        return run_metric(self.rows)

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    def evaluated(self, key: str) -> list[dict[str, Any]]:
        """The rows in which ``key`` was evaluated."""
        return [r for r in self.rows if r.get(key) is not None]

    def probe(self, name: str) -> float | None:
        """The accuracy in ``representation/<name>.json``, None without one."""
        try:
            return float(json.loads((self.path / "representation" / f"{name}.json").read_text())["acc"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def round_seconds(self) -> dict[int, float]:
        """Seconds of each round, from ``timing.jsonl`` (wall time: never in the metrics)."""
        try:
            lines = (self.path / "timing.jsonl").read_text().splitlines()
        except OSError:
            return {}
        seconds: dict[int, float] = {}
        for line in lines:
            try:
                row = json.loads(line)
                seconds[int(row["round"])] = float(row["seconds"])
            except (ValueError, KeyError, TypeError):
                continue
        return seconds


@dataclass
class Group:
    """The runs of one configuration over seeds (a suite's method, a sweep's cell);
    ``setting`` and ``method`` split a suite's ``"<setting> / <method>"`` name."""

    label: str
    runs: list[Run] = field(default_factory=list)
    paper: Any = None
    setting: str = ""
    method: str = ""

    @property
    def completed(self) -> list[Run]:
        return [r for r in self.runs if r.status == "completed" and r.metric is not None]

    @property
    def metric(self) -> Metric | None:
        """The metric the group is judged by (:func:`~contrafl.experiments.report.run_metric`)."""
        return next((r.metric for r in self.completed), None)

    @property
    def families(self) -> list[Metric]:
        """Every metric family its completed runs evaluated, in :data:`METRICS` order,
        then those of :data:`ATTACK_METRICS`."""
        return [m for m in (*METRICS, *ATTACK_METRICS) if any(r.evaluated(m.key) for r in self.completed)]

    @property
    def states(self) -> str:
        """How many of the runs are in each state (:func:`~contrafl.experiments.report.count_states`)."""
        return count_states(r.status for r in self.runs)


def _records(paths: Sequence[Path]) -> dict[Path, tuple[tuple[str, str], str, Any, str]]:
    """Run directory -> ((suite directory, method), group label, paper number, setting)
    from the suites and sweeps among ``paths`` (their ``suite.json`` or ``sweep.json``)."""
    found: dict[Path, tuple[tuple[str, str], str, Any, str]] = {}
    for path in map(Path, paths):
        if (path / SWEEP_RECORD).is_file():
            sweep = Sweep(**json.loads((path / SWEEP_RECORD).read_text())["sweep"])
            suite, paper = sweep.suite(), {}
        elif (path / SUITE_RECORD).is_file():
            suite = Suite(**json.loads((path / SUITE_RECORD).read_text())["suite"])
            paper = suite.paper
        else:
            continue
        for method in suite.methods:
            setting, base = split_method(suite, method)
            number = paper.get(method, paper.get(base))
            for seed in suite.seeds:
                found[run_path(path, method, seed).absolute()] = ((str(path.absolute()), method), method, number, setting)
    return found


def group_runs(paths: Sequence[Path]) -> list[Group]:
    """The runs below ``paths`` grouped by configuration except the seed: by method or
    cell for suites and sweeps, else by their settings. A group is labelled by its
    suite's method or sweep's cell, else by :func:`~contrafl.experiments.report.algorithm_label`
    (``moon mu=5``; also a suite method named as its bare algorithm, as ``contrafl
    compare`` named its methods before it named them so), with the settings that tell
    apart groups of one label (:func:`~contrafl.experiments.report.configuration_labels`)."""
    records = _records(paths)
    units: dict[Any, tuple[str | None, Any, str, list[Run]]] = {}
    for path, name in find_runs(paths):
        config, rows, summary = read_run(path)
        run = Run(path, name, config, rows, summary)
        if path.absolute() in records:
            key, method, paper, setting = records[path.absolute()]
            base = algorithm_label(config.get("algorithm", "?")) if method == _algorithm(config) else method
            units.setdefault(key, (base, paper, setting, []))[3].append(run)
        else:
            units.setdefault(fingerprint({**config, "seed": 0}), (None, None, "", []))[3].append(run)
    order = {key: i for i, key in enumerate(dict.fromkeys(key for key, *_ in records.values()))}  # a suite's methods in its order
    units = dict(sorted(units.items(), key=lambda item: order.get(item[0], len(order))))
    labels = configuration_labels([runs[0].config for *_, runs in units.values()], [base for base, *_ in units.values()])
    groups = []
    for label, (_, paper, setting, runs) in zip(labels, units.values()):
        method = label[len(setting) + 3 :] if setting and label.startswith(setting + " / ") else label
        groups.append(Group(label, runs, paper=paper, setting=setting, method=method))
    return groups


def _algorithm(config: Mapping[str, Any]) -> str:
    algo = config.get("algorithm", "?")
    return str(algo.get("name") if isinstance(algo, Mapping) else algo)


def suite_baseline(paths: Sequence[Path]) -> str | None:
    """The baseline method of the one suite among ``paths`` (its ``suite.json``), None
    when there is not exactly one."""
    records = [Path(p) / SUITE_RECORD for p in paths if (Path(p) / SUITE_RECORD).is_file()]
    if len(records) != 1:
        return None
    try:
        return Suite(**json.loads(records[0].read_text())["suite"]).baseline_method()
    except (OSError, ValueError, TypeError, KeyError):
        return None
