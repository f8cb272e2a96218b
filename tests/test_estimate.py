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
from contrafl.engine.progress import Progress, RoundWork
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
    """Clients trained elsewhere (a Flower grid): no steps, the clients done, and an ETA
    from the pace of the rounds done, none in round 1. Such clients train at the same
    time, so one done early says nothing of the others: extrapolated from the clients
    done, a deployment's ETA once said 0:16:50 for a run of 3:53."""
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(3, out, clock=clock)
    work = RoundWork(1, 8)
    expected = []
    for at, done, line in [
        (5.0, 1, None),  # 5 s into the round: too early
        (10.5, 2, "round 1/3: clients 2/8 done, 0:00:10 into the round"),  # no round done: no ETA
        (15.0, 3, None),  # 4.5 s after the last line
        (21.0, 4, "round 1/3: clients 4/8 done, 0:00:21 into the round"),
        (40.0, 8, None),  # the round's last client: its round line follows
    ]:
        clock.now = 100.0 + at
        work.clients_done = done
        progress.working(work)
        expected += [line] if line else []
        assert out.getvalue().splitlines() == expected
    progress.round_done({"round": 1, "train_loss": 0.5})
    assert out.getvalue().splitlines()[-1].startswith("round 1/3  |")
    work = RoundWork(2, 8)
    clock.now += 9.0  # 9 s into round 2
    work.clients_done = 1
    progress.working(work)
    clock.now += 2.0
    work.clients_done = 2
    progress.working(work)  # this round: 40 s as round 1, 29 s of it left; round 3: 40 s
    assert out.getvalue().splitlines()[-1] == "round 2/3: clients 2/8 done, 0:00:11 into the round, ETA 0:01:09"


def test_local_steps_give_the_round_its_progress_and_remake_the_eta_early():
    """A heavy model: no client is done for minutes, the steps are. The first line comes
    after `every` seconds, and its ETA is the round's measured pace, not the
    calibration's."""
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(2, out, clock=clock)
    work = RoundWork(1, 10, steps=40)
    for at, steps in [(4.0, 1), (8.0, 2), (12.0, 3)]:
        clock.now = 100.0 + at
        work.steps_done = steps
        progress.working(work)
    # 3 steps in 12 s: the round's 40 take 160 s, 148 s of them left, and round 2 as long
    assert out.getvalue().splitlines() == [
        "round 1/2: local steps 3/40, clients 0/10 done, 0:00:12 into the round, ETA 0:05:08"
    ]


def test_the_wait_for_clients_to_come_up_is_not_the_runs_pace():
    """A deployment's round 1 waits 30 s for its SuperNodes to load their clients, then
    trains 10 s; the wait (told by the transport) leaves the seconds per round and the
    ETA at the training's pace: 10 s a round, 3 rounds left after round 1."""
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(4, out, clock=clock)
    clock.now += 30.0
    progress.waited(30.0)
    clock.now += 10.0
    progress.round_done({"round": 1})
    assert out.getvalue().splitlines()[-1].endswith("10.0s/round ETA 0:00:30")


def test_a_terminal_line_shows_steps_and_updates_at_most_every_LIVE_S():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, clock = Terminal(), FakeClock()
    progress = Progress(1, out, clock=clock)
    work = RoundWork(1, 2, steps=100)
    for i in range(1, 11):  # ten steps in 0.1 s: one update
        clock.now += 0.01
        work.steps_done = i
        progress.working(work)
    clock.now += 0.2
    work.steps_done = 50
    progress.working(work)
    updates = out.getvalue().split("\r")[1:]
    assert len(updates) == 1 and "|##########..........| local steps 50/100, clients 0/2 done ETA 0:00:00" in updates[0]


def test_a_short_round_prints_only_its_line():
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(2, out, clock=clock)
    work = RoundWork(1, 5, steps=20)
    for done in range(1, 5):
        clock.now += 2.0
        work.steps_done, work.clients_done = 4 * done, done
        progress.working(work)
    progress.round_done({"round": 1})
    assert len(out.getvalue().splitlines()) == 1


def test_a_slow_step_is_timed_once_and_the_calibration_says_what_it_does(tmp_path, capsys, monkeypatch):
    """A heavy model on a CPU (here: every step counts as slow) is calibrated on one
    timed step after the first (whose warm-up is no measure of a step), not on REPEATS
    x CALIBRATION_STEPS of them, and the run says so before it times it."""
    from contrafl.engine import estimate as module

    monkeypatch.setattr(module, "SHORT_RUN_S", 0.0)
    monkeypatch.setattr(module, "SLOW_STEP_S", 0.0)
    assert main(["run", "--out", str(tmp_path / "run"), *SMALL, "executor=sequential"]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = next(i for i, x in enumerate(lines) if x.startswith("estimating the run's time: a local step takes"))
    line = next(i for i, x in enumerate(lines) if x.startswith("estimated time: ~"))
    assert said < line and "(calibrated on 2 local steps:" in lines[line]


class Recorder(Progress):
    """Keeps the round's work every time it is reported (steps done, steps planned)."""

    def __init__(self, rounds: int) -> None:
        super().__init__(rounds, io.StringIO())
        self.seen: dict[int, list[tuple[int, int | None]]] = {}

    def working(self, work: RoundWork) -> None:
        self.seen.setdefault(work.round, []).append((work.steps_done, work.steps))
        super().working(work)


@pytest.mark.parametrize(
    "settings",
    [
        ["executor=sequential", "algorithm=fedprox", "drop_last=false", "client_speed=uniform:2,8", "round_deadline=1", "stragglers=partial"],
        ["executor=parallel", "workers=2"],
        ["executor=vectorized", "algorithm=moon"],
    ],
    ids=["sequential-deadline", "parallel", "vectorized"],
)
def test_every_executor_reports_each_local_step_of_the_round(settings):
    """The steps reported add up to the round's `local_steps`, the planned total ends as
    the jobs' own (a deadline's cut included), and the count only grows; the parallel
    executor's workers report theirs through shared memory."""
    progress = Recorder(2)
    sim = Simulation(prepare(load_config(None, [*SMALL, *settings])), None, progress)
    summary = sim.run()
    assert summary["status"] == "completed"
    for row in sim.history:
        seen = progress.seen[row["round"]]
        done = [d for d, _ in seen]
        assert done == sorted(done) and done[-1] == row["local_steps"] > 0
        assert seen[-1][1] == row["local_steps"] and all(d <= total for d, total in seen)
    if "stragglers=partial" in settings:  # the deadline cut some client's planned steps
        assert any(row.get("stragglers") for row in sim.history)


def test_ranks_that_stack_their_share_are_timed_with_a_ranks_threads(monkeypatch):
    """``executor=distributed rank_executor=vectorized`` started by contrafl on a CPU: the
    calibration times the stacked steps with the threads each rank gets (the machine's
    cores shared among the ranks), not this process's, and leaves those as they were."""
    import torch

    from contrafl.cores import cores_each
    from contrafl.execution.vectorized import VectorizedExecutor

    seen = []
    train = VectorizedExecutor.train
    monkeypatch.setattr(VectorizedExecutor, "train", lambda ex, jobs, *a, **k: seen.append(torch.get_num_threads()) or train(ex, jobs, *a, **k))
    sim = Simulation(prepare(load_config(None, [*SMALL, "executor=distributed", "workers=2", "rank_executor=vectorized"])))
    threads = torch.get_num_threads()
    torch.set_num_threads(cores_each(2) + 1)
    try:
        assert estimate(sim) is not None
        assert seen and set(seen) == {cores_each(2)} and torch.get_num_threads() == cores_each(2) + 1
    finally:
        torch.set_num_threads(threads)
