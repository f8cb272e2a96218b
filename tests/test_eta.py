"""ETAs within 2x of the truth (#54): after a suite's or sweep's first run, whose runs
differ tenfold in cost per round and come method after method, and after a run's first
round, which carries a process's warm-up (fake clocks, no sleeps); the calibration
says what it measured and does not take a first step's warm-up for a slow step."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from contrafl.cli import main
from contrafl.engine.progress import Progress, RoundWork
from contrafl.experiments.eta import RunTimes, seconds_left
from contrafl.experiments.suite import Cell, Suite, SuiteClock, SuiteProgress, run_suite
from contrafl.experiments.sweep import _Board, _Job

STEPS = 10  # local steps of every round


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def within_2x(eta: float, truth: float) -> bool:
    return truth / 2 <= eta <= truth * 2


def test_a_suite_of_a_cheap_then_a_tenfold_costlier_method():
    """FedAvg-like runs take 2 s a round, MOON-like ones 20 s (their estimates, a few
    steps timed at the start, say 1 s and 10 s: the runs take twice as long), each
    after 3 s of set-up; the suite's first round warms the process up for 8 s. One
    pace for every round (the old clock) said 0:01:03 after the first run for 3:39
    left; a run's ETA from its first round, warm-up included, said 0:00:40 for 8 s."""
    clock = FakeClock()
    plan = [("cheap", 5.0, 2.0), ("cheap", 5.0, 2.0), ("costly", 50.0, 20.0), ("costly", 50.0, 20.0)]
    suite = SuiteClock([RunTimes(5, estimate) for _, estimate, _ in plan], clock)
    suite_etas = []  # (time, the suite's ETA) after each round from the first run's last on
    run_etas = []  # (time, the run's ETA, the run's end) after each run's round 1
    for i, (_, _, per_round) in enumerate(plan):
        clock.now += 3.0  # prepare(): data, model
        out = io.StringIO()
        bar = SuiteProgress(suite, 5, out, prefix="")
        for t in range(1, 6):
            if i == 0 and t == 1:
                clock.now += 8.0  # the first step of the process: memory, kernels
            work = RoundWork(t, 2, steps=STEPS)
            for step in range(STEPS):
                clock.now += per_round / STEPS
                work.steps_done = step + 1
                bar.working(work)
            bar.round_done({"round": t})
            if i > 0 or t == 5:
                suite_etas.append((clock.now, suite.eta()))
            if t == 1:
                after_round_1 = (clock.now, bar.eta())
        run_etas.append((*after_round_1, clock.now))
        assert re.search(r"ETA 0:00:00  suite ETA \d:\d\d:\d\d$", out.getvalue().splitlines()[-1])
    end = clock.now
    for now, eta in suite_etas:
        assert eta is not None and within_2x(eta, end - now), (now, eta, end - now)
    for now, eta, run_end in run_etas:
        assert within_2x(eta, run_end - now), (now, eta, run_end - now)


def test_a_runs_eta_after_its_first_round_leaves_out_the_warm_up():
    """`contrafl run --resume` (no calibration before it) warms up in its first round:
    5 s before the first of its 10 steps of 0.1 s. Its later rounds take 1 s: the ETA
    after round 1 is 9 s (at the round's pace it was 54 s); after round 2 the rounds
    after the first give the pace."""
    clock = FakeClock()
    progress = Progress(10, io.StringIO(), clock=clock)
    for t in (1, 2):
        clock.now += 5.0 if t == 1 else 0.0
        work = RoundWork(t, 2, steps=STEPS)
        for step in range(STEPS):
            clock.now += 0.1
            work.steps_done = step + 1
            progress.working(work)
        progress.round_done({"round": t})
        assert progress.eta() == pytest.approx(10 - t)
    assert progress.stream.getvalue().splitlines()[0].endswith("ETA 0:00:09")


def test_a_run_of_a_method_without_an_estimate_takes_the_pace_of_the_rounds_seen():
    """The calibration gave nothing for the second method (its run reports why): its
    runs are predicted at the mean seconds per round of the runs seen."""
    runs = [RunTimes(4, 4.0, done=4, pace=2.0, overhead=1.0, state="ended"), RunTimes(4, None)]
    assert seconds_left(runs) == 1.0 + 4 * 2.0


def test_a_sweep_predicts_its_workers_slots():
    """Two slots: the run to come goes to the one that frees first."""
    runs = [
        RunTimes(4, 4.0, done=2, pace=1.0, overhead=0.0, state="running"),  # 2 s left
        RunTimes(4, 4.0, done=1, pace=3.0, overhead=0.0, state="running"),  # 9 s left
        RunTimes(4, 4.0),  # after the first: 4 rounds at 5/3 s (the 3 rounds seen took 5 s for 3 estimated)
    ]
    assert seconds_left(runs, workers=2) == pytest.approx(max(9.0, 2.0 + 4 * 5 / 3))


def _job(cell: Cell, start: float) -> _Job:
    return _Job(cell, SimpleNamespace(wait=lambda: 0), cell.path / "log", start, slot=0)  # type: ignore[arg-type]


def test_a_sweep_of_a_cheap_then_a_tenfold_costlier_cell(tmp_path: Path):
    """A sweep's runs are processes of their own: each starts (4 s), warms up in its
    first round (2 s) and writes its rounds' seconds to timing.jsonl; the cheap cell's
    rounds take 1 s, the costly one's 10 s (estimated at half that). One pace for every
    round (the old board) said 0:00:46 for 2:00 left when the second run started."""
    clock = FakeClock()
    plan = [("cheap", 0, 2.5, 1.0), ("cheap", 1, 2.5, 1.0), ("costly", 0, 25.0, 10.0), ("costly", 1, 25.0, 10.0)]
    cells = [Cell(m, s, SimpleNamespace(rounds=5), tmp_path / m / f"seed{s}") for m, s, _, _ in plan]  # type: ignore[arg-type]
    board = _Board(cells, io.StringIO(), {"cheap": 2.5, "costly": 25.0}, workers=1, clock=clock)
    seen = []
    for cell, (_, _, _, per_round) in zip(cells, plan):
        cell.path.mkdir(parents=True)
        job = _job(cell, clock.now)
        clock.now += 4.0  # python, torch, prepare()
        seen.append((clock.now, board.eta([job])))
        for t in range(1, 6):
            seconds = per_round + (2.0 if t == 1 else 0.0)
            clock.now += seconds
            with (cell.path / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"round": t, "test_acc": 0.5}) + "\n")
            with (cell.path / "timing.jsonl").open("a") as f:
                f.write(json.dumps({"round": t, "seconds": seconds}) + "\n")
            seen.append((clock.now, board.eta([job])))
        clock.now += 0.5  # the summary, the process's exit
        board.finished(job, [])
    end = clock.now
    first_ended = 4.0 + 5 * 1.0 + 2.0 + 0.5
    for now, text in seen:
        if first_ended < now < end - 1:  # the last run's exit: below the display's second
            h, m, s = map(int, re.fullmatch(r"ETA (\d+):(\d\d):(\d\d)", text).groups())  # type: ignore[union-attr]
            assert within_2x(3600 * h + 60 * m + s, end - now), (now, text, end - now)


def test_the_calibration_does_not_change_what_a_suites_runs_compute(tmp_path: Path):
    """With progress shown, the suite times a few local steps of each method first (on
    simulations of their own) and prints a suite ETA on every round's line; the runs'
    metrics are those of a suite without it."""
    suite = Suite(
        name="tiny",
        base={"rounds": 2, "local_epochs": 1, "num_clients": 3, "executor": "sequential"},
        methods={"FedAvg": {"algorithm": "fedavg"}, "MOON": {"algorithm": {"name": "moon", "mu": 5}}},
    )
    log: list[str] = []
    out = io.StringIO()
    run_suite(suite, tmp_path / "shown", log=log.append, progress=out)
    run_suite(suite, tmp_path / "quiet", log=lambda _: None)
    assert any(line.startswith("ETA: timed a few local steps of a run of each of 2 methods (") for line in log)
    rounds = [line for line in out.getvalue().splitlines() if "round 2/2  |" in line]
    assert len(rounds) == 2 and all(re.search(r"suite ETA \d:\d\d:\d\d$", line) for line in rounds)
    for method in ("FedAvg", "MOON"):
        shown = (tmp_path / "shown" / method / "seed0" / "metrics.jsonl").read_bytes()
        assert shown == (tmp_path / "quiet" / method / "seed0" / "metrics.jsonl").read_bytes()


SMALL = ["rounds=2", "num_clients=3", "local_epochs=1", "executor=sequential"]


@pytest.fixture
def first_step_warms_up(monkeypatch):
    """The calibration's first timed call (the first local step) takes 2 s more: the
    warm-up of a process's first step, as `contrafl run` measured (1 s for a step of
    0.01 s)."""
    from contrafl.engine import estimate as module

    seconds = module.Calibration.seconds
    calls = []

    def warming_up(self, fn, arg, warm_up=None, repeats=1):
        calls.append(fn)
        return seconds(self, fn, arg, warm_up, repeats) + (2.0 if len(calls) == 1 else 0.0)

    monkeypatch.setattr(module.Calibration, "seconds", warming_up)
    monkeypatch.setattr(module, "SHORT_RUN_S", 0.0)


def test_a_first_step_slowed_by_its_warm_up_is_not_a_slow_step(tmp_path, capsys, first_step_warms_up):
    """A second step is timed before the step counts as slow: it is fast, so the
    calibration times its usual steps, and says nothing of a slow step."""
    assert main(["run", "--out", str(tmp_path / "run"), *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("estimating the run's time") for line in lines)
    line = next(x for x in lines if x.startswith("estimated time: ~"))
    steps, per_step = re.search(r"calibrated on (\d+) local steps: ([0-9.e-]+) s/step", line).groups()  # type: ignore[union-attr]
    assert int(steps) > 2 and float(per_step) < 1.0


def test_the_calibration_says_what_it_measured(tmp_path, capsys, monkeypatch, first_step_warms_up):
    """A slow step (here every step counts as one) is timed after the first, and the
    line says both: the step it counts, and the first with its warm-up."""
    from contrafl.engine import estimate as module

    monkeypatch.setattr(module, "SLOW_STEP_S", 0.0)
    assert main(["run", "--out", str(tmp_path / "run"), *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = next(x for x in lines if x.startswith("estimating the run's time"))
    step, first = map(float, re.fullmatch(
        r"estimating the run's time: a local step takes ([0-9.e-]+)s here \(timed after a first step of "
        r"([0-9.e-]+)s, its warm-up included\); timing an evaluation batch",
        said,
    ).groups())  # type: ignore[union-attr]
    assert first >= 2.0 > step
    estimated = next(x for x in lines if x.startswith("estimated time: ~"))
    assert "(calibrated on 2 local steps:" in estimated
