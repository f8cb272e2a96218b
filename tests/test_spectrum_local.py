"""``contrafl eval-repr --protocol spectrum`` with local models (FedU2's Figure 3, right)
and :meth:`Simulation.local_models`, which trains them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from contrafl.cli import main
from contrafl.config import load_config
from contrafl.engine.run_dir import RunDir
from contrafl.engine.setup import prepare
from contrafl.engine.resume import load_checkpoint, read_only
from contrafl.engine.simulation import Simulation
from contrafl.experiments.probe import client_ids, effective_rank

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["rounds=2", "local_epochs=1", "eval_personal=false", "executor=sequential", "batch_size=32"]
# MOON keeps state on its clients (its previous local models), which local training reads
MOON = ["algorithm=moon", "num_clients=3", "model.projection_dim=16", *TINY]


def _files(run) -> dict[str, bytes]:
    """Every file of a run directory but the evaluation outputs, with its bytes."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and "representation" not in p.parts
    }


@pytest.fixture(scope="module")
def moon_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("spectrum") / "moon"
    assert main(["run", "--quiet", "--out", str(out), *MOON]) == 0
    return out


def _spectrum(run, *args: str) -> dict:
    assert main(["eval-repr", str(run), "--protocol", "spectrum", *args]) == 0
    return json.loads((run / "representation" / "spectrum.json").read_text())


def test_local_spectra_of_the_requested_clients_leave_the_run_unchanged(moon_run, capsys):
    assert any((moon_run / "client-state").iterdir())  # the clients' MOON histories are read
    before = _files(moon_run)
    result = _spectrum(moon_run, "--clients", "2,0")
    assert _files(moon_run) == before  # metrics.jsonl, checkpoint.pt, client-state/, ...: byte-identical
    assert set(result["local"]) == {"0", "2"} and result["local_from_round"] == result["round"] == 2
    glob = torch.tensor(result["singular_values"])
    for record in result["local"].values():
        local = torch.tensor(record["singular_values"])
        assert local.shape == glob.shape and (local[:-1] >= local[1:]).all()
        assert (local - glob).abs().max() > 1e-4 * glob[0]  # local training moved the model
        assert record["effective_rank"] == pytest.approx(effective_rank(local))
    assert result["local"]["0"]["singular_values"] != result["local"]["2"]["singular_values"]
    assert (moon_run / "representation" / "spectrum.png").is_file()
    out = capsys.readouterr().out
    assert "local models of 2 clients" in out and "effective rank" in out


def test_local_spectra_are_deterministic_and_optional(moon_run):
    first = _spectrum(moon_run, "--clients", "all")
    second = _spectrum(moon_run, "--clients", "all")
    assert set(first["local"]) == {"0", "1", "2"}
    assert first["local"] == second["local"]
    global_only = _spectrum(moon_run, "--no-local")
    assert "local" not in global_only and "local_from_round" not in global_only
    assert global_only["singular_values"] == first["singular_values"]


@pytest.mark.parametrize("value", ["3", "-1", "a", "0,,1", "", "1.5"])
def test_bad_clients_are_a_one_line_error(moon_run, capsys, value):
    assert main(["eval-repr", str(moon_run), "--protocol", "spectrum", "--clients", value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert repr(value) in err and "0..2" in err


def test_default_clients():
    assert client_ids(None, 4) == [0, 1, 2, 3]
    assert client_ids(None, 100) == list(range(10))
    assert client_ids("all", 12) == list(range(12))
    assert client_ids(" 5, 1,5", 12) == [1, 5]
    assert client_ids([3, 0], 4) == [0, 3]


def test_effective_rank():
    assert effective_rank(torch.ones(7)) == pytest.approx(7)
    assert effective_rank(torch.tensor([3.0, 0.0, 0.0])) == pytest.approx(1)
    assert effective_rank(torch.tensor([1.0, 1.0, 0.0, 0.0])) == pytest.approx(2)
    p = torch.tensor([0.5, 0.25, 0.25])
    assert effective_rank(2 * p) == pytest.approx(math.exp(-(p * p.log()).sum().item()))
    assert effective_rank(torch.zeros(3)) == 0


def test_spectrum_of_a_supervised_run_with_split_models(tmp_path):
    """FedRep trains its model as ``body`` and ``head`` (no ``model`` role): the local
    model is their union; 12 clients: the default is the first 10."""
    out = tmp_path / "fedrep"
    assert main(["run", "--quiet", "--out", str(out), "algorithm=fedrep", "num_clients=12", "rounds=1", "drop_last=false", *TINY[1:]]) == 0
    result = _spectrum(out)
    assert list(result["local"]) == [str(c) for c in range(10)]
    assert all(r["singular_values"] != result["singular_values"] for r in result["local"].values())


def _simulation(*overrides: str) -> Simulation:
    return Simulation(prepare(load_config(None, [*MOON, *overrides])))


def _capture_replies(sim: Simulation) -> dict[int, dict[str, torch.Tensor]]:
    """The model each client sends in the simulation's rounds (MOON replies with the
    trained ``model`` role), recorded by wrapping the algorithm's ``client_end``."""
    sent: dict[int, dict[str, torch.Tensor]] = {}
    client_end = sim.algorithm.client_end

    def recording(task, result, state, ctx):
        reply, new_state = client_end(task, result, state, ctx)
        sent[ctx.cid] = reply.payload["model"]
        return reply, new_state

    sim.algorithm.client_end = recording
    return sent


# momentum with persisted optimiser state: the executor updates the stored state in place
STATEFUL = ["momentum=0.9", "persist_optimizer_state=true"]


def test_local_models_are_what_the_round_trains_and_change_nothing():
    """Two identical simulations run round 1; before it, one of them computes the local
    models of round 1 with :meth:`local_models`. Those must equal the models the clients
    send in that simulation's round 1 (captured from ``client_end``: MOON's reply is the
    trained model, ``model_state``), and round 1 must end with the same server model and
    metrics in both simulations, with client state (MOON's history, momentum) that round
    0 left in the store."""
    probed, plain = _simulation(*STATEFUL), _simulation(*STATEFUL)
    for sim in (probed, plain):
        sim.run_round(0)
        sim.rounds_done = 1
    assert probed.store.get(1)["optimizer"] is not None
    local = probed.local_models([1, 2])
    assert set(local) == {1, 2} and probed.rounds_done == 1
    sent = _capture_replies(probed)
    rows = [sim.run_round(1) for sim in (probed, plain)]
    assert rows[0] == rows[1]
    for k, v in plain.server.model.items():
        assert torch.equal(probed.server.model[k], v), k
    for cid in (1, 2):
        assert local[cid].keys() == sent[cid].keys()
        for k, v in sent[cid].items():
            assert torch.equal(local[cid][k], v), (cid, k)
    assert not all(torch.equal(local[1][k], v) for k, v in local[2].items())


def test_read_only_simulation_continues_like_the_run(tmp_path):
    """The simulation :func:`read_only` rebuilds from a run directory's checkpoint (and
    the client states it names) trains the same local models as the simulation that
    wrote the checkpoint, which still holds its clients' states in memory."""
    setup = prepare(load_config(None, [*MOON, *STATEFUL]))
    path = tmp_path / "run"
    sim = Simulation(setup, RunDir(path))
    sim.run()
    expected = sim.local_models([0, 2])
    before = _files(path)
    again = read_only(prepare(load_config(path / "config.yaml")), path, load_checkpoint(path), [0, 2])
    try:
        local = again.local_models([0, 2])
    finally:
        again.store.close()
    assert _files(path) == before
    for cid in (0, 2):
        for k, v in expected[cid].items():
            assert torch.equal(local[cid][k], v), (cid, k)
