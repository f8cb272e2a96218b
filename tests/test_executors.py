"""The vectorized executor reproduces the sequential executor client by client.

Covers what makes vectorization hard: clients with different numbers of steps (a client
that has finished must not move), BatchNorm statistics, persisted optimiser state,
frozen models shared by all clients vs. per client, epoch-end snapshots and post-step
corrections.
"""

import copy
import os
import signal
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from contrafl.algorithms.base import LocalTask, Stage, TrainResult
from contrafl.data.augment import eval_transform
from contrafl.config import load_config
from contrafl.execution.executor import FunctionalNet, Job, PhaseRun, SequentialExecutor, Workload
from contrafl.execution.optim import SGD, Adam
from contrafl.execution.plan import make_plan
from contrafl.rng import generator
from contrafl.execution.vectorized import VectorizedExecutor, stack_trees
from contrafl.errors import DataError
from contrafl.models.base import FedModel
from contrafl.models.build import build_model


def _model(seed=0):
    torch.manual_seed(seed)
    features = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU())
    return FedModel(features, 16, 3, projection_dim=8)


def _split(model):
    names = {n for n, _ in model.named_parameters()}
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v for k, v in sd.items() if k in names}, {k: v for k, v in sd.items() if k not in names}


def supervised(task, batch, net):
    out = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True)
    loss = F.cross_entropy(out.logits, batch.y)
    return loss, {"loss": loss.detach(), "count": torch.ones(3)}


def contrastive(task, batch, net):
    """CE + pull z to a shared frozen model + push from a per-client one + a const term."""
    out = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True)
    with torch.no_grad():
        zg = net(task.frozen["global"], batch.x, train=False).z
        zp = net(task.frozen["prev"], batch.x, train=False).z
    sims = torch.stack([F.cosine_similarity(out.z, zg, dim=-1), F.cosine_similarity(out.z, zp, dim=-1)], 1)
    con = F.cross_entropy(sims / 0.5, torch.zeros(len(sims), dtype=torch.long))
    lin = sum((p * task.consts["c"][k]).sum() for k, p in task.params["model"].items())
    loss = F.cross_entropy(out.logits, batch.y) + con + 0.1 * lin
    return loss, {"loss": loss.detach()}


def with_history(task, batch, net):
    out = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True)
    with torch.no_grad():
        zh = net(task.frozen["hist"], batch.x, train=False).z
    loss = F.cross_entropy(out.logits, batch.y) + F.cosine_similarity(out.z, zh, dim=-1).mean()
    return loss, {"loss": loss.detach()}


def post(task, batch, net):
    return {"model": {k: w - 0.01 * task.consts["c"][k] for k, w in task.params["model"].items()}}


SIZES = [70, 33, 9, 48]  # with batch 16 and drop_last: 4, 2, 0 and 3 steps per epoch


def _data():
    """Features, labels and transform of the SIZES clients, and each client's rows."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SIZES), 6, generator=g)
    y = torch.randint(0, 3, (sum(SIZES),), generator=g)
    bounds = np.cumsum([0, *SIZES])
    return x, y, eval_transform(None, None), [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


# drop_last=false: batches of 15, so that every client ends its epochs with a partial
# batch (10, 3, 9 and 3 samples: none of 1, which BatchNorm cannot train on) and the
# clients' partial batches fall on different steps
LAYOUTS = {True: 16, False: 15}


def _jobs(global_params, global_buffers, extra=lambda cid, task: None, opt_state=None, epochs=2, drop_last=True):
    x, y, tf, client_rows = _data()
    jobs = []
    for cid, rows in enumerate(client_rows):
        plan = make_plan(rows, epochs, LAYOUTS[drop_last], drop_last, tf.sample, 1, generator(0, "plan", cid))
        task = LocalTask(params={"model": dict(global_params)}, buffers={"model": dict(global_buffers)})
        extra(cid, task)
        jobs.append(Job(cid, task, [plan], seed=cid, opt_state=None if opt_state is None else opt_state(cid)))
    return x, y, tf, jobs


def _compare(stages, optimizer, extra=lambda cid, task: None, opt_state=None, drop_last=True):
    model = _model()
    params, buffers = _split(model)
    x, y, tf, jobs = _jobs(params, buffers, extra, opt_state, drop_last=drop_last)
    net = FunctionalNet(model)
    seq = SequentialExecutor(Workload.single(x, y, tf, net, stages, optimizer)).train(jobs)
    x, y, tf, jobs = _jobs(params, buffers, extra, opt_state, drop_last=drop_last)
    vec = VectorizedExecutor(Workload.single(x, y, tf, net, stages, optimizer), memory_bytes=2**30).train(jobs)
    x, y, tf, jobs = _jobs(params, buffers, extra, opt_state, drop_last=drop_last)
    padded = VectorizedExecutor(Workload.single(x, y, tf, net, stages, optimizer), 2**30, pad_finished=True).train(jobs)
    _assert_same_results(vec, padded)
    batch = LAYOUTS[drop_last]
    for a, b, n in zip(seq, vec, SIZES):
        assert a.steps == b.steps == 2 * (n // batch if drop_last else -(-n // batch))
        for role in a.params:
            for k in a.params[role]:
                torch.testing.assert_close(b.params[role][k], a.params[role][k], rtol=0, atol=1e-5)
            for k in a.buffers[role]:
                torch.testing.assert_close(b.buffers[role][k], a.buffers[role][k], rtol=0, atol=1e-5)
        assert a.stats.keys() == b.stats.keys()
        for k in a.stats:
            torch.testing.assert_close(b.stats[k], a.stats[k], rtol=1e-5, atol=1e-5)
    if not drop_last:
        return seq, vec
    # the client with no step is returned untouched, BN statistics included
    for k, v in params.items():
        assert torch.equal(vec[2].params["model"][k], v)
    for k, v in buffers.items():
        assert torch.equal(vec[2].buffers["model"][k], v)
    return seq, vec


def _assert_same_results(a: list[TrainResult], b: list[TrainResult]) -> None:
    """Equal parameters, buffers, statistics, steps and optimiser states (to float
    rounding: a batched matmul over more clients may sum in another order)."""
    for ra, rb in zip(a, b, strict=True):
        assert ra.steps == rb.steps
        for x, y in ((ra.params, rb.params), (ra.buffers, rb.buffers), (ra.stats, rb.stats), (ra.opt_state, rb.opt_state)):
            (xs, sx), (ys, sy) = pytree.tree_flatten(x), pytree.tree_flatten(y)
            assert sx == sy
            for u, v in zip(xs, ys):
                torch.testing.assert_close(v, u, rtol=0, atol=1e-6)


@pytest.mark.parametrize("drop_last", [True, False])
def test_supervised_sgd_momentum(drop_last):
    seq, vec = _compare([Stage(supervised)], SGD(0.1, 0.9, 1e-3), drop_last=drop_last)
    assert vec[0].buffers["model"]["features.1.num_batches_tracked"].item() == (8 if drop_last else 10)


def _adam_history(opt, params, cid):
    """A persisted Adam state of a client with ``cid`` earlier steps."""
    st = opt.init(list(params.values()))
    st["step"] = [t + cid for t in st["step"]]
    st["exp_avg_sq"] = [torch.full_like(t, 0.01 * (cid + 1)) for t in st["exp_avg_sq"]]
    return [st]


@pytest.mark.parametrize("drop_last", [True, False])
def test_adam_with_persisted_state(drop_last):
    model = _model()
    params, _ = _split(model)
    opt = Adam(0.01)
    seq, vec = _compare([Stage(supervised)], opt, opt_state=lambda cid: _adam_history(opt, params, cid), drop_last=drop_last)
    assert vec[0].opt_state[0]["step"][0].item() == (8 if drop_last else 10)
    assert vec[2].opt_state[0]["step"][0].item() == (2 if drop_last else 4)


@pytest.mark.parametrize("returning", [(1, 2), (0,), (3,)])
def test_adam_state_of_returning_and_new_clients(returning):
    """Clients with persisted optimiser state keep it, new clients start fresh, whichever
    sorts first in the stack (client 0 trains longest and sorts first). A large eps keeps
    Adam from magnifying float noise in the conv bias before BatchNorm (gradient ~0)."""
    model = _model()
    params, _ = _split(model)
    opt = Adam(0.01, eps=1e-3)
    state = lambda cid: _adam_history(opt, params, 10 * (cid + 1)) if cid in returning else None  # noqa: E731
    seq, vec = _compare([Stage(supervised)], opt, opt_state=state)
    steps = [2 * (n // 16) for n in SIZES]
    for cid, r in enumerate(vec):
        expected = steps[cid] + (10 * (cid + 1) if cid in returning else 0)
        assert r.opt_state[0]["step"][0].item() == expected
        assert seq[cid].opt_state[0]["step"][0].item() == expected


@pytest.mark.parametrize("drop_last", [True, False])
def test_shared_and_per_client_frozen_models_consts_and_post_step(drop_last):
    shared_global = _split(_model(1))
    shared = {**shared_global[0], **shared_global[1]}
    consts_shared = {k: torch.full_like(v, 0.5) for k, v in shared_global[0].items()}

    def extra(cid, task):
        prev = _split(_model(10 + cid))
        task.frozen["global"] = shared
        task.frozen["prev"] = {**prev[0], **prev[1]}
        task.consts["c"] = consts_shared

    _compare([Stage(contrastive, post_step=post)], SGD(0.05, 0.9), extra, drop_last=drop_last)
    tree, dims = stack_trees([{"g": shared, "c": consts_shared}] * 3)
    assert all(d is None for d in dims["g"].values())  # shared: not copied per client


@pytest.mark.parametrize("drop_last", [True, False])
def test_epoch_snapshots_and_two_stages(drop_last):
    branch = _split(_model(3))

    def extra(cid, task):
        task.params["branch"] = dict(branch[0])
        task.buffers["branch"] = dict(branch[1])
        task.frozen["hist"] = {**task.params["model"], **task.buffers["model"]}
        task.snapshots["hist"] = "model"

    def branch_loss(task, batch, net):
        out = net({**task.params["branch"], **task.buffers["branch"]}, batch.x, train=True)
        loss = F.cross_entropy(out.logits, batch.y)
        return loss, {"branch": loss.detach()}

    stages = [Stage(branch_loss, trains=("branch",)), Stage(with_history, trains=("model",))]
    _compare(stages, SGD(0.05, 0.9), extra, drop_last=drop_last)


def test_a_client_with_partial_batches_budgets_the_gathered_group():
    """With partial last batches (drop_last=false) a mixed step gathers a group's state:
    the chunk budget counts a copy of a client's parameters, optimiser state and
    buffers more, as padding does."""
    model = _model()
    params, buffers = _split(model)
    workload = Workload.single(*_data()[:3], FunctionalNet(model), [Stage(supervised)], SGD(0.1, 0.9))
    full = _jobs(params, buffers)[3][0]
    partial = _jobs(params, buffers, drop_last=False)[3][0]
    plain, padded = VectorizedExecutor(workload, 2**30), VectorizedExecutor(workload, 2**30, pad_finished=True)
    copy = 2 * sum(v.numel() * v.element_size() for v in params.values()) + sum(v.numel() * v.element_size() for v in buffers.values())
    assert padded.client_bytes(full) - plain.client_bytes(full) == copy  # no frozen models here
    assert plain.client_bytes(partial) == padded.client_bytes(partial)


def test_each_clients_result_owns_its_storage():
    """The vectorized executor's results are copies, not views of the stack: a view kept
    in the client store would keep the whole stack alive and be saved whole."""
    model = _model()
    params, buffers = _split(model)
    x, y, tf, jobs = _jobs(params, buffers)
    workload = Workload.single(x, y, tf, FunctionalNet(model), [Stage(supervised)], SGD(0.1, 0.9))
    results = VectorizedExecutor(workload, 2**30).train(jobs)
    tensors = [t for r in results for t in (*r.params["model"].values(), *r.buffers["model"].values(), *r.stats.values())]
    tensors += [t for r in results for state in r.opt_state for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)


def test_chunking_by_memory_gives_the_same_results():
    model = _model()
    params, buffers = _split(model)
    x, y, tf, jobs = _jobs(params, buffers)
    ex = VectorizedExecutor(Workload.single(x, y, tf, FunctionalNet(model), [Stage(supervised)], SGD(0.1, 0.9)), 1.0)
    assert ex.chunk_size(jobs[0]) == 1  # a tiny budget gives one client per chunk
    ids = {j.cid: j for j in jobs}
    chunked = [r for _, r in ex.run(lambda cid: ids[cid], [0, 1, 2, 3])]
    x, y, tf, jobs = _jobs(params, buffers)
    whole = VectorizedExecutor(Workload.single(x, y, tf, FunctionalNet(model), [Stage(supervised)], SGD(0.1, 0.9)), 2**30).train(jobs)
    for a, b in zip(chunked, whole):
        for k in a.params["model"]:
            torch.testing.assert_close(a.params["model"][k], b.params["model"][k], rtol=0, atol=1e-5)


def test_parallel_executor_matches_sequential():
    from contrafl.execution.parallel import ParallelExecutor, balance

    assert balance([5, 1, 4, 4], 2) == [[0, 1], [2, 3]]
    assert balance([3], 4) == [[0]]
    model = _model()
    params, buffers = _split(model)
    x, y, tf, jobs = _jobs(params, buffers)
    workload = Workload.single(x, y, tf, FunctionalNet(model), [Stage(supervised)], SGD(0.1, 0.9))
    seq = SequentialExecutor(workload).train(jobs)
    x, y, tf, jobs = _jobs(params, buffers)
    ids = {j.cid: j for j in jobs}
    par = [r for _, r in ParallelExecutor(workload, workers=2).run(lambda c: ids[c], [0, 1, 2, 3])]
    for a, b in zip(seq, par):
        assert a.steps == b.steps
        for k in a.params["model"]:
            torch.testing.assert_close(b.params["model"][k], a.params["model"][k], rtol=0, atol=1e-5)
        for k in a.buffers["model"]:
            torch.testing.assert_close(b.buffers["model"][k], a.buffers["model"][k], rtol=0, atol=1e-5)


@pytest.mark.parametrize("executor", ["sequential", "parallel", "vectorized"])
def test_results_leave_out_the_optimiser_state_a_run_does_not_keep(executor):
    """persist_optimizer_state=false: no result carries the state (a parallel worker
    would otherwise send Adam's moments of every client through its pipe); the
    parameters are the same as with it."""
    from contrafl.execution.parallel import ParallelExecutor

    model = _model()
    params, buffers = _split(model)
    results = {}
    for keep in (True, False):
        x, y, tf, jobs = _jobs(params, buffers)
        workload = Workload.single(x, y, tf, FunctionalNet(model), [Stage(supervised)], Adam(0.01), keep_opt_state=keep)
        make = {
            "sequential": lambda: SequentialExecutor(workload),
            "parallel": lambda: ParallelExecutor(workload, workers=2),
            "vectorized": lambda: VectorizedExecutor(workload, memory_bytes=2**30),
        }[executor]
        results[keep] = make().train(jobs)
    assert all(r.opt_state is not None for r in results[True]) and all(r.opt_state is None for r in results[False])
    for a, b in zip(results[True], results[False]):
        for k in a.params["model"]:
            torch.testing.assert_close(b.params["model"][k], a.params["model"][k], rtol=0, atol=0)


def _parallel_with_loss(loss):
    from contrafl.execution.parallel import ParallelExecutor

    model = _model()
    params, buffers = _split(model)
    x, y, tf, jobs = _jobs(params, buffers)
    return ParallelExecutor(Workload.single(x, y, tf, FunctionalNet(model), [Stage(loss)], SGD(0.1)), workers=2), jobs


def test_parallel_executor_reports_worker_failures():
    """The worker's exception is the first line of the error (a run's summary.json keeps
    that line), its traceback follows; a user error keeps its type (one line, exit 2)."""
    from contrafl.execution.parallel import WorkerError
    from contrafl.errors import one_line

    def broken(task, batch, net):
        raise ValueError("boom in a worker")

    ex, jobs = _parallel_with_loss(broken)
    with pytest.raises(WorkerError) as info:
        ex.train(jobs)
    assert one_line(info.value) == "WorkerError: a worker process failed with ValueError: boom in a worker"
    assert "Traceback" in str(info.value)

    def bad_input(task, batch, net):
        raise DataError("file x is truncated; download it again")

    ex, jobs = _parallel_with_loss(bad_input)
    with pytest.raises(DataError, match="^file x is truncated; download it again$"):
        ex.train(jobs)


def test_parallel_executor_stops_waiting_for_a_worker_that_died():
    """A worker killed before it sends its results (the kernel's OOM killer sends
    SIGKILL) is an error, not a wait without end."""
    from contrafl.execution.parallel import WorkerError

    def killed(task, batch, net):
        os.kill(os.getpid(), signal.SIGKILL)

    ex, jobs = _parallel_with_loss(killed)
    with pytest.raises(WorkerError, match="died with exit code -9 before it sent its results .killed by signal 9"):
        ex.train(jobs)


def test_auto_executor_follows_device_and_clients_per_round(monkeypatch):
    from types import SimpleNamespace

    from contrafl.config import build_config
    from contrafl.engine import setup as simulation

    algo = SimpleNamespace(name="fedavg", vectorizable=True)
    many = build_config({"num_clients": 10})
    one = build_config({"num_clients": 10, "sample_fraction": 0.1})  # one client a round
    monkeypatch.setattr(simulation, "cpu_cores", lambda: 2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert simulation.choose_executor(many, algo, cpu) == "distributed"
    assert simulation.choose_executor(one, algo, cpu) == "sequential"
    assert simulation.choose_executor(many, algo, cuda) == "vectorized"
    assert simulation.choose_executor(many, SimpleNamespace(name="x", vectorizable=False), cuda) == "sequential"
    monkeypatch.setattr(simulation, "cpu_cores", lambda: 1)
    assert simulation.choose_executor(many, algo, cpu) == "sequential"


def test_worker_results_travel_as_one_buffer_and_come_back_equal():
    from contrafl.execution.parallel import pack, unpack

    result = TrainResult(
        params={"model": {"w": torch.randn(3, 5), "b": torch.randn(7), "scalar": torch.tensor(2.5)}},
        buffers={"model": {"count": torch.tensor(9), "mask": torch.tensor([True, False, True]),
                           "half": torch.randn(3, dtype=torch.bfloat16), "empty": torch.zeros(0, 4)}},
        stats={"loss": torch.tensor(1.25)},
        steps=4,
        opt_state=[{"momentum": [torch.randn(3, 5)]}],
    )
    data = pack(result)
    assert isinstance(data, bytes)
    back = unpack(data)
    assert back.steps == 4
    flat_in = [result.params, result.buffers, result.stats, result.opt_state]
    flat_out = [back.params, back.buffers, back.stats, back.opt_state]
    ins, _ = pytree.tree_flatten(flat_in)
    outs, _ = pytree.tree_flatten(flat_out)
    assert len(ins) == len(outs) == 9
    for a, b in zip(ins, outs):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    filled = [b for b in outs if b.numel()]
    assert len({b.untyped_storage().data_ptr() for b in filled}) == len(filled)  # none shares a storage
    assert all(b.untyped_storage().nbytes() == b.numel() * b.element_size() for b in filled)


def _body_head_jobs(model, phase_epochs):
    """Jobs training the model as two roles, body and head (classifier ``l3``)."""
    params, buffers = _split(model)
    head = {k: v for k, v in params.items() if k.startswith("l3.")}
    body = {k: v for k, v in params.items() if not k.startswith("l3.")}
    x, y, tf, client_rows = _data()
    jobs = []
    for cid, rows in enumerate(client_rows):
        gen = generator(0, "plan", cid)
        plans = [make_plan(rows, e, b, True, tf.sample, 1, gen) for e, b in phase_epochs]
        task = LocalTask(params={"body": dict(body), "head": dict(head)}, buffers={"body": dict(buffers), "head": {}})
        jobs.append(Job(cid, task, plans, seed=cid))
    return x, y, tf, jobs


def split_supervised(task, batch, net):
    state = {**task.params["body"], **task.params["head"], **task.buffers["body"]}
    loss = F.cross_entropy(net(state, batch.x, train=True).logits, batch.y)
    return loss, {"loss": loss.detach()}


def test_phases_with_their_own_epochs_batches_and_optimisers_agree_across_executors():
    """FedRep-like: head phase (1 epoch, batch 8, Adam) then body phase (2 epochs,
    batch 16, SGD with momentum, 2 steps per batch). (Adam on the body would amplify
    float noise: the bias before BatchNorm has a zero gradient.)"""
    phases = [
        PhaseRun((Stage(split_supervised, trains=("head",)),), Adam(0.01)),
        PhaseRun((Stage(split_supervised, trains=("body",), repeat=2),), SGD(0.05, 0.9)),
    ]
    model = _model()
    net = FunctionalNet(model)
    x, y, tf, jobs = _body_head_jobs(model, [(1, 8), (2, 16)])
    seq = SequentialExecutor(Workload(x, y, tf, net, phases)).train(jobs)
    x, y, tf, jobs = _body_head_jobs(model, [(1, 8), (2, 16)])
    vec = VectorizedExecutor(Workload(x, y, tf, net, phases), memory_bytes=2**30).train(jobs)
    x, y, tf, jobs = _body_head_jobs(model, [(1, 8), (2, 16)])
    _assert_same_results(vec, VectorizedExecutor(Workload(x, y, tf, net, phases), 2**30, pad_finished=True).train(jobs))
    for a, b, n in zip(seq, vec, SIZES):
        assert a.steps == b.steps == n // 8 + 2 * (n // 16)
        assert len(a.opt_state) == len(b.opt_state) == 2
        for role in a.params:
            for k in a.params[role]:
                torch.testing.assert_close(b.params[role][k], a.params[role][k], rtol=0, atol=1e-5)
        torch.testing.assert_close(b.stats["loss"], a.stats["loss"], rtol=1e-5, atol=1e-5)
    # Adam stepped once per head batch; both phases moved their own parameters only
    assert seq[0].opt_state[0]["step"][0].item() == 70 // 8
    assert len(seq[0].opt_state[1]["momentum"]) == len(jobs[0].task.params["body"])


def test_a_head_phase_then_a_body_phase_by_hand():
    """Phase 1 moves only the head, phase 2 only the body, each with its own SGD lr."""
    torch.manual_seed(0)
    model = FedModel(nn.Sequential(nn.Linear(6, 4), nn.ReLU()), 4, 3, projection_dim=None)
    params, _ = _split(model)
    x = torch.randn(8, 6)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    tf = eval_transform(None, None)
    body = {k: v for k, v in params.items() if not k.startswith("l3.")}
    head = {k: v for k, v in params.items() if k.startswith("l3.")}
    gen = generator(0, "p")
    plans = [make_plan(np.arange(8), 1, 8, True, tf.sample, 1, gen) for _ in range(2)]
    task = LocalTask(params={"body": dict(body), "head": dict(head)}, buffers={"body": {}, "head": {}})
    phases = [
        PhaseRun((Stage(split_supervised, trains=("head",)),), SGD(0.3)),
        PhaseRun((Stage(split_supervised, trains=("body",)),), SGD(0.1)),
    ]
    result = SequentialExecutor(Workload(x, y, tf, FunctionalNet(model), phases)).train([Job(0, task, plans, seed=0)])[0]

    def loss_of(b, h):
        hidden = torch.relu(x @ b["features.0.weight"].T + b["features.0.bias"])
        return F.cross_entropy(hidden @ h["l3.weight"].T + h["l3.bias"], y)

    h = {k: v.clone().requires_grad_(True) for k, v in head.items()}
    grads = torch.autograd.grad(loss_of(body, h), list(h.values()))
    h1 = {k: (v - 0.3 * g).detach() for (k, v), g in zip(h.items(), grads)}
    b = {k: v.clone().requires_grad_(True) for k, v in body.items()}
    grads = torch.autograd.grad(loss_of(b, h1), list(b.values()))
    b1 = {k: (v - 0.1 * g).detach() for (k, v), g in zip(b.items(), grads)}
    for k in head:
        torch.testing.assert_close(result.params["head"][k], h1[k])
    for k in body:
        torch.testing.assert_close(result.params["body"][k], b1[k])


# -- CUDA graphs (the bookkeeping, with a stand-in graph; tests/test_cuda.py runs real ones) --
class _RecordedGraph:
    """A CUDA graph's contract: capturing records the step without running it; a replay
    runs what was recorded."""

    fail = False

    def __init__(self, pool):
        self.pool = pool

    def capture(self, step):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        self.step = step

    def replay(self):
        self.step()


def _record_graphs(monkeypatch, graph: type | None = None) -> list:
    """From now on the vectorized executor's StepGraphs capture stand-in graphs
    (``graph``, by default :class:`_RecordedGraph`), on any device; the list of those
    made, in order."""
    from contrafl.execution import vectorized
    from contrafl.execution.cuda_graphs import StepGraphs

    made = []

    def stand_in(device, wanted):
        made.append(StepGraphs(True, new_graph=graph or _RecordedGraph))
        return made[-1]

    monkeypatch.setattr(vectorized.StepGraphs, "for_device", staticmethod(stand_in))
    return made


def _record_gathers(monkeypatch) -> list:
    """From now on every group the vectorized executor gathers from its stack to train
    apart (:meth:`_Stack.take`); the list of their client positions, in order."""
    from contrafl.execution import vectorized

    gathered = []
    take = vectorized._Stack.take
    monkeypatch.setattr(vectorized._Stack, "take", lambda st, idx: gathered.append(idx) or take(st, idx))
    return gathered


def test_step_graphs_warm_up_then_capture_then_replay():
    from contrafl.execution.cuda_graphs import MIN_REPLAYS, StepGraphs

    done = []
    graphs = StepGraphs(True, new_graph=_RecordedGraph)
    for s in range(20):  # 20 steps of 10 clients, then 5 of 3 (too few to capture)
        graphs.run(10, 20 - s, lambda: done.append(10))
    for s in range(5):
        graphs.run(3, 5 - s, lambda: done.append(3))
    assert done == [10] * 20 + [3] * 5  # every step done once
    assert graphs.replays == 19 and set(graphs.graphs) == {10}  # the first step of a shape runs eagerly
    assert 5 < MIN_REPLAYS


def test_step_graphs_fall_back_to_eager_steps_when_a_capture_fails():
    from contrafl.execution.cuda_graphs import StepGraphs

    class Failing(_RecordedGraph):
        fail = True

    done = []
    graphs = StepGraphs(True, new_graph=Failing)
    with pytest.warns(RuntimeWarning, match=r"captured as a CUDA graph \(RuntimeError: operation not permitted when stream is capturing\); steps run eagerly"):
        for s in range(12):
            graphs.run(4, 12 - s, lambda: done.append(s))
    assert done == list(range(12)) and graphs.replays == 0 and not graphs.enabled
    assert StepGraphs.failed is None  # a stand-in's failure does not switch off the process's real graphs


def test_padded_steps_replay_one_graph_per_phase(monkeypatch):
    """With ``pad_finished`` every step of the phase has one shape: after one eager step
    all the others replay the graph captured at the second (which reads the mask of
    active clients from a fixed address), and the clients come out as without padding,
    the one without a step untouched."""

    model = _model()
    params, buffers = _split(model)
    x, y, tf, jobs = _jobs(params, buffers, epochs=4)  # 16, 8, 0 and 12 steps
    workload = Workload.single(x, y, tf, FunctionalNet(model), [Stage(supervised)], SGD(0.05, 0.9))
    eager = VectorizedExecutor(workload, 2**30).train(jobs)
    made = _record_graphs(monkeypatch)
    replayed = VectorizedExecutor(workload, 2**30, pad_finished=True).train(_jobs(params, buffers, epochs=4)[3])
    assert [r.steps for r in replayed] == [16, 8, 0, 12]
    assert set(made[0].graphs) == {(4, 16)} and made[0].replays == 15  # (clients, batch size)
    _assert_same_results(eager, replayed)
    assert all(torch.equal(replayed[2].params["model"][k], v) for k, v in params.items())


@pytest.mark.parametrize("pad", [False, True])
def test_mixed_steps_replay_a_graph_for_each_group(monkeypatch, pad):
    """``drop_last=false``, steps replayed as graphs: in a step where some clients take
    their partial last batch, each group of clients taking batches of one size is one
    step over the stack's prefix masked to the group, replayed from a graph keyed by
    (clients, batch size, masked) (with padding: (all clients, batch size)), and no
    group is gathered and trained apart; the results are those of the same steps run
    eagerly, of the CPU's grouping (every group apart) and of the sequential
    executor."""
    from contrafl.execution import cuda_graphs

    model = _model()
    params, buffers = _split(model)
    stages, opt = [Stage(supervised)], SGD(0.1, 0.9, 1e-3)
    # 60, 36, 12 and 48 steps of 15 samples or fewer (the last batches of the four
    # clients' epochs hold 10, 3, 9 and 3). Sorted longest first, the keys of the runs
    # captured (at a shape's second run, when at least MIN_REPLAYS=8 runs are left) are
    # (4, 15, "masked") and (4, 9, "masked") with 12 runs each, (3, 15, "masked") 14,
    # (3, 3, "masked") 12, (3, 15) 10 and (1, 15) 9; the others have too few. With
    # padding: (4, 15) 56 runs, (4, 3) 21, (4, 9) 12 and (4, 10) 12
    x, y, tf, jobs = _jobs(params, buffers, epochs=12, drop_last=False)
    workload = Workload.single(x, y, tf, FunctionalNet(model), stages, opt)

    def train():
        return VectorizedExecutor(workload, 2**30, pad_finished=pad).train(_jobs(params, buffers, epochs=12, drop_last=False)[3])

    seq, apart = SequentialExecutor(workload).train(jobs), train()
    made = _record_graphs(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "MIN_REPLAYS", 10**9)
    eager = train()
    assert not made[0].graphs
    monkeypatch.setattr(cuda_graphs, "MIN_REPLAYS", 8)
    gathered = _record_gathers(monkeypatch)
    replayed = train()
    assert not gathered
    _assert_same_results(eager, replayed)
    for a, b, c in zip(seq, apart, replayed):  # rounding grows over 60 steps of lr 0.1: 2.9e-5 from the sequential run
        assert a.steps == b.steps == c.steps
        for k, v in a.params["model"].items():
            torch.testing.assert_close(b.params["model"][k], v, rtol=0, atol=1e-4)
            torch.testing.assert_close(c.params["model"][k], b.params["model"][k], rtol=0, atol=1e-4)
        torch.testing.assert_close(c.stats["loss"], b.stats["loss"], rtol=1e-6, atol=0)
    if pad:
        assert set(made[1].graphs) == {(4, 15), (4, 3), (4, 9), (4, 10)}
        assert made[1].replays == 55 + 20 + 11 + 11
    else:
        assert set(made[1].graphs) == {(4, 15, "masked"), (4, 9, "masked"), (3, 15, "masked"), (3, 3, "masked"), (3, 15), (1, 15)}
        assert made[1].replays == 11 + 11 + 13 + 11 + 9 + 8


def test_arenas_replay_an_earlier_rounds_graphs(monkeypatch):
    """Steps replayed as graphs, the arena kept between rounds: a shape with fewer steps a
    round than pay for a capture (here all of them) runs eagerly in the first round, is
    captured in the second and replayed from then on, on the same tensors, into which
    each round's values are copied; every round trains as eager steps do. A frozen model
    shared by all clients (each round's own) is copied into the arena, and the tensors it
    came from are left as they were."""
    from contrafl.execution.vectorized import StepArenas

    model = _model()
    params, buffers = _split(model)
    x, y, tf, _ = _data()
    workload = Workload.single(x, y, tf, FunctionalNet(model), [Stage(with_history)], SGD(0.1, 0.9))
    arenas = StepArenas()
    history = [{**{k: v - 0.02 * r for k, v in params.items()}, **buffers} for r in range(3)]
    kept = [{k: v.clone() for k, v in h.items()} for h in history]

    def jobs(r):  # round r: other global weights and history (one object for all clients); 4, 3, 2 and 0 steps
        start = {k: v + 0.01 * r for k, v in params.items()}
        return _jobs(start, buffers, lambda cid, task: task.frozen.update(hist=history[r]), epochs=1)[3]

    eager = [VectorizedExecutor(workload, 2**30).train(jobs(r)) for r in range(3)]
    made = _record_graphs(monkeypatch)
    probes = _count_calls(monkeypatch, "used_parameters")
    replays = []
    for r in range(3):
        _assert_same_results(eager[r], VectorizedExecutor(workload, 2**30, arenas=arenas).train(jobs(r)))
        replays.append(made[0].replays)
    (arena,) = arenas.arenas.values()
    assert arena.graphs is made[0] and set(made[0].graphs) == {(3, 16), (2, 16), (1, 16)}
    assert replays == [0, 4, 8]  # (3, 16) twice, (2, 16) and (1, 16) once a round: all replayed from round 2
    assert probes == [1]  # which parameters get gradients: probed when the arena was made
    for h, k in zip(history, kept):
        assert all(torch.equal(h[name], k[name]) for name in h)
    other = Workload.single(x, y, tf, workload.net, [Stage(with_history)], SGD(0.05, 0.9))  # another learning rate
    VectorizedExecutor(other, 2**30, arenas=arenas).train(jobs(0))
    assert len(arenas.arenas) == 2 and probes == [2]


def _count_calls(monkeypatch, name: str) -> list[int]:
    """From now on, the calls of the vectorized module's function ``name``, counted in
    the one-element list returned."""
    from contrafl.execution import vectorized

    calls, fn = [0], getattr(vectorized, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return fn(*args, **kwargs)

    monkeypatch.setattr(vectorized, name, counted)
    return calls


def test_kept_arenas_probe_a_chunks_memory_once(monkeypatch):
    """With a run's arenas kept from round to round (on a GPU), the memory probe that
    sizes the chunks (an eager step of one client) runs once for each computation, not
    every round, and sizes them as it did; another computation (another learning rate)
    is probed anew. The probe of which parameters get gradients leaves the global
    random stream as it found it, so training draws the same numbers with or without it."""
    from contrafl.execution.executor import used_parameters
    from contrafl.execution.vectorized import StepArenas

    model = _model()
    params, buffers = _split(model)
    x, y, tf, _ = _data()
    workload = Workload.single(x, y, tf, FunctionalNet(model), [Stage(supervised)], SGD(0.1, 0.9))
    other = Workload.single(x, y, tf, workload.net, [Stage(supervised)], SGD(0.05, 0.9))
    job = _jobs(params, buffers)[3][0]
    memory = 2.5 * VectorizedExecutor(workload, 2**30).client_bytes(job)
    monkeypatch.setattr(VectorizedExecutor, "_keeps_arenas", property(lambda self: self.arenas is not None))
    probes = _count_calls(monkeypatch, "saved_bytes_of_step")
    arenas = StepArenas()
    assert [VectorizedExecutor(workload, memory, arenas=arenas).chunk_size(_jobs(params, buffers)[3][0]) for _ in range(3)] == [2] * 3
    assert probes == [1]
    VectorizedExecutor(other, memory, arenas=arenas).chunk_size(job)
    assert probes == [2]
    state = torch.get_rng_state()
    used_parameters(workload, job)
    assert torch.equal(torch.get_rng_state(), state)


def test_arenas_keep_a_runs_rounds_equal(monkeypatch):
    """A run whose steps are replayed from arenas kept across rounds ends as the run of
    eager steps (MOON: the global model, a frozen tensor shared by all clients, changes
    every round and is copied into the arena's own copy)."""
    from conftest import simulate

    args = ["executor=vectorized", "algorithm=moon", "rounds=3", "partition=dirichlet", "partition.beta=0.5"]
    eager = simulate(*args)
    _record_graphs(monkeypatch)
    replayed = simulate(*args)
    assert sum(a.graphs.replays for a in replayed.step_arenas.arenas.values()) > 0
    for k, v in eager.server.model.items():
        torch.testing.assert_close(replayed.server.model[k], v, rtol=0, atol=1e-6)
    for a, b in zip(eager.history, replayed.history):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-6)


def test_padded_runs_give_the_unpadded_results():
    """``pad_finished_clients=true`` reaches the vectorized executor of a run, and the run
    (clients of unequal sizes) ends as without it."""
    from conftest import simulate
    from contrafl.execution.clients import make_executor

    args = ["executor=vectorized", "partition=dirichlet", "partition.beta=0.3", "local_epochs=2", "algorithm=scaffold"]
    plain, padded = simulate(*args), simulate(*args, "pad_finished_clients=true")
    assert make_executor("vectorized", None, padded.cfg).pad_finished
    assert len({len(rows) for rows in padded.rows}) > 1  # the clients' steps differ
    for k, v in plain.server.model.items():
        torch.testing.assert_close(padded.server.model[k], v, rtol=0, atol=1e-6)
    for a, b in zip(plain.history, padded.history):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-6)


@pytest.mark.parametrize("algorithm", ["moon", "fedper"])
def test_partial_last_batches_vectorized_equal_the_sequential_run(algorithm):
    """``drop_last=false`` (every client's epochs end with a batch of its own size):
    ``executor=auto``'s vectorized choice on a GPU is no longer ruled out, and a
    vectorized run, plain or padded, ends as the sequential run (MOON: a frozen global
    and previous model per client; FedPer: a personal head kept by each client)."""
    from conftest import simulate
    from contrafl.algorithms.registry import ALGORITHMS
    from contrafl.engine.setup import choose_executor

    args = [f"algorithm={algorithm}", "drop_last=false", "batch_size=24", "partition=dirichlet", "partition.beta=0.5",
            "local_epochs=2"]
    cfg = load_config(None, [*args, "executor=auto"])
    assert choose_executor(cfg, ALGORITHMS.get(algorithm), torch.device("cuda")) == "vectorized"
    seq = simulate(*args, "executor=sequential")
    assert len({len(rows) % 24 for rows in seq.rows}) > 2  # partial batches of several sizes
    for extra in ([], ["pad_finished_clients=true"]):
        vec = simulate(*args, "executor=vectorized", *extra)
        assert [r["local_steps"] for r in vec.history] == [r["local_steps"] for r in seq.history]
        for k, v in seq.server.model.items():
            torch.testing.assert_close(vec.server.model[k], v, rtol=0, atol=1e-5)
        for a, b in zip(seq.history, vec.history):
            assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)


def test_a_model_with_batch_norm_leaves_out_last_batches_of_one_sample():
    """``drop_last=false`` with BatchNorm (MOON's projection head with ``projection_bn``):
    a client whose epochs end with one sample leaves that batch out (PyTorch cannot
    train BatchNorm on it; FedU2's clients skip it) and the run trains, sequential and
    vectorized alike; ``batch_size=1`` is refused in one line; Per-FedAvg, whose loss
    halves each batch, leaves out a last batch that cannot give each half two."""
    from conftest import simulate
    from contrafl.engine.setup import prepare
    from contrafl.errors import ConfigError

    args = ["algorithm=moon", "model.projection_bn=true", "drop_last=false", "batch_size=9", "local_epochs=1", "rounds=1"]
    seq = simulate(*args, "executor=sequential")
    sizes = [len(rows) for rows in seq.rows]
    assert any(n % 9 == 1 for n in sizes)  # a last batch of one sample, left out
    assert seq.history[0]["local_steps"] == sum(n // 9 + (n % 9 > 1) for n in sizes)
    vec = simulate(*args, "executor=vectorized")
    assert vec.history[0]["local_steps"] == seq.history[0]["local_steps"]
    for k, v in seq.server.model.items():
        torch.testing.assert_close(vec.server.model[k], v, rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match=r"^batch_size=1 cannot train model mlp: its BatchNorm layers .* use batch_size=2 or more$"):
        prepare(load_config(None, [*args, "batch_size=1"]))
    # Per-FedAvg splits each batch of 2B in halves (Phase.parts=2): a last batch needs 4
    meta = simulate("algorithm=perfedavg", "model.projection_bn=true", "drop_last=false", "batch_size=7", "rounds=1")
    assert any(n % 14 in (2, 3) for n in sizes)
    assert meta.history[0]["local_steps"] == 2 * sum(n // 14 + (n % 14 >= 4) for n in sizes)


def test_step_graphs_only_on_a_gpu():
    from contrafl.execution.cuda_graphs import StepGraphs

    assert not StepGraphs.for_device(torch.device("cpu"), True).enabled
    assert not StepGraphs.for_device(torch.device("cuda"), False).enabled



def test_functional_net_gives_cpu_image_batches_channels_last():
    """On the CPU the model gets image batches channels-last, with the values and, to
    float precision, the outputs of the NCHW forward; other inputs, and the batches of
    the forward for vmap, go in as they come."""
    torch.manual_seed(0)
    model = build_model("moon_cnn", (3, 16, 16), 10)
    nchw = copy.deepcopy(model).eval()
    net, state = FunctionalNet(model), dict(model.state_dict())
    seen = []
    net.eval_model.features.conv1.register_forward_pre_hook(lambda _, args: seen.append(args[0].stride()))
    x = torch.randn(2, 3, 16, 16)
    out = net(state, x, train=False)
    assert seen == [x.contiguous(memory_format=torch.channels_last).stride()]
    expected = nchw(x)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-6)
    stacked = {k: torch.stack([v, v]) for k, v in state.items()}
    batched = torch.vmap(lambda s, b: net.for_vmap()(s, b, train=False).logits)(stacked, torch.stack([x, x]))
    assert seen[-1] == x.stride()
    torch.testing.assert_close(batched, torch.stack([out.logits, out.logits]), rtol=1e-5, atol=1e-6)
    net(state, x, train=False)  # for_vmap left the run's forward as it was
    assert seen[-1] != x.stride()
    rows = torch.tensor([1, 0])
    batch = Workload(x, torch.arange(2), lambda raw, params: raw, net, []).inputs(rows, [{}])
    assert batch.x.is_contiguous(memory_format=torch.channels_last) and torch.equal(batch.x, x[rows])
    assert net.layout(batch.x).data_ptr() == batch.x.data_ptr()  # converted once per batch: no copy per forward pass

    mlp = build_model("mlp", (5,), 3)
    flat = torch.randn(4, 5)
    assert torch.equal(FunctionalNet(mlp)(dict(mlp.state_dict()), flat, train=False).logits, mlp.eval()(flat).logits)


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "uint8", "flat"])
def test_take_rows_is_indexing_in_the_same_layout(layout):
    """The batch gather copies rows in storage order; the values, shape and strides are
    those of ``x[rows]``, whatever the layout, repeated rows included."""
    from contrafl.execution.executor import take_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 8, 8, generator=g)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "uint8":
        x = (x * 50).clamp(0, 255).to(torch.uint8)
    elif layout == "flat":
        x = x.flatten(1)
    rows = torch.tensor([7, 0, 39, 7, 12])
    got, want = take_rows(x, rows), x[rows]
    assert torch.equal(got, want) and got.stride() == want.stride() and got.dtype == want.dtype


def _stacked_model(seed=0):
    """A model without BatchNorm: on the CPU the vectorized executor runs it stacked."""
    torch.manual_seed(seed)
    return FedModel(nn.Sequential(nn.Linear(6, 16), nn.ReLU()), 16, 3, projection_dim=8)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("case", ["frozen_consts_post_step", "snapshots_two_stages", "adam"])
def test_the_stacked_forward_reproduces_the_sequential_executor(monkeypatch, case, drop_last):
    """With a model that has a stacked forward, the vectorized executor on the CPU leaves
    ``vmap`` for its forward passes (counted) and still gives each client the sequential
    executor's training: frozen models shared by all and per client, constants, a
    post-step, two stages, epoch snapshots, Adam, clients of different steps and batches
    of different sizes."""
    from contrafl.execution import stacked

    monkeypatch.setattr(sys.modules[__name__], "_model", _stacked_model)
    calls = []
    call = stacked.StackedNet.__call__
    monkeypatch.setattr(stacked.StackedNet, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    if case == "frozen_consts_post_step":
        test_shared_and_per_client_frozen_models_consts_and_post_step(drop_last)
    elif case == "snapshots_two_stages":
        test_epoch_snapshots_and_two_stages(drop_last)
    else:
        test_adam_with_persisted_state(drop_last)
    assert calls
