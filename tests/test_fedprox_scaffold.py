"""FedProx and SCAFFOLD: losses, control variates, equivalences and executors."""

import math
from types import SimpleNamespace

import pytest
import torch

from contrafl.algorithms.base import Batch, Federation, LocalTask, TaskView, TrainResult
from contrafl.algorithms.fedprox import FedProx, FedProxParams, proximal_term
from contrafl.algorithms.scaffold import Scaffold, ScaffoldParams
from contrafl.config import load_config
from contrafl.engine.comm import tensor_bytes
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.errors import ConfigError
from contrafl.models.base import ModelOutput

BASE = ["dataset=digits", "num_clients=4", "rounds=2", "local_epochs=1"]


def simulation(*overrides: str) -> Simulation:
    return Simulation(prepare(load_config(None, [*BASE, *overrides])), None, None)


def run_rounds(sim: Simulation, rounds: int) -> list[dict]:
    """Run ``rounds`` rounds one at a time (the loop of Simulation.run without outputs)."""
    for t in range(rounds):
        sim.history.append(sim.run_round(t))
    return sim.history


def record(algorithm, method: str) -> list[tuple[tuple, object]]:
    """Wrap ``algorithm.<method>`` so that every call's ``(args, result)`` is recorded."""
    calls = []
    original = getattr(algorithm, method)

    def wrapper(*args):
        result = original(*args)
        calls.append((args, result))
        return result

    setattr(algorithm, method, wrapper)
    return calls


def params_of(sim: Simulation, state: dict) -> dict:
    return {k: state[k] for k in sim.algorithm.federation.param_names}


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def linear_net(state, x, *, train):
    logits = x @ state["w"].T + state["b"]
    return ModelOutput(x, x, logits)


# -- FedProx ---------------------------------------------------------------------------
def test_proximal_term_is_the_squared_distance():
    w = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[0.5]])}
    anchor = {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([[1.5]])}
    assert proximal_term(w, anchor).item() == pytest.approx(1 + 1 + 1)


def test_fedprox_loss_and_gradient_by_hand():
    fed = Federation(1, 2, 1, 0.01, 1, 1, ("w", "b"))
    algo = FedProx(FedProxParams(mu=0.1), fed)
    w = torch.zeros(2, 2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    glob = {"w": torch.ones(2, 2), "b": torch.tensor([1.0, -1.0])}
    task = TaskView({"model": {"w": w, "b": b}}, {"model": {}}, {}, {"global": glob})
    batch = Batch(torch.tensor([[1.0, 2.0]]), torch.tensor([0]))
    loss, stats = algo.local_loss(task, batch, linear_net)
    # logits [0, 0] -> CE = log 2; prox = 4 * (0 - 1)^2 + (0 - 1)^2 + (0 + 1)^2 = 6
    assert loss.item() == pytest.approx(math.log(2) + 0.1 / 2 * 6)
    assert stats["prox"].item() == pytest.approx(6)
    gw, gb = torch.autograd.grad(loss, [w, b])
    # CE: dl/dlogits = softmax - onehot = [-0.5, 0.5]; dW = dlogits^T x, db = dlogits.
    # prox: mu (w - w_glob) = -0.1 for every W entry, [-0.1, 0.1] for b.
    assert torch.allclose(gw, torch.tensor([[-0.5 - 0.1, -1.0 - 0.1], [0.5 - 0.1, 1.0 - 0.1]]))
    assert torch.allclose(gb, torch.tensor([-0.5 - 0.1, 0.5 + 0.1]))


def test_fedprox_with_mu_zero_is_fedavg():
    prox = simulation("algorithm=fedprox", "algorithm.mu=0")
    avg = simulation("algorithm=fedavg")
    prox_rows, avg_rows = run_rounds(prox, 2), run_rounds(avg, 2)
    assert [{k: v for k, v in r.items() if k != "loss_parts"} for r in prox_rows] == avg_rows  # FedAvg's loss has no parts
    assert [r["loss_parts"]["ce"] for r in prox_rows] == [r["train_loss"] for r in avg_rows]
    assert_states_equal(prox.server.model, avg.server.model)
    pulled = simulation("algorithm=fedprox", "algorithm.mu=1")
    run_rounds(pulled, 1)
    assert pulled.history[0]["train_loss"] != avg.history[0]["train_loss"]


def test_fedprox_shares_the_broadcast_parameters():
    sim = simulation("algorithm=fedprox")
    calls = record(sim.algorithm, "client_begin")
    run_rounds(sim, 1)
    message = calls[0][0][0]
    for _, task in calls:
        assert task.consts["global"].keys() == set(sim.algorithm.federation.param_names)
        assert all(v is message["model"][k] for k, v in task.consts["global"].items())


# -- SCAFFOLD --------------------------------------------------------------------------
def test_scaffold_control_variates_follow_option_two():
    sim = simulation("algorithm=scaffold", "sample_fraction=0.5", "rounds=3")
    calls = record(sim.algorithm, "aggregate")
    fed, cfg = sim.algorithm.federation, sim.cfg
    assert fed.num_clients == 4 and len(sim.schedule[0]) == 2  # N differs from |S|
    c = {k: torch.zeros_like(v) for k, v in params_of(sim, sim.server.model).items()}
    c_i: dict[int, dict] = {}
    for t in range(3):
        sim.history.append(sim.run_round(t))
        (server, replies, _), _ = calls[t]
        w_glob = server.model
        deltas = []
        for r in replies:
            steps = cfg.local_epochs * (len(sim.rows[r.cid]) // cfg.batch_size)
            old = c_i.get(r.cid, {k: torch.zeros_like(v) for k, v in c.items()})
            new = {k: old[k] - c[k] + (w_glob[k] - r.payload["model"][k]) / (steps * cfg.lr) for k in c}
            deltas.append({k: new[k] - old[k] for k in c})
            c_i[r.cid] = new
            for k in c:
                assert torch.allclose(sim.store.get(r.cid)["algorithm"]["c_i"][k], new[k], atol=1e-6)
                assert torch.allclose(r.payload["delta_c"][k], deltas[-1][k], atol=1e-6)
        c = {k: c[k] + sum(d[k] for d in deltas) / fed.num_clients for k in c}
        for k in c:
            assert torch.allclose(sim.server.extras["c"][k], c[k], atol=1e-6)
    assert max(v.abs().max().item() for v in c.values()) > 1e-3


def test_scaffold_bytes_by_kind():
    sim = simulation("algorithm=scaffold", "sample_fraction=0.5")
    row = run_rounds(sim, 1)[0]
    model = tensor_bytes(sim.server.model)
    params = tensor_bytes(params_of(sim, sim.server.model))
    assert row["bytes_down"] == {"model": 2 * model, "c": 2 * params}
    assert row["bytes_up"] == {"model": 2 * model, "delta_c": 2 * params}


def test_scaffold_with_one_iid_client_is_fedavg():
    one = ["num_clients=1", "partition=iid"]
    scaffold = simulation("algorithm=scaffold", *one)
    avg = simulation("algorithm=fedavg", *one)
    corrections = record(scaffold.algorithm, "correction")
    run_rounds(scaffold, 1)
    run_rounds(avg, 1)
    c, c_1 = scaffold.server.extras["c"], scaffold.store.get(0)["algorithm"]["c_i"]
    assert_states_equal(c, c_1)
    assert max(v.abs().max().item() for v in c.values()) > 1e-3
    scaffold.history.append(scaffold.run_round(1))
    avg.history.append(avg.run_round(1))
    assert corrections and all(v.abs().max() == 0 for _, d in corrections for v in d.values())
    for rows in (scaffold.history, avg.history):
        for row in rows:
            del row["bytes_down"], row["bytes_up"]
    assert scaffold.history == avg.history
    assert_states_equal(scaffold.server.model, avg.server.model)


def final_model_gap(a: Simulation, b: Simulation) -> float:
    return max((v.double() - b.server.model[k].double()).abs().max().item() for k, v in a.server.model.items())


def test_scaffold_corrections_coincide_for_plain_sgd():
    sgd = ["algorithm=scaffold", "momentum=0", "weight_decay=0"]
    post = simulation(*sgd)
    grad = simulation(*sgd, "algorithm.correction=gradient")
    avg = simulation("algorithm=fedavg", "momentum=0", "weight_decay=0")
    for sim in (post, grad, avg):
        run_rounds(sim, 2)
    assert final_model_gap(post, grad) < 1e-5
    for k, v in post.server.extras["c"].items():
        assert torch.allclose(v, grad.server.extras["c"][k], atol=1e-5), k
    assert final_model_gap(post, avg) > 1e-3  # the correction acted in round 2
    # with momentum the gradient form passes c - c_i through it, the NIID-Bench form does not
    post_m, grad_m = simulation("algorithm=scaffold"), simulation("algorithm=scaffold", "algorithm.correction=gradient")
    for sim in (post_m, grad_m):
        run_rounds(sim, 2)
    assert final_model_gap(post_m, grad_m) > 1e-3


@pytest.mark.parametrize(
    "algorithm",
    [["algorithm=fedprox"], ["algorithm=scaffold"], ["algorithm=scaffold", "algorithm.correction=gradient"]],
    ids=["fedprox", "scaffold", "scaffold-gradient"],
)
def test_sequential_and_vectorized_executors_agree(algorithm):
    seq, vec = (simulation(*algorithm, f"executor={e}", "local_epochs=2") for e in ("sequential", "vectorized"))
    for sim in (seq, vec):
        run_rounds(sim, 2)
    assert final_model_gap(seq, vec) < 1e-5
    for k, v in seq.server.extras.get("c", {}).items():
        assert torch.allclose(v, vec.server.extras["c"][k], atol=1e-5), k


def test_scaffold_client_without_steps_keeps_its_control_variate():
    algo = Scaffold(ScaffoldParams(), Federation(4, 2, 1, 0.01, 1, 16, ("w",)))
    w = {"w": torch.tensor([1.0, 2.0])}
    c_i = {"w": torch.tensor([0.5, -0.5])}
    task = LocalTask({"model": w}, {"model": {}}, consts={"c": {"w": torch.tensor([1.0, 1.0])}, "c_i": c_i})
    result = TrainResult({"model": w}, {"model": {}}, {}, steps=0)
    reply, state = algo.client_end(task, result, {"c_i": c_i}, SimpleNamespace(cid=3, num_samples=8))
    assert torch.equal(reply.payload["delta_c"]["w"], torch.zeros(2))
    assert state["c_i"] is c_i


def test_scaffold_rejects_an_unknown_correction():
    with pytest.raises(ConfigError, match="correction"):
        prepare(load_config(None, ["algorithm=scaffold", "algorithm.correction=paper"]))
