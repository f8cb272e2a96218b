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
    settings:                                        # optional: the table's columns, each
      CIFAR-10 practical: {partition: ...}           # settings on top of base (FedCRL Table II)
    metric: best                                     # optional: PFLlib's best-round client accuracy
    probes: [linear, finetune-1%]                    # optional, with metric: representation

With ``settings`` every method runs in every setting (``"<setting> / <method>"``), and
the table has a row per method and an accuracy and a client-std column per setting.
``metric: best`` reports, per run, the best round's sample-weighted client accuracy and
the std over clients at that round (PFLlib, FedCRL's Tables II-III); the default
``final`` reports the last round's global test accuracy (MOON's tables).
``metric: representation`` reports the last round's kNN accuracy of the global encoder
and the accuracy of every probe in ``probes`` (:mod:`contrafl.experiments.probe`: ``linear``,
``finetune-1%``, ``finetune-10%``), which the suite runs on each finished run and keeps
in its ``representation/`` folder (FedU2's Tables 1-2).

Every run goes to ``OUT/<method>/seed<k>/`` (a normal run directory). A finished run with
the same settings (fingerprint) is reused and a stopped one resumes from its checkpoint,
so an interrupted suite continues where it stopped; a relative ``data_dir`` in the file is
relative to the file's folder. The table reports the mean
+- std over seeds of the final global test accuracy; for methods without a global model
(SOLO) the mean +- std of client accuracies, as MOON's Table 1 does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from .. import params as P
from ..config import differences, fingerprint, parse_overrides
from ..engine.progress import Progress, clock_text
from ..engine.run_dir import read_summary, to_json
from ..execution.signals import interrupts, stop_point
from ..errors import ConfigError, ContraflError, one_line
from ..words import count
from ..metrics.history import last_row, last_value, mean_std, rounds_to_reach
from .eta import RunTimes, calibrate_each, seconds_left
from .groups import Group, group_runs
from .report import ATTACK_METRICS, METRICS, pm, read_run
from .spec import SUITE_RECORD, Suite, _slug, base_methods, run_path, split_method


def load_suite(path: Path) -> Suite:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file not found: {path}; see experiments/ for the available suites")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path} is not valid YAML; fix the syntax") from None
    if "grid" in data and "methods" not in data:
        raise ConfigError(f"{path} is a sweep file (it has a grid); run it with `contrafl sweep {path}`")
    for key in ("name", "methods"):
        if key not in data:
            raise ConfigError(f"{path} has no '{key}'; an experiment needs a name, a base config and methods")
    unknown = set(data) - {"name", "description", "base", "methods", "seeds", "paper", "paper_rounds", "target", "settings", "metric", "probes", "baseline"}
    if unknown:
        raise ConfigError(f"{path}: unknown key '{sorted(unknown)[0]}' in the experiment file")
    metric = data.get("metric", "final")
    if metric not in ("final", "best", "representation"):
        raise ConfigError(
            f"{path}: metric '{metric}' is invalid; expected 'final' (global test accuracy), 'best' "
            "(PFLlib's best-round client accuracy) or 'representation' (kNN and probes)"
        )
    probes = [str(p) for p in data.get("probes") or []]
    for probe in probes:
        if probe not in PROBES:
            raise ConfigError(f"{path}: probe '{probe}' is invalid; expected one of {', '.join(PROBES)}")
    if probes and metric != "representation":
        raise ConfigError(f"{path}: probes need 'metric: representation'")
    methods = {str(k): (v or {}) for k, v in data["methods"].items()}
    baseline = data.get("baseline")
    if baseline is not None and str(baseline) not in methods:
        raise ConfigError(f"{path}: baseline '{baseline}' is not one of its methods; expected one of {', '.join(methods)}")
    settings = {str(k): (v or {}) for k, v in (data.get("settings") or {}).items()}
    if settings:  # every method in every setting; a method's own settings come last
        methods = {
            f"{setting} / {method}": _combine(extra, own)
            for setting, extra in settings.items()
            for method, own in methods.items()
        }
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
        base=_paths_from(data.get("base") or {}, path.parent),
        methods={m: _paths_from(v, path.parent) for m, v in methods.items()},
        seeds=[int(s) for s in data.get("seeds", [0])],
        paper=data.get("paper") or {},
        paper_rounds=data.get("paper_rounds") or {},
        target=data.get("target") or {},
        settings=list(settings),
        metric=metric,
        probes=probes,
        baseline=None if baseline is None else str(baseline),
    )


PROBES = {"linear": ("linear", 0.0), "finetune-1%": ("finetune", 0.01), "finetune-10%": ("finetune", 0.1)}
"""Suite probe names: (protocol of :func:`contrafl.experiments.probe.evaluate_run`, label fraction)."""


def _combine(setting: Mapping[str, Any], method: Mapping[str, Any]) -> dict[str, Any]:
    """A setting's overrides, then a method's; a component given by both as mappings
    with the same name (or the method's without one) merges option by option."""
    out = dict(setting)
    for key, value in method.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping) and value.get("name", old.get("name")) == old.get("name"):
            out[key] = {**old, **value}
        else:
            out[key] = value
    return out


@dataclass
class Cell:
    """One run of a suite: a method with a seed, its resolved configuration, its run
    directory and what is there already (``new``, ``done``, ``resume``)."""

    method: str
    seed: int
    config: Any
    path: Path
    state: str = "new"
    rounds_done: int = 0


def run_suite(
    suite: Suite,
    out: Path,
    overrides: Sequence[str] = (),
    methods: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Run (or resume) every method x seed of ``suite`` into ``out``; return the results.

    A run directory is reused when it finished with the same fingerprint
    (:func:`contrafl.config.fingerprint`) as the configuration asked for now, and resumed
    from its checkpoint when it stopped early; a run made with other settings is moved
    to ``<method>/.previous/seed<k>-<fingerprint>`` (and moved back if those settings
    are asked for again) and run anew. The tables cover every method of the suite whose
    runs match the current settings, whether run now or before (``methods`` only
    chooses what to run). A failed run is reported and the suite goes on; Ctrl-C or
    SIGTERM stop it (a ``KeyboardInterrupt`` whose ``where`` names the run).
    """
    from ..engine.setup import check_data_dir, prepare

    chosen = list(suite.methods)
    if methods:
        known = {P.fold(n): n for n in [*suite.methods, *base_methods(suite)]}  # names match as config names do
        unknown = [m for m in methods if P.fold(m.strip()) not in known]
        if unknown:
            raise ConfigError(
                f"unknown method '{unknown[0]}' in {suite.name}{P.suggest(unknown[0], list(known.values()))}; "
                f"the suite has: {', '.join(base_methods(suite))}"
            )
        wanted = {known[P.fold(m.strip())] for m in methods}
        chosen = [m for m in suite.methods if m in wanted or split_method(suite, m)[1] in wanted]
    for key, value in parse_overrides(overrides):
        if key == "seed":
            raise ConfigError(f"seed={value} is set by the suite for each run; choose seeds with --seeds (--seeds {value}, runs seed {value} alone)")
    configs = resolved_configs(suite, overrides)  # every run's settings checked before the first starts
    cells = [Cell(m, s, configs[m, s], run_path(out, m, s)) for m in chosen for s in suite.seeds]
    for cell in cells:
        check_data_dir(cell.config)
    log(f"{suite.name}: {count(len(chosen), 'method')} x {count(len(suite.seeds), 'seed')} -> {out}")
    for cell in cells:
        _inspect(cell, log)
    created = not out.exists()  # removed again if bad input stops the suite before a run finishes
    clock = SuiteClock.for_cells(cells, log if progress is not None else None)
    failed = []
    with interrupts():
        for i, cell in enumerate(cells, start=1):
            stop_point()  # a stop requested between two runs, or while probing a finished one
            head = f"[{i}/{len(cells)}] {cell.method} seed {cell.seed}"
            if cell.state == "done":
                log(f"{head}: done before, reused")
                _run_probes(suite, cell, log, head)
                continue
            log(f"{head}{' resumed after round ' + str(cell.rounds_done) if cell.state == 'resume' else ''} -> {cell.path}")
            try:
                setup = prepare(cell.config)
            except ContraflError:  # bad input (data files, a setting) that every run would meet alike
                if created:
                    shutil.rmtree(out, ignore_errors=True)  # this command made it and nothing in it is finished
                raise
            try:
                summary = _run_cell(cell, setup, clock, progress, head)
            except KeyboardInterrupt as exc:
                exc.where = f"{cell.method} seed {cell.seed}"  # type: ignore[attr-defined]
                raise
            except Exception as exc:  # reported, and the other runs go on
                failed.append(cell)
                log(f"{head}: FAILED: {one_line(exc)} ({_traceback_file(cell.path, exc)}); "
                    "run the suite again to resume it from its checkpoint")
                continue
            created = False
            log(f"{head}: {_final_line(suite, summary)} in {summary['wall_time_s']:.0f}s")
            _run_probes(suite, cell, log, head)
    results = collect(suite, out, list(suite.methods), {k: fingerprint(c) for k, c in configs.items()})
    results["failed"] = [f"{c.method} seed {c.seed}" for c in failed]
    out.mkdir(parents=True, exist_ok=True)
    record = {"suite": dataclasses.asdict(suite), "overrides": list(overrides)}
    (out / SUITE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    groups = group_runs([out])  # read once for the figures and the families' tables
    results["figures"] = [str(p) for p in plot_families(groups, out)]
    (out / "results.json").write_text(to_json(results, indent=2) + "\n")
    paper = "" if suite.families_only else format_table(suite, results) + "\n\n"
    (out / "results.md").write_text(paper + statistics(groups, suite) + "\n")
    return results


def _final_line(suite: Suite, summary: Mapping[str, Any]) -> str:
    """What a finished run reached: the suite's metric, else every metric family it
    evaluated at its last round (a comparison of families)."""
    final = summary.get("final", {})
    if suite.metric == "best":
        value = summary.get("best_personal_acc")
        return f"best client accuracy {'-' if value is None else f'{value:.4f}'}"
    metrics = [m for m in (*METRICS, *ATTACK_METRICS) if suite.metric != "representation" or m.key == "knn_acc"]
    parts = [f"final {m.words} {final[m.key]:.4f}" for m in metrics if final.get(m.key) is not None]
    return ", ".join(parts) or "no evaluated accuracy"


def _run_probes(suite: Suite, cell: Cell, log: Callable[[str], None], head: str) -> None:
    """The suite's probes of a finished run that it does not hold yet (seeded with the
    run's seed)."""
    from .probe import evaluate_run

    for probe in suite.probes:
        if (cell.path / "representation" / f"{probe}.json").is_file():
            continue
        protocol, fraction = PROBES[probe]
        start = time.perf_counter()
        result = evaluate_run(cell.path, protocol, label_fraction=fraction or 0.01, seed=cell.seed, device=cell.config.device)
        log(f"{head}: {probe} accuracy {result['acc']:.4f} in {time.perf_counter() - start:.0f}s")


def resolved_configs(suite: Suite, overrides: Sequence[str]) -> dict[tuple[str, int], Any]:
    """The resolved configuration of every method x seed of ``suite`` (all validated)."""
    from ..engine.setup import resolve

    return {(m, s): resolve(suite.config(m, s, overrides)) for m in suite.methods for s in suite.seeds}


def _inspect(cell: Cell, log: Callable[[str], None]) -> None:
    """Decide whether ``cell`` is done, to be resumed or new; set aside a run made with
    other settings (and bring back one made with these)."""
    wanted = fingerprint(cell.config)
    found = run_fingerprint(cell.path)
    if found is not None and found != wanted:
        old = yaml.safe_load((cell.path / "config.yaml").read_text()) if (cell.path / "config.yaml").is_file() else {}
        changed = differences(old or {}, cell.config.to_dict())
        aside = cell.path.parent / ".previous" / f"{cell.path.name}-{found}"
        if aside.exists():
            shutil.rmtree(aside)
        aside.parent.mkdir(parents=True, exist_ok=True)
        cell.path.rename(aside)
        earlier = cell.path.parent / ".previous" / f"{cell.path.name}-{wanted}"
        found = None
        if earlier.exists():
            earlier.rename(cell.path)
            found = wanted
        log(
            f"{cell.method} seed {cell.seed}: the run in {cell.path} had other settings "
            f"({'; '.join(changed[:4]) or 'from an older contrafl'}); kept as {aside}, "
            + ("the earlier run with these settings is back" if found else "running anew")
        )
    if found is None:
        if cell.path.exists():  # started but never got to write its summary
            shutil.rmtree(cell.path)
        return
    summary = read_summary(cell.path)
    if summary.get("status") == "completed":
        cell.state = "done"
        return
    cell.state = "resume"
    cell.rounds_done = summary.get("checkpointed_rounds", 0)


def _run_cell(cell: Cell, setup: Any, clock: "SuiteClock", progress: TextIO | None, head: str) -> dict[str, Any]:
    from ..engine.run_dir import RunDir
    from ..engine.resume import resume
    from ..engine.simulation import Simulation

    bar = SuiteProgress(clock, cell.config.rounds, progress, prefix=f"{head}  ") if progress is not None else None
    if cell.state == "resume":
        sim = resume(setup, RunDir(cell.path, resume=True), bar)
    else:
        sim = Simulation(setup, RunDir(cell.path), bar)
    for w in setup.warnings:
        (progress or sys.stderr).write(f"    warning: {w}\n")
    return sim.run()


def _traceback_file(path: Path, exc: BaseException) -> str:
    """Where the traceback of a failed run is: its ``error.txt``, which the run writes,
    or written here for a failure before the run could."""
    error = path / "error.txt"
    if not error.is_file():
        import traceback

        path.mkdir(parents=True, exist_ok=True)
        error.write_text("".join(traceback.format_exception(exc)))
    return f"traceback in {error}"


def run_fingerprint(path: Path) -> str | None:
    """The fingerprint of the run in ``path`` (from its summary, else its config), or
    None when there is no run there."""
    summary = read_summary(path)
    if "fingerprint" in summary:
        return summary["fingerprint"]
    config = path / "config.yaml"
    if config.is_file():
        return fingerprint(yaml.safe_load(config.read_text()) or {})
    return None


class SuiteClock:
    """The suite's ETA (:func:`~contrafl.experiments.eta.seconds_left`): the runs it has
    to do, in their order, each known by its method's estimate and, once it runs, by the
    pace of its rounds, which its :class:`SuiteProgress` measures. A run's time spans
    from its start (when its :class:`SuiteProgress` is made; the clock's, for the
    first) to the next run's: the set-up of a run, before its :class:`SuiteProgress`,
    counts with the run before it. ``clock`` gives the time in seconds (a test passes a
    fake one)."""

    def __init__(self, runs: list[RunTimes], clock: Callable[[], float] = time.perf_counter) -> None:
        self.runs = runs
        self.now = clock
        self.since = clock()  # the start of the current run's time
        self.bar: SuiteProgress | None = None  # the current run's

    @classmethod
    def for_cells(cls, cells: list[Cell], say: Callable[[str], object] | None) -> SuiteClock:
        """The clock of the runs of ``cells`` not done yet, each with the estimate of a
        run of its method (:func:`~contrafl.experiments.eta.calibrate_each`, which tells
        ``say``; none without ``say``: no ETA is shown)."""
        todo = [c for c in cells if c.state != "done"]
        configs: dict[str, Any] = {}
        for cell in todo:
            configs.setdefault(cell.method, cell.config)
        estimates = calibrate_each(configs, "method", say) if say is not None else {}
        return cls([RunTimes(c.config.rounds, estimates.get(c.method), c.rounds_done) for c in todo])

    def run_started(self, bar: SuiteProgress) -> None:
        """The next run starts, its rounds measured by ``bar``; the current one ended."""
        current = self.current()
        if current is not None:
            self.observe(current)
            current.state = "ended"
            self.since = self.now()
        following = next(r for r in self.runs if r.state == "pending")
        following.state = "running"
        self.bar = bar

    def current(self) -> RunTimes | None:
        return next((r for r in self.runs if r.state == "running"), None)

    def observe(self, run: RunTimes) -> None:
        """``run``'s rounds, pace and time beyond them, from its bar."""
        if self.bar is not None:
            run.done, run.pace = self.bar.done, self.bar.per_round()
        run.overhead = self.now() - self.since - (run.pace or 0.0) * run.done

    def eta(self) -> float | None:
        """Seconds left in the suite; None before any round."""
        current = self.current()
        if current is not None:
            self.observe(current)
        return seconds_left(self.runs)


class SuiteProgress(Progress):
    """A run's per-round progress line, with the whole suite's ETA."""

    def __init__(self, clock: SuiteClock, rounds: int, stream: TextIO, prefix: str) -> None:
        super().__init__(rounds, stream, prefix=prefix, clock=clock.now)
        self.clock = clock
        clock.run_started(self)

    def suffix(self) -> str:
        eta = self.clock.eta()
        return "" if eta is None else f"  suite ETA {clock_text(eta)}"


def _paths_from(settings: Any, folder: Path) -> Any:
    """``settings`` with a relative ``data_dir`` made relative to ``folder`` (the suite
    file's), so that a suite runs the same from any working directory."""
    data_dir = settings.get("data_dir") if isinstance(settings, Mapping) else None
    if isinstance(data_dir, str) and not Path(data_dir).expanduser().is_absolute():
        return {**settings, "data_dir": os.path.normpath(folder.absolute() / data_dir)}
    return settings


def suite_report(out: Path) -> str:
    """The detailed table of the suite in directory ``out`` (:func:`format_table` with
    ``detailed``), recomputed from its run directories for the suite definition and
    overrides recorded there, with the executors that produced the runs."""
    record_path = Path(out) / SUITE_RECORD
    try:
        record = json.loads(record_path.read_text())
        suite = Suite(**record["suite"])
    except (OSError, ValueError, TypeError, KeyError):
        raise ConfigError(f"{record_path} is missing or unreadable; run the suite with `contrafl experiment` first") from None
    configs = resolved_configs(suite, record["overrides"])
    results = collect(suite, Path(out), list(suite.methods), {k: fingerprint(c) for k, c in configs.items()})
    used = [read_run(run_path(Path(out), m, s))[0] for m, e in results["methods"].items() for s in e["seed_list"]]
    executors = sorted({f"{c.get('executor')} executor, {c.get('workers')} worker(s), {c.get('device')}" for c in used})
    runs = sum(e["seeds"] for e in results["methods"].values())
    note = f"{runs} completed runs ({'; '.join(executors)}); regenerate with `contrafl report {out} --markdown`"
    paper = "" if suite.families_only else format_table(suite, results, detailed=True) + "\n\n"
    return paper + statistics(group_runs([Path(out)]), suite) + "\n\n" + note


def statistics(groups: Sequence[Group], suite: Suite) -> str:
    """The tables of the metric families of ``groups`` (a suite directory's runs,
    :func:`~contrafl.experiments.groups.group_runs`), one per family, with bootstrap
    intervals over seeds and paired differences to the suite's baseline, then the
    attackers found by the aggregators that choose clients
    (:mod:`contrafl.experiments.comparison`)."""
    from .comparison import detection_table, family_tables, markdown

    detection = detection_table(groups)
    tables = [*family_tables(groups, suite.baseline_method()), *([detection] if detection else [])]
    return "\n\n".join(markdown(t) for t in tables)


def plot_families(groups: Sequence[Group], out: Path) -> list[Path]:
    """``curves-<metric>.png`` in ``out`` for each metric family of ``groups`` (the runs in
    ``out``): the mean over seeds per round with a ± std band, one metric on each
    figure's axis; a figure of a family no run evaluated any more is removed."""
    from .comparison import FAMILIES
    from .html import curves_figure

    written = []
    for metric in FAMILIES:
        path = out / f"curves-{metric.key}.png"
        png = curves_figure(groups, metric)
        if png is None:
            path.unlink(missing_ok=True)
            continue
        path.write_bytes(png)
        written.append(path)
    return written


def collect(
    suite: Suite, out: Path, methods: Sequence[str], fingerprints: Mapping[tuple[str, int], str] | None = None
) -> dict[str, Any]:
    """Per method, over its completed runs (those with the fingerprint in
    ``fingerprints``, when given): the seeds, final accuracy per seed with mean and std,
    the mean over seeds of the last ``LAST`` evaluated rounds (and how many rounds that
    is: fewer in shorter runs), the mean curve, client accuracies and the rounds each
    seed needs to reach the suite's target. docs/sweeps.md describes every key of the
    ``results.json`` this makes."""

    def usable(method: str, seed: int) -> bool:
        path = run_path(out, method, seed)
        if read_summary(path).get("status") != "completed":
            return False
        return fingerprints is None or run_fingerprint(path) == fingerprints[method, seed]

    seeds = {m: [s for s in suite.seeds if usable(m, s)] for m in methods}
    histories = {m: [read_run(run_path(out, m, s))[1] for s in seeds[m]] for m in methods}
    finals = {m: [f for f in map(last_value, histories[m]) if f is not None] for m in methods}
    target = _target(suite, finals)
    per_method: dict[str, Any] = {}
    for method in methods:
        runs = histories[method]
        entry: dict[str, Any] = {"seeds": len(runs), "seed_list": seeds[method]}
        if finals[method]:
            entry["test_acc"] = finals[method]
            entry["test_acc_mean"], entry["test_acc_std"] = mean_std(finals[method])
            entry["test_acc_last_mean"] = mean_std([_last_mean(rows, "test_acc") for rows in runs])[0]
            entry["test_acc_last_rounds"] = min(len(_last(rows, "test_acc")) for rows in runs)
            entry["curve"] = _mean_curve(runs, "test_acc")
        best = [max((r for r in rows if "personal_acc" in r), key=lambda r: r["personal_acc"]) for rows in runs if any("personal_acc" in r for r in rows)]
        if best:  # PFLlib: the best round's client accuracy, and the std over clients then
            entry["best_acc"] = [r["personal_acc"] for r in best]
            entry["best_acc_mean"], entry["best_acc_seed_std"] = mean_std(entry["best_acc"])
            entry["best_client_std"] = mean_std([r["personal_acc_std"] for r in best])[0]
            entry["best_round"] = [r["round"] for r in best]
            entry.setdefault("curve", _mean_curve(runs, "personal_acc"))
        personal = [r for r in (last_row(rows, "personal_acc") for rows in runs) if r is not None]
        if personal:
            entry["personal_acc"] = [r["personal_acc"] for r in personal]
            entry["personal_acc_mean"], entry["personal_acc_seed_std"] = mean_std(entry["personal_acc"])
            entry["personal_acc_client_std"] = mean_std([r["personal_acc_std"] for r in personal])[0]
        knn = [r for r in (last_row(rows, "knn_acc") for rows in runs) if r is not None]
        if knn:
            entry["knn"] = [r["knn_acc"] for r in knn]
            entry["knn_mean"], entry["knn_std"] = mean_std(entry["knn"])
            entry["best_knn"] = [max(r["knn_acc"] for r in rows if "knn_acc" in r) for rows in runs]
            entry.setdefault("curve", _mean_curve(runs, "knn_acc"))
        for probe in suite.probes:
            files = [run_path(out, method, s) / "representation" / f"{probe}.json" for s in seeds[method]]
            if files and all(f.is_file() for f in files):
                entry[probe] = [json.loads(f.read_text())["acc"] for f in files]
                entry[f"{probe}_mean"], entry[f"{probe}_std"] = mean_std(entry[probe])
        if target is not None and finals[method]:
            entry["rounds_to_target"] = [rounds_to_reach(rows, target) for rows in runs]
        per_method[method] = entry
    return {"suite": suite.name, "target": target, "methods": per_method}


LAST = 5  # rounds averaged in the "mean of the last rounds" column


def _last(rows: Sequence[Mapping], key: str) -> list[float]:
    """The values of ``key`` in the last :data:`LAST` rounds that evaluated it (fewer
    in a run with fewer)."""
    return [r[key] for r in rows if r.get(key) is not None][-LAST:]


def _last_mean(rows: Sequence[Mapping], key: str) -> float:
    values = _last(rows, key)
    return sum(values) / len(values)


def _last_rounds(methods: Mapping[str, Any]) -> int:
    """The rounds the column of :func:`_last_mean` averages: as many as every method's
    runs have (3 for 3-round runs), else ``LAST`` (a cell of fewer says how many)."""
    counts = {e["test_acc_last_rounds"] for e in methods.values() if "test_acc_last_rounds" in e}
    return counts.pop() if len(counts) == 1 else LAST


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


def format_table(suite: Suite, results: Mapping[str, Any], detailed: bool = False) -> str:
    """A markdown table: ours (mean ± std over seeds) next to the paper's numbers.

    ``detailed`` adds the final accuracy of every seed and the mean of the last
    :data:`LAST` evaluated rounds, or of as many as the runs have (the tables of
    docs/results.md). A single seed's accuracy has no ``± std``."""
    if suite.metric == "best":
        return _best_table(suite, results, detailed)
    if suite.metric == "representation":
        return _representation_table(suite, results, detailed)
    target = results.get("target")
    methods = results["methods"]
    header = ["method", "accuracy (ours)", "seeds"]
    if detailed:
        last_rounds = _last_rounds(methods)
        header += ["per seed", "last round" if last_rounds == 1 else f"mean of last {last_rounds} rounds"]
    if any("personal_acc_mean" in e and "test_acc_mean" in e for e in methods.values()):
        header.append("client accuracy (ours)")
    if suite.paper:
        header.append("paper")
    if target is not None:
        header.append(f"rounds to {100 * target:.1f}%")
        if suite.paper_rounds:
            header.append("paper rounds")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, e in methods.items():
        seeds = ", ".join(map(str, e.get("seed_list", []))) if detailed else str(e["seeds"])
        if "test_acc_mean" in e:
            acc = pm(e["test_acc_mean"], e["test_acc_std"], len(e.get("test_acc", ())) or e["seeds"])
            per_seed = ", ".join(f"{100 * a:.2f}" for a in e["test_acc"])
        elif "personal_acc_mean" in e:
            acc = f"{100 * e['personal_acc_mean']:.2f} ± {100 * e['personal_acc_client_std']:.2f} (clients)"
            per_seed = ", ".join(f"{100 * a:.2f}" for a in e.get("personal_acc", [])) + " (client means)"
        else:
            acc, per_seed = "-", ""
        cells = [method, acc, seeds or "-"]
        if detailed:
            last = ""
            if "test_acc_last_mean" in e:
                fewer = e.get("test_acc_last_rounds", LAST)
                last = f"{100 * e['test_acc_last_mean']:.2f}" + (f" (last {fewer})" if fewer != last_rounds else "")
            cells += [per_seed, last]
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


def _best_table(suite: Suite, results: Mapping[str, Any], detailed: bool) -> str:
    """PFLlib's layout (FedCRL Tables II-III): per method and setting, the best-round
    client accuracy (mean ± std over seeds) and the std over clients at that round."""
    methods = results["methods"]
    settings = suite.settings or [""]
    header = ["method"]
    for setting in settings:
        label = f"{setting}: " if setting else ""
        header += [f"{label}Acc (%)", f"{label}Std"]
    if detailed:
        header += ["seeds", "best rounds"]
    if suite.paper:
        header.append("paper")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for base in base_methods(suite):
        cells, seeds, rounds = [base], [], []
        for setting in settings:
            e = methods.get(f"{setting} / {base}" if setting else base, {})
            if "best_acc_mean" in e:
                cells += [pm(e["best_acc_mean"], e["best_acc_seed_std"], len(e["best_acc"])), f"{100 * e['best_client_std']:.2f}"]
                seeds.append(", ".join(map(str, e["seed_list"])))
                rounds.append(", ".join(map(str, e["best_round"])))
            else:
                cells += ["-", "-"]
        if detailed:
            cells += ["; ".join(dict.fromkeys(seeds)) or "-", "; ".join(rounds) or "-"]
        if suite.paper:
            cells.append(str(suite.paper.get(base, "")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _representation_table(suite: Suite, results: Mapping[str, Any], detailed: bool) -> str:
    """FedU2's layout: per method and setting, the last round's kNN accuracy and each
    probe's accuracy, mean ± std over seeds (``detailed``: the best round's kNN too)."""
    methods = results["methods"]
    settings = suite.settings or [""]
    columns = [("knn", "kNN")] + [(p, {"linear": "LP"}.get(p, p.replace("finetune-", "FT"))) for p in suite.probes]
    header = ["method"]
    for setting in settings:
        label = f"{setting}: " if setting else ""
        header += [f"{label}{title} (%)" for _, title in columns]
        if detailed:
            header.append(f"{label}best kNN (%)")
    if detailed:
        header.append("seeds")
    if suite.paper:
        header.append("paper")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for base in base_methods(suite):
        cells, seeds = [base], []
        for setting in settings:
            e = methods.get(f"{setting} / {base}" if setting else base, {})
            for key, _ in columns:
                cells.append(pm(e[key + "_mean"], e[key + "_std"], len(e[key])) if f"{key}_mean" in e else "-")
            if detailed:
                cells.append(f"{100 * mean_std(e['best_knn'])[0]:.2f}" if e.get("best_knn") else "-")
            if e.get("seed_list"):
                seeds.append(", ".join(map(str, e["seed_list"])))
        if detailed:
            cells.append("; ".join(dict.fromkeys(seeds)) or "-")
        if suite.paper:
            cells.append(str(suite.paper.get(base, "")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
