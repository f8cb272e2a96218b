"""FedSSC: L_glob, the client's class representations, the server's sampling, the schedule,
and equivalences (MOON when mu_glob = 0; sequential == vectorized)."""

import math

import numpy as np
import pytest
import torch

from contrafl.algorithms.base import Federation, Reply, ServerState, TrainResult
from contrafl.algorithms.fedssc import FedSSC, FedSSCParams, class_contrastive_loss, client_class_reps
from contrafl.config import load_config
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.execution.context import Context


pytestmark = pytest.mark.usefixtures("one_thread")


def federation(num_classes=3, seed=0):
    return Federation(num_clients=4, num_classes=num_classes, rounds=10, lr=0.01, local_epochs=1,
                      batch_size=8, param_names=("w",), seed=seed)


def without_bytes(row):
    """A history row without its communication counts (FedSSC also sends class representations)."""
    return {k: v for k, v in row.items() if not k.startswith("bytes")}


def simulate(*overrides):
    sim = Simulation(prepare(load_config(None, ["local_epochs=1", *overrides])), None, None)
    sim.run()
    return sim


def test_class_contrastive_loss_by_hand():
    # classes 0 and 2 are shared (zs^0 = e1, zs^2 = e2); class 1 is not, tau = 0.5
    reps = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    mask = torch.tensor([True, False, True])
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0], [3.0, -1.0], [0.0, 2.0]])
    y = torch.tensor([0, 2, 1, 0])
    # sample 0: cos = (1, 0)       -> logits (2, 0):   -log(e^2 / (e^2 + 1))     = log(1 + e^-2)
    # sample 1: cos = (.707, .707) -> logits equal:    -log(1/2)                 = log 2
    # sample 2: label 1 has no shared representation -> left out
    # sample 3: cos = (0, 1)       -> logits (0, 2):   -log(1 / (1 + e^2))       = log(1 + e^2)
    expected = (math.log(1 + math.exp(-2)) + math.log(2) + math.log(1 + math.exp(2))) / 3  # 0.982334
    loss = class_contrastive_loss(z, y, reps, mask, temperature=0.5)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert loss.item() == pytest.approx(0.9823344, abs=1e-6)
    # no sample with a shared label: the term is 0 (and has a finite gradient)
    zz = z.clone().requires_grad_(True)
    none = class_contrastive_loss(zz, torch.tensor([1, 1, 1, 1]), reps, mask, 0.5)
    none.backward()
    assert none.item() == 0.0 and torch.equal(zz.grad, torch.zeros_like(z))


def test_mu_glob_schedule():
    algo = FedSSC(FedSSCParams(), federation())
    assert [algo.mu_glob(t) for t in (0, 50, 100, 150)] == pytest.approx([1.0, 0.55, 0.1, 0.1])
    constant = FedSSC(FedSSCParams(schedule="constant", mu_glob_start=0.3), federation())
    assert [constant.mu_glob(t) for t in (0, 50, 150)] == [0.3, 0.3, 0.3]


def test_client_class_reps_threshold():
    # rows 0-9 are class 0 (10 samples: shared), rows 10-18 class 1 (9 samples: not shared)
    z = torch.stack([torch.arange(19.0), torch.ones(19)], dim=1)
    y = torch.tensor([0] * 10 + [1] * 9)
    reps, mask = client_class_reps(z, y, num_classes=3, min_samples=10)
    assert mask.tolist() == [True, False, False]
    assert reps.tolist() == [[4.5, 1.0], [0.0, 0.0], [0.0, 0.0]]  # (0 + ... + 9) / 10 = 4.5


def test_client_reps_are_class_means_of_predict_outputs():
    sim = Simulation(prepare(load_config(None, ["algorithm=fedssc", "rounds=1"])), None, None)
    counts = sim.label_counts
    cid = next(i for i in range(len(counts)) if ((counts[i] > 0) & (counts[i] < 10)).any())
    ctx = Context(sim, cid, 0)
    state = sim.initial_state(cid)
    params, buffers = sim.algorithm.federation.split(state)
    result = TrainResult({"model": params}, {"model": buffers}, {}, 0)
    reply, _ = sim.algorithm.client_end(None, result, {}, ctx)

    # independent: eval-mode forward of the client's rows, mean per class with numpy
    rows = sim.rows_t[cid]
    z = sim.net(state, sim.setup.eval_transform(sim.train.x[rows]), train=False).z.detach().numpy()
    y = sim.train.y[rows].numpy()
    shared = [c for c in range(10) if (y == c).sum() >= 10]
    assert 0 < len(shared) < len(set(y.tolist()))  # some present classes have < 10 samples
    assert reply.payload["class_reps"]["mask"].tolist() == [c in shared for c in range(10)]
    expected = np.stack([z[y == c].mean(0) for c in shared])
    np.testing.assert_allclose(reply.payload["class_reps"]["reps"].numpy(), expected, rtol=1e-5, atol=1e-6)


def replies_with_reps():
    """Three clients, C = 3, d = 2: client 0 shares classes {0, 1}, client 1 {0, 2}, client 2 {0}."""
    g = torch.Generator().manual_seed(1)
    full = torch.randn(3, 3, 2, generator=g)  # [client, class, d]
    masks = torch.tensor([[True, True, False], [True, False, True], [True, False, False]])
    replies = [
        Reply(i, 10 * (i + 1), {"model": {"w": torch.full((2,), float(i))},
                                "class_reps": {"reps": full[i][masks[i]], "mask": masks[i]}})
        for i in range(3)
    ]
    return replies, full, masks


def test_server_reps_with_k_at_least_clients_is_unweighted_mean():
    replies, full, masks = replies_with_reps()
    algo = FedSSC(FedSSCParams(k=5), federation())
    server = algo.aggregate(ServerState({"w": torch.zeros(2)}), replies, round=1)
    reps, mask = server.extras["class_reps"], server.extras["class_mask"]
    assert mask.tolist() == [True, True, True]
    torch.testing.assert_close(reps[0], (full[0, 0] + full[1, 0] + full[2, 0]) / 3)  # unweighted
    torch.testing.assert_close(reps[1], full[0, 1])
    torch.testing.assert_close(reps[2], full[1, 2])
    # the model is FedAvg's: weights 10/60, 20/60, 30/60 of w = 0, 1, 2
    torch.testing.assert_close(server.model["w"], torch.full((2,), (20 + 60) / 60))


def test_server_reps_with_k_1_pick_one_client_deterministically():
    replies, full, masks = replies_with_reps()
    picks = set()
    for round in range(8):
        algo = FedSSC(FedSSCParams(k=1), federation(seed=3))
        reps = algo.aggregate(ServerState({"w": torch.zeros(2)}), replies, round).extras["class_reps"]
        again = FedSSC(FedSSCParams(k=1), federation(seed=3))
        assert torch.equal(reps, again.aggregate(ServerState({"w": torch.zeros(2)}), replies, round).extras["class_reps"])
        matches = [i for i in range(3) if torch.equal(reps[0], full[i, 0])]
        assert len(matches) == 1
        picks.add(matches[0])
    assert len(picks) > 1  # the draw changes with the round


def test_server_keeps_or_drops_classes_nobody_shared():
    replies, full, masks = replies_with_reps()
    only_class_0 = [Reply(r.cid, r.num_samples, {"model": r.payload["model"], "class_reps": {
        "reps": r.payload["class_reps"]["reps"][:1], "mask": torch.tensor([True, False, False])}}) for r in replies]
    for missing, expect_mask in (("keep", [True, True, True]), ("drop", [True, False, False])):
        algo = FedSSC(FedSSCParams(missing_class=missing), federation())
        first = algo.aggregate(ServerState({"w": torch.zeros(2)}), replies, round=1)
        second = algo.aggregate(first, only_class_0, round=2)
        assert second.extras["class_mask"].tolist() == expect_mask
        if missing == "keep":
            torch.testing.assert_close(second.extras["class_reps"][1:], first.extras["class_reps"][1:])
        message = algo.broadcast(second, 3)
        assert message["class_reps"]["reps"].shape == (sum(expect_mask), 2)


# One executor that aggregates every reply on the server for both: the distributed one
# sums MOON's replies on its workers (its server needs only their mean) but not FedSSC's,
# and the two orders of summation differ in the last bits.
SAME_SUMS = "executor=parallel"


@pytest.fixture(scope="module")
def moon():
    return simulate("algorithm=moon", "algorithm.mu=5", "rounds=3", SAME_SUMS)


def test_without_l_glob_fedssc_is_moon(moon):
    ssc = simulate("algorithm=fedssc", "algorithm.mu_moon=5", "algorithm.mu_glob_start=0", "algorithm.mu_glob_end=0", "rounds=3", SAME_SUMS)
    assert [without_bytes(r) for r in ssc.history] == [without_bytes(r) for r in moon.history]
    for key, value in moon.server.model.items():
        assert torch.equal(ssc.server.model[key], value), key
    # communication: class representations only for classes with >= 10 samples (+ the mask)
    shared = (ssc.label_counts >= 10).sum(dim=1)
    assert ssc.history[0]["bytes_up"]["class_reps"] == int((shared * 256 * 4 + 10).sum())
    assert "class_reps" not in ssc.history[0]["bytes_down"]
    assert ssc.history[1]["bytes_down"]["class_reps"] == 10 * (int(ssc.server.extras["class_mask"].sum()) * 256 * 4 + 10)


def test_sequential_and_vectorized_agree(moon):
    runs = [simulate("algorithm=fedssc", "rounds=2", f"executor={ex}") for ex in ("sequential", "vectorized")]
    assert runs[0].history[1]["train_loss"] != moon.history[1]["train_loss"]  # L_glob is active in round 2
    for key, value in runs[0].server.model.items():
        torch.testing.assert_close(runs[1].server.model[key], value, atol=1e-5, rtol=0)
    torch.testing.assert_close(runs[1].server.extras["class_reps"], runs[0].server.extras["class_reps"], atol=1e-5, rtol=0)
