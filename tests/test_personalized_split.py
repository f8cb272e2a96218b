"""FedPer, LG-FedAvg, FedRep and Ditto: what is shared and averaged, what stays on the
client, the local updates checked against hand-computed SGD steps on a tiny model, and
short digits simulations (sequential == vectorized, every client evaluated)."""

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import contrafl.algorithms.ditto  # noqa: F401  (registration)
import contrafl.algorithms.fedper  # noqa: F401
import contrafl.algorithms.fedrep  # noqa: F401
import contrafl.algorithms.lgfedavg  # noqa: F401
from contrafl import params as P
from contrafl.algorithms.base import Federation, Reply, TrainResult
from contrafl.algorithms.ditto import Ditto, DittoParams
from contrafl.algorithms.fedper import FedPer
from contrafl.algorithms.fedrep import FedRep, FedRepParams
from contrafl.algorithms.lgfedavg import LGFedAvg
from contrafl.data.augment import eval_transform
from contrafl.execution.executor import FunctionalNet, Job, PhaseRun, SequentialExecutor, Workload
from contrafl.execution.optim import SGD
from contrafl.execution.plan import make_plan
from contrafl.rng import generator
from contrafl.execution.validate import check_reply
from contrafl.execution.vectorized import VectorizedExecutor
from contrafl.models.base import FedModel

from conftest import simulate


pytestmark = pytest.mark.usefixtures("one_thread")


# -- hand-made states ----------------------------------------------------------------
NAMES = ("features.0.weight", "l3.weight", "l3.bias")


def fed(names=NAMES, lr=0.1):
    return Federation(num_clients=2, num_classes=2, rounds=1, lr=lr, local_epochs=1, batch_size=4, param_names=tuple(names))


def state(a, b, c):
    """A three-entry state dict: body ``features.0.weight`` = a, head ``l3.*`` = b, c."""
    return {"features.0.weight": torch.tensor(a), "l3.weight": torch.tensor(b), "l3.bias": torch.tensor(c)}


def ctx(cid=0, n=4, init=None):
    return SimpleNamespace(cid=cid, round=0, num_samples=n, initial_state=lambda: init)


def result(body, head):
    """A TrainResult holding the roles ``body`` and ``head`` (no buffers)."""
    return TrainResult(params={"body": body, "head": head}, buffers={"body": {}, "head": {}}, stats={}, steps=1)


def test_fedper_shares_and_averages_the_body_only():
    algo = FedPer(P.NoOptions(), fed())
    server = algo.init_server(state([[1.0, 2.0]], [[5.0, 6.0]], [7.0]))
    message = algo.broadcast(server, 0)
    assert set(message) == {"body"} and list(message["body"]) == ["features.0.weight"]

    # a client starts its head from its own initialisation, the body from the message
    own = state([[9.0, 9.0]], [[-1.0, -2.0]], [-3.0])
    st = algo.init_client(ctx(init=own))
    task = algo.client_begin(message, st, ctx(init=own))
    assert torch.equal(task.params["body"]["features.0.weight"], message["body"]["features.0.weight"])
    assert torch.equal(task.params["head"]["l3.weight"], own["l3.weight"])

    # the reply carries the trained body only; the trained head is the new client state
    trained_body = {"features.0.weight": torch.tensor([[3.0, 4.0]])}
    trained_head = {"l3.weight": torch.tensor([[0.5, 0.5]]), "l3.bias": torch.tensor([0.25])}
    reply, new_state = algo.client_end(task, result(trained_body, trained_head), st, ctx(n=1))
    assert set(reply.payload) == {"body"} and not any(k.startswith("l3.") for k in reply.payload["body"])
    assert check_reply(reply, algo.reply_spec(message)) is None
    assert new_state == {"head": trained_head}

    # aggregate: n-weighted body (1 and 3 samples); the server's head is left as it was
    other = Reply(1, 3, {"body": {"features.0.weight": torch.tensor([[7.0, 8.0]])}})
    new = algo.aggregate(server, [reply, other], 0)
    assert new.model["features.0.weight"].tolist() == [[(3 + 3 * 7) / 4, (4 + 3 * 8) / 4]]  # [[6, 7]]
    assert new.model["l3.weight"].tolist() == [[5.0, 6.0]] and new.model["l3.bias"].tolist() == [7.0]
    # the next round trains the new body with the head the client kept
    nxt = algo.client_begin(algo.broadcast(new, 1), new_state, ctx(init=own))
    assert nxt.params["body"]["features.0.weight"].tolist() == [[6.0, 7.0]]
    assert nxt.params["head"] == trained_head

    # evaluation: the received body with the client's own head (not the server's)
    personal = algo.personal_model(new_state, algo.broadcast(new, 1), ctx()).state
    assert personal["features.0.weight"].tolist() == [[6.0, 7.0]]
    assert personal["l3.weight"].tolist() == [[0.5, 0.5]] and personal["l3.bias"].tolist() == [0.25]
    # a client that never trained: received body + its own initial head
    fresh = algo.personal_model(algo.init_client(ctx(init=own)), algo.broadcast(new, 1), ctx()).state
    assert fresh["features.0.weight"].tolist() == [[6.0, 7.0]] and fresh["l3.bias"].tolist() == [-3.0]


def test_lg_fedavg_shares_and_averages_the_head_only():
    algo = LGFedAvg(P.NoOptions(), fed())
    server = algo.init_server(state([[1.0, 2.0]], [[5.0, 6.0]], [7.0]))
    message = algo.broadcast(server, 0)
    assert set(message) == {"head"} and sorted(message["head"]) == ["l3.bias", "l3.weight"]

    own = state([[9.0, 8.0]], [[-1.0, -2.0]], [-3.0])
    st = algo.init_client(ctx(init=own))
    assert list(st["body"]) == ["features.0.weight"]  # the client's own body, no head
    task = algo.client_begin(message, st, ctx(init=own))
    assert task.params["body"]["features.0.weight"].tolist() == [[9.0, 8.0]]  # own, not the server's
    assert task.params["head"]["l3.weight"].tolist() == [[5.0, 6.0]]  # received

    trained_body = {"features.0.weight": torch.tensor([[0.0, 1.0]])}
    h1 = {"l3.weight": torch.tensor([[1.0, -1.0]]), "l3.bias": torch.tensor([2.0])}
    reply, new_state = algo.client_end(task, result(trained_body, h1), st, ctx(n=1))
    assert set(reply.payload) == {"head"} and all(k.startswith("l3.") for k in reply.payload["head"])
    assert check_reply(reply, algo.reply_spec(message)) is None
    assert new_state == {"body": trained_body}

    # h = (1 * h1 + 3 * h2) / 4; the server's body entries stay the initial ones
    h2 = {"l3.weight": torch.tensor([[5.0, 3.0]]), "l3.bias": torch.tensor([-2.0])}
    new = algo.aggregate(server, [reply, Reply(1, 3, {"head": h2})], 0)
    assert new.model["l3.weight"].tolist() == [[(1 + 15) / 4, (-1 + 9) / 4]]  # [[4, 2]]
    assert new.model["l3.bias"].tolist() == [(2 - 6) / 4]  # [-1]
    assert new.model["features.0.weight"].tolist() == [[1.0, 2.0]]
    assert set(new.model) == set(NAMES)  # still a full state dict
    # the next round trains the body the client kept with the new head
    nxt = algo.client_begin(algo.broadcast(new, 1), new_state, ctx(init=own))
    assert nxt.params["body"] == trained_body
    assert nxt.params["head"]["l3.weight"].tolist() == [[4.0, 2.0]]

    # evaluation: the client's own body with the received head
    personal = algo.personal_model(new_state, algo.broadcast(new, 1), ctx()).state
    assert personal["features.0.weight"].tolist() == [[0.0, 1.0]]
    assert personal["l3.weight"].tolist() == [[4.0, 2.0]] and personal["l3.bias"].tolist() == [-1.0]


# -- local training of a tiny model against hand-computed SGD steps --------------------
LR = 0.1


def tiny_model(seed):
    """``logits = relu(x W1^T + b1) W3^T + b3``: body features.0.*, head l3.*."""
    torch.manual_seed(seed)
    return FedModel(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), 4, 2, projection_dim=None)


def tiny_state(seed):
    return {k: v.detach().clone() for k, v in tiny_model(seed).state_dict().items()}


def tiny_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(4, 3, generator=g), torch.tensor([0, 1, 1, 0])


def ce_by_hand(s, x, y):
    hidden = F.relu(x @ s["features.0.weight"].T + s["features.0.bias"])
    return F.cross_entropy(hidden @ s["l3.weight"].T + s["l3.bias"], y)


def sgd_step(s, grads_of, x, y, lam=0.0, anchor=None):
    """One plain SGD step on the entries ``grads_of`` of ``s``:
    ``w - LR * (grad CE + lam * (w - anchor))``."""
    s = {k: v.clone().requires_grad_(k in grads_of) for k, v in s.items()}
    grads = torch.autograd.grad(ce_by_hand(s, x, y), [s[k] for k in grads_of])
    out = {k: v.detach() for k, v in s.items()}
    for k, g in zip(grads_of, grads):
        prox = lam * (out[k] - anchor[k]) if lam else 0.0
        out[k] = out[k] - LR * (g + prox)
    return out


def local_training(algo, message, client_state, executor="sequential", phases=None):
    """One client's round: client_begin, the algorithm's phases on the 4-sample dataset in
    batches of 4 (one step per epoch) with plain SGD, client_end."""
    model = tiny_model(0)
    net = FunctionalNet(model)
    x, y = tiny_data()
    tf = eval_transform(None, None)
    c = ctx(n=4, init=tiny_state(1))
    task = algo.client_begin(message, client_state, c)
    all_phases = algo.phases(0)
    chosen = all_phases if phases is None else [all_phases[i] for i in phases]
    runs = [PhaseRun(p.stages, SGD(LR)) for p in chosen]
    plans = [make_plan(np.arange(4), p.epochs or 1, 4, True, tf.sample, 1, generator(0, "plan", i)) for i, p in enumerate(chosen)]
    work = Workload(x, y, tf, net, runs)
    job = Job(0, task, plans, seed=0)
    ex = SequentialExecutor(work) if executor == "sequential" else VectorizedExecutor(work, 2**30)
    res = ex.train([job])[0]
    reply, new_state = algo.client_end(task, res, client_state, c)
    return res, reply, new_state


def names(model):
    return tuple(n for n, _ in model.named_parameters())


def split(s):
    return {k: v for k, v in s.items() if not k.startswith("l3.")}, {k: v for k, v in s.items() if k.startswith("l3.")}


def assert_states_close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_fedrep_trains_the_head_then_the_body(executor):
    algo = FedRep(FedRepParams(head_epochs=2), fed(names(tiny_model(0)), LR))
    server = algo.init_server(tiny_state(0))
    message = algo.broadcast(server, 0)
    st = algo.init_client(ctx(init=tiny_state(1)))
    x, y = tiny_data()
    body, head = split(tiny_state(0))[0], split(tiny_state(1))[1]
    assert not torch.equal(head["l3.weight"], split(tiny_state(0))[1]["l3.weight"])  # own head

    # by hand: 2 head steps with the received body, then 1 body step with the new head
    s = {**body, **head}
    s = sgd_step(s, ["l3.weight", "l3.bias"], x, y)
    s = sgd_step(s, ["l3.weight", "l3.bias"], x, y)
    after_head = s
    s = sgd_step(s, ["features.0.weight", "features.0.bias"], x, y)
    hand_body, hand_head = split(s)

    res, reply, new_state = local_training(algo, message, st, executor)
    assert res.steps == 3
    assert_states_close(reply.payload["body"], hand_body)
    assert_states_close(new_state["head"], hand_head)
    assert_states_close(hand_head, split(after_head)[1])  # the body phase left the head alone

    # the head phase alone: the body is exactly the received one
    res, reply, new_state = local_training(algo, message, st, executor, phases=[0])
    for k, v in message["body"].items():
        assert torch.equal(reply.payload["body"][k], v)
    assert_states_close(new_state["head"], split(after_head)[1])
    assert not torch.equal(new_state["head"]["l3.weight"], head["l3.weight"])


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
@pytest.mark.parametrize("lam", [0.5, 0.0])
def test_ditto_personal_step_is_pulled_to_the_global_model(lam, executor):
    algo = Ditto(DittoParams(lam=lam, personal_epochs=1), fed(names(tiny_model(0)), LR))
    w_g = tiny_state(0)
    v = tiny_state(2)  # the client's personal model from an earlier round
    message = algo.broadcast(algo.init_server(w_g), 0)
    x, y = tiny_data()
    params = list(names(tiny_model(0)))

    hand_v = sgd_step(v, params, x, y, lam=lam, anchor=w_g)  # v - lr (grad CE(v) + lam (v - w_g))
    hand_w = sgd_step(w_g, params, x, y)  # the global track: plain CE from w_g
    if lam == 0:
        assert_states_close(hand_v, sgd_step(v, params, x, y))
    else:
        plain = sgd_step(v, params, x, y)
        assert not torch.allclose(hand_v["l3.weight"], plain["l3.weight"])

    res, reply, new_state = local_training(algo, message, {"personal": v}, executor)
    assert res.steps == 2
    assert_states_close(new_state["personal"], hand_v)
    assert_states_close(reply.payload["model"], hand_w)
    assert check_reply(reply, algo.reply_spec(message)) is None
    assert algo.personal_model(new_state, message, ctx()).state is new_state["personal"]

    # the personal phase alone leaves the global track at w_g
    res, reply, _ = local_training(algo, message, {"personal": v}, executor, phases=[0])
    for k, t in w_g.items():
        assert torch.equal(reply.payload["model"][k], t)

    # a client without a personal model starts it from w_g (the pull is then 0 at first)
    res, reply, new_state = local_training(algo, message, {}, executor)
    assert_states_close(new_state["personal"], hand_w)
    assert algo.personal_model({}, message, ctx()).state is message["model"]


# -- short simulations ------------------------------------------------------------------
SIMULATED = ["fedper", "fedrep", "lg_fedavg", "ditto"]
SHARED = {"fedper": "body", "fedrep": "body", "lg_fedavg": "head", "ditto": "model"}


def close_rows(a, b):
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, float):
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
        elif isinstance(v, dict):  # loss_parts
            close_rows(v, b[k])
        elif isinstance(v, list) and v and isinstance(v[0], float):  # per-client values
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
        else:
            assert b[k] == v, k


@pytest.mark.parametrize("algorithm", SIMULATED)
def test_simulation_sequential_equals_vectorized(algorithm):
    common = [f"algorithm={algorithm}", "test_fraction=0.25", "eval_personal=true", "sample_fraction=0.5"]
    if algorithm == "fedrep":
        common.append("algorithm.head_epochs=2")
    seq = simulate(*common, "executor=sequential")
    vec = simulate(*common, "executor=vectorized")
    for a, b in zip(seq.history, vec.history, strict=True):
        close_rows(a, b)
        assert a["personal_clients"] == 4  # every client, sampled or not
        assert set(a["bytes_up"]) == {SHARED[algorithm]}
    for k, v in seq.server.model.items():
        torch.testing.assert_close(vec.server.model[k], v, rtol=0, atol=1e-5)
    assert ("test_acc" in seq.history[-1]) == (algorithm == "ditto")
    # client states are plain tensor trees that a weights-only checkpoint load accepts
    for cid in range(4):
        entry = seq.store.get(cid)
        if entry is not None:
            buf = io.BytesIO()
            torch.save(entry["algorithm"], buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=True)
            assert loaded.keys() == entry["algorithm"].keys()
