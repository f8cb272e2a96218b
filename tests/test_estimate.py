"""Time you can plan (#20 item 5): the estimate before round 1 changes nothing the run
computes and counts the local steps it takes; a long round reports the clients done
on streams that are not terminals (a fake clock, no sleeps)."""

from __future__ import annotations

import io
import json

import pytest

from contrafl.cli import main
from contrafl.config import load_config
from contrafl.engine.estimate import Estimate, estimate
from contrafl.engine.progress import Progress
from contrafl.engine.run_dir import RunDir
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation

SMALL = ["rounds=2", "num_clients=3", "local_epochs=1"]


def run(path, calibrate: bool, settings: list[str]) -> Estimate | None:
    sim = Simulation(prepare(load_config(None, [*SMALL, *settings])), RunDir(path))
    planned = estimate(sim) if calibrate else None
    sim.run()
    return planned


@pytest.mark.parametrize(
    "settings",
    [
        ["executor=sequential", "algorithm=moon", "sample_fraction=0.67", "drop_last=false", "eval_personal=true"],
        pytest.param(["executor=vectorized", "algorithm=moon"], marks=pytest.mark.slow),
        ["executor=parallel", "workers=2", "algorithm=fedprox"],
    ],
    ids=["sequential", "vectorized", "parallel"],
)
def test_the_calibration_changes_nothing_the_run_computes(tmp_path, settings):
    planned = run(tmp_path / "calibrated", True, settings)
    run(tmp_path / "plain", False, settings)
    metrics = (tmp_path / "calibrated" / "metrics.jsonl").read_bytes()
    assert metrics == (tmp_path / "plain" / "metrics.jsonl").read_bytes()
    rows = [json.loads(line) for line in metrics.splitlines()]
    assert planned is not None and planned.steps == sum(r["local_steps"] for r in rows)
    assert planned.seconds == planned.train_seconds + planned.eval_seconds and planned.train_seconds > 0


def test_no_estimate_for_a_run_that_has_done_rounds():
    sim = Simulation(prepare(load_config(None, [*SMALL, "executor=sequential"])))
    sim.rounds_done = 1
    assert estimate(sim) is None
    sim.store.close()


def test_run_prints_the_estimate_and_records_it(tmp_path, capsys, monkeypatch):
    from contrafl.engine import estimate as module

    monkeypatch.setattr(module, "SHORT_RUN_S", 0.0)
    assert main(["run", "--out", str(tmp_path / "run"), *SMALL, "executor=sequential"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("estimated time: ~"))
    assert "local steps:" in line and " s/step x 166 steps + evaluation 0:00:0" in line
    assert lines.index(line) < next(i for i, x in enumerate(lines) if x.startswith("round 1/2"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["estimated_time_s"] > 0


def test_a_short_run_prints_no_estimate(tmp_path, capsys):
    """One timed step puts this run far below SHORT_RUN_S: no calibration, no line."""
    assert main(["run", "--out", str(tmp_path / "run"), *SMALL, "executor=sequential"]) == 0
    out = capsys.readouterr().out
    assert "estimated time" not in out and "round 1/2" in out
    assert "estimated_time_s" not in json.loads((tmp_path / "run" / "summary.json").read_text())


def test_estimate_line():
    planned = Estimate(seconds=750.4, train_seconds=700.0, eval_seconds=50.4, steps=30000, calibration_steps=6)
    assert planned.line() == (
        "estimated time: ~0:12:30 (calibrated on 6 local steps: 0.0233 s/step x 30,000 steps + evaluation 0:00:50)"
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_long_round_reports_clients_done_on_a_log_at_most_every_10_seconds():
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(3, out, clock=clock)
    expected = []
    for at, done, line in [
        (5.0, 1, None),  # 5 s into the round: too early
        (10.5, 2, "round 1/3: clients 2/8 done, 0:00:10 into the round"),
        (15.0, 3, None),  # 4.5 s after the last line
        (21.0, 4, "round 1/3: clients 4/8 done, 0:00:21 into the round"),
        (40.0, 8, None),  # the round's last client: its round line follows
    ]:
        clock.now = 100.0 + at
        progress.clients(1, done, 8)
        expected += [line] if line else []
        assert out.getvalue().splitlines() == expected
    progress.round_done({"round": 1, "train_loss": 0.5})
    assert out.getvalue().splitlines()[-1].startswith("round 1/3  |")
    clock.now += 9.0  # 9 s into round 2
    progress.clients(2, 1, 8)
    clock.now += 2.0
    progress.clients(2, 2, 8)
    assert out.getvalue().splitlines()[-1] == "round 2/3: clients 2/8 done, 0:00:11 into the round"


def test_a_short_round_prints_only_its_line():
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(2, out, clock=clock)
    for done in range(1, 5):
        clock.now += 2.0
        progress.clients(1, done, 5)
    progress.round_done({"round": 1})
    assert len(out.getvalue().splitlines()) == 1


def test_a_slow_step_is_timed_once_and_the_calibration_says_what_it_does(tmp_path, capsys, monkeypatch):
    """A heavy model on a CPU (here: every step counts as slow) is calibrated on one
    timed step (and the check of a short run's), not on REPEATS x CALIBRATION_STEPS of
    them, and the run says so before it times it."""
    from contrafl.engine import estimate as module

    monkeypatch.setattr(module, "SHORT_RUN_S", 0.0)
    monkeypatch.setattr(module, "SLOW_STEP_S", 0.0)
    assert main(["run", "--out", str(tmp_path / "run"), *SMALL, "executor=sequential"]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = next(i for i, x in enumerate(lines) if x.startswith("estimating the run's time: a local step takes about"))
    line = next(i for i, x in enumerate(lines) if x.startswith("estimated time: ~"))
    assert said < line and "(calibrated on 1 local step:" in lines[line]
