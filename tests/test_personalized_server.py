"""FedAMP, FedGH and FedPAC: the server-side personalisation (attentive cloud models, a
head trained on prototypes, per-client head combinations) by hand, and short runs."""

import io
import itertools
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from contrafl.algorithms.base import Batch, Federation, Reply, ServerState, TaskView, TrainResult
# importing the modules registers fedamp, fedgh and fedpac for the simulations below
from contrafl.algorithms.fedamp import FedAMP, FedAMPParams, attention_weights
from contrafl.algorithms.fedgh import FedGH, FedGHParams, prototype_pairs
from contrafl.algorithms.fedpac import (
    FedPAC,
    FedPACParams,
    combination_matrix,
    combination_weights,
    feature_statistics,
    repair_psd,
    simplex_qp,
)
from contrafl.algorithms.split import split_head
from contrafl.config import load_config
from contrafl.engine.comm import tensor_bytes
from contrafl.engine.run_dir import RunDir
from contrafl.engine.setup import prepare
from contrafl.engine.resume import resume
from contrafl.engine.simulation import Simulation
from contrafl.execution.context import Context
from contrafl.models.base import ModelOutput

from conftest import simulate

PERSONAL = ("test_fraction=0.25", "eval_personal=true", "executor=sequential")


pytestmark = pytest.mark.usefixtures("one_thread")


def federation(param_names=("w",), num_classes=3, rep_dim=2, batch_size=4, num_clients=4):
    return Federation(num_clients=num_clients, num_classes=num_classes, rounds=3, lr=0.1, local_epochs=1,
                      batch_size=batch_size, param_names=param_names, seed=0, rep_dim=rep_dim)


class _Ctx:
    cid, round = 0, 0

    def initial_state(self):
        raise AssertionError("the client's own initialisation is not expected here")


def _safe_roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _assert_personal_rows(sim, num_clients=4):
    for row in sim.history:
        assert row["personal_clients"] == num_clients
        assert 0.0 <= row["personal_acc"] <= 1.0
    _safe_roundtrip({"extras": sim.server.extras, "clients": {c: sim.store.get(c) for c in range(num_clients)}})


# ---------------------------------------------------------------------------------------------
# FedAMP


def _amp_server():
    models = {
        0: {"w": torch.tensor([0.0, 0.0]), "b": torch.tensor([0.0])},
        1: {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([1.0])},
        2: {"w": torch.tensor([0.0, 2.0]), "b": torch.tensor([0.0])},
    }
    return ServerState({"w": torch.full((2,), 9.0), "b": torch.full((1,), 9.0)}, {"models": models})


def test_fedamp_attention_weights_and_cloud_models_by_hand():
    # squared distances over all parameters: d01 = 1 + 1 = 2, d02 = 4, d12 = 1 + 4 + 1 = 6
    # alpha_K = 0.5, sigma = 2: xi_ij = 0.5 * exp(-d/2) / 2 = exp(-d/2) / 4
    algo = FedAMP(FedAMPParams(alpha_k=0.5, sigma=2.0), federation(("w", "b")))
    server = _amp_server()
    algo.init_server(server.model)
    e1, e2, e3 = math.exp(-1), math.exp(-2), math.exp(-3)

    cids, xi = attention_weights(server.extras["models"], 0, 0.5, 2.0)
    assert cids == [0, 1, 2]
    np.testing.assert_allclose(xi.numpy(), [1 - (e1 + e2) / 4, e1 / 4, e2 / 4], rtol=1e-12)
    assert xi.sum().item() == pytest.approx(1.0, abs=1e-15)

    u0 = algo.message_for(algo.broadcast(server, 1), server, 0, 1)
    assert set(u0) == {"cloud"}
    # u_0 = xi_00 * 0 + xi_01 * w_1 + xi_02 * w_2
    torch.testing.assert_close(u0["cloud"]["w"], torch.tensor([e1 / 4, 2 * e2 / 4]))
    torch.testing.assert_close(u0["cloud"]["b"], torch.tensor([e1 / 4]))

    xi11 = 1 - (e1 + e3) / 4
    u1 = algo.message_for(algo.broadcast(server, 1), server, 1, 1)
    torch.testing.assert_close(u1["cloud"]["w"], torch.tensor([xi11, 2 * e3 / 4]))
    torch.testing.assert_close(u1["cloud"]["b"], torch.tensor([xi11]))
    assert not torch.equal(u0["cloud"]["w"], u1["cloud"]["w"])

    # no stored model: the common initialisation (init=common) or nothing (init=own)
    assert algo.message_for({}, server, 3, 1) == {"init": server.model}
    own = FedAMP(FedAMPParams(init="own"), federation(("w", "b")))
    assert own.message_for({}, server, 3, 1) == {}


def test_fedamp_xi_self_is_negative_for_nearby_models_with_pfllib_defaults():
    models = {i: {"w": torch.tensor([0.01 * i])} for i in range(4)}
    _, xi = attention_weights(models, 0, 1.0, 1.0)
    assert xi[0] < -1.9 and xi.sum().item() == pytest.approx(1.0)


def _linear_net(state, x, train):
    return ModelOutput(x, x, x + 0.0 * state["w"].sum())  # logits whose gradient is 0


def test_fedamp_penalty_gradient_is_lambda_over_alpha_times_w_minus_u():
    w, u = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.0, 1.0, 0.5])
    batch = Batch(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1]))
    for penalty, lam, alpha_k in (("squared", 0.6, 0.5), ("pfllib", 0.6, 0.5)):
        algo = FedAMP(FedAMPParams(lam=lam, alpha_k=alpha_k, penalty=penalty), federation())
        task = algo.client_begin({"cloud": {"w": u}}, {"model": {"w": w}}, _Ctx())
        assert torch.equal(task.params["model"]["w"], w)  # starts from its own model
        wg = w.clone().requires_grad_(True)
        view = TaskView({"model": {"w": wg}}, task.buffers, task.frozen, task.consts)
        loss, stats = algo.local_loss(view, batch, _linear_net)
        (grad,) = torch.autograd.grad(loss, [wg])
        ce = F.cross_entropy(batch.x, batch.y)
        if penalty == "squared":
            torch.testing.assert_close(grad, lam / alpha_k * (w - u))  # 1.2 * (w - u)
            assert loss.item() == pytest.approx(ce.item() + lam / (2 * alpha_k) * float(((w - u) ** 2).sum()), rel=1e-6)
        else:  # PFLlib: 0.5 lambda/alpha_K ||w - u||_2 of detached tensors, no gradient
            assert torch.count_nonzero(grad) == 0
            assert stats["prox"].item() == pytest.approx(0.5 * lam / alpha_k * float((w - u).norm()), rel=1e-6)

    # no cloud model: the same task structure, the term weighted 0
    algo = FedAMP(FedAMPParams(), federation())
    task = algo.client_begin({}, {"model": {"w": w}}, _Ctx())
    assert set(task.consts) == {"cloud", "prox_weight"} and task.consts["prox_weight"].item() == 0.0
    wg = w.clone().requires_grad_(True)
    loss, _ = algo.local_loss(TaskView({"model": {"w": wg}}, task.buffers, {}, task.consts), batch, _linear_net)
    assert torch.count_nonzero(torch.autograd.grad(loss, [wg])[0]) == 0
    # start=cloud: local training starts from u_i
    cloud = FedAMP(FedAMPParams(start="cloud"), federation()).client_begin({"cloud": {"w": u}}, {"model": {"w": w}}, _Ctx())
    assert torch.equal(cloud.params["model"]["w"], u)


@pytest.fixture(scope="module")
def amp_sim():
    return simulate("algorithm=fedamp", *PERSONAL, "sample_fraction=0.5", "rounds=3")


def test_fedamp_bytes_down_are_the_sum_of_the_clients_own_messages(amp_sim):
    sim = amp_sim
    params = {k: v for k, v in sim.server.model.items() if k in sim.algorithm.federation.param_names}
    param_bytes, state_bytes = tensor_bytes(params), tensor_bytes(sim.server.model)
    uploaded: set[int] = set()
    for row in sim.history:
        sampled = row["clients"]
        assert len(sampled) == 2
        old = [c for c in sampled if c in uploaded]
        new = [c for c in sampled if c not in uploaded]
        expected = {}
        if new:  # first message: the common initial model
            expected["init"] = len(new) * state_bytes
        if old:  # then: the client's own cloud model u_i
            expected["cloud"] = len(old) * param_bytes
        assert row["bytes_down"] == expected
        assert row["bytes_up"] == {"model": len(sampled) * param_bytes}
        uploaded |= set(sampled)
    assert any("cloud" in row["bytes_down"] for row in sim.history)
    assert set(sim.server.extras["models"]) == uploaded
    _assert_personal_rows(sim)


def test_fedamp_penalty_shapes_training_only_in_the_papers_form():
    runs = {
        name: simulate("algorithm=fedamp", *PERSONAL, *extra)
        for name, extra in {
            "paper": ["algorithm.alpha_k=0.1", "algorithm.sigma=100"],
            "pfllib": ["algorithm.alpha_k=0.1", "algorithm.sigma=100", "algorithm.penalty=pfllib"],
            "lam0": ["algorithm.alpha_k=0.1", "algorithm.sigma=100", "algorithm.lam=0"],
        }.items()
    }
    models = {name: sim.server.extras["models"] for name, sim in runs.items()}
    # round 1: nobody has a cloud model; round 2: PFLlib's penalty has no gradient
    for cid in range(4):
        for key, value in models["lam0"][cid].items():
            assert torch.equal(models["pfllib"][cid][key], value)
    assert any(not torch.equal(models["paper"][0][k], v) for k, v in models["lam0"][0].items())
    for sim in runs.values():
        _assert_personal_rows(sim)


# ---------------------------------------------------------------------------------------------
# FedGH


def test_fedgh_trains_the_global_header_on_prototypes_one_sgd_step_by_hand():
    # pairs: (r = (1, 0), class 0) from client 0 and (r = (0, 1), class 2) from client 1;
    # rows of labels a client does not hold (count 0) must be ignored
    replies = [
        Reply(0, 10, {"prototypes": {"reps": torch.tensor([[1.0, 0.0], [5.0, 5.0], [7.0, 7.0]]), "counts": torch.tensor([5, 0, 0])}}),
        Reply(1, 20, {"prototypes": {"reps": torch.tensor([[9.0, 9.0], [9.0, 9.0], [0.0, 1.0]]), "counts": torch.tensor([0, 0, 3])}}),
    ]
    reps, labels = prototype_pairs([r.payload["prototypes"] for r in replies])
    assert reps.tolist() == [[1.0, 0.0], [0.0, 1.0]] and labels.tolist() == [0, 2]

    head = {"l3.weight": torch.zeros(3, 2), "l3.bias": torch.tensor([math.log(2.0), 0.0, 0.0])}
    server = ServerState({"body.w": torch.ones(4), **head})
    before = {k: v.clone() for k, v in server.model.items()}
    algo = FedGH(FedGHParams(server_lr=2.0), federation(("body.w", "l3.weight", "l3.bias"), batch_size=4))
    new = algo.aggregate(server, replies, round=0)

    # softmax(W r + b) = (1/2, 1/4, 1/4) for both pairs; CE averaged over the batch of 2:
    # grad_b = ((p - e_0) + (p - e_2)) / 2 = (0, 1/4, -1/4)
    # grad_W = ((p - e_0) r_1^T + (p - e_2) r_2^T) / 2 = [[-1/4, 1/4], [1/8, 1/8], [1/8, -3/8]]
    # one SGD step with lr 2: W' = -2 grad_W, b' = b - 2 grad_b
    torch.testing.assert_close(new.model["l3.weight"], torch.tensor([[0.5, -0.5], [-0.25, -0.25], [-0.25, 0.75]]))
    torch.testing.assert_close(new.model["l3.bias"], torch.tensor([math.log(2.0), -0.5, 0.5]))
    assert torch.equal(new.model["body.w"], before["body.w"])  # bodies are never aggregated
    for key, value in before.items():  # the previous head is not trained in place
        assert torch.equal(server.model[key], value)
    assert algo.broadcast(new, 1) == {"head": {"l3.weight": new.model["l3.weight"], "l3.bias": new.model["l3.bias"]}}

    # two steps (batch size 1) start from the previous global head, in a seeded order
    small = FedGH(FedGHParams(server_lr=2.0), federation(("body.w", "l3.weight", "l3.bias"), batch_size=1))
    again = [small.aggregate(server, replies, round=r).model["l3.weight"] for r in (0, 0)]
    assert torch.equal(again[0], again[1])
    assert not torch.allclose(again[0], new.model["l3.weight"])


def test_fedgh_reply_holds_no_body_and_its_prototypes_are_class_means():
    sim = Simulation(prepare(load_config(None, ["algorithm=fedgh", "rounds=1", "num_clients=4"])), None, None)
    algo, cid = sim.algorithm, 2
    ctx = Context(sim, cid, 0)
    message = algo.message_for(algo.broadcast(sim.server, 0), sim.server, cid, 0)
    task = algo.client_begin(message, {}, ctx)
    result = TrainResult(task.params, task.buffers, {}, 0)  # untrained: the client's init body + global head
    reply, state = algo.client_end(task, result, {}, ctx)
    assert set(reply.payload) == {"prototypes"}
    assert set(state) == {"body"} and not any(k.startswith("l3.") for k in state["body"])

    body = split_head(sim.initial_state(cid))[0]
    rows = sim.rows_t[cid]
    z = sim.net({**body, **message["head"]}, sim.setup.eval_transform(sim.train.x[rows]), train=False).z.numpy()
    y = sim.train.y[rows].numpy()
    held = sorted(set(y.tolist()))
    counts = reply.payload["prototypes"]["counts"]
    assert counts.tolist() == [int((y == c).sum()) for c in range(10)]
    np.testing.assert_allclose(reply.payload["prototypes"]["reps"][held].numpy(), np.stack([z[y == c].mean(0) for c in held]), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def gh_sim():
    return simulate("algorithm=fedgh", *PERSONAL)


def test_fedgh_simulation(gh_sim):
    sim = gh_sim
    _assert_personal_rows(sim)
    initial = Simulation(prepare(load_config(None, ["rounds=2", "local_epochs=1", "num_clients=4", "algorithm=fedgh", *PERSONAL])), None, None).server.model
    for key, value in sim.server.model.items():
        assert torch.equal(value, initial[key]) != key.startswith("l3."), key  # only the head moves
    for row in sim.history:
        assert set(row["bytes_up"]) == {"prototypes"} and set(row["bytes_down"]) == {"head"}
    again = simulate("algorithm=fedgh", *PERSONAL)
    assert again.history == sim.history  # same seed, same run


# ---------------------------------------------------------------------------------------------
# FedPAC


def test_feature_statistics_by_hand():
    z = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 1])
    v, h = feature_statistics(z, y, num_classes=3)
    # p = (2/3, 1/3, 0); mu_0 = (2, 0), mu_1 = (0, 2); mean ||z||^2: class 0 (1 + 9)/2 = 5, class 1: 4
    # V = (2/3 * 5 + 1/3 * 4 - (4/9 * 4 + 1/9 * 4)) / 3 = (14/3 - 20/9) / 3 = 22/27
    assert v.shape == () and v.item() == pytest.approx(22 / 27, rel=1e-6)
    torch.testing.assert_close(h, torch.tensor([[4 / 3, 0.0], [0.0, 2 / 3], [0.0, 0.0]]))


def _brute_force_simplex_qp(p):
    """The best KKT point over every support (exact for tiny problems)."""
    m, best = p.shape[0], None
    for r in range(1, m + 1):
        for support in itertools.combinations(range(m), r):
            idx = torch.tensor(support)
            kkt = torch.zeros(r + 1, r + 1, dtype=torch.float64)
            kkt[:r, :r], kkt[:r, r], kkt[r, :r] = 2 * p[idx][:, idx], 1.0, 1.0
            rhs = torch.zeros(r + 1, dtype=torch.float64)
            rhs[r] = 1.0
            sol = torch.linalg.lstsq(kkt, rhs.unsqueeze(1)).solution[:r, 0]
            if (sol < -1e-12).any() or abs(float(sol.sum()) - 1) > 1e-9:
                continue
            a = torch.zeros(m, dtype=torch.float64)
            a[idx] = sol
            if best is None or float(a @ p @ a) < best:
                best = float(a @ p @ a)
    return best


def test_simplex_qp_known_optima():
    # diagonal P: alpha_j proportional to 1 / P_jj
    for diag in ([1.0, 3.0], [0.5, 2.0, 4.0]):
        alpha = simplex_qp(torch.diag(torch.tensor(diag, dtype=torch.float64)))
        inv = 1 / torch.tensor(diag, dtype=torch.float64)
        torch.testing.assert_close(alpha, inv / inv.sum(), rtol=1e-12, atol=1e-14)
    # an optimum on an edge: the third point is far, alpha_3 = 0
    p = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 100.0]], dtype=torch.float64) + 5.0
    alpha = simplex_qp(p)
    assert alpha[2] < 0.05 and alpha[0] == pytest.approx(alpha[1].item())
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        m = int(torch.randint(2, 6, (1,), generator=g))
        a = torch.randn(m, int(torch.randint(1, 5, (1,), generator=g)), generator=g, dtype=torch.float64)
        p = a @ a.T + torch.diag(0.1 * torch.rand(m, generator=g, dtype=torch.float64))
        alpha = simplex_qp(p)
        assert (alpha >= 0).all() and alpha.sum().item() == pytest.approx(1.0, abs=1e-12)
        assert float(alpha @ p @ alpha) == pytest.approx(_brute_force_simplex_qp(p), rel=1e-9, abs=1e-12)


def test_combination_weights_two_clients_by_hand():
    v = torch.tensor([0.5, 2.0])
    hs = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 1.0]]])  # ||h_0 - h_1||^2 = 2
    # P^(0) = diag(0.5, 2) + [[0, 0], [0, 2]] = diag(0.5, 4): alpha ~ (1/0.5, 1/4) = (8/9, 1/9)
    torch.testing.assert_close(combination_matrix(v, hs, 0), torch.diag(torch.tensor([0.5, 4.0], dtype=torch.float64)))
    torch.testing.assert_close(combination_weights(v, hs, 0), torch.tensor([8 / 9, 1 / 9], dtype=torch.float64))
    # P^(1) = diag(0.5 + 2, 2): alpha ~ (1/2.5, 1/2) = (4/9, 5/9)
    torch.testing.assert_close(combination_weights(v, hs, 1), torch.tensor([4 / 9, 5 / 9], dtype=torch.float64))
    # a weight <= 1e-3 is zeroed; the rest renormalised (or not)
    v = torch.tensor([1.0, 2000.0])  # P^(0) = diag(1, 2002): alpha = (2002, 1) / 2003
    assert combination_weights(v, hs, 0).tolist() == [1.0, 0.0]
    raw = combination_weights(v, hs, 0, renormalize=False)
    assert raw[1] == 0.0 and raw[0].item() == pytest.approx(2002 / 2003)


def test_repair_psd_drops_small_eigenpairs_only_when_some_eigenvalue_is_negative():
    psd = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    assert torch.equal(repair_psd(psd, 0.01), psd)
    q = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / math.sqrt(2)  # orthogonal
    p = q @ torch.diag(torch.tensor([3.0, -1e-6], dtype=torch.float64)) @ q.T
    torch.testing.assert_close(repair_psd(p, 0.01), 3.0 * q[:, :1] @ q[:, :1].T)


def _pac_replies():
    g = torch.Generator().manual_seed(0)
    replies = []
    for cid, n in ((0, 30), (2, 10), (3, 60)):
        counts = torch.tensor([3, 0, 2])
        replies.append(Reply(cid, n, {
            "body": {"w": torch.randn(2, generator=g)},
            "head": {"l3.weight": torch.randn(3, 2, generator=g), "l3.bias": torch.randn(3, generator=g)},
            "prototypes": {"reps": torch.randn(3, 2, generator=g) * (counts > 0).unsqueeze(1), "counts": counts},
            "stats": {"V": torch.rand((), generator=g), "h": torch.rand(3, 2, generator=g)},
        }))
    return replies


def test_fedpac_server_combines_the_heads_as_uploaded():
    replies = _pac_replies()
    uploaded = [{k: v.clone() for k, v in r.payload["head"].items()} for r in replies]
    algo = FedPAC(FedPACParams(), federation(("w", "l3.weight", "l3.bias")))
    server = algo.init_server({"w": torch.zeros(2), "l3.weight": torch.zeros(3, 2), "l3.bias": torch.zeros(3)})
    new = algo.aggregate(server, replies, round=0)

    torch.testing.assert_close(new.model["w"], sum(r.num_samples / 100 * r.payload["body"]["w"] for r in replies))
    protos = new.extras["prototypes"]  # uniform mean over the clients holding the label
    assert protos["mask"].tolist() == [True, False, True]
    torch.testing.assert_close(protos["reps"][0], sum(r.payload["prototypes"]["reps"][0] for r in replies) / 3)
    variances = torch.stack([r.payload["stats"]["V"] for r in replies])
    hs = torch.stack([r.payload["stats"]["h"] for r in replies])
    for i, r in enumerate(replies):
        weights = new.extras["head_weights"][r.cid]
        assert weights[1].item() == 0.0  # client 1 did not upload
        alpha = weights[[0, 2, 3]]
        assert (alpha >= 0).all() and alpha.sum().item() == pytest.approx(1.0, abs=1e-12)
        torch.testing.assert_close(alpha, combination_weights(variances, hs, i))
        for key in ("l3.weight", "l3.bias"):
            expected = sum(float(a) * h[key] for a, h in zip(alpha, uploaded))
            torch.testing.assert_close(new.extras["heads"][r.cid][key], expected)
        message = algo.message_for(algo.broadcast(new, 1), new, r.cid, 1)
        assert message["head"] is new.extras["heads"][r.cid] and "prototypes" in message
    for r, head in zip(replies, uploaded):  # no head was overwritten in place
        for key, value in head.items():
            assert torch.equal(r.payload["head"][key], value)
    broadcast = algo.broadcast(new, 1)
    assert algo.message_for(broadcast, new, 1, 1) is broadcast  # no combined head: the broadcast itself
    _safe_roundtrip(new.extras)


@pytest.fixture(scope="module")
def pac_sim():
    return simulate("algorithm=fedpac", *PERSONAL)


def test_fedpac_simulation(pac_sim):
    sim = pac_sim
    _assert_personal_rows(sim)
    assert set(sim.server.extras["heads"]) == {0, 1, 2, 3}
    for cid, weights in sim.server.extras["head_weights"].items():
        assert (weights >= 0).all() and weights.sum().item() == pytest.approx(1.0, abs=1e-9)
    # every client is evaluated with phi_g and its combined head
    algo = sim.algorithm
    message = algo.message_for(algo.broadcast(sim.server, 2), sim.server, 1, 2)
    model = algo.personal_model(sim.store.get(1)["algorithm"], message, Context(sim, 1, 2))
    assert model.state["l3.weight"] is sim.server.extras["heads"][1]["l3.weight"]
    assert model.state["features.fc1.weight"] is sim.server.model["features.fc1.weight"]
    # round 2 downloads: the body and the prototypes to all, a combined head to each
    head_bytes = tensor_bytes(sim.server.extras["heads"][0])
    assert sim.history[1]["bytes_down"]["head"] == 4 * head_bytes
    assert "head" not in sim.history[0]["bytes_down"] and "prototypes" not in sim.history[0]["bytes_down"]
    assert set(sim.history[0]["bytes_up"]) == {"body", "head", "prototypes", "stats"}


def test_fedpac_reply_statistics_use_the_received_body():
    sim = Simulation(prepare(load_config(None, ["algorithm=fedpac", "rounds=1", "num_clients=4"])), None, None)
    algo, cid = sim.algorithm, 1
    ctx = Context(sim, cid, 0)
    message = algo.message_for(algo.broadcast(sim.server, 0), sim.server, cid, 0)
    task = algo.client_begin(message, {}, ctx)
    trained = {r: {k: v + 0.1 for k, v in sd.items()} for r, sd in task.params.items()}  # a stand-in for training
    reply, _ = algo.client_end(task, TrainResult(trained, task.buffers, {}, 1), {}, ctx)
    out, y = ctx.predict({**message["body"], **split_head(sim.initial_state(cid))[1]})
    v, h = feature_statistics(out.z, y, 10)
    torch.testing.assert_close(reply.payload["stats"]["V"], v)
    torch.testing.assert_close(reply.payload["stats"]["h"], h)
    assert torch.equal(reply.payload["body"]["features.fc1.weight"], trained["body"]["features.fc1.weight"])


# ---------------------------------------------------------------------------------------------
# All three: vectorized training, checkpoints


@pytest.mark.parametrize("algorithm", ["fedamp", "fedpac"])
def test_sequential_and_vectorized_agree(algorithm):
    runs = [simulate(f"algorithm={algorithm}", "test_fraction=0.25", "eval_personal=true", f"executor={ex}") for ex in ("sequential", "vectorized")]
    for a, b in zip(runs[0].history, runs[1].history):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
    for cid in range(4):
        for role, value in runs[0].store.get(cid)["algorithm"].items():
            for key, tensor in value.items():
                torch.testing.assert_close(runs[1].store.get(cid)["algorithm"][role][key], tensor, atol=1e-5, rtol=0)


class _StopAfter:
    """A progress reporter that interrupts the run after round ``n`` (checkpointed)."""

    def __init__(self, n):
        self.n = n

    def resume_at(self, rounds_done):
        pass

    def working(self, work):
        pass

    def round_done(self, row):
        if row["round"] == self.n:
            raise KeyboardInterrupt


@pytest.mark.parametrize("algorithm", ["fedamp", "fedgh", "fedpac"])
def test_interrupted_run_resumes_exactly_from_its_checkpoint(tmp_path, algorithm):
    """Client states and server extras survive torch.save / weights_only loading."""
    settings = ["rounds=3", "local_epochs=1", "num_clients=4", f"algorithm={algorithm}", *PERSONAL, "sample_fraction=0.5"]
    Simulation(prepare(load_config(None, settings)), RunDir(tmp_path / "clean")).run()
    with pytest.raises(KeyboardInterrupt):
        Simulation(prepare(load_config(None, settings)), RunDir(tmp_path / "run"), _StopAfter(2)).run()
    resume(prepare(load_config(None, settings)), RunDir(tmp_path / "run", resume=True)).run()
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == (tmp_path / "clean" / "metrics.jsonl").read_bytes()
