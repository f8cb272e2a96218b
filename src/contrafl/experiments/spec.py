"""What a suite and a sweep are, and the records they leave in their output directories.

A suite (:class:`Suite`) runs named methods with seeds; a sweep (:class:`Sweep`) runs
every cell of a grid of settings, as a suite with a method per cell. Their output
directories hold ``suite.json`` / ``sweep.json`` (:data:`SUITE_RECORD`,
:data:`SWEEP_RECORD`) and one run directory per method and seed (:func:`run_path`),
which the reports group (:mod:`~contrafl.experiments.groups`). Running them is
:mod:`~contrafl.experiments.suite`'s and :mod:`~contrafl.experiments.sweep`'s.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import params as P
from ..config import COMPONENTS, Component, apply_overrides, apply_settings, build_config, merge


@dataclass
class Suite:
    name: str
    base: dict[str, Any]
    methods: dict[str, dict[str, Any]]
    seeds: list[int] = field(default_factory=lambda: [0])
    paper: dict[str, Any] = field(default_factory=dict)
    paper_rounds: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    settings: list[str] = field(default_factory=list)
    metric: str = "final"
    probes: list[str] = field(default_factory=list)
    baseline: str | None = None
    families_only: bool = False
    """Tabulated by metric family only (``contrafl compare``), without the paper's layout."""

    def baseline_method(self) -> str | None:
        """The method every other is compared with (paired differences, targets): the
        file's ``baseline``, else the method of ``target: {from: ...}``, else the first."""
        names = base_methods(self)
        return self.baseline or self.target.get("from") or (names[0] if names else None)

    def config(self, method: str, seed: int, overrides: Sequence[str] = ()):
        """The validated configuration of one run (``method`` is a ``"<setting> /
        <method>"`` pair in a suite with settings)."""
        tree: dict[str, Any] = {}
        merge(tree, self.base, f"{self.name} base")
        merge(tree, self.methods[method], f"{self.name} method {method}")
        apply_overrides(tree, overrides)
        tree["seed"] = seed
        return build_config(tree)


SUITE_RECORD = "suite.json"  # the suite and overrides of a suite directory's last run


def run_path(out: Path, method: str, seed: int) -> Path:
    """The run directory of ``method`` with ``seed`` in a suite's output directory."""
    return out / _slug(method) / f"seed{seed}"


def _slug(name: str) -> str:
    """Directory name of a method: ``"MOON + FedAvgM (mu=5)"`` -> ``"MOON-FedAvgM-mu-5"``."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", name).strip("-")


def base_methods(suite: Suite) -> list[str]:
    """The suite's methods without their settings, in order."""
    return list(dict.fromkeys(split_method(suite, m)[1] for m in suite.methods))


def split_method(suite: Suite, name: str) -> tuple[str, str]:
    """``(setting, method)`` of a run name (setting ``""`` in a suite without settings)."""
    for setting in suite.settings:
        if name.startswith(setting + " / "):
            return setting, name[len(setting) + 3 :]
    return "", name


SWEEP_RECORD = "sweep.json"  # the sweep, its overrides and cells, in its output directory
SHARD_RECORD = "sweep-shard-{i}-of-{n}.json"  # what share I of N ran, beside it


@dataclass
class Sweep:
    """A grid of settings (axis -> values) over ``base``, each cell run with ``seeds``."""

    name: str
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    seeds: list[int] = field(default_factory=lambda: [0])
    description: str = ""

    def cells(self) -> dict[str, list[tuple[str, Any]]]:
        """Every cell's name and settings, in grid order: the cartesian product of the
        axes, without the ``NAME.OPTION`` axes of algorithms a cell does not run (the
        cells that differ only there are one cell)."""
        base_algorithm = _algorithm_name(self.base.get("algorithm", "fedavg"))
        cells: dict[str, list[tuple[str, Any]]] = {}
        for values in itertools.product(*self.grid.values()):
            pairs = list(zip(self.grid, values))
            algorithm = next((_algorithm_name(v) for k, v in pairs if k == "algorithm"), base_algorithm)
            kept = [(k, v) for k, v in pairs if _applies(k, algorithm)]
            cells.setdefault(" ".join(f"{k}={_text(v)}" for k, v in kept) or "base", kept)
        return cells

    def suite(self) -> Suite:
        """The sweep as a suite with a method per cell (each holding the components
        and settings its cell sets, resolved on top of ``base``)."""
        methods = {}
        for name, pairs in self.cells().items():
            tree: dict[str, Any] = {}
            merge(tree, self.base, f"{self.name} base")
            apply_settings(tree, pairs)
            heads = {_head(k) for k, _ in pairs}
            methods[name] = {k: v.as_yaml() if isinstance(v, Component) else v for k, v in tree.items() if k in heads}
        return Suite(name=self.name, base=self.base, methods=methods, seeds=self.seeds, description=self.description)


def _algorithm_name(value: Any) -> str:
    return str(value.get("name", "")) if isinstance(value, Mapping) else str(value)


def _head(key: str) -> str:
    """The tree entry a grid key sets: ``partition.beta`` -> partition, ``moon.mu`` ->
    algorithm, ``lr`` -> lr."""
    head, dot, _ = key.partition(".")
    return head if not dot or head in COMPONENTS else "algorithm"


def _applies(key: str, algorithm: str) -> bool:
    """Whether grid axis ``key`` applies to a cell running ``algorithm``."""
    head, dot, _ = key.partition(".")
    return not dot or head in COMPONENTS or P.fold(head) == P.fold(algorithm)


def _text(value: Any) -> str:
    """A grid value as a cell name shows it: ``moon(mu=5)`` for a mapping with a name."""
    if isinstance(value, Mapping):
        options = ",".join(f"{k}={_text(v)}" for k, v in value.items() if k != "name")
        return f"{value.get('name', '')}({options})" if options else str(value.get("name", ""))
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return str(value)
