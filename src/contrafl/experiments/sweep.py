"""Sweeps: the cartesian product of settings, each cell run over several seeds.

A sweep file has::

    name: beta sweep on digits           # optional (default: the file's name)
    base: {dataset: digits, rounds: 3}   # settings shared by every run
    grid:                                # KEY: [values]; every combination is a cell
      algorithm: [fedavg, moon]
      partition.beta: [0.1, 0.5]
      moon.mu: [1, 5]                    # NAME.OPTION: only in the cells of algorithm NAME
    seeds: [0, 1]                        # or a count: 2

A grid key is any setting of ``contrafl run`` (``lr``, ``num_clients``, ``rounds``), a
component (``algorithm``, ``dataset``, ``partition``, ``model``: a name or a mapping with
a name and options) or a component's option (``partition.beta``, ``algorithm.mu``). An
option written with an algorithm's name, ``moon.mu``, applies to the cells that run that
algorithm and is left out of the others, so the grid above has 2 x 2 FedAvg cells and
2 x 2 x 2 MOON cells, not 2 x 2 x 2 x 2.

A sweep is run as a suite (:mod:`contrafl.experiments.suite`) whose methods are its cells: each
run goes to ``OUT/<cell>/seed<k>/``, a finished run with the same settings is reused and a
stopped one resumes from its checkpoint. Runs go to ``workers`` processes of ``contrafl
run``, each on its share of the CPU cores and, for runs on CUDA, a GPU of its own (one
process per visible GPU by default); ``OUT/sweep.json`` records the sweep and
``OUT/results.md`` its table.

``--shard I/N`` runs the I-th of N disjoint shares of the runs (every N-th run, from the
I-th, in the sweep's order), so that the N jobs of a cluster's job array run one sweep,
into one output directory or several: each share inspects, runs and resumes its own runs
only, records itself in ``OUT/sweep-shard-I-of-N.json``, and the table covers the runs of
every share found in ``OUT`` (those of no share yet are ``not started``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TextIO, TypeVar

import yaml

from .. import params as P
from ..config import COMPONENTS, SETTINGS, Config, parse_overrides
from ..engine.progress import clock_text, pace_of
from ..engine.run_dir import read_summary, to_json
from ..execution.signals import exit_code, interrupts, signal_name, stop_point
from ..errors import ConfigError
from ..words import count
from ..metrics.history import mean_std
from .eta import RunTimes, calibrate_each, seconds_left
from .report import METRICS, Metric, _format, count_states, pm, read_run, robustness, run_metric
from .groups import group_runs
from .spec import SHARD_RECORD, SWEEP_RECORD, Suite, Sweep, _algorithm_name, _applies, _slug, _text, run_path
from .suite import Cell, _inspect, _paths_from, resolved_configs, statistics

T = TypeVar("T")


def load_sweep(path: Path) -> Sweep:
    """Read and check a sweep file (every axis and value is checked when the cells'
    configurations are resolved, before the first run starts)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file not found: {path}; write one as in docs/sweeps.md")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path} is not valid YAML; fix the syntax") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} must hold a mapping with base, grid and seeds (docs/sweeps.md)")
    unknown = set(data) - {"name", "description", "base", "grid", "seeds"}
    if unknown:
        raise ConfigError(f"{path}: unknown key '{sorted(unknown)[0]}'; a sweep file has name, description, base, grid and seeds")
    grid = data.get("grid")
    if not isinstance(grid, Mapping) or not grid:
        raise ConfigError(f"{path} has no 'grid'; give the settings to vary, e.g. grid: {{algorithm: [fedavg, moon], partition.beta: [0.1, 0.5]}}")
    axes: dict[str, list[Any]] = {}
    for key, values in grid.items():
        key = str(key)
        head, dot, _ = key.partition(".")
        if key == "seed":
            raise ConfigError(f"{path}: vary the seed with 'seeds: [0, 1, 2]', not as a grid axis")
        if not dot and key not in COMPONENTS and key not in SETTINGS:
            raise ConfigError(f"{path}: grid key '{key}' is not a setting{P.suggest(key, SETTINGS + list(COMPONENTS))}; see `contrafl run --help`")
        values = values if isinstance(values, list) else [values]
        if not values:
            raise ConfigError(f"{path}: grid key '{key}' has no values; give a list, e.g. {key}: [a, b]")
        axes[key] = values
    algorithms = {_algorithm_name(v) for v in axes.get("algorithm", [(data.get("base") or {}).get("algorithm", "fedavg")])}
    for key in axes:
        head, dot, _ = key.partition(".")
        if dot and head not in COMPONENTS and not any(_applies(key, a) for a in algorithms):
            raise ConfigError(
                f"{path}: grid key '{key}' sets an option of algorithm {head}, which no cell runs "
                f"(algorithms: {', '.join(sorted(algorithms))}); add {head} to the algorithm axis or write algorithm.{key.partition('.')[2]}"
            )
    seeds = data.get("seeds", [0])
    seeds = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ConfigError(f"{path}: seeds {data.get('seeds')!r} is invalid; give a count (3) or distinct seeds >= 0 ([0, 1, 2])")
    return Sweep(
        name=str(data.get("name") or path.stem),
        description=str(data.get("description", "")),
        base=_paths_from(data.get("base") or {}, path.parent),
        grid=axes,
        seeds=seeds,
    )


def parse_shard(text: str) -> tuple[int, int]:
    """``(I, N)`` of ``--shard I/N``: the I-th (from 1) of N shares of a sweep's runs."""
    found = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", text)
    if found and 1 <= int(found[1]) <= int(found[2]):
        return int(found[1]), int(found[2])
    raise ConfigError(f"--shard {text or repr(text)} is invalid: expected I/N with 1 <= I <= N, e.g. --shard 2/4 (the second of 4 shares)")


def in_shard(items: Sequence[T], shard: tuple[int, int] | None) -> list[T]:
    """The items of share ``(I, N)``: every N-th, from the I-th (all of them without a
    shard). The N shares are disjoint and cover the items; they depend on the items'
    order alone, so every job of an array computes the same shares."""
    if shard is None:
        return list(items)
    i, n = shard
    return list(items[i - 1 :: n])


def visible_gpus() -> list[str]:
    """The GPUs this process may use, named as ``CUDA_VISIBLE_DEVICES`` names them: the
    entries of its own ``CUDA_VISIBLE_DEVICES`` (indices, UUIDs or MIG ids) when set,
    else ``0``, ``1``, ...; as many as PyTorch sees."""
    import torch

    seen = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [n.strip() for n in listed.split(",")] if listed is not None else [str(k) for k in range(seen)]
    return names[:seen]


def sweep_gpus(configs: Sequence[Any]) -> list[str]:
    """The GPUs a sweep's runs are spread over, a run at a time on each: the visible ones
    when a run trains on CUDA (``device=cuda``, or ``auto`` with a GPU), none on the CPU."""
    return visible_gpus() if any(c.device == "cuda" for c in configs) else []


def default_workers(configs: Sequence[Any], gpus: Sequence[str] = ()) -> int:
    """Processes for a sweep when not given: one per CPU core (a run of the small models
    of a sweep uses one core well), one per GPU (``gpus``) for runs on CUDA."""
    from ..cores import cpu_cores

    if any(c.device == "cuda" for c in configs):
        return max(1, len(gpus))
    return cpu_cores()


@dataclass
class _Job:
    cell: Cell
    process: subprocess.Popen
    log: Path
    start: float
    slot: int
    gpu: str | None = None


def run_sweep(
    sweep: Sweep,
    out: Path,
    overrides: Sequence[str] = (),
    workers: int | None = None,
    stream: TextIO | None = None,
    dry_run: bool = False,
    shard: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Run (or resume) every cell x seed of ``sweep`` into ``out`` with ``workers``
    processes (the runs of share ``shard = (I, N)`` only: :func:`in_shard`); the results
    of every run in ``out`` (:func:`collect`), also written to ``out``.

    Each run is a ``contrafl run`` process (``--resume`` for a stopped one) pinned to its
    share of the CPU cores, with a GPU of its own for runs on CUDA (``CUDA_VISIBLE_DEVICES``
    set to one of :func:`sweep_gpus`, given back when the run ends; ``workers`` defaults
    to one per GPU), its output in ``out/logs/``. A failed run is reported and the
    others go on. On SIGINT, SIGTERM or SIGHUP every running run is asked to stop at its
    next safe point (it keeps its checkpoint) and :class:`~contrafl.execution.signals.
    Interrupted` is raised with ``summary`` (what is done, stopped and left) as an
    attribute; the next call continues.
    """
    from ..cores import cpu_cores
    from ..engine.setup import check_data_dir

    stream = stream or sys.stdout
    suite = sweep.suite()
    for key, value in parse_overrides(overrides):
        if key == "seed":
            raise ConfigError(f"seed={value} is set for each run by the sweep's seeds; choose them with --seeds")
    configs = resolved_configs(suite, overrides)  # every cell checked before the first run
    cells = [Cell(m, s, configs[m, s], run_path(out, m, s)) for m in suite.methods for s in suite.seeds]
    mine = in_shard(cells, shard)  # the runs this call inspects, runs and resumes
    # how each run executes is chosen by its own process, on its share of the cores
    where = {(c.method, c.seed): _execution(suite.config(c.method, c.seed, overrides)) for c in mine}
    for cell in mine:
        check_data_dir(cell.config)
    part = f", share {shard[0]}/{shard[1]}: {count(len(mine), 'run') if mine else 'no runs'}" if shard else ""
    stream.write(f"{sweep.name}: {count(len(suite.methods), 'cell')} x {count(len(suite.seeds), 'seed')} = {count(len(cells), 'run')}{part} -> {out}\n")
    if dry_run:
        for cell in mine:
            stream.write(f"  {cell.method} seed {cell.seed}: {_planned(cell)} -> {cell.path}\n")
        return {}
    for cell in mine:
        _inspect(cell, lambda line: stream.write(line + "\n"))
    queue = [c for c in mine if c.state != "done"]
    gpus = sweep_gpus([c.config for c in mine])
    cores = cpu_cores()
    workers = max(1, min(workers or default_workers([c.config for c in mine], gpus), len(queue) or 1))
    share = max(1, cores // workers)
    reused = f"{len(mine) - len(queue)} done before, reused; " if len(queue) < len(mine) else ""
    stream.write(
        f"{reused}{len(queue)} to run, {workers} at a time ({_each(share, workers, gpus)})\n" if queue
        else f"{'the' if len(mine) == 1 else 'all'} {count(len(mine), 'run')} done before, reused\n" if mine
        else f"nothing to run: the sweep has only {count(len(cells), 'run')} for {shard[1]} shares\n"  # type: ignore[index]
    )
    _record(sweep, out, overrides)
    if shard:
        _record_shard(sweep, out, overrides, shard, mine, stream)
    todo: dict[str, Config] = {}
    for cell in queue:
        todo.setdefault(cell.method, cell.config)
    estimates = calibrate_each(todo, "cell", lambda line: stream.write(line + "\n"), threads=share)
    board = _Board(mine, stream, estimates, workers)
    running: list[_Job] = []
    failed: list[str] = []
    try:
        with interrupts():
            while queue or running:
                stop_point()
                free = sorted(set(range(workers)) - {j.slot for j in running})
                while queue and free:
                    cell, slot = queue.pop(0), free.pop(0)
                    gpu = gpus[slot % len(gpus)] if gpus else None  # the slot's GPU, free again when its run ends
                    running.append(_start(cell, where[cell.method, cell.seed], out, slot, share, cores, gpu))
                for job in [j for j in running if j.process.poll() is not None]:
                    running.remove(job)
                    board.finished(job, failed)
                board.show(running)
                time.sleep(0.2)
    except KeyboardInterrupt as exc:
        _stop(running, getattr(exc, "signum", signal.SIGINT))
        for job in running:
            board.finished(job, failed, stopping=True)
        exc.summary = board.interrupted_summary(mine)  # type: ignore[attr-defined]
        raise
    results = collect(sweep, suite, out, cells)  # every share's runs found in out
    results["failed"] = failed
    if shard:
        results["shard"] = f"{shard[0]}/{shard[1]}"
        _record_shard(sweep, out, overrides, shard, mine, failed=failed)
    _write(out / "results.json", to_json(results, indent=2) + "\n")
    _write(out / "results.md", format_table(sweep, results) + "\n")
    return results


def _each(share: int, workers: int, gpus: Sequence[str]) -> str:
    """What each of ``workers`` processes runs on: its cores, and its GPU if any."""
    cores = f"{share} core{'s' if share > 1 else ''} each"
    if not gpus:
        return cores
    used = list(dict.fromkeys(gpus[s % len(gpus)] for s in range(workers)))
    per = -(-workers // len(gpus))
    shared = "" if per == 1 else f", {'up to ' if workers % len(gpus) else ''}{per} runs a GPU"
    return f"{cores}; CUDA_VISIBLE_DEVICES {', '.join(used)}{shared}"


def _planned(cell: Cell) -> str:
    """What a sweep would do with ``cell`` (read only, for --dry-run)."""
    from ..config import fingerprint
    from .suite import run_fingerprint

    found = run_fingerprint(cell.path)
    if found is None:
        return "to run"
    if found != fingerprint(cell.config):
        return "a run with other settings is there: set aside, then run anew"
    summary = read_summary(cell.path)
    if summary.get("status") == "completed":
        return "done, reused"
    return f"resumes after round {summary.get('checkpointed_rounds', 0)}"


def _record(sweep: Sweep, out: Path, overrides: Sequence[str]) -> None:
    """``out/sweep.json``: the sweep and its overrides (the same for every share of one
    command, so that shares writing it at once agree)."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"sweep": asdict(sweep), "overrides": list(overrides), "cells": {n: [list(p) for p in ps] for n, ps in sweep.cells().items()}}
    _write(out / SWEEP_RECORD, json.dumps(record, indent=2, default=str) + "\n")


def _record_shard(
    sweep: Sweep,
    out: Path,
    overrides: Sequence[str],
    shard: tuple[int, int],
    mine: Sequence[Cell],
    stream: TextIO | None = None,
    failed: Sequence[str] | None = None,
) -> None:
    """``out/sweep-shard-I-of-N.json``: what share ``shard`` runs, where and when (its
    own file: no other share writes it); at the end (``failed`` given) its failed runs.
    On ``stream``, a warning per other share recorded in ``out`` with another sweep or
    other settings (its runs would not count in this share's table)."""
    path = out / SHARD_RECORD.format(i=shard[0], n=shard[1])
    record = {
        "shard": f"{shard[0]}/{shard[1]}",
        "sweep": asdict(sweep),
        "overrides": list(overrides),
        "runs": [f"{c.method} seed {c.seed}" for c in mine],
        "host": platform.node(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if failed is not None:
        try:
            record["started"] = json.loads(path.read_text()).get("started", record["started"])
        except (OSError, ValueError):
            pass
        record.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), failed=list(failed))
    if stream is not None:
        wanted = json.loads(json.dumps([record["sweep"], record["overrides"]], default=str))
        for other in sorted(out.glob(SHARD_RECORD.format(i="*", n="*"))):
            try:
                theirs = json.loads(other.read_text())
            except (OSError, ValueError):
                continue
            if other != path and [theirs.get("sweep"), theirs.get("overrides")] != wanted:
                stream.write(
                    f"warning: share {theirs.get('shard', '?')} ({other}) ran another sweep or other settings "
                    f"(KEY=VALUE {' '.join(theirs.get('overrides') or []) or 'none'}); run every share with the same "
                    "command, or the runs of the others show as 'other settings' in the table\n"
                )
    _write(path, json.dumps(record, indent=2, default=str) + "\n")


def _write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once (a temporary file named by this host and
    process, renamed over it): shares of a sweep writing the same file at the same time,
    on one machine or several, and their readers never see a torn one."""
    tmp = path.with_name(f".{path.name}.{platform.node()}-{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _execution(requested: Config) -> dict[str, Any]:
    """The executor, workers and rank executor a run asked for (``auto`` is left for its
    process to resolve on its share of the cores)."""
    return {"executor": requested.executor, "workers": requested.workers, "rank_executor": requested.rank_executor}


def _start(cell: Cell, execution: dict[str, Any], out: Path, slot: int, share: int, cores: int, gpu: str | None = None) -> _Job:
    """A ``contrafl run`` process for ``cell`` on cores ``[slot * share, (slot + 1) * share)``
    and GPU ``gpu`` alone (its ``CUDA_VISIBLE_DEVICES``; the parent's environment without
    one), in its own session (a terminal's Ctrl-C reaches the sweep, which stops its runs once)."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{_slug(cell.method)}-seed{cell.seed}.log"
    if cell.state == "resume":
        where = [f"{k}={v}" for k, v in execution.items() if v is not None]
        args = ["run", "--resume", str(cell.path), *where, "--quiet"]
    else:
        config = logs / f"{_slug(cell.method)}-seed{cell.seed}.yaml"
        config.write_text(dataclasses.replace(cell.config, **execution).to_yaml())
        args = ["run", str(config), "--out", str(cell.path), "--quiet"]
    pinned = sorted({(slot * share + i) % cores for i in range(share)})
    boot = (
        "import os, sys\n"
        f"if hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {pinned!r})\n"
        "from contrafl.cli import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    with log.open("a") as f:
        f.write(f"$ contrafl {' '.join(args)}  (cores {pinned}{'' if gpu is None else ', CUDA_VISIBLE_DEVICES=' + gpu})\n")
        f.flush()
        process = _spawn([sys.executable, "-c", boot, *args], f, env)
    return _Job(cell, process, log, time.perf_counter(), slot, gpu)


def _spawn(argv: list[str], log: TextIO, env: dict[str, str] | None) -> subprocess.Popen:
    """Start a run's process, its output to ``log``, in its own session."""
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _stop(running: list[_Job], signum: int) -> None:
    """Ask every running run to stop at its next safe point and wait for it; a second
    Ctrl-C repeats the request (a run's second request stops it at once)."""
    for job in running:
        job.process.send_signal(signum)
    while any(j.process.poll() is None for j in running):
        try:
            time.sleep(0.1)
        except KeyboardInterrupt:
            for job in running:
                if job.process.poll() is None:
                    job.process.send_signal(signal.SIGINT)


def _round_seconds(path: Path, after: int) -> list[float]:
    """The seconds of the rounds after round ``after`` that a run directory's
    timing.jsonl holds (a line still being written left out)."""
    try:
        with (path / "timing.jsonl").open() as f:
            rows = [json.loads(line) for line in f if line.endswith("\n")]
    except (OSError, ValueError):
        return []
    return [float(r["seconds"]) for r in rows if r.get("round", 0) > after]


def _rounds_in(path: Path) -> int:
    """Rounds a run directory's metrics.jsonl holds (0 before its first round ends)."""
    try:
        with (path / "metrics.jsonl").open() as f:
            return sum(1 for line in f if line.endswith("\n"))
    except OSError:
        return 0


class _Board:
    """The sweep's one progress display: a line per finished run, and the runs going on
    with the whole sweep's rounds and ETA (a live line on a terminal, else every 30 s).
    The ETA (:func:`~contrafl.experiments.eta.seconds_left`, ``workers`` runs at a
    time) predicts each run to come from its cell's estimate (``estimates``, by cell)
    and the runs seen so far: their rounds' seconds (their ``timing.jsonl``) and their
    time beyond them, process start included. ``clock`` gives the time in seconds (a
    test passes a fake one)."""

    EVERY = 30.0  # seconds between status lines when not on a terminal (1 s on one)

    def __init__(
        self,
        cells: list[Cell],
        stream: TextIO,
        estimates: Mapping[str, float | None] | None = None,
        workers: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.stream = stream
        self.live = stream.isatty()
        self.total = len(cells)
        self.done = sum(c.state == "done" for c in cells)
        self.rounds_total = sum(c.config.rounds for c in cells)
        self.rounds_before = sum(c.config.rounds if c.state == "done" else c.rounds_done for c in cells)
        self.rounds_finished = 0  # rounds of the runs finished by this call
        estimates = estimates or {}
        self.times = {
            (c.method, c.seed): RunTimes(c.config.rounds, estimates.get(c.method), c.rounds_done) for c in cells if c.state != "done"
        }  # in the order the runs start
        self.workers = workers
        self.now = clock
        self.shown = clock()

    def rounds_now(self, running: list[_Job]) -> int:
        return self.rounds_finished + sum(max(0, _rounds_in(j.cell.path) - j.cell.rounds_done) for j in running)

    def observe(self, job: _Job, state: Literal["running", "ended"]) -> None:
        """``job``'s run as its ``timing.jsonl`` has it now: its rounds done by this call,
        their pace and its time beyond them."""
        run = self.times[job.cell.method, job.cell.seed]
        seconds = _round_seconds(job.cell.path, job.cell.rounds_done)
        run.done, run.pace, run.state = len(seconds), pace_of(seconds), state
        run.overhead = self.now() - job.start - (run.pace or 0.0) * run.done

    def eta(self, running: list[_Job]) -> str:
        for job in running:
            self.observe(job, "running")
        left = seconds_left(list(self.times.values()), self.workers)
        return "ETA after the first round" if left is None else f"ETA {clock_text(left)}"

    def show(self, running: list[_Job]) -> None:
        now = self.now()
        if not running or now - self.shown < (1.0 if self.live else self.EVERY):
            return
        self.shown = now
        going = ", ".join(f"{j.cell.method} seed {j.cell.seed} {_rounds_in(j.cell.path)}/{j.cell.config.rounds}" for j in running)
        line = (
            f"sweep {self.done}/{self.total} runs done, rounds {self.rounds_before + self.rounds_now(running)}/"
            f"{self.rounds_total}, {self.eta(running)}; running: {going}"
        )
        if self.live:
            width = max(40, _columns() - 1)
            self.stream.write("\r" + line[:width].ljust(width))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finished(self, job: _Job, failed: list[str], stopping: bool = False) -> None:
        code = job.process.wait()
        cell = job.cell
        self.rounds_finished += max(0, _rounds_in(cell.path) - cell.rounds_done)
        self.observe(job, "ended")
        seconds = self.now() - job.start
        head = f"{cell.method} seed {cell.seed}"
        # a run stopped after its last round finished it: its summary says completed
        if code == 0 or (stopping and read_summary(cell.path).get("status") == "completed"):
            self.done += 1
            cell.state = "done"
            _, rows, _ = read_run(cell.path)
            metric = run_metric(rows)
            value = next((r[metric.key] for r in reversed(rows) if metric and r.get(metric.key) is not None), None)
            what = f"{metric.label} {value:.4f}" if value is not None else "no evaluation"
            text = f"[{self.done}/{self.total}] {head}: {what} in {seconds:.0f}s"
        elif stopping:
            cell.rounds_done = read_summary(cell.path).get("checkpointed_rounds", 0)
            cell.state = "resume" if cell.rounds_done else "new"
            text = f"{head}: stopped after round {cell.rounds_done} (continues on the next call)"
        else:
            failed.append(head)
            text = f"{head}: FAILED (exit status {code}): {_last_error(job.log)} (log: {job.log})"
        self.stream.write(("\r" if self.live else "") + text.ljust(_columns() - 1 if self.live else 0) + "\n")
        self.stream.flush()

    def interrupted_summary(self, cells: list[Cell]) -> str:
        stopped = sum(c.state == "resume" for c in cells)
        left = sum(c.state == "new" for c in cells)
        return f"{self.done} of {self.total} runs done, {stopped} stopped with a checkpoint, {left} not started"


def _columns() -> int:
    return shutil.get_terminal_size((100, 24)).columns


def _last_error(log: Path) -> str:
    """The last line of a failed run's log that says what went wrong."""
    try:
        lines = [l.strip() for l in log.read_text().splitlines() if l.strip()]
    except OSError:
        return "no log"
    errors = [l for l in lines if l.startswith("contrafl: ") or "Error" in l]
    return (errors or lines or ["no output"])[-1]


ROBUSTNESS_KEYS = {"backdoor_success": "backdoor success (%)", "precision": "precision (%)", "recall": "recall (%)"}
"""What a cell's runs with attackers or a robust aggregator measured
(:class:`~contrafl.experiments.report.Robustness`), per seed in ``results.json``, and its
column in the table."""


def collect(sweep: Sweep, suite: Suite, out: Path, cells: Sequence[Cell]) -> dict[str, Any]:
    """Per cell: its settings, the completed runs with the current settings and, in
    their metric (:func:`~contrafl.experiments.report.run_metric`), the final value per seed
    with mean and std, the best value and round per seed, the client std at the final
    round (personalised runs), what robustness measured in runs with attackers or a
    robust aggregator (:data:`ROBUSTNESS_KEYS`), and the state of its other runs."""
    from .suite import run_fingerprint
    from ..config import fingerprint

    per_cell: dict[str, Any] = {}
    names = sweep.cells()
    for name in suite.methods:
        entry: dict[str, Any] = {"settings": {k: v for k, v in names[name]}, "seeds": [], "status": {}}
        finals, bests, rounds, client_std, epsilons = [], [], [], [], []
        measured: dict[str, list[float]] = {key: [] for key in ROBUSTNESS_KEYS}
        metric: Metric | None = None
        for cell in (c for c in cells if c.method == name):
            summary = read_summary(cell.path)
            status = summary.get("status", "not started")
            if status == "completed" and run_fingerprint(cell.path) != fingerprint(cell.config):
                status = "other settings"
            entry["status"][str(cell.seed)] = status
            if status != "completed":
                continue
            config, rows, _ = read_run(cell.path)
            metric = metric or run_metric(rows)
            evaluated = [r for r in rows if metric and r.get(metric.key) is not None]
            if not evaluated:
                continue
            best = max(evaluated, key=lambda r: r[metric.key])
            entry["seeds"].append(cell.seed)
            finals.append(evaluated[-1][metric.key])
            bests.append(best[metric.key])
            rounds.append(best["round"])
            if metric.std:
                client_std.append(evaluated[-1][metric.std])
            found = robustness(config, rows)
            for key in ROBUSTNESS_KEYS:
                value = None if found is None else getattr(found, key)
                if value is not None:
                    measured[key].append(value)
            spent = [r for r in rows if "dp_epsilon" in r]
            if spent:
                epsilons.append(spent[-1]["dp_epsilon"])
                if summary.get("dp", {}).get("noise") == "reproducible":
                    entry["reproducible_noise"] = True
        if epsilons:
            entry["epsilon"] = epsilons
        if metric is not None and finals:
            entry["metric"] = metric.key
            entry["final"], entry["best"], entry["best_round"] = finals, bests, rounds
            entry["final_mean"], entry["final_std"] = mean_std(finals)
            entry["best_mean"], entry["best_std"] = mean_std(bests)
            if client_std:
                entry["client_std_mean"] = mean_std(client_std)[0]
        for key, values in measured.items():
            if values:
                entry[key], (entry[f"{key}_mean"], entry[f"{key}_std"]) = values, mean_std(values)
        per_cell[name] = entry
    return {"sweep": sweep.name, "axes": list(sweep.grid), "cells": per_cell}


def format_table(sweep: Sweep, results: Mapping[str, Any], markdown: bool = True) -> str:
    """A row per cell: its value of every grid axis, the epsilon the runs spent (when a
    cell ran with ``dp``: the last round's, ``inf`` without noise, marked when the noise
    was ``dp.noise=reproducible``), the metric, final and
    best value (mean ± std over seeds, in %), the client std of personalised runs, the
    columns of :data:`ROBUSTNESS_KEYS` some cell measured (mean ± std over seeds, in %:
    the final backdoor success rate, lower is better for the defender; each run's mean
    precision and recall over its rounds) and the runs' states."""
    axes = results["axes"]
    labels = {m.key: m.label for m in METRICS}
    private = any("epsilon" in e for e in results["cells"].values())
    measured = [k for k in ROBUSTNESS_KEYS if any(f"{k}_mean" in e for e in results["cells"].values())]
    header = [*axes, *(["epsilon"] if private else []), "metric", "final (%)", "best (%)", "best rounds", "client std (%)",
              *(ROBUSTNESS_KEYS[k] for k in measured), "seeds", "runs"]
    table = [header]
    for name, e in results["cells"].items():
        values = [_text(e["settings"][a]) if a in e["settings"] else "-" for a in axes]
        if private:
            spent = ", ".join(sorted({"inf" if x is None else f"{x:.3g}" for x in e.get("epsilon", [])})) or "-"
            values.append(f"{spent} (reproducible noise: protects nothing)" if e.get("reproducible_noise") else spent)
        states = count_states(e["status"].values())
        robust = [pm(e[f"{k}_mean"], e[f"{k}_std"], len(e[k])) if f"{k}_mean" in e else "-" for k in measured]
        if "final_mean" in e:
            cells = [
                labels.get(e["metric"], e["metric"]),
                pm(e["final_mean"], e["final_std"], len(e["final"])),
                pm(e["best_mean"], e["best_std"], len(e["best"])),
                ", ".join(map(str, e["best_round"])),
                f"{100 * e['client_std_mean']:.2f}" if "client_std_mean" in e else "",
                *robust,
                ", ".join(map(str, e["seeds"])),
            ]
        else:
            cells = ["-", "-", "-", "", "", *robust, "-"]
        table.append([*values, *cells, states])
    return _format(table, markdown)


def sweep_report(out: Path, markdown: bool = True) -> str:
    """The table of the sweep in directory ``out``, recomputed from its run directories
    for the sweep and overrides recorded there."""
    sweep, overrides = _read_record(Path(out))
    suite = sweep.suite()
    configs = resolved_configs(suite, overrides)
    cells = [Cell(m, s, configs[m, s], run_path(Path(out), m, s)) for m in suite.methods for s in suite.seeds]
    return format_table(sweep, collect(sweep, suite, Path(out), cells), markdown)


def sweep_statistics(out: Path) -> str:
    """The tables of the metric families of the sweep in ``out`` (intervals over seeds,
    differences to its first cell; :func:`contrafl.experiments.suite.statistics`)."""
    return statistics(group_runs([Path(out)]), _read_record(Path(out))[0].suite())


def _read_record(out: Path) -> tuple[Sweep, list[str]]:
    """The sweep and overrides recorded in ``out``."""
    record_path = out / SWEEP_RECORD
    try:
        record = json.loads(record_path.read_text())
        return Sweep(**record["sweep"]), record["overrides"]
    except (OSError, ValueError, TypeError, KeyError):
        raise ConfigError(f"{record_path} is missing or unreadable; run the sweep with `contrafl sweep` first") from None


def interrupted_line(exc: KeyboardInterrupt) -> tuple[str, int]:
    """The one line printed when a sweep is stopped, and the exit status."""
    summary = getattr(exc, "summary", "")
    return (
        f"contrafl: sweep interrupted by {signal_name(exc)}{': ' + summary if summary else ''}; "
        "run the same command again to continue (finished runs are reused, stopped ones resume)",
        exit_code(exc),
    )
