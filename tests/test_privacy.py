"""Client-level differential privacy: ``dp=central`` (the server clips and adds one
Gaussian draw to the sum of the updates) and ``dp=local`` (each client clips and adds its
own noise), with secret noise by default, the server's checks of local replies, the
ledger of releases and epsilon from dp-accounting's RDP accountant."""

from __future__ import annotations

import json
import math
import random
import sys

import pytest
import torch
from dp_accounting import dp_event, privacy_accountant
from dp_accounting.rdp import RdpAccountant

from contrafl.algorithms.base import Reply
from contrafl.cli import main
from contrafl.config import fingerprint, load_config
from contrafl.engine.checkpoint import history_rows
from contrafl.engine.privacy import (
    LEDGER, Accountant, Privacy, add_noise, clip, gaussian, is_label_table, protect_labels, secret_normal, updates, vector_norm,
)
from contrafl.engine.run_dir import RunDir
from contrafl.engine.sampling import sample_schedule, secret_sample
from contrafl.engine.setup import prepare
from contrafl.engine.resume import resume
from contrafl.engine.simulation import Simulation
from contrafl.execution.validate import check_reply, update_norm
from contrafl.errors import CheckpointError, ConfigError
from contrafl.rng import generator
from test_resume import CLIENTS, SETTINGS, _killed_run, _uninterrupted

pytestmark = pytest.mark.usefixtures("one_thread")

DIGITS = ["num_clients=6", "rounds=2", "local_epochs=1", "eval_personal=false", "executor=sequential"]


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten().double() for t in tensors])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_the_update_is_every_float_tensor_against_the_message_and_clipping_bounds_its_norm():
    """The update of a payload is its float tensors minus the message's (the tensor itself
    where the message has none; integer tensors left alone); clipping scales it to norm C
    when longer and leaves it as it is when shorter."""
    g = torch.Generator().manual_seed(0)
    message = {"model": {"w": torch.randn(5, 3, generator=g), "n": torch.tensor(4)}}
    payload = {"model": {"w": torch.randn(5, 3, generator=g), "n": torch.tensor(9)}, "delta_c": {"w": torch.randn(5, 3, generator=g)}}
    u = updates(payload, message)
    assert len(u) == 2 and torch.equal(u[0], payload["model"]["w"] - message["model"]["w"]) and torch.equal(u[1], payload["delta_c"]["w"])
    before = vector_norm(u)
    for bound in (0.1, 1.0, before / 2):
        clipped, measured = clip(payload, message, bound)
        assert measured == pytest.approx(before)
        assert vector_norm(updates(clipped, message)) == pytest.approx(bound, rel=1e-6)
        assert torch.equal(clipped["model"]["n"], payload["model"]["n"])
        direction = updates(clipped, message)[0] / bound
        assert torch.allclose(direction, u[0] / before, atol=1e-6)  # scaled, not turned
    same, _ = clip(payload, message, before * 2)
    assert same is payload
    noisy = add_noise(payload, message, [torch.ones(5, 3), torch.zeros(5, 3)])
    assert torch.allclose(noisy["model"]["w"], payload["model"]["w"] + 1) and torch.equal(noisy["delta_c"]["w"], payload["delta_c"]["w"])


def test_tensors_in_lists_and_tuples_are_clipped_and_noised_like_those_of_mappings():
    """A reply whose tensors sit in a list and a tuple: each is part of the update (against
    the message's tensor at the same position), clipping scales them all, the noise
    reaches them all, and the server's norm check measures them too."""
    g = torch.Generator().manual_seed(1)
    message = {"model": {"w": torch.randn(4, generator=g)}, "parts": [torch.randn(3, generator=g), (torch.randn(2, generator=g),)]}
    payload = {"model": {"w": torch.randn(4, generator=g)}, "parts": [torch.randn(3, generator=g), (torch.randn(2, generator=g), torch.tensor(7))]}
    u = updates(payload, message)
    assert len(u) == 3 and torch.equal(u[1], payload["parts"][0] - message["parts"][0]) and torch.equal(u[2], payload["parts"][1][0])
    assert update_norm(payload, message) == pytest.approx(vector_norm(u))
    clipped, before = clip(payload, message, 0.1)
    assert isinstance(clipped["parts"], list) and isinstance(clipped["parts"][1], tuple) and torch.equal(clipped["parts"][1][1], torch.tensor(7))
    assert vector_norm(updates(clipped, message)) == pytest.approx(0.1, rel=1e-6) and before > 0.1
    noisy = add_noise(clipped, message, [torch.full_like(x, 5.0) for x in u])
    assert all(torch.allclose(a, b + 5) for a, b in zip(updates(noisy, message), updates(clipped, message)))


def still(sim: Simulation, cid: int) -> Reply:
    """A reply whose update is 0: the client sends back the broadcast model."""
    return Reply(cid, 37, {"model": {k: v.clone() for k, v in sim.server.model.items()}})


def central_noise(sim: Simulation, t: int) -> list[torch.Tensor]:
    message = sim.algorithm.broadcast(sim.server, 0)
    replies, clipped = sim.privacy.central([still(sim, c) for c in (1, 2, 4)], {c: message for c in (1, 2, 4)}, t)
    assert clipped == 0 and [r.num_samples for r in replies] == [1, 1, 1]
    return [flat(updates(r.payload, message)) for r in replies]


def test_central_noise_has_scale_z_c_over_m_is_one_draw_for_every_reply_and_is_secret():
    """Three replies with no update: after central DP each carries the same draw xi, whose
    standard deviation over the model's coordinates is z * C / 3 (within 5 standard
    errors); every reply counts as one sample. By default the draw is secret: the same
    round again gives another one. With dp.noise=reproducible it is the stream
    (seed, "dp", round)'s."""
    sim = Simulation(prepare(load_config(None, [*DIGITS, "dp=central", "dp.clip=2", "dp.noise_multiplier=1.5"])))
    noise = central_noise(sim, 0)
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[0], noise[2])
    n = noise[0].numel()
    assert n > 5000
    assert float(noise[0].mean()) == pytest.approx(0, abs=5 * 1.0 / math.sqrt(n))
    assert float(noise[0].std()) == pytest.approx(1.5 * 2 / 3, rel=5 / math.sqrt(2 * n))
    assert not torch.equal(central_noise(sim, 0)[0], noise[0])  # secret: not a function of the round

    seeded = Simulation(prepare(load_config(None, [*DIGITS, "dp=central", "dp.clip=2", "dp.noise_multiplier=1.5", "dp.noise=reproducible"])))
    first = central_noise(seeded, 0)[0]
    assert torch.equal(central_noise(seeded, 0)[0], first) and not torch.equal(central_noise(seeded, 1)[0], first)
    shapes = updates(seeded.algorithm.broadcast(seeded.server, 0), {})
    assert torch.allclose(first, flat(gaussian(shapes, 1.0, generator(0, "dp", 0))), atol=1e-5)  # anyone with config.yaml regenerates it


def test_secret_noise_is_standard_normal_from_the_os_and_touches_no_seeded_stream():
    """secret_normal: mean 0, std 1, 95% within 1.96, kurtosis 3 (within 5 standard
    errors over 400,001 draws); draws after torch.manual_seed(0) differ from each other
    and leave torch's global generator where it was."""
    torch.manual_seed(0)
    state = torch.get_rng_state()
    z = secret_normal(400_001)
    assert torch.equal(torch.get_rng_state(), state)
    n = z.numel()
    assert n == 400_001 and z.dtype == torch.float64
    assert float(z.mean()) == pytest.approx(0, abs=5 / math.sqrt(n))
    assert float(z.std()) == pytest.approx(1, abs=5 / math.sqrt(2 * n))
    assert float((z.abs() < 1.959964).double().mean()) == pytest.approx(0.95, abs=5 * math.sqrt(0.95 * 0.05 / n))
    assert float(z.pow(4).mean()) == pytest.approx(3, abs=5 * math.sqrt(96 / n))
    torch.manual_seed(0)
    again = secret_normal(1000)
    assert not torch.equal(again, z[:1000]) and secret_normal(0).numel() == 0 and secret_normal(1).numel() == 1


def test_local_noise_has_scale_z_c_and_differs_between_clients():
    sim = Simulation(prepare(load_config(None, [*DIGITS, "dp=local", "dp.clip=0.5", "dp.noise_multiplier=2"])))
    message = sim.algorithm.broadcast(sim.server, 0)
    a, b = (sim.privacy.privatize(still(sim, c), message, 0) for c in (1, 2))
    assert a.num_samples == b.num_samples == 1
    xa, xb = (flat(updates(r.payload, message)) for r in (a, b))
    assert float(xa.std()) == pytest.approx(1.0, rel=5 / math.sqrt(2 * xa.numel()))
    assert not torch.equal(xa, xb)


def client_update(noise: str, z: float = 10.0, cid: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Client ``cid``'s round-1 update under dp=local with ``noise``: (its clipped update,
    what the server receives, the noise an attacker regenerates from config.yaml's seed,
    the seed)."""
    cfg = load_config(None, [*DIGITS, "dp=local", "dp.clip=0.5", f"dp.noise_multiplier={z}", f"dp.noise={noise}", "seed=11"])
    sim = Simulation(prepare(cfg))
    message = sim.algorithm.broadcast(sim.server, 0)
    sim.privacy = None  # the client's reply before local DP: what it must keep to itself
    plain = next(iter(sim.train_locally(0, [cid], lambda c: message, sim.algorithm.phases(0)))).reply
    truth = flat(updates(clip(plain.payload, message, 0.5)[0], message))
    sim.privacy = Privacy(sim.cfg)
    received = updates(sim.privacy.privatize(plain, message, 0).payload, message)
    regenerated = gaussian(received, z * 0.5, generator(cfg.seed, "dp", 0, cid))  # contrafl's own stream of the round
    return truth, flat(received), flat(regenerated), cfg.seed


def test_a_curious_server_cannot_subtract_secret_local_noise_but_can_subtract_reproducible_noise():
    """The server knows config.yaml (the seed) and the code: with dp.noise=reproducible it
    regenerates a client's noise and recovers its clipped update (cosine 1); with the
    default secret noise the same attack's cosine is that of independent noise, within 6
    standard deviations of 20 draws the attacker could equally have subtracted."""
    truth, received, regenerated, _ = client_update("reproducible")
    assert cosine(received - regenerated, truth) > 0.99999
    truth, received, regenerated, seed = client_update("secret")
    attack = cosine(received - regenerated, truth)
    g = torch.Generator().manual_seed(seed)
    independent = torch.tensor([cosine(received - 5.0 * torch.randn(received.shape, generator=g, dtype=torch.float64), truth) for _ in range(20)])
    assert abs(attack - float(independent.mean())) < 6 * float(independent.std()) + 1e-4
    assert abs(attack) < 0.05


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
    moved = vector_norm([small.server.model[k] - start[k] for k in start if start[k].is_floating_point()])
    assert 0 < moved <= 0.05 + 1e-6
    assert row["dp_epsilon"] is None  # no noise, no guarantee


def library_epsilon(event, relation: str, count: int, delta: float) -> float:
    accountant = RdpAccountant(neighboring_relation=getattr(privacy_accountant.NeighboringRelation, relation))
    accountant.compose(event, count)
    return accountant.get_epsilon(delta)


def most_rounds(history: list[dict], clients: int) -> int:
    return max(sum(c in row["clients"] for row in history) for c in range(clients))


def test_epsilon_is_the_rdp_accountants_for_full_participation_secret_and_public_samples_and_local_dp():
    """Epsilon after each round against dp-accounting, computed here from the rounds:
    every client every round, t Gaussian releases of z (add-or-remove-one); 3 of 6 clients
    drawn secretly, t sampled-without-replacement releases of z / 2 (replace-one); the
    same sample drawn from the seed (public: metrics.jsonl lists it), no amplification: a
    Gaussian release of z / 2 for each round the most sampled client took part in; local
    DP, the client that replied most often, a release of z / 2 per reply. (A secret
    sample's bound is also at most that of taking part in every round: the smaller
    counts.)"""
    common = [*DIGITS, "rounds=3", "dp.noise_multiplier=1.1", "dp.clip=0.01"]
    full = Simulation(prepare(load_config(None, [*common, "dp=central", "dp.delta=1e-3"])))
    full.run()
    assert [r["dp_epsilon"] for r in full.history] == [library_epsilon(dp_event.GaussianDpEvent(1.1), "ADD_OR_REMOVE_ONE", t, 1e-3) for t in (1, 2, 3)]
    assert full.privacy.summary()["sampling"] == "full" and full.privacy.summary()["neighbouring"] == "add_or_remove_one"

    secret = Simulation(prepare(load_config(None, [*common, "sample_fraction=0.5", "sampling=secret", "dp=central"])))
    summary = secret.run()
    event = dp_event.SampledWithoutReplacementDpEvent(6, 3, dp_event.GaussianDpEvent(0.55))
    assert [r["dp_epsilon"] for r in secret.history] == [
        min(library_epsilon(event, "REPLACE_ONE", t, 1e-5), library_epsilon(dp_event.GaussianDpEvent(0.55), "REPLACE_ONE", t, 1e-5)) for t in (1, 2, 3)
    ]
    assert summary["dp"] == {
        "mode": "central", "epsilon": secret.history[-1]["dp_epsilon"], "delta": 1e-5, "releases": 3,
        "neighbouring": "replace_one", "sampling": "secret", "noise": "secret",
    }

    public = Simulation(prepare(load_config(None, [*common, "sample_fraction=0.5", "dp=central"])))
    public.run()
    for t in (1, 2, 3):
        most = most_rounds(public.history[:t], 6)
        assert public.history[t - 1]["dp_releases"] == most
        assert public.history[t - 1]["dp_epsilon"] == library_epsilon(dp_event.GaussianDpEvent(0.55), "REPLACE_ONE", most, 1e-5)

    local = Simulation(prepare(load_config(None, [*DIGITS, "rounds=3", "sample_fraction=0.5", "dp=local", "dp.noise_multiplier=3", "dp.clip=0.003"])))
    local.run()
    most = most_rounds(local.history, 6)
    assert local.history[-1]["dp_releases"] == most
    assert local.history[-1]["dp_epsilon"] == library_epsilon(dp_event.GaussianDpEvent(1.5), "REPLACE_ONE", most, 1e-5)


@pytest.mark.parametrize("clients, sampled, z, rounds", [(100, 10, 4, 100), (1000, 10, 2, 1000)])
def test_the_issues_examples_public_sampling_counts_the_most_sampled_clients_rounds(clients, sampled, z, rounds):
    """Issue #33's examples (the schedule of seed 0): a public sample gets no
    amplification, so its epsilon is the most sampled client's rounds of Gaussian(z / 2),
    above the secret sample's amplified one (which assumed the sample unknown); and the
    secret sample's is the amplified bound, below that of taking part in every round."""
    schedule = sample_schedule(clients, sampled / clients, rounds, 0)
    most = max(sum(c in r for r in schedule) for c in range(clients))
    public = Accountant.of("central", "public", z, 1e-5, clients, sampled)
    secret = Accountant.of("central", "secret", z, 1e-5, clients, sampled)
    assert public.epsilon(most) == library_epsilon(dp_event.GaussianDpEvent(z / 2), "REPLACE_ONE", most, 1e-5)
    event = dp_event.SampledWithoutReplacementDpEvent(clients, sampled, dp_event.GaussianDpEvent(z / 2))
    assert secret.epsilon(rounds) == pytest.approx(library_epsilon(event, "REPLACE_ONE", rounds, 1e-5), rel=1e-12)
    assert secret.epsilon(rounds) < library_epsilon(dp_event.GaussianDpEvent(z / 2), "REPLACE_ONE", rounds, 1e-5)
    assert public.epsilon(most) > 2 * secret.epsilon(rounds)


def test_the_accountant_computes_the_events_rdp_once_whatever_the_rounds(monkeypatch):
    """The sampled event's RDP (the costly part) is computed once for a whole run (and
    the every-round Gaussian's, its alternative bound); each round's epsilon is a
    conversion of a multiple of them."""
    calls = []
    compose = RdpAccountant.compose
    monkeypatch.setattr(RdpAccountant, "compose", lambda self, event, count=1: calls.append(count) or compose(self, event, count))
    sim = Simulation(prepare(load_config(None, [*DIGITS, "rounds=6", "sample_fraction=0.5", "sampling=secret", "dp=central", "dp.clip=0.01"])))
    sim.run()
    assert calls == [1, 1] and [r["dp_releases"] for r in sim.history] == [1, 2, 3, 4, 5, 6]


def test_dp_settings_and_algorithms_that_cannot_take_them_give_one_line_errors():
    with pytest.raises(ConfigError, match=r"dp='centrl' is invalid: expected one of none, central, local \(did you mean 'central'\?\)"):
        prepare(load_config(None, ["dp=centrl"]))
    with pytest.raises(ConfigError, match="dp.clip is set but dp=none; add dp=central"):
        prepare(load_config(None, ["dp.clip=1"]))
    with pytest.raises(ConfigError, match=r"dp.noise_multiplier='-1' is invalid: expected >= 0"):
        prepare(load_config(None, ["dp=local", "dp.noise_multiplier=-1"]))
    with pytest.raises(ConfigError, match=r"dp.noise='seeded' is invalid: expected one of secret, reproducible"):
        prepare(load_config(None, ["dp=local", "dp.noise=seeded"]))
    with pytest.raises(ConfigError, match=r"sampling='private' is invalid: expected one of seeded, secret"):
        prepare(load_config(None, ["sampling=private"]))
    with pytest.raises(ConfigError, match=r"update_outlier_factor=3 judges updates by their norms before dp=central clips them.*set update_outlier_factor=0"):
        prepare(load_config(None, ["dp=central", "update_outlier_factor=3"]))
    assert prepare(load_config(None, ["dp=local", "update_outlier_factor=3"])).config.update_outlier_factor == 3  # noisy norms are public anyway
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
    assert fingerprint(load_config(None, ["rounds=3", "sampling=seeded"])) == fingerprint(plain)
    assert fingerprint(load_config(None, ["rounds=3", "dp=local"])) != fingerprint(plain)
    assert fingerprint(load_config(None, ["rounds=3", "dp=local", "dp.noise=reproducible"])) != fingerprint(load_config(None, ["rounds=3", "dp=local"]))


def test_contrafl_deploy_refuses_reproducible_noise(tmp_path, capsys):
    pytest.importorskip("flwr")
    assert main(["deploy", "--prepare-only", "--insecure", "--out", str(tmp_path / "run"), "dp=local", "dp.noise=reproducible"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dp.noise=reproducible derives the noise from config.yaml's seed" in err[0] and "leave dp.noise unset" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_secret_sample_is_drawn_from_the_os_and_no_file_of_the_run_says_who_took_part(tmp_path):
    """sampling=secret: each round's clients are a fresh CSPRNG draw (Python's seeded
    generator does not decide them); metrics.jsonl, the checkpoint's history and the
    privacy ledger name no client, lost clients are reported without their ids."""
    draws = set()
    for _ in range(8):
        random.seed(0)
        draws.add(tuple(secret_sample(20, 0.25)))
    assert len(draws) > 1 and all(len(d) == 5 and list(d) == sorted(set(d)) for d in draws)
    run = tmp_path / "run"
    settings = [*DIGITS, "rounds=3", "sample_fraction=0.5", "sampling=secret", "client_dropout=0.4", "dp=central", "dp.clip=0.1", "dp.noise_multiplier=1"]
    assert main(["run", "--quiet", "--out", str(run), *settings]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and not any("clients" in row for row in rows)
    lost = [item for row in rows for item in row.get("lost", [])]
    assert lost and all(set(item) == {"reason"} for item in lost)
    ledger = [json.loads(line) for line in (run / LEDGER).read_text().splitlines()]
    assert [e["round"] for e in ledger] == [0, 1, 2] and not any("clients" in e or e["client"] is not None for e in ledger)
    history = history_rows(torch.load(run / "checkpoint.pt", weights_only=True))
    assert not any("clients" in row for row in history)
    assert json.loads((run / "summary.json").read_text())["dp"]["sampling"] == "secret"


def local_sim(*extra: str) -> Simulation:
    return Simulation(prepare(load_config(None, [*DIGITS, "dp=local", "dp.clip=0.5", "dp.noise_multiplier=1", *extra])))


def test_under_local_dp_the_server_refuses_heavy_and_long_replies():
    """Honest replies pass; a reply weighing 37 samples, one longer than clipping plus the
    noise can make (bound: C + z C (sqrt(d) + sqrt(2 ln 1e9))), and one whose label table
    marks only some labels under dp.labels=hide are refused with the reason."""
    sim = local_sim()
    message = sim.algorithm.broadcast(sim.server, 0)
    replies = [next(iter(sim.train_locally(0, [c], lambda _: message, sim.algorithm.phases(0)))).reply for c in range(3)]
    assert all(sim.privacy.check_local(r, message) is None for r in replies)
    heavy = Reply(1, 37, replies[1].payload)
    assert sim.privacy.check_local(heavy, message) == "num_samples=37, expected 1 (under dp=local every reply counts once)"
    size = sum(u.numel() for u in updates(replies[0].payload, message))
    bound = sim.privacy.local_bound(size)
    assert bound == pytest.approx((0.5 + 0.5 * (math.sqrt(size) + math.sqrt(2 * math.log(1e9)))) * (1 + 1e-5))
    long = Reply(2, 1, add_noise(replies[2].payload, message, [u * (2 * bound / vector_norm(updates(replies[2].payload, message))) for u in updates(replies[2].payload, message)]))
    assert "exceeds" in sim.privacy.check_local(long, message) and "the most that clipping to dp.clip=0.5 plus the noise gives" in sim.privacy.check_local(long, message)
    tables = {"reps": torch.zeros(3, 2), "counts": torch.tensor([1, 0, 1])}
    assert "mark only some labels" in sim.privacy.check_local(Reply(0, 1, {"prototypes": tables}), {})


def test_under_local_dp_a_spike_in_one_value_is_refused_and_what_passes_is_bounded():
    """Issue #53, N1: a client that puts its whole norm budget into one weight passed the
    L2 bound. The per-value bound C + z C sqrt(2 ln(2 d / 1e-9)) refuses it; the largest
    spike that passes moves the global weight by at most that bound over the round's
    clients (against the client sending no update), measured here, where the spike
    through the L2 bound alone moved it about 39x more."""
    sim = local_sim()
    message = sim.algorithm.broadcast(sim.server, 0)
    honest = [next(iter(sim.train_locally(0, [c], lambda _: message, sim.algorithm.phases(0)))).reply for c in range(3)]
    u = updates(honest[0].payload, message)
    size = sum(x.numel() for x in u)
    per_value = sim.privacy.coordinate_bound(size)
    assert per_value == pytest.approx((0.5 + 0.5 * math.sqrt(2 * math.log(2 * size / 1e-9))) * (1 + 1e-5))
    assert all(max(float(x.abs().max()) for x in updates(r.payload, message)) < per_value for r in honest)

    def spiked(value: float) -> Reply:  # client 0's reply whose update is one weight moved by value
        spike = [-x for x in u]
        spike[0].view(-1)[0] += value
        return Reply(0, 1, add_noise(honest[0].payload, message, spike))

    norm_budget = 0.9 * sim.privacy.local_bound(size)
    assert "an update value of" in sim.privacy.check_local(spiked(norm_budget), message)
    assert sim.privacy.check_local(spiked(0.99 * per_value), message) is None
    weight = next(iter(message["model"]))
    moved = {}
    for name, value in (("passes", 0.99 * per_value), ("through the L2 bound alone", norm_budget)):
        out = sim.algorithm.aggregate(sim.server, [spiked(value), *honest[1:]], 0)
        ref = sim.algorithm.aggregate(sim.server, [spiked(0.0), *honest[1:]], 0)  # client 0 sends no update
        moved[name] = float((out.model[weight] - ref.model[weight]).abs().max())
    assert moved["passes"] <= per_value / 3 + 1e-6
    assert moved["through the L2 bound alone"] > 35 * moved["passes"]


def test_a_heavy_local_reply_is_left_out_of_the_round(monkeypatch):
    """In a round: a client whose privatized reply claims 50 samples is rejected by the
    server (on_bad_update=skip: left out, the row says why); the others are aggregated."""
    sim = local_sim("on_bad_update=skip")
    privatize = sim.privacy.privatize
    monkeypatch.setattr(sim.privacy, "privatize", lambda reply, message, t: (lambda r: Reply(r.cid, 50 if r.cid == 3 else 1, r.payload))(privatize(reply, message, t)))
    row = sim.run_round(0)
    assert row["rejected"] == [{"client": 3, "reason": "num_samples=50, expected 1 (under dp=local every reply counts once)"}]
    assert row["dp_releases"] == 1  # the rejected reply reached the server: a release of its client all the same


def test_label_tables_have_their_rows_clipped_and_can_hide_which_labels_a_client_holds():
    """With hide, every label is marked and an absent label's row carries no update (the
    message's row, else zeros), so clipping the update cannot turn it into a scaled copy
    of the global row; a compact table (FedSSC's rows of the marked labels only) is
    spread out to a row per label."""
    reps = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.3, 0.4]])
    payload = {"body": {"w": torch.ones(2)}, "prototypes": {"reps": reps, "counts": torch.tensor([7, 0, 2])}}
    assert is_label_table(payload["prototypes"]) and not is_label_table(payload) and is_label_table({"reps": reps, "mask": torch.tensor([True, False, True])})
    out = protect_labels(payload, None, 1.0, hide=True)
    assert torch.allclose(out["prototypes"]["reps"], torch.tensor([[0.6, 0.8], [0.0, 0.0], [0.3, 0.4]]))
    assert torch.equal(out["prototypes"]["counts"], torch.ones(3, dtype=torch.long)) and out["body"]["w"] is payload["body"]["w"]
    clear = protect_labels(payload, None, None, hide=False)
    assert torch.equal(clear["prototypes"]["reps"], reps) and torch.equal(clear["prototypes"]["counts"], payload["prototypes"]["counts"])

    message = {"prototypes": {"reps": torch.tensor([[1.0, 1.0], [5.0, -5.0], [2.0, 0.0]]), "mask": torch.ones(3, dtype=torch.bool)}}
    hidden = protect_labels(payload, message, None, hide=True)
    assert torch.equal(hidden["prototypes"]["reps"][1], message["prototypes"]["reps"][1])
    clipped, _ = clip(hidden, message, 0.01)
    assert torch.equal(clipped["prototypes"]["reps"][1], message["prototypes"]["reps"][1])  # no update there to scale

    compact = protect_labels({"class_reps": {"reps": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "mask": torch.tensor([True, False, True])}}, None, None, hide=True)
    assert torch.equal(compact["class_reps"]["reps"], torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]))
    assert bool(compact["class_reps"]["mask"].all())


def test_fedssc_under_local_dp_with_hidden_labels_sends_a_table_of_every_label():
    """FedSSC's reply has a row per shared class; under dp=local with labels hidden it
    sends a row for every class (the shape no longer tells how many it holds) and the
    server aggregates it. A table whose rows do not match its mask is refused."""
    sim = Simulation(prepare(load_config(None, [*DIGITS, "algorithm=fedssc", "dp=local", "dp.noise_multiplier=0", "dp.clip=1e6"])))
    outcomes = list(sim.train_locally(0, [0, 1], lambda c: sim.algorithm.broadcast(sim.server, 0), sim.algorithm.phases(0)))
    for outcome in outcomes:
        table = outcome.reply.payload["class_reps"]
        assert table["reps"].shape == (10, table["reps"].shape[1]) and bool(table["mask"].all())
    row = sim.run_round(0)
    assert "rejected" not in row and bool(sim.server.extras["class_mask"].all())
    bad = Reply(0, 1, {**outcomes[0].reply.payload, "class_reps": {"reps": torch.zeros(4, 8), "mask": torch.ones(10, dtype=torch.bool)}})
    assert check_reply(bad, sim.algorithm.reply_spec(sim.algorithm.broadcast(sim.server, 1))) == "a per-label table has 4 rows for 10 labels (10 marked)"


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


def test_a_release_computed_again_counts_once_and_another_one_counts_again():
    """The ledger counts distinct releases: a round re-run that releases the same thing
    (reproducible noise, same replies) adds nothing; secret noise makes another release,
    which counts."""
    for noise, expected in (("reproducible", [1, 1, 2]), ("secret", [1, 2, 3])):
        sim = Simulation(prepare(load_config(None, [*DIGITS, "dp=central", "dp.clip=0.1", f"dp.noise={noise}"])))
        message = sim.algorithm.broadcast(sim.server, 0)
        spent = []
        for t in (0, 0, 1):
            replies, _ = sim.privacy.central([still(sim, c) for c in (1, 2)], {c: message for c in (1, 2)}, t)
            spent.append(sim.privacy.record(t, replies)["dp_releases"])
        assert spent == expected, noise


@pytest.mark.slow
def test_a_run_with_local_dp_killed_in_a_round_resumes_exactly(tmp_path):
    settings = ["algorithm=scaffold", *SETTINGS, "sample_fraction=0.5", "dp=local", "dp.clip=5", "dp.noise_multiplier=0.01", "dp.noise=reproducible"]
    clean = _uninterrupted(tmp_path, settings)
    rows = [json.loads(line) for line in clean.decode().splitlines()]
    assert [r["dp_epsilon"] is not None for r in rows] == [True] * 4
    run = tmp_path / "run"
    _killed_run(run, "round", CLIENTS + 1, settings)
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean


@pytest.mark.slow
def test_secret_noise_resumes_keeping_the_checkpoint_and_counting_the_abandoned_round(tmp_path):
    """Secret local noise, checkpoints every 2 rounds, killed at round 4's first reply:
    the resumed run keeps rounds 1-2 as they were (their noise is in the checkpoint),
    re-runs round 3 with fresh noise, and counts each client's round-3 releases twice
    (5 releases, where an uninterrupted run has 4): epsilon never under-reports."""
    settings = ["algorithm=fedavg", *SETTINGS, "checkpoint_every=2", "eval_personal=false", "dp=local", "dp.clip=5", "dp.noise_multiplier=0.01"]
    run = tmp_path / "run"
    _killed_run(run, "round", 3 * CLIENTS + 1, settings)
    before = (run / "metrics.jsonl").read_text().splitlines()
    assert len(before) == 3
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    after = (run / "metrics.jsonl").read_text().splitlines()
    assert after[:2] == before[:2] and after[2] != before[2] and len(after) == 4
    rows = [json.loads(line) for line in after]
    assert [r["dp_releases"] for r in rows] == [1, 2, 4, 5]
    assert rows[-1]["dp_epsilon"] == library_epsilon(dp_event.GaussianDpEvent(0.005), "REPLACE_ONE", 5, 1e-5)


def test_a_checkpoint_whose_ledger_lost_releases_is_refused(tmp_path):
    """The release count a resumed run starts from is checked against the rounds recorded:
    without the ledger file and with the checkpoint's copy emptied, or with a ledger line
    that is not a release, resuming stops with one line."""
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *DIGITS, "rounds=3", "dp=central", "dp.clip=0.1"]) == 0
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
    checkpoint["privacy"] = {"ledger": []}
    torch.save(checkpoint, run / "checkpoint.pt")
    (run / LEDGER).write_text((run / LEDGER).read_text().splitlines()[0] + "\n")  # round 1's release only
    setup = prepare(load_config(run / "config.yaml"))
    with pytest.raises(CheckpointError, match=r"round 2 released an update that the privacy ledger does not record \(epsilon would be under-reported\)"):
        resume(setup, RunDir(run, resume=True))
    (run / LEDGER).write_text('{"round": 0, "client": null}\n')
    with pytest.raises(CheckpointError, match=r"is not a release \(round, client, digest, prev\)"):
        resume(setup, RunDir(run, resume=True))


def _resume_error(run, capsys) -> str:
    """The one line ``contrafl run --resume run rounds=5`` (a completed run extended)
    stops with (exit status 2)."""
    capsys.readouterr()
    assert main(["run", "--quiet", "--resume", str(run), "rounds=5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_deleted_emptied_cut_or_edited_ledger_stops_the_resume_with_one_line(tmp_path, capsys):
    """The ledger is a hash chain that must begin with the checkpoint's copy: a deleted,
    emptied, cut or edited ledger stops ``--resume`` with one line, and the rounds done
    are kept (issue #53, N3). The intact ledger resumes."""
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *DIGITS, "rounds=3", "dp=local", "dp.clip=5", "dp.noise_multiplier=0.01"]) == 0
    lines = (run / LEDGER).read_text().splitlines()
    assert len(lines) == 18 and json.loads(lines[0])["prev"] == "" and all(json.loads(a)["prev"] for a in lines[1:])
    metrics = (run / "metrics.jsonl").read_bytes()
    cases = {
        "missing, but checkpoint": None,
        "holds 0 releases, but checkpoint": "",
        "holds 12 releases, but checkpoint": "\n".join(lines[:12]) + "\n",
        "line 7 does not follow the release before it": "\n".join(lines[:6] + lines[7:]) + "\n",
        "line 5: {\"round\": -1, ": "\n".join(lines[:4] + [json.dumps({**json.loads(lines[4]), "round": -1})] + lines[5:]) + "\n",
    }
    for expected, text in cases.items():
        (run / LEDGER).unlink(missing_ok=True)
        if text is not None:
            (run / LEDGER).write_text(text)
        line = _resume_error(run, capsys)
        assert expected in line and LEDGER in line, line
        assert (run / "metrics.jsonl").read_bytes() == metrics
    (run / LEDGER).write_text("\n".join(lines) + "\n")
    assert main(["run", "--quiet", "--resume", str(run), "rounds=4"]) == 0
    assert len((run / LEDGER).read_text().splitlines()) == 24


def test_a_ledger_cut_back_to_the_checkpoint_is_found_by_the_rows_published_after_it(tmp_path, capsys):
    """Releases made after the last checkpoint are in the ledger and in the rows
    ``metrics.jsonl`` published: a ledger cut back to the checkpoint's releases stops the
    resume although it holds all of them."""
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *DIGITS, "rounds=2", "dp=central", "dp.clip=0.5"]) == 0
    at_round_2 = (run / "checkpoint.pt").read_bytes()
    assert main(["run", "--quiet", "--resume", str(run), "rounds=3"]) == 0
    (run / "checkpoint.pt").write_bytes(at_round_2)  # as if killed after round 3's row, before its checkpoint
    (run / LEDGER).write_text("".join(line + "\n" for line in (run / LEDGER).read_text().splitlines()[:2]))
    line = _resume_error(run, capsys)
    assert "round 3 released an update that the privacy ledger does not record (epsilon would be under-reported)" in line


def test_no_file_of_a_run_is_written_through_a_symbolic_link(tmp_path, capsys):
    """A run directory holding a link (the ledger, or client-state/ pointing elsewhere) is
    refused with one line, and the file it points to is untouched (issue #53, N8)."""
    run, outside = tmp_path / "run", tmp_path / "outside.jsonl"
    assert main(["run", "--quiet", "--out", str(run), *DIGITS, "dp=central", "dp.clip=0.5"]) == 0
    outside.write_bytes((run / LEDGER).read_bytes())
    (run / LEDGER).unlink()
    (run / LEDGER).symlink_to(outside)
    before = outside.read_bytes()
    line = _resume_error(run, capsys)
    assert line.startswith(f"contrafl: error: {run / LEDGER} is a symbolic link (to {outside})"), line
    assert outside.read_bytes() == before
    from contrafl.files import append_line

    with pytest.raises(ConfigError, match="is a symbolic link"):
        append_line(run / LEDGER, "{}")
    assert outside.read_bytes() == before


def test_reproducible_noise_says_on_the_last_line_that_it_protects_nothing(tmp_path, capsys):
    """``dp.noise=reproducible`` (anyone with config.yaml can subtract the noise) says so
    beside the epsilon it reports (issue #53, N7); secret noise does not."""
    for noise in ("reproducible", "secret"):
        assert main(["run", "--out", str(tmp_path / noise), *DIGITS, "rounds=1", "dp=central", "dp.clip=0.1", f"dp.noise={noise}"]) == 0
        done = capsys.readouterr().out.splitlines()[-1]
        assert ("-DP (central; reproducible noise: protects nothing)" in done) == (noise == "reproducible"), done
        assert "-DP (central" in done


def test_without_dp_accounting_the_server_stops_at_once_and_a_client_needs_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # as if not installed
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *DIGITS, "dp=local"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['contrafl: error: dp needs the dp-accounting package for its privacy accountant; pip install "contrafl[privacy]"']
    assert not (tmp_path / "run").exists()
    client = Simulation(prepare(load_config(None, [*DIGITS, "dp=local"])))  # a SuperNode's side of the run
    outcome = next(iter(client.train_locally(0, [3], lambda cid: client.algorithm.broadcast(client.server, 0), client.algorithm.phases(0))))
    assert outcome.reply.num_samples == 1


def test_noise_too_large_for_the_model_stops_the_run_with_one_line_that_names_it(tmp_path, capsys):
    """README's warning: central noise of z C / m = 0.1 per weight on digits' model makes
    training diverge; the run stops at the first non-finite update (exit status 3) with
    one line that points at the DP noise, and keeps the rounds done."""
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), "dp=central", "dp.clip=1", "dp.noise_multiplier=1", "dp.noise=reproducible"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-finite values" in err[0] and "or the DP noise (dp.noise_multiplier, dp.clip)" in err[0]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds_completed"] >= 1
