"""client_dropout: sampled clients that do not reply in a round, drawn from the run's
seed; they train nothing, keep their state, and metrics.jsonl records them as lost, as a
Flower deployment records the clients it loses."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import missing_clients_keep_state, simulate
from contrafl.cli import main
from contrafl.config import load_config
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.errors import ConfigError
from test_resume import CLIENTS, SETTINGS, _killed_run, _uninterrupted

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_sampled_client_drops_out_with_the_configured_probability_from_the_seed():
    """2,000 draws at p=0.3 (a fixed seed): the share that drops out is within 5 standard
    deviations of 0.3; the same seed and round give the same clients, another seed others."""
    sims = [Simulation(prepare(load_config(None, ["num_clients=10", "client_dropout=0.3", f"seed={s}"]))) for s in (0, 0, 1)]
    rounds = range(200)
    drawn = [[sim.dropped_out(t, list(range(10))) for t in rounds] for sim in sims]
    share = sum(len(d) for d in drawn[0]) / 2000
    assert abs(share - 0.3) < 5 * (0.3 * 0.7 / 2000) ** 0.5
    assert drawn[0] == drawn[1] and drawn[0] != drawn[2]
    assert Simulation(prepare(load_config(None, ["num_clients=10"]))).dropped_out(0, list(range(10))) == set()


def test_the_round_aggregates_the_clients_that_reply_and_records_the_others_as_lost():
    """FedAvg with client_dropout=0.5 equals, bit for bit, FedAvg whose schedule holds
    only the clients that replied; the others are lost with the reason, and SCAFFOLD's
    dropped clients keep their control variates as they were."""
    settings = ["num_clients=6", "rounds=4", "local_epochs=1", "eval_personal=false", "executor=sequential"]
    dropping = simulate(*settings, "client_dropout=0.5")
    lost = [{x["client"] for x in row.get("lost", [])} for row in dropping.history]
    assert any(lost) and all(len(s) < 6 for s in lost)
    for t, row in enumerate(dropping.history):
        assert lost[t] == dropping.dropped_out(t, row["clients"])
        assert all(x["reason"] == "dropped out (client_dropout=0.5)" for x in row.get("lost", []))

    replay = Simulation(prepare(load_config(None, [*settings, "client_dropout=0"])))
    replay.schedule = [[c for c in row["clients"] if c not in lost[t]] for t, row in enumerate(dropping.history)]
    replay.run()
    for k, v in dropping.server.model.items():
        assert torch.equal(v, replay.server.model[k]), k
    assert [r["test_acc"] for r in replay.history] == [r["test_acc"] for r in dropping.history]
    assert [r["local_steps"] for r in replay.history] == [r["local_steps"] for r in dropping.history]

    sim = Simulation(prepare(load_config(None, ["algorithm=scaffold", *settings, "client_dropout=0.5"])))
    assert missing_clients_keep_state(sim, 4, lambda t: sim.dropped_out(t, sim.schedule[t]))  # a client that had trained dropped out later


def test_a_dropout_of_one_is_a_one_line_error():
    with pytest.raises(ConfigError, match="client_dropout"):
        load_config(None, ["client_dropout=1"])


@pytest.mark.slow
def test_a_run_with_dropout_killed_in_a_round_resumes_exactly(tmp_path):
    settings = ["algorithm=scaffold", *SETTINGS, "client_dropout=0.4"]
    clean = _uninterrupted(tmp_path, settings)
    assert any("lost" in json.loads(line) for line in clean.decode().splitlines())
    run = tmp_path / "run"
    _killed_run(run, "round", CLIENTS + 1, settings)  # in round 2 or 3, whatever dropped out
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean
