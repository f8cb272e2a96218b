"""FedSiam-DA: stop-gradient losses, dual aggregation and end-to-end equivalences."""

import functools
import math

import numpy as np
import pytest
import torch

from contrafl import params as P
from contrafl.algorithms import ALGORITHMS
from contrafl.algorithms.base import Batch, Federation, Reply, ServerState, TaskView
from contrafl.algorithms.fedsiam_da import FedSiamDA, FedSiamDAParams, history_term, similarity_weights
from contrafl.config import load_config
from contrafl.execution.executor import FunctionalNet
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.errors import ConfigError
from contrafl.metrics.evaluate import evaluate
from contrafl.models import Heads, build_model
from contrafl.models.base import ModelOutput


def make_algo(param_names=("w",), **options) -> FedSiamDA:
    federation = Federation(10, 3, 2, 0.1, 1, 4, tuple(param_names))
    return FedSiamDA(P.build(FedSiamDAParams, options, "algorithm"), federation)


# -- the loss on a hand-built linear "network" ------------------------------------------
def linear_net(state, x, *, train):
    """z = x W, p = z P, logits = z."""
    z = x @ state["W"]
    return ModelOutput(z, z, z, z @ state["P"])


def hand_task() -> TaskView:
    eye, swap = torch.eye(2), torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    model = {"W": eye, "P": swap}  # z_k = [3, 4], p_k = [4, 3]
    branch = {"W": swap, "P": eye}  # z_g = [4, 3], p_g = [4, 3]
    hist = {"W": torch.tensor([[1.0, 0.0], [0.0, 0.0]]), "P": eye}  # z_prev = [3, 0]
    empty = {"n": torch.zeros(())}
    return TaskView({"model": model, "branch": branch}, {"model": empty, "branch": dict(empty)}, {"hist": hist}, {})


def test_stage_losses_against_hand_computed_values():
    algo, task = make_algo(mu=0.1), hand_task()
    batch = Batch(torch.tensor([[3.0, 4.0]]), torch.tensor([1]))
    ce = math.log(1 + math.exp(-1))  # -log softmax([3, 4])[1]
    # eq. 8: mu/2 * D(p_g, z_k) = 0.05 * -(4*3 + 3*4)/(5*5) = 0.05 * -0.96
    loss, stats = algo.branch_loss(task, batch, linear_net)
    assert loss.item() == pytest.approx(-0.048) and stats["stop_g"].item() == pytest.approx(-0.96)
    # eq. 9: CE + mu (cos(z_prev, z_k) + 1/2 D(p_k, z_g)) = CE + 0.1 (9/15 - 1/2 * 1)
    loss, stats = algo.model_loss(task, batch, linear_net)
    assert stats["hist"].item() == pytest.approx(0.6) and stats["stop_k"].item() == pytest.approx(-1.0)
    assert loss.item() == pytest.approx(ce + 0.1 * (0.6 - 0.5))
    # joint: CE + mu (0.6 + 1/2 (-0.96) + 1/2 (-1))
    loss, _ = make_algo(mu=0.1, update="joint").joint_loss(task, batch, linear_net)
    assert loss.item() == pytest.approx(ce + 0.1 * (0.6 - 0.48 - 0.5))


def test_batch_mean_of_the_cosine_terms():
    algo, task = make_algo(mu=1.0), hand_task()
    # second sample x = [1, 0]: z_k = [1, 0], p_g = z_g = [0, 1] -> D(p_g, z_k) = 0
    batch = Batch(torch.tensor([[3.0, 4.0], [1.0, 0.0]]), torch.tensor([1, 0]))
    _, stats = algo.branch_loss(task, batch, linear_net)
    assert stats["stop_g"].item() == pytest.approx((-0.96 + 0.0) / 2)


# -- stop-gradient on the real architecture ------------------------------------------
def tiny_setup(seed=0):
    def init(s):
        torch.manual_seed(s)
        return build_model("mlp", (8,), 3, {"hidden": [6], "projection_dim": 5}, heads=Heads(predictor_hidden=4))

    model = init(seed)
    names = tuple(n for n, _ in model.named_parameters())
    algo = make_algo(names, mu=0.5)
    states = [{k: v.detach().clone() for k, v in init(seed + i).state_dict().items()} for i in range(3)]
    roles = {}
    for role, state in zip(("model", "branch"), states):
        params, buffers = algo.federation.split(state)
        roles[role] = ({k: v.requires_grad_(True) for k, v in params.items()}, buffers)
    task = TaskView({r: p for r, (p, _) in roles.items()}, {r: b for r, (_, b) in roles.items()}, {"hist": states[2]}, {})
    g = torch.Generator().manual_seed(seed)
    batch = Batch(torch.randn(6, 8, generator=g), torch.tensor([0, 1, 2, 0, 1, 2]))
    return algo, task, batch, FunctionalNet(model)


def grads_by_role(loss, task):
    out = {}
    for role, params in task.params.items():
        grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
        out[role] = {k: torch.zeros_like(p) if gr is None else gr for (k, p), gr in zip(params.items(), grads)}
    return out


def norm(grads):
    return sum(float(g.norm()) for g in grads.values())


def test_branch_stage_trains_only_the_branch_and_its_batchnorm():
    algo, task, batch, net = tiny_setup()
    before = {r: {k: v.clone() for k, v in b.items()} for r, b in task.buffers.items()}
    loss, _ = algo.branch_loss(task, batch, net)
    grads = grads_by_role(loss, task)
    assert norm(grads["model"]) == 0
    assert all(float(grads["branch"][k].norm()) > 0 for k in ("features.fc1.weight", "l2.weight", "predictor.3.weight"))
    assert float(grads["branch"]["l3.weight"].norm()) == 0  # the classifier is not in eq. 8
    bn = "predictor.1.running_mean"
    assert torch.equal(task.buffers["model"][bn], before["model"][bn])
    assert not torch.equal(task.buffers["branch"][bn], before["branch"][bn])


def test_model_stage_trains_only_the_local_model_and_its_batchnorm():
    algo, task, batch, net = tiny_setup()
    before = {r: {k: v.clone() for k, v in b.items()} for r, b in task.buffers.items()}
    loss, _ = algo.model_loss(task, batch, net)
    grads = grads_by_role(loss, task)
    assert norm(grads["branch"]) == 0
    assert all(float(g.norm()) > 0 for g in grads["model"].values())
    bn = "predictor.1.running_mean"
    assert torch.equal(task.buffers["branch"][bn], before["branch"][bn])
    assert not torch.equal(task.buffers["model"][bn], before["model"][bn])


def test_joint_gradients_are_those_of_the_two_stages():
    """Disjoint gradients: the joint loss gives the branch the gradient of eq. 8 and the
    local model that of eq. 9 (same parameters, the branch not yet stepped)."""
    algo, task, batch, net = tiny_setup()
    joint = grads_by_role(algo.joint_loss(task, batch, net)[0], task)
    branch = grads_by_role(algo.branch_loss(task, batch, net)[0], task)["branch"]
    model = grads_by_role(algo.model_loss(task, batch, net)[0], task)["model"]
    for k in branch:
        torch.testing.assert_close(joint["branch"][k], branch[k])
        torch.testing.assert_close(joint["model"][k], model[k])


def test_first_history_stand_in_switches_l_hist_off():
    algo, task, batch, net = tiny_setup()
    fresh = algo.client_begin({"model": {**task.params["model"], **task.buffers["model"]}}, {}, None)
    zero = fresh.frozen["hist"]
    assert all(float(v.abs().sum()) == 0 for v in zero.values())
    z_prev = net(zero, batch.x, train=False).z
    assert float(z_prev.abs().sum()) == 0
    with_zero = task._replace(frozen={"hist": zero})
    loss, stats = algo.model_loss(with_zero, batch, net)
    assert stats["hist"].item() == 0
    assert loss.item() == pytest.approx((stats["ce"] + 0.5 * 0.5 * stats["stop_k"]).item())
    z = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True).z
    assert norm(grads_by_role(history_term(z_prev, z), task)["model"]) == 0


def test_alternating_stages_follow_eqs_8_then_9():
    alternating = make_algo().stages(0)
    assert [s.trains for s in alternating] == [("branch",), ("model",)]
    assert [s.loss.__name__ for s in alternating] == ["branch_loss", "model_loss"]
    joint = make_algo(update="joint").stages(0)
    assert len(joint) == 1 and joint[0].trains is None and joint[0].loss.__name__ == "joint_loss"


def test_client_begin_roles_history_and_reset():
    algo = make_algo(("w",))
    glob = {"w": torch.ones(2), "bn.running_mean": torch.zeros(2)}
    mine = {"w": torch.full((2,), 5.0), "bn.running_mean": torch.ones(2)}
    task = algo.client_begin({"model": glob}, {"model": mine}, None)
    assert task.params["model"]["w"] is glob["w"] and task.params["branch"]["w"] is glob["w"]
    assert task.frozen["hist"] is mine and task.snapshots == {"hist": "model"}
    kept = make_algo(("w",), reset=False, history="round").client_begin({"model": glob}, {"model": mine}, None)
    assert kept.params["model"]["w"] is mine["w"] and kept.params["branch"]["w"] is glob["w"]
    assert kept.snapshots == {}
    first = make_algo(("w",), reset=False).client_begin({"model": glob}, {}, None)
    assert first.params["model"]["w"] is glob["w"]


def test_options_are_validated():
    with pytest.raises(ConfigError, match="algorithm.update='both'"):
        P.build(FedSiamDAParams, {"update": "both"}, "algorithm")
    assert ALGORITHMS.get("fedsiam_da").heads(FedSiamDAParams()).predictor_hidden == 256


# -- dual aggregation ---------------------------------------------------------------------
def replies_of(states, sizes):
    return [Reply(cid, n, {"model": s}) for cid, (s, n) in enumerate(zip(states, sizes))]


def test_dual_aggregation_weights_are_normalised_parameter_cosines():
    g = torch.Generator().manual_seed(1)
    states = [
        {
            "w": torch.randn(3, 2, generator=g) + 1,
            "b": torch.randn(2, generator=g) + 1,
            "bn.running_var": torch.rand(2, generator=g) * 100,  # a buffer: not in the cosine
            "bn.num_batches_tracked": torch.tensor(10 * (k + 1)),
        }
        for k in range(3)
    ]
    sizes = [10, 30, 60]
    for first in ("uniform", "samples"):
        algo = make_algo(("w", "b"), first_average=first)
        server = algo.aggregate(ServerState({}, {"other": 1}), replies_of(states, sizes), 0)
        vecs = np.stack([np.concatenate([s["w"].numpy().ravel(), s["b"].numpy().ravel()]).astype(np.float64) for s in states])
        a = np.full(3, 1 / 3) if first == "uniform" else np.array(sizes) / 100
        ref = a @ vecs
        d = vecs @ ref / (np.linalg.norm(vecs, axis=1) * np.linalg.norm(ref))
        xi = d / d.sum()
        assert server.extras["other"] == 1
        np.testing.assert_allclose([server.extras["xi"][k] for k in range(3)], xi, rtol=1e-12)
        for key in ("w", "b", "bn.running_var"):
            expected = sum(x * s[key].double().numpy() for x, s in zip(xi, states))
            np.testing.assert_allclose(server.model[key].numpy(), expected, rtol=1e-5)
        assert server.model["bn.num_batches_tracked"].item() == int(sum(x * 10 * (k + 1) for k, x in enumerate(xi)))


def test_dual_aggregation_clips_negative_similarities():
    v = torch.tensor([1.0, 2.0])
    # w^f0 = (v + v - 3v)/3 = -v/3: D = [-1, -1, 1] -> xi = [0, 0, 1]
    xi = similarity_weights([{"w": v}, {"w": v}, {"w": -3 * v}], [1 / 3] * 3, ["w"])
    assert xi.tolist() == [0.0, 0.0, 1.0]
    # w^f0 = 0: every D is 0 -> uniform
    assert similarity_weights([{"w": v}, {"w": -v}], [0.5, 0.5], ["w"]).tolist() == [0.5, 0.5]


# -- end to end on digits -----------------------------------------------------------------
BASE = ("rounds=2", "local_epochs=2", "num_clients=4", "lr=0.05")
# Few, small steps keep the executor comparison within float noise: over many or large
# steps the predictor's BatchNorm, normalising hidden units of tiny batch variance,
# amplifies the rounding differences of batched and unbatched kernels (and of thread
# counts) beyond 1e-5.
SHORT = ("batch_size=64", "lr=0.02")


@functools.cache
def simulate(*overrides: str) -> Simulation:
    sim = Simulation(prepare(load_config(None, [*BASE, *overrides])), None, None)
    sim.run()
    return sim


def max_difference(a, b):
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("update", ["alternating", "joint"])
def test_sequential_and_vectorized_executors_agree(update):
    seq = simulate(*SHORT, "algorithm=fedsiam_da", f"algorithm.update={update}", "executor=sequential")
    vec = simulate(*SHORT, "algorithm=fedsiam_da", f"algorithm.update={update}", "executor=vectorized")
    for k, v in seq.server.model.items():
        torch.testing.assert_close(vec.server.model[k], v, atol=1e-5, rtol=0)
    assert vec.server.extras["xi"] == pytest.approx(seq.server.extras["xi"], abs=1e-6)
    # the epoch snapshots matter far beyond that tolerance
    prev_round = simulate(*SHORT, "algorithm=fedsiam_da", f"algorithm.update={update}", "algorithm.history=round", "executor=sequential")
    assert max_difference(prev_round.server.model, seq.server.model) > 1e-4


@pytest.mark.slow
def test_both_update_modes_train_and_differ():
    init = prepare(load_config(None, [*BASE, "algorithm=fedsiam_da"])).model.state_dict()
    models = {}
    for update in ("alternating", "joint"):
        sim = simulate("algorithm=fedsiam_da", f"algorithm.update={update}", "executor=sequential")
        init_eval = evaluate(sim.net, init, sim.test.x, sim.test.y, sim.setup.eval_transform, 1000)
        assert sim.history[-1]["test_loss"] < 0.6 * init_eval["loss"]
        assert sim.history[-1]["test_acc"] > init_eval["acc"] + 0.3
        models[update] = sim.server.model
    assert max_difference(models["alternating"], models["joint"]) > 1e-4


def test_mu_zero_with_plain_averaging_is_fedavg():
    """With mu = 0 the local objective is CE alone: the encoder, head and classifier follow
    FedAvg's exactly (the predictor is extra and untrained)."""
    siam = simulate(*SHORT, "algorithm=fedsiam_da", "algorithm.mu=0", "algorithm.aggregation=fedavg", "executor=sequential")
    avg = simulate(*SHORT, "algorithm=fedavg", "executor=sequential")
    assert set(avg.server.model) < set(siam.server.model)
    for k, v in avg.server.model.items():
        torch.testing.assert_close(siam.server.model[k], v, atol=1e-6, rtol=0)
    dual = simulate(*SHORT, "algorithm=fedsiam_da", "algorithm.mu=0", "executor=sequential")
    assert max_difference({"l3.weight": dual.server.model["l3.weight"]}, avg.server.model) > 0


def test_personal_accuracy_is_the_mean_over_uploaded_local_models():
    sim = simulate("algorithm=fedsiam_da", "algorithm.update=alternating", "executor=sequential")
    assert all("personal_acc" in row and "personal_acc_std" in row for row in sim.history)
    accs = []
    for cid in range(4):
        state = sim.store.get(cid)["algorithm"]["model"]
        accs.append(evaluate(sim.net, state, sim.test.x, sim.test.y, sim.setup.eval_transform, 1000)["acc"])
    assert sim.history[-1]["personal_acc"] == pytest.approx(np.mean(accs))
    assert sim.history[-1]["personal_acc_std"] == pytest.approx(np.std(accs))
    assert sorted(sim.server.extras["xi"]) == [0, 1, 2, 3]
    assert sum(sim.server.extras["xi"].values()) == pytest.approx(1.0)
