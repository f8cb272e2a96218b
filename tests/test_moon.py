"""MOON: the loss, the previous-model pool and the reduction to FedAvg."""

import math

import pytest
import torch
from torch.nn import functional as F

from contrafl.algorithms.moon import model_at, model_contrastive_loss

from conftest import simulate


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_contrastive_loss_k1_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    zg = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    zp = torch.tensor([[-1.0, 0.0], [1.0, 1.0]])
    tau = 0.5
    expected = 0.0
    for zi, gi, pi in zip(z.tolist(), zg.tolist(), zp.tolist()):
        pos, neg = _cos(zi, gi) / tau, _cos(zi, pi) / tau
        expected += -math.log(math.exp(pos) / (math.exp(pos) + math.exp(neg)))
    expected /= 2
    # sample 1: cos = 1/sqrt2 vs -1; sample 2: cos = 1 vs 1/sqrt2
    assert expected == pytest.approx(0.5 * (math.log(1 + math.exp(2 * (-1 - 1 / math.sqrt(2)))) + math.log(1 + math.exp(2 * (1 / math.sqrt(2) - 1)))))
    assert model_contrastive_loss(z, zg, [zp], tau).item() == pytest.approx(expected, rel=1e-6)


def test_contrastive_loss_k2_by_hand():
    z = torch.tensor([[3.0, 4.0]])
    zg = torch.tensor([[3.0, 4.0]])
    zp1 = torch.tensor([[4.0, -3.0]])
    zp2 = torch.tensor([[-3.0, -4.0]])
    tau = 1.0
    # cosines: 1, 0, -1  ->  -log(e / (e + 1 + 1/e))
    expected = -math.log(math.e / (math.e + 1 + math.exp(-1)))
    assert model_contrastive_loss(z, zg, [zp1, zp2], tau).item() == pytest.approx(expected, rel=1e-6)
    # equals MOON's code path: CE of the stacked logits with target 0
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    assert F.cross_entropy(logits, torch.tensor([0])).item() == pytest.approx(expected, rel=1e-6)


class _Ctx:
    def initial_state(self):
        return {"init": torch.zeros(1)}


def test_previous_model_lookup_under_sampling():
    """z_prev^i is the client's latest local model as of round t - i; before any, its init."""
    a, b = {"w": torch.ones(1)}, {"w": torch.full((1,), 2.0)}
    history = [(1, a), (4, b)]  # trained in rounds 1 and 4
    assert model_at(history, 5, _Ctx()) is b  # sampled again at round 6: z_prev = round-4 model
    assert model_at(history, 3, _Ctx()) is a  # second negative (k=2) at round 5: state as of round 3
    assert "init" in model_at(history, 0, _Ctx())  # never trained by round 0: own initialisation
    assert "init" in model_at([], 7, _Ctx())


def without_parts(history):
    """The rows without ``loss_parts`` (FedAvg's loss has no parts, MOON's has ``ce`` and
    ``con``)."""
    return [{k: v for k, v in row.items() if k != "loss_parts"} for row in history]


def test_round_zero_has_no_contrastive_term_and_mu0_is_fedavg():
    moon0 = simulate("algorithm=moon", "algorithm.mu=5", "rounds=1")
    fedavg = simulate("algorithm=fedavg", "rounds=1")
    # in round 0 there is no previous model: the loss is CE only, so MOON == FedAvg exactly
    assert without_parts(moon0.history) == fedavg.history
    assert moon0.history[0]["loss_parts"] == {"ce": fedavg.history[0]["train_loss"]}
    for k, v in fedavg.server.model.items():
        assert torch.equal(moon0.server.model[k], v)
    moon_mu0 = simulate("algorithm=moon", "algorithm.mu=0", "rounds=3")
    fedavg3 = simulate("algorithm=fedavg", "rounds=3")
    assert without_parts(moon_mu0.history) == fedavg3.history


def test_contrastive_term_active_from_round_one():
    moon = simulate("algorithm=moon", "algorithm.mu=5", "rounds=2")
    fedavg = simulate("algorithm=fedavg", "rounds=2")
    assert without_parts(moon.history)[0] == fedavg.history[0]
    assert moon.history[1]["train_loss"] != fedavg.history[1]["train_loss"]
    assert moon.history[1]["loss_parts"]["con"] > 0


def test_pool_holds_latest_models_under_sampling():
    sim = simulate("algorithm=moon", "algorithm.k=2", "num_clients=6", "sample_fraction=0.5", "rounds=4")
    for cid in range(6):
        rounds_sampled = [t for t, clients in enumerate(sim.schedule) if cid in clients]
        entry = sim.store.get(cid)
        if not rounds_sampled:
            assert entry is None
            continue
        history = entry["algorithm"]["history"]
        assert [t for t, _ in history] == rounds_sampled[-2:]


def test_l2_variant_runs_and_differs():
    l2 = simulate("algorithm=moon", "algorithm.loss=l2", "algorithm.mu=1", "rounds=1")
    fedavg = simulate("algorithm=fedavg", "rounds=1")
    assert l2.history[0]["train_loss"] != fedavg.history[0]["train_loss"]


def test_moon_sequential_equals_vectorized():
    a = simulate("algorithm=moon", "algorithm.mu=5", "algorithm.k=2", "rounds=3", "executor=sequential")
    b = simulate("algorithm=moon", "algorithm.mu=5", "algorithm.k=2", "rounds=3", "executor=vectorized")
    for k, v in a.server.model.items():
        torch.testing.assert_close(b.server.model[k], v, rtol=0, atol=1e-5)
