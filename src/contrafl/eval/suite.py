"""Experiment suites: several methods x several seeds, tabulated next to a paper's numbers.

A suite file (``experiments/**/*.yaml``) has::

    name: MOON Table 1, CIFAR-10
    base: {dataset: cifar10, rounds: 100, ...}      # settings shared by every run
    seeds: [0, 1, 2]
    methods:                                         # name -> settings on top of base
      MOON: {algorithm: {name: moon, mu: 5}}
      FedAvg: {algorithm: fedavg}
    paper: {MOON: "69.1±0.4", FedAvg: "66.3±0.5"}   # optional reference numbers
    target: {from: FedAvg}                           # optional: rounds to reach FedAvg's final
                                                     # accuracy (MOON Table 2), or {accuracy: 0.68}

Every run goes to ``OUT/<method>/seed<k>/`` (a normal run directory); finished runs are
skipped, so an interrupted suite resumes where it stopped. The table reports the mean
+- std over seeds of the final global test accuracy; for methods without a global model
(SOLO) the mean +- std of client accuracies, as MOON's Table 1 does.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import apply_overrides, build_config, merge
from ..errors import ConfigError
from .metrics import last_row, last_value, mean_std, rounds_to_reach
from .report import read_run


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

    def config(self, method: str, seed: int, overrides: Sequence[str] = ()):
        """The validated configuration of one run."""
        tree: dict[str, Any] = {}
        merge(tree, self.base, f"{self.name} base")
        merge(tree, self.methods[method], f"{self.name} method {method}")
        apply_overrides(tree, overrides)
        tree["seed"] = seed
        return build_config(tree)


def load_suite(path: Path) -> Suite:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file not found: {path}; see experiments/ for the available suites")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path} is not valid YAML; fix the syntax") from None
    for key in ("name", "methods"):
        if key not in data:
            raise ConfigError(f"{path} has no '{key}'; an experiment needs a name, a base config and methods")
    unknown = set(data) - {"name", "description", "base", "methods", "seeds", "paper", "paper_rounds", "target"}
    if unknown:
        raise ConfigError(f"{path}: unknown key '{sorted(unknown)[0]}' in the experiment file")
    methods = {str(k): (v or {}) for k, v in data["methods"].items()}
    seen: dict[str, str] = {}
    for method in methods:
        if not _slug(method):
            raise ConfigError(f"{path}: method name '{method}' has no letters or digits; name it, e.g. 'MOON'")
        other = seen.setdefault(_slug(method), method)
        if other != method:
            raise ConfigError(
                f"{path}: methods '{other}' and '{method}' would share the run directory "
                f"'{_slug(method)}'; rename one so that they differ in letters or digits"
            )
    return Suite(
        name=data["name"],
        description=data.get("description", ""),
        base=data.get("base") or {},
        methods=methods,
        seeds=[int(s) for s in data.get("seeds", [0])],
        paper=data.get("paper") or {},
        paper_rounds=data.get("paper_rounds") or {},
        target=data.get("target") or {},
    )


def run_suite(
    suite: Suite,
    out: Path,
    overrides: Sequence[str] = (),
    methods: Sequence[str] | None = None,
    runner: Callable[[Any, Path], None] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run (or resume) every method x seed of ``suite`` into ``out``; return the results."""
    from ..engine.run_dir import RunDir
    from ..engine.setup import check_components, check_data_dir, prepare
    from ..engine.simulation import Simulation

    chosen = list(methods) if methods else list(suite.methods)
    for m in chosen:
        if m not in suite.methods:
            raise ConfigError(f"unknown method '{m}' in {suite.name}; the suite has: {', '.join(suite.methods)}")
    configs = {(m, s): suite.config(m, s, overrides) for m in chosen for s in suite.seeds}
    for cfg in configs.values():  # every run's settings are checked before the first starts
        check_components(cfg)
        check_data_dir(cfg)
    total = len(configs)
    log(f"{suite.name}: {len(chosen)} methods x {len(suite.seeds)} seeds -> {out}")
    for i, ((method, seed), cfg) in enumerate(configs.items(), start=1):
        path = run_path(out, method, seed)
        if _completed(path):
            log(f"[{i}/{total}] {method} seed {seed}: done before, skipped")
            continue
        if path.exists():  # an interrupted run starts again
            shutil.rmtree(path)
        log(f"[{i}/{total}] {method} seed {seed} -> {path}")
        if runner is not None:
            runner(cfg, path)
        else:
            summary = Simulation(prepare(cfg), RunDir(path), None).run()
            final = summary.get("final", {})
            acc = final.get("test_acc", final.get("personal_acc"))
            log(f"    final accuracy {acc:.4f} in {summary['wall_time_s']:.0f}s")
    results = collect(suite, out, chosen)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(format_table(suite, results) + "\n")
    plot_curves(results, out / "curves.png", title=suite.name)
    return results


def run_path(out: Path, method: str, seed: int) -> Path:
    """The run directory of ``method`` with ``seed`` in a suite's output directory."""
    return out / _slug(method) / f"seed{seed}"


def _slug(name: str) -> str:
    """Directory name of a method: ``"MOON + FedAvgM (mu=5)"`` -> ``"MOON-FedAvgM-mu-5"``."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", name).strip("-")


def _completed(path: Path) -> bool:
    summary = path / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("status") == "completed"


def collect(suite: Suite, out: Path, methods: Sequence[str]) -> dict[str, Any]:
    """Per method: final accuracies per seed, mean curve, client accuracies, rounds to target."""
    histories = {
        method: [read_run(p)[1] for p in (run_path(out, method, seed) for seed in suite.seeds) if _completed(p)]
        for method in methods
    }
    finals = {m: [f for f in map(last_value, runs) if f is not None] for m, runs in histories.items()}
    target = _target(suite, finals)
    per_method: dict[str, Any] = {}
    for method, runs in histories.items():
        entry: dict[str, Any] = {"seeds": len(runs)}
        if finals[method]:
            entry["test_acc"] = finals[method]
            entry["test_acc_mean"], entry["test_acc_std"] = mean_std(finals[method])
            entry["curve"] = _mean_curve(runs, "test_acc")
        personal = [r for r in (last_row(rows, "personal_acc") for rows in runs) if r is not None]
        if personal:
            entry["personal_acc_mean"], entry["personal_acc_seed_std"] = mean_std([r["personal_acc"] for r in personal])
            entry["personal_acc_client_std"] = mean_std([r["personal_acc_std"] for r in personal])[0]
        if target is not None and finals[method]:
            entry["rounds_to_target"] = [rounds_to_reach(rows, target) for rows in runs]
        per_method[method] = entry
    return {"suite": suite.name, "target": target, "methods": per_method}


def _target(suite: Suite, finals: Mapping[str, list[float]]) -> float | None:
    """The suite's target accuracy: a number, or the mean final accuracy of a method."""
    if "accuracy" in suite.target:
        return float(suite.target["accuracy"])
    ref = suite.target.get("from")
    return mean_std(finals[ref])[0] if ref and finals.get(ref) else None


def _mean_curve(runs: list[list[dict]], key: str) -> list[tuple[int, float]]:
    by_round: dict[int, list[float]] = {}
    for rows in runs:
        for r in rows:
            if r.get(key) is not None:
                by_round.setdefault(r["round"], []).append(r[key])
    return [(t, sum(v) / len(v)) for t, v in sorted(by_round.items()) if len(v) == len(runs)]


def format_table(suite: Suite, results: Mapping[str, Any]) -> str:
    """A markdown table: ours (mean ± std over seeds) next to the paper's numbers."""
    target = results.get("target")
    header = ["method", "accuracy (ours)", "seeds"]
    if any("personal_acc_mean" in e and "test_acc_mean" in e for e in results["methods"].values()):
        header.append("client accuracy (ours)")
    if suite.paper:
        header.append("paper")
    if target is not None:
        header.append(f"rounds to {100 * target:.1f}%")
        if suite.paper_rounds:
            header.append("paper rounds")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, e in results["methods"].items():
        if "test_acc_mean" in e:
            acc = f"{100 * e['test_acc_mean']:.2f} ± {100 * e['test_acc_std']:.2f}"
        elif "personal_acc_mean" in e:
            acc = f"{100 * e['personal_acc_mean']:.2f} ± {100 * e['personal_acc_client_std']:.2f} (clients)"
        else:
            acc = "-"
        cells = [method, acc, str(e["seeds"])]
        if "client accuracy (ours)" in header:
            cells.append(f"{100 * e['personal_acc_mean']:.2f}" if "personal_acc_mean" in e and "test_acc_mean" in e else "")
        if suite.paper:
            cells.append(str(suite.paper.get(method, "")))
        if target is not None:
            reached = e.get("rounds_to_target")
            cells.append(", ".join("-" if r is None else str(r) for r in reached) if reached else "")
            if suite.paper_rounds:
                cells.append(str(suite.paper_rounds.get(method, "")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(results: Mapping[str, Any], path: Path, title: str = "") -> Path | None:
    """Mean test accuracy per round of every method (Agg backend, no display needed)."""
    curves = {m: e["curve"] for m, e in results["methods"].items() if e.get("curve")}
    if not curves:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for method, curve in curves.items():
        ax.plot([r for r, _ in curve], [100 * a for _, a in curve], label=method)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)

