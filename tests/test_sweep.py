"""contrafl sweep: the grid's cells, their configurations, and a sweep stopped and continued."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import check_screenshot, chromium_screenshot
from contrafl.cli import main
from contrafl.errors import ConfigError
from contrafl.experiments.report import find_runs, read_run
from contrafl.experiments.sweep import Sweep, load_sweep, sweep_report

SPEC = """\
name: digits sweep
base: {dataset: digits, rounds: 3, num_clients: 4, local_epochs: 1}
grid:
  algorithm: [fedavg, moon]
  partition.beta: [0.1, 0.5]
seeds: [0, 1]
"""


def test_cells_are_the_product_with_algorithm_options_only_where_they_apply():
    sweep = Sweep(
        name="s",
        base={"partition": {"name": "dirichlet", "min_size": 2}},
        grid={"algorithm": ["fedavg", "moon"], "moon.mu": [1, 5], "partition.beta": [0.1, 0.5]},
    )
    cells = sweep.cells()
    assert list(cells) == [
        "algorithm=fedavg partition.beta=0.1",
        "algorithm=fedavg partition.beta=0.5",
        "algorithm=moon moon.mu=1 partition.beta=0.1",
        "algorithm=moon moon.mu=1 partition.beta=0.5",
        "algorithm=moon moon.mu=5 partition.beta=0.1",
        "algorithm=moon moon.mu=5 partition.beta=0.5",
    ]
    suite = sweep.suite()
    cfg = suite.config("algorithm=moon moon.mu=5 partition.beta=0.1", seed=3, overrides=["rounds=2"])
    assert (cfg.algorithm.name, cfg.algorithm.options) == ("moon", {"mu": 5})
    # the base partition keeps its name and options; the cell adds beta
    assert (cfg.partition.name, cfg.partition.options) == ("dirichlet", {"min_size": 2, "beta": 0.1})
    assert (cfg.seed, cfg.rounds) == (3, 2)
    assert suite.config("algorithm=fedavg partition.beta=0.5", 0).algorithm.options == {}


def test_grid_values_may_be_components_with_options():
    sweep = Sweep(name="s", base={"rounds": 2}, grid={"algorithm": ["fedavg", {"name": "fedprox", "mu": 0.01}], "lr": [0.01, 0.1]})
    cells = sweep.cells()
    assert "algorithm=fedprox(mu=0.01) lr=0.1" in cells
    cfg = sweep.suite().config("algorithm=fedprox(mu=0.01) lr=0.1", 0)
    assert (cfg.algorithm.name, cfg.algorithm.options, cfg.lr, cfg.rounds) == ("fedprox", {"mu": 0.01}, 0.1, 2)


@pytest.mark.parametrize(
    "text, message",
    [
        ("grid: {algorithm: [fedavg]}\nbogus: 1\n", "unknown key 'bogus'"),
        ("base: {rounds: 2}\n", "has no 'grid'"),
        ("grid: {lrr: [0.1]}\n", "grid key 'lrr' is not a setting (did you mean 'lr'"),
        ("grid: {seed: [0, 1]}\n", "vary the seed with 'seeds"),
        ("grid: {algorithm: [fedavg], moon.mu: [1, 5]}\n", "sets an option of algorithm moon, which no cell runs"),
        ("grid: {lr: []}\n", "grid key 'lr' has no values"),
        ("grid: {lr: [0.1]}\nseeds: [0, 0]\n", "seeds [0, 0] is invalid"),
    ],
)
def test_bad_sweep_files_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_sweep(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_values_are_reported_before_any_run(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text("base: {rounds: 2}\ngrid: {partition.beta: [0.5, -1]}\n")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("contrafl: error: ") and "beta" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_dry_run_lists_the_runs_and_changes_nothing(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    assert main(["sweep", str(spec), "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"digits sweep: 4 cells x 2 seeds = 8 runs -> {out}"
    assert len(lines) == 9 and all(line.endswith("seed0") or line.endswith("seed1") for line in lines[1:])
    assert "algorithm=moon partition.beta=0.5 seed 1: to run" in lines[8]
    assert not out.exists()


def test_shipped_sweeps_are_valid_and_not_suites(capsys):
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "experiments" / "sweeps"
    files = sorted(folder.glob("*.yaml"))
    assert files
    for path in files:
        sweep = load_sweep(path)
        suite = sweep.suite()
        for cell in suite.methods:
            assert suite.config(cell, sweep.seeds[0]).seed == sweep.seeds[0]
        assert main(["experiment", str(path)]) == 2
        assert f"is a sweep file (it has a grid); run it with `contrafl sweep {path}`" in capsys.readouterr().err


def _wait_for(process: subprocess.Popen, text: str, timeout: float = 240) -> list[str]:
    seen, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"{text!r} not printed; output: {''.join(seen)}")


@pytest.mark.slow
def test_sweep_stopped_by_sigint_continues_with_the_missing_runs_only(tmp_path):
    """The issue's acceptance: 2 algorithms x 2 betas x 2 seeds on digits (3 rounds),
    SIGINT after the first run, started again: only the missing runs run, and the
    report lists 8 completed runs."""
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "contrafl", "sweep", str(spec), "--workers", "1", "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _wait_for(process, "[1/8] algorithm=fedavg partition.beta=0.1 seed 0: test acc")
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("contrafl: sweep interrupted by SIGINT: 1 of 8 runs done"), err
    assert "run the same command again to continue" in lines[0]
    first = out / "algorithm-fedavg-partition.beta-0.1" / "seed0"
    before = (first / "metrics.jsonl").read_bytes()
    second = out / "algorithm-fedavg-partition.beta-0.1" / "seed1"
    status = json.loads((second / "summary.json").read_text())["status"] if (second / "summary.json").is_file() else "not started"
    assert status in ("interrupted", "not started")  # stopped at a safe point, or before it began
    statuses = [json.loads((p / "summary.json").read_text())["status"] for p, _ in find_runs([out])]
    assert statuses.count("completed") == 1

    again = subprocess.run([*command[:-4], "--workers", "2", *command[-2:]], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 0, again.stderr  # continued with more workers: the runs' settings are the same
    assert "1 done before, reused; 7 to run" in again.stdout
    assert (first / "metrics.jsonl").read_bytes() == before  # not run again
    assert again.stdout.count("] algorithm=") == 7
    report = subprocess.run([sys.executable, "-m", "contrafl", "report", str(out)], capture_output=True, text=True, check=True)
    rows = [line for line in report.stdout.splitlines() if "/seed" in line]
    assert len(rows) == 8 and all(" completed " in row for row in rows)
    # every run has its cell's settings, and the table has a row per cell with both seeds
    for path, _ in find_runs([out]):
        config, _, _ = read_run(path)
        beta = config["partition"]["beta"]
        assert f"partition.beta-{beta}" in str(path) and (config["rounds"], config["num_clients"]) == (3, 4)
    # its HTML report, rendered in headless Chromium: the table's text and the figures
    page = out / "report.html"
    assert main(["report", str(out), "--html", str(page)]) == 0
    dom = chromium_screenshot(page, tmp_path / "shot.png", tmp_path)
    assert "<td>algorithm=moon partition.beta=0.5</td>" in dom and "2 completed" in dom
    check_screenshot(tmp_path / "shot.png")
    table = sweep_report(out)
    assert table.count("| 2 completed |") == 4 and "| 0, 1 |" in table
    assert (out / "results.md").read_text().strip() == table


@pytest.mark.slow
def test_parallel_workers_give_the_results_of_one_worker(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("base: {dataset: digits, rounds: 2, num_clients: 3, local_epochs: 1}\ngrid: {algorithm: [fedavg, fedprox]}\n")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "two"), "--workers", "2"]) == 0
    assert main(["sweep", str(spec), "--out", str(tmp_path / "one"), "--workers", "1"]) == 0
    for cell in ("algorithm-fedavg", "algorithm-fedprox"):
        rows = [read_run(tmp_path / d / cell / "seed0")[1] for d in ("two", "one")]
        assert [r["test_acc"] for r in rows[0]] == [r["test_acc"] for r in rows[1]]
    logs = sorted(p.name for p in (tmp_path / "two" / "logs").iterdir())
    assert logs == ["algorithm-fedavg-seed0.log", "algorithm-fedavg-seed0.yaml", "algorithm-fedprox-seed0.log", "algorithm-fedprox-seed0.yaml"]
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2:
        assert "(cores [0])" in (tmp_path / "two" / "logs" / "algorithm-fedavg-seed0.log").read_text()
    for log in (tmp_path / "two" / "logs").glob("*.log"):  # each run chooses its executor settings on its cores
        assert "warning" not in log.read_text(), log.read_text()
        assert "rank_executor: auto" in log.with_suffix(".yaml").read_text()


@pytest.mark.slow
def test_a_sweep_over_dp_reports_the_epsilon_each_cell_spent(tmp_path):
    """A grid over dp: the table gets an epsilon column, the last round's epsilon of the
    cell's runs (inf for clipping without noise, - without dp); other tables have none."""
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "base: {dataset: digits, rounds: 2, num_clients: 3, local_epochs: 1, dp: {name: local, clip: 0.01}}\n"
        "grid: {dp: [none, {name: local, noise_multiplier: 0}, {name: local, noise_multiplier: 2}]}\n"
    )
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--workers", "1"]) == 0
    rows = [line.split(" | ") for line in sweep_report(tmp_path / "out").splitlines()[2:]]
    rows = {r[0].strip("| "): r[1] for r in rows}
    spent = read_run(tmp_path / "out" / "dp-local-noise_multiplier-2" / "seed0")[1][-1]["dp_epsilon"]
    assert rows == {"none": "-", "local(noise_multiplier=0)": "inf", "local(noise_multiplier=2)": f"{spent:.3g}"}
    assert sweep_report(tmp_path / "out").splitlines()[0].startswith("| dp | epsilon | metric |")
    summary = tmp_path / "out" / "dp-local-noise_multiplier-2" / "seed0" / "summary.json"
    summary.write_text(summary.read_text().replace('"noise": "secret"', '"noise": "reproducible"'))  # as dp.noise=reproducible writes it
    rows = {r[0].strip("| "): r[1] for r in (line.split(" | ") for line in sweep_report(tmp_path / "out").splitlines()[2:])}
    assert rows["local(noise_multiplier=2)"] == f"{spent:.3g} (reproducible noise: protects nothing)"


def test_a_run_stopped_after_its_last_round_is_reported_done(tmp_path):
    """#35: a run that got the stop request after its last round exits with the signal's
    status, but its summary says completed: the sweep counts it as done, not as
    "stopped after round 3 (continues on the next call)"."""
    import io
    from types import SimpleNamespace

    from contrafl.experiments.suite import Cell
    from contrafl.experiments.sweep import _Board

    path = tmp_path / "cell" / "seed0"
    path.mkdir(parents=True)
    rows = [{"round": t, "test_acc": 0.5 + 0.1 * t} for t in (1, 2, 3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"status": "completed", "rounds_completed": 3, "checkpointed_rounds": 3}))
    stopped = tmp_path / "other" / "seed0"
    stopped.mkdir(parents=True)
    (stopped / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (stopped / "summary.json").write_text(json.dumps({"status": "interrupted", "checkpointed_rounds": 1}))
    config = SimpleNamespace(rounds=3)
    cells = [Cell("cell", 0, config, path), Cell("other", 0, config, stopped)]
    stream = io.StringIO()
    board = _Board(cells, stream)
    for cell in cells:
        job = SimpleNamespace(cell=cell, process=SimpleNamespace(wait=lambda: 130), log=tmp_path / "log", start=0.0, slot=0)
        board.finished(job, [], stopping=True)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[1/2] cell seed 0: test acc 0.8000 in ") and "stopped" not in lines[0]
    assert lines[1] == "other seed 0: stopped after round 1 (continues on the next call)"
    assert cells[0].state == "done" and cells[1].state == "resume"
    assert board.interrupted_summary(cells) == "1 of 2 runs done, 1 stopped with a checkpoint, 0 not started"
