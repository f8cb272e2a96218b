"""The straggler model: ``client_speed`` (each client's local steps per unit of simulated
time, drawn from the seed), ``round_deadline`` and ``stragglers`` (drop a late client's
reply, or keep the steps it finished, for FedProx)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from contrafl.cli import main
from contrafl.config import load_config
from contrafl.execution.plan import make_plan
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.errors import ConfigError
from contrafl.rng import generator
from contrafl.speeds import client_speeds, round_speed, step_budget
from conftest import missing_clients_keep_state
from test_resume import CLIENTS, SETTINGS, _killed_run, _uninterrupted

pytestmark = pytest.mark.usefixtures("one_thread")


def test_speeds_follow_their_distribution_and_come_from_the_seed():
    """10,000 clients: lognormal:0.5 has median 1 and log-std 0.5 (within 5 standard
    errors); uniform stays in its range with mean (LOW + HIGH) / 2; slow makes exactly
    round(FRACTION * N) clients FACTOR times slower; the same seed gives the same speeds."""
    n = 10_000
    log = torch.log(client_speeds("lognormal:0.5", n, 3))
    assert abs(float(log.median())) < 5 * 0.5 * math.sqrt(math.pi / 2 / n)
    assert abs(float(log.std()) - 0.5) < 5 * 0.5 / math.sqrt(2 * n)
    uniform = client_speeds("uniform:0.2,1", n, 3)
    assert 0.2 <= float(uniform.min()) and float(uniform.max()) <= 1
    assert abs(float(uniform.mean()) - 0.6) < 5 * 0.8 / math.sqrt(12 * n)
    slow = client_speeds("slow:0.3,4", 101, 3)
    assert sorted(set(slow.tolist())) == [0.25, 1.0] and int((slow == 0.25).sum()) == 30
    assert torch.equal(client_speeds("lognormal:0.5", n, 3), client_speeds("lognormal:0.5", n, 3))
    assert not torch.equal(client_speeds("lognormal:0.5", n, 3), client_speeds("lognormal:0.5", n, 4))
    assert torch.equal(client_speeds("constant", 5, 0), torch.ones(5, dtype=torch.float64))
    jittered = [round_speed(2.0, 0.5, 3, t, 7) for t in range(2000)]
    logs = torch.log(torch.tensor(jittered) / 2)
    assert abs(float(logs.mean())) < 5 * 0.5 / math.sqrt(2000) and abs(float(logs.std()) - 0.5) < 5 * 0.5 / math.sqrt(4000)
    assert round_speed(2.0, 0.5, 3, 5, 7) == jittered[5] and round_speed(2.0, 0.0, 3, 5, 7) == 2.0


def test_the_step_budget_is_the_deadline_times_the_speed_rounded_down():
    assert step_budget(10, 0.25) == 2
    assert step_budget(12, 0.25) == 3  # exactly K / s allows K steps
    assert step_budget(0.1 * 3, 10 / 3) == 1  # 0.3 * 3.333... = 0.99999... in floats
    assert step_budget(5, 0.1) == 0


def test_the_head_of_a_plan_is_its_first_steps():
    g = generator(0, "plan")
    plan = make_plan(torch.arange(50).numpy(), 3, 8, True, lambda n, g: {"flip": torch.rand(n, generator=g)}, 2, g)
    head = plan.head(8)
    assert head.steps == 8 and head.sizes == plan.sizes[:8]
    for step in range(8):
        rows, aug = head.batch(step)
        rows_all, aug_all = plan.batch(step)
        assert torch.equal(rows, rows_all) and all(torch.equal(a["flip"], b["flip"]) for a, b in zip(aug, aug_all))
    assert head.epoch_ends == frozenset({5}) and plan.epoch_ends == frozenset({5, 11, 17})
    assert plan.head(0).steps == 0 and len(plan.head(0).order) == 0


DIGITS = ["num_clients=6", "rounds=3", "local_epochs=1", "eval_personal=false", "executor=sequential"]


def planned_steps(sim: Simulation, cid: int) -> int:
    return sim.cfg.local_epochs * (len(sim.rows[cid]) // sim.cfg.batch_size)


def test_a_late_client_is_dropped_keeps_its_state_and_the_round_waits_until_the_deadline():
    """Half the clients 4x slower and a deadline of 40 steps: FedAvg equals, bit for bit,
    FedAvg whose schedule holds the clients with ``K_i / s_i <= 40``; the others are
    recorded as lost and as stragglers (planned ``K_i``, done 0), the round lasts the
    deadline when a client is late and its slowest reply otherwise; with speed_jitter a
    client is late in some rounds only, and SCAFFOLD's clients keep their control
    variates through the rounds they miss."""
    settings = [*DIGITS, "client_speed=slow:0.5,4", "round_deadline=40"]
    sim = Simulation(prepare(load_config(None, settings)))
    sim.run()
    late = {cid for cid in range(6) if planned_steps(sim, cid) / sim.speeds[cid] > 40}
    assert late and len(late) < 6
    for row in sim.history:
        assert {x["client"] for x in row["lost"]} == late
        assert {x["reason"] for x in row["lost"]} == {"straggler: missed round_deadline=40"}
        assert row["stragglers"] == [
            {"client": c, "speed": 0.25, "planned": planned_steps(sim, c), "done": 0} for c in sorted(late)
        ]
        assert row["round_time"] == 40
    assert sim.summary("completed", 1.0)["straggler_replies"] == {"dropped": 3 * len(late), "partial": 0}

    replay = Simulation(prepare(load_config(None, DIGITS)))
    replay.schedule = [[c for c in clients if c not in late] for clients in sim.schedule]
    replay.run()
    for k, v in sim.server.model.items():
        assert torch.equal(v, replay.server.model[k]), k
    assert [r["test_acc"] for r in replay.history] == [r["test_acc"] for r in sim.history]
    assert "round_time" not in replay.history[0]

    on_time = Simulation(prepare(load_config(None, [*DIGITS, "client_speed=slow:0.5,4", "round_deadline=1000"])))
    on_time.run()
    slowest = max(planned_steps(on_time, c) / on_time.speeds[c] for c in range(6))
    assert [r["round_time"] for r in on_time.history] == [pytest.approx(slowest)] * 3
    assert "lost" not in on_time.history[0] and "stragglers" not in on_time.history[0]

    jittery = ["algorithm=scaffold", *DIGITS, "rounds=6", "speed_jitter=1", "round_deadline=12"]
    scaffold = Simulation(prepare(load_config(None, jittery)))
    late = lambda t: {c for c in range(6) if planned_steps(scaffold, c) / scaffold.speed(c, t) > 12}  # noqa: E731
    assert missing_clients_keep_state(scaffold, 6, late)  # a client that had trained was late later


def test_partial_work_is_the_first_steps_a_straggler_finished():
    """FedProx with 2 local epochs of 42 steps and a deadline of 42 steps at speed 1 keeps
    each client's first epoch: bit for bit the run with 1 local epoch; and with
    lognormal speeds each client does min(K_i, floor(42 * s_i)) steps."""
    common = ["algorithm=fedprox", "partition=iid", "num_clients=2", "rounds=2", "eval_personal=false", "executor=sequential"]
    cut = Simulation(prepare(load_config(None, [*common, "local_epochs=2", "round_deadline=42", "stragglers=partial"])))
    cut.run()
    assert [planned_steps(cut, c) for c in range(2)] == [84, 84]
    one_epoch = Simulation(prepare(load_config(None, [*common, "local_epochs=1"])))
    one_epoch.run()
    for k, v in cut.server.model.items():
        assert torch.equal(v, one_epoch.server.model[k]), k
    assert [r["train_loss"] for r in cut.history] == [r["train_loss"] for r in one_epoch.history]
    assert cut.history[0]["stragglers"] == [{"client": c, "speed": 1.0, "planned": 84, "done": 42} for c in range(2)]
    assert "lost" not in cut.history[0]

    spread = Simulation(prepare(load_config(None, [*common, "num_clients=6", "partition=dirichlet", "local_epochs=1",
                                                    "client_speed=lognormal:1", "round_deadline=20", "stragglers=partial"])))
    spread.run()
    expected = [min(planned_steps(spread, c), step_budget(20, spread.speeds[c])) for c in range(6)]
    assert any(e < planned_steps(spread, c) for c, e in enumerate(expected))
    assert spread.history[0]["local_steps"] == sum(e for e in expected if e > 0)
    zero = {c for c, e in enumerate(expected) if e == 0}  # nothing done by the deadline: dropped
    assert {x["client"] for x in spread.history[0].get("lost", [])} == zero


def test_straggler_settings_are_checked_with_one_line_errors():
    with pytest.raises(ConfigError, match=r"client_speed='lognormal'.*lognormal takes 1 number"):
        load_config(None, ["client_speed=lognormal"])
    with pytest.raises(ConfigError, match=r"round_deadline='-1' is invalid: expected > 0"):
        load_config(None, ["round_deadline=-1"])
    with pytest.raises(ConfigError, match="stragglers=partial .* round_deadline, which is not set"):
        prepare(load_config(None, ["algorithm=fedprox", "stragglers=partial"]))
    with pytest.raises(ConfigError, match="stragglers=partial but moon counts only complete local work .*: fedprox"):
        prepare(load_config(None, ["algorithm=moon", "round_deadline=5", "stragglers=partial"]))
    assert load_config(None, ["client_speed=Uniform: 0.2, 1"]).client_speed == "uniform:0.2,1"


def test_the_straggler_settings_at_their_defaults_leave_the_fingerprint_as_it_was():
    from contrafl.config import fingerprint

    plain = load_config(None, ["rounds=3"])
    assert fingerprint(load_config(None, ["rounds=3", "client_speed=constant", "stragglers=drop"])) == fingerprint(plain)
    assert fingerprint(load_config(None, ["rounds=3", "round_deadline=5"])) != fingerprint(plain)


@pytest.mark.slow
def test_a_run_with_stragglers_killed_in_a_round_resumes_exactly(tmp_path):
    settings = ["algorithm=scaffold", *SETTINGS, "client_speed=lognormal:1", "speed_jitter=0.5", "round_deadline=60"]
    clean = _uninterrupted(tmp_path, settings)
    rows = [json.loads(line) for line in clean.decode().splitlines()]
    assert any("stragglers" in row for row in rows) and all("round_time" in row for row in rows)
    run = tmp_path / "run"
    _killed_run(run, "round", CLIENTS + 1, settings)
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean
