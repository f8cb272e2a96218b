"""Client-level differential privacy: ``dp=central`` (the server clips and adds one
Gaussian draw to the sum of the updates) and ``dp=local`` (each client clips and adds its
own noise), with epsilon from dp-accounting's RDP accountant."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from dp_accounting import dp_event, privacy_accountant
from dp_accounting.rdp import RdpAccountant

from contrafl.algorithms.base import Reply
from contrafl.cli import main
from contrafl.config import fingerprint, load_config
from contrafl.engine.privacy import add_noise, clip, is_label_table, protect_labels, updates
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.errors import ConfigError
from test_resume import CLIENTS, SETTINGS, _killed_run, _uninterrupted

pytestmark = pytest.mark.usefixtures("one_thread")

DIGITS = ["num_clients=6", "rounds=2", "local_epochs=1", "eval_personal=false", "executor=sequential"]


def norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def test_the_update_is_every_float_tensor_against_the_message_and_clipping_bounds_its_norm():
    """The update of a payload is its float tensors minus the message's (the tensor itself
    where the message has none; integer tensors left alone); clipping scales it to norm C
    when longer and leaves it as it is when shorter."""
    g = torch.Generator().manual_seed(0)
    message = {"model": {"w": torch.randn(5, 3, generator=g), "n": torch.tensor(4)}}
    payload = {"model": {"w": torch.randn(5, 3, generator=g), "n": torch.tensor(9)}, "delta_c": {"w": torch.randn(5, 3, generator=g)}}
    u = updates(payload, message)
    assert len(u) == 2 and torch.equal(u[0], payload["model"]["w"] - message["model"]["w"]) and torch.equal(u[1], payload["delta_c"]["w"])
    before = norm(u)
    for bound in (0.1, 1.0, before / 2):
        clipped, measured = clip(payload, message, bound)
        assert measured == pytest.approx(before)
        assert norm(updates(clipped, message)) == pytest.approx(bound, rel=1e-6)
        assert torch.equal(clipped["model"]["n"], payload["model"]["n"])
        direction = updates(clipped, message)[0] / bound
        assert torch.allclose(direction, u[0] / before, atol=1e-6)  # scaled, not turned
    same, _ = clip(payload, message, before * 2)
    assert same is payload
    noisy = add_noise(payload, message, [torch.ones(5, 3), torch.zeros(5, 3)])
    assert torch.allclose(noisy["model"]["w"], payload["model"]["w"] + 1) and torch.equal(noisy["delta_c"]["w"], payload["delta_c"]["w"])


def still(sim: Simulation, cid: int) -> Reply:
    """A reply whose update is 0: the client sends back the broadcast model."""
    return Reply(cid, 37, {"model": {k: v.clone() for k, v in sim.server.model.items()}})


def test_central_noise_has_scale_z_c_over_m_and_is_one_draw_for_every_reply():
    """Three replies with no update: after central DP each carries the same draw xi, and
    xi's standard deviation over the model's coordinates is z * C / 3 (within 5 standard
    errors); every reply counts as one sample."""
    sim = Simulation(prepare(load_config(None, [*DIGITS, "dp=central", "dp.clip=2", "dp.noise_multiplier=1.5"])))
    message = sim.algorithm.broadcast(sim.server, 0)
    replies, clipped = sim.privacy.central([still(sim, c) for c in (1, 2, 4)], {c: message for c in (1, 2, 4)}, 0)
    assert clipped == 0 and [r.num_samples for r in replies] == [1, 1, 1]
    noise = [torch.cat([u.flatten() for u in updates(r.payload, message)]) for r in replies]
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[0], noise[2])
    n = noise[0].numel()
    assert n > 5000
    assert float(noise[0].mean()) == pytest.approx(0, abs=5 * 1.0 / math.sqrt(n))
    assert float(noise[0].std()) == pytest.approx(1.5 * 2 / 3, rel=5 / math.sqrt(2 * n))
    again, _ = sim.privacy.central([still(sim, c) for c in (1, 2, 4)], {c: message for c in (1, 2, 4)}, 0)
    assert torch.equal(updates(again[0].payload, message)[0], updates(replies[0].payload, message)[0])  # from the seed
    other, _ = sim.privacy.central([still(sim, c) for c in (1, 2, 4)], {c: message for c in (1, 2, 4)}, 1)
    assert not torch.equal(updates(other[0].payload, message)[0], updates(replies[0].payload, message)[0])


def test_local_noise_has_scale_z_c_and_differs_between_clients():
    sim = Simulation(prepare(load_config(None, [*DIGITS, "dp=local", "dp.clip=0.5", "dp.noise_multiplier=2"])))
    message = sim.algorithm.broadcast(sim.server, 0)
    a, b = (sim.privacy.privatize(still(sim, c), message, 0) for c in (1, 2))
    assert a.num_samples == b.num_samples == 1
    xa, xb = (torch.cat([u.flatten() for u in updates(r.payload, message)]) for r in (a, b))
    assert float(xa.std()) == pytest.approx(1.0, rel=5 / math.sqrt(2 * xa.numel()))
    assert not torch.equal(xa, xb)


def test_without_noise_central_dp_is_the_equal_weight_mean_of_the_clipped_updates():
    """dp=central with z=0: a clip far above every update gives the mean of the clients'
    local models with equal weights; a clip of 0.05 moves the global model by the mean
    of the clipped updates, whose norm is at most 0.05."""
    big = Simulation(prepare(load_config(None, [*DIGITS, "dp=central", "dp.clip=1e6", "dp.noise_multiplier=0"])))
    start = {k: v.clone() for k, v in big.server.model.items()}
    local = big.local_models(big.schedule[0])
    big.run_round(0)
    for k, v in big.server.model.items():
        expected = sum(local[c][k] for c in big.schedule[0]) / len(big.schedule[0])
        assert torch.allclose(v, expected, atol=1e-6), k
    small = Simulation(prepare(load_config(None, [*DIGITS, "dp=central", "dp.clip=0.05", "dp.noise_multiplier=0"])))
    row = small.run_round(0)
    assert row["dp_clipped"] == 6
    moved = norm([small.server.model[k] - start[k] for k in start if start[k].is_floating_point()])
    assert 0 < moved <= 0.05 + 1e-6
    assert row["dp_epsilon"] is None  # no noise, no guarantee


def library_epsilon(event, relation: str, count: int, delta: float) -> float:
    accountant = RdpAccountant(neighboring_relation=getattr(privacy_accountant.NeighboringRelation, relation))
    accountant.compose(event, count)
    return accountant.get_epsilon(delta)


def test_epsilon_is_the_rdp_accountants_after_every_round():
    """Central DP, 3 of 6 clients per round: epsilon after round t equals dp-accounting's
    for t sampled-without-replacement Gaussian releases (replace-one, z / 2); with every
    client it is t Gaussian releases of z (add-or-remove-one); local DP reports the client
    that replied most often, each reply a Gaussian release of z / 2."""
    sampled = Simulation(prepare(load_config(None, [*DIGITS, "rounds=3", "sample_fraction=0.5", "dp=central", "dp.noise_multiplier=1.1", "dp.clip=0.01"])))
    summary = sampled.run()
    event = dp_event.SampledWithoutReplacementDpEvent(6, 3, dp_event.GaussianDpEvent(0.55))
    assert [r["dp_epsilon"] for r in sampled.history] == [library_epsilon(event, "REPLACE_ONE", t, 1e-5) for t in (1, 2, 3)]
    assert summary["dp"] == {"mode": "central", "epsilon": sampled.history[-1]["dp_epsilon"], "delta": 1e-5, "releases": 3, "neighbouring": "replace_one"}

    full = Simulation(prepare(load_config(None, [*DIGITS, "dp=central", "dp.noise_multiplier=1.1", "dp.clip=0.01", "dp.delta=1e-3"])))
    full.run()
    assert full.history[-1]["dp_epsilon"] == library_epsilon(dp_event.GaussianDpEvent(1.1), "ADD_OR_REMOVE_ONE", 2, 1e-3)

    local = Simulation(prepare(load_config(None, [*DIGITS, "rounds=3", "sample_fraction=0.5", "dp=local", "dp.noise_multiplier=3", "dp.clip=0.003"])))
    local.run()
    most = max(sum(c in row["clients"] for row in local.history) for c in range(6))
    assert local.history[-1]["dp_releases"] == most
    assert local.history[-1]["dp_epsilon"] == library_epsilon(dp_event.GaussianDpEvent(1.5), "REPLACE_ONE", most, 1e-5)


def test_dp_settings_and_algorithms_that_cannot_take_them_give_one_line_errors():
    with pytest.raises(ConfigError, match=r"dp='centrl' is invalid: expected one of none, central, local \(did you mean 'central'\?\)"):
        prepare(load_config(None, ["dp=centrl"]))
    with pytest.raises(ConfigError, match="dp.clip is set but dp=none; add dp=central"):
        prepare(load_config(None, ["dp.clip=1"]))
    with pytest.raises(ConfigError, match=r"dp.noise_multiplier='-1' is invalid: expected >= 0"):
        prepare(load_config(None, ["dp=local", "dp.noise_multiplier=-1"]))
    with pytest.raises(ConfigError, match="dp=central needs a server that aggregates the sum of the updates, but FedAMP's server keeps"):
        prepare(load_config(None, ["algorithm=fedamp", "dp=central"]))
    with pytest.raises(ConfigError, match="FedSiam-DA's server weighs each model .*aggregation=fedavg averages instead"):
        prepare(load_config(None, ["algorithm=fedsiam_da", "dp=central"]))
    with pytest.raises(ConfigError, match="solo's clients send nothing; leave dp unset"):
        prepare(load_config(None, ["algorithm=solo", "dp=local"]))
    assert prepare(load_config(None, ["algorithm=fedsiam_da", "algorithm.aggregation=fedavg", "dp=central"])).config.dp.name == "central"
    assert prepare(load_config(None, ["algorithm=fedamp", "dp=local"])).config.dp.name == "local"
    plain = load_config(None, ["rounds=3"])
    assert fingerprint(load_config(None, ["rounds=3", "dp=none"])) == fingerprint(plain)
    assert fingerprint(load_config(None, ["rounds=3", "dp=local"])) != fingerprint(plain)


@pytest.mark.slow
def test_a_run_with_local_dp_killed_in_a_round_resumes_exactly(tmp_path):
    settings = ["algorithm=scaffold", *SETTINGS, "sample_fraction=0.5", "dp=local", "dp.clip=5", "dp.noise_multiplier=0.01"]
    clean = _uninterrupted(tmp_path, settings)
    rows = [json.loads(line) for line in clean.decode().splitlines()]
    assert [r["dp_epsilon"] is not None for r in rows] == [True] * 4
    run = tmp_path / "run"
    _killed_run(run, "round", CLIENTS + 1, settings)
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean


def test_without_dp_accounting_the_server_stops_at_once_and_a_client_needs_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # as if not installed
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *DIGITS, "dp=local"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['contrafl: error: dp needs the dp-accounting package for its privacy accountant; pip install "contrafl[privacy]"']
    assert not (tmp_path / "run").exists()
    client = Simulation(prepare(load_config(None, [*DIGITS, "dp=local"])))  # a SuperNode's side of the run
    outcome = next(iter(client.train_locally(0, [3], lambda cid: client.algorithm.broadcast(client.server, 0), client.algorithm.phases(0))))
    assert outcome.reply.num_samples == 1


def test_label_tables_have_their_rows_clipped_and_can_hide_which_labels_a_client_holds():
    reps = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.3, 0.4]])
    payload = {"body": {"w": torch.ones(2)}, "prototypes": {"reps": reps, "counts": torch.tensor([7, 0, 2])}}
    assert is_label_table(payload["prototypes"]) and not is_label_table(payload) and is_label_table({"reps": reps, "mask": torch.tensor([True, False, True])})
    out = protect_labels(payload, 1.0, hide=True)
    assert torch.allclose(out["prototypes"]["reps"], torch.tensor([[0.6, 0.8], [0.0, 0.0], [0.3, 0.4]]))
    assert torch.equal(out["prototypes"]["counts"], torch.ones(3, dtype=torch.long)) and out["body"]["w"] is payload["body"]["w"]
    clear = protect_labels(payload, None, hide=False)
    assert torch.equal(clear["prototypes"]["reps"], reps) and torch.equal(clear["prototypes"]["counts"], payload["prototypes"]["counts"])
    masked = protect_labels({"class_reps": {"reps": reps, "mask": torch.tensor([True, False, True])}}, None, hide=True)
    assert bool(masked["class_reps"]["mask"].all())


def test_fedcrl_under_local_dp_sends_every_label_and_its_clipped_representation():
    """FedCRL with dp=local, labels hidden and rows clipped to 0.5 (no noise, a loose update
    clip): every label gets a global representation (every client sends every row) whose
    norm is at most 0.5, the mean of the clipped rows, zeros of absent labels included."""
    settings = ["algorithm=fedcrl", "num_clients=4", "rounds=1", "local_epochs=1", "partition=pathological", "partition.classes_per_client=2", "partition.uncovered=drop"]
    sim = Simulation(prepare(load_config(None, [*settings, "dp=local", "dp.noise_multiplier=0", "dp.clip=1e6", "dp.rep_clip=0.5"])))
    sim.run_round(0)
    protos = sim.server.extras["prototypes"]
    assert bool(protos["mask"].all())
    assert float(protos["reps"].norm(dim=1).max()) <= 0.5 + 1e-6
    plain = Simulation(prepare(load_config(None, settings)))
    plain.run_round(0)
    assert not bool(plain.server.extras["prototypes"]["mask"].all())  # 4 clients of 2 classes each do not hold all 10


def test_noise_too_large_for_the_model_stops_the_run_with_one_line_that_names_it(tmp_path, capsys):
    """README's warning: central noise of z C / m = 0.1 per weight on digits' model makes
    training diverge; the run stops at the first non-finite update (exit status 3) with
    one line that points at the DP noise, and keeps the rounds done."""
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), "dp=central", "dp.clip=1", "dp.noise_multiplier=1"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-finite values" in err[0] and "or the DP noise (dp.noise_multiplier, dp.clip)" in err[0]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds_completed"] >= 1
