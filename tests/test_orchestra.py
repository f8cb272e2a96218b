"""Orchestra: Sinkhorn-Knopp, local and global clustering, the order of its per-step
updates (EMA before the step, memory after it) and its rounds."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from contrafl.algorithms.base import Federation, Reply
from contrafl.algorithms.orchestra import Orchestra, OrchestraParams, global_clustering, local_clustering, sinkhorn_knopp
from contrafl.config import load_config
from contrafl.data.augment import eval_transform
from contrafl.engine.executor import FunctionalNet, Job, SequentialExecutor, Workload
from contrafl.engine.optim import SGD
from contrafl.engine.plan import make_plan
from contrafl.rng import generator
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.engine.validate import check_reply
from contrafl.engine.vectorized import VectorizedExecutor
from contrafl.models.base import FedModel
from test_datasets import write_cifar10

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sinkhorn_knopp_keeps_balanced_assignments_and_balances_skewed_ones():
    """Scores whose softmax is already doubly balanced come back as that softmax; scores
    that send every sample to cluster 0 come back with rows summing to 1 and every
    cluster receiving N / K."""
    S = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    torch.testing.assert_close(sinkhorn_knopp(S, 3.0, 100), F.softmax(3.0 * S, dim=1))
    g = torch.Generator().manual_seed(0)
    skewed = torch.rand(12, 3, generator=g) * 0.2
    skewed[:, 0] += 1.0
    Q = sinkhorn_knopp(skewed, 1.0, 100)
    torch.testing.assert_close(Q.sum(dim=1), torch.ones(12), atol=1e-2, rtol=0)
    torch.testing.assert_close(Q.sum(dim=0), torch.full((3,), 4.0), atol=1e-2, rtol=0)
    assert F.softmax(skewed, dim=1).sum(dim=0)[0] > 6  # it started skewed to cluster 0


def test_local_clustering_finds_separated_groups():
    g = torch.Generator().manual_seed(0)
    directions = torch.eye(4)
    Z = F.normalize(directions.repeat_interleave(8, dim=0) + 0.05 * torch.randn(32, 4, generator=g), dim=1)
    mu = local_clustering(Z, 4, 5, 25.0, 10, torch.Generator().manual_seed(1))
    torch.testing.assert_close(mu.norm(dim=1), torch.ones(4))
    cos = mu @ directions.T
    assert sorted(cos.argmax(dim=1).tolist()) == [0, 1, 2, 3]  # one centroid per group
    assert cos.max(dim=1).values.min() > 0.99


def test_global_clustering_is_torch_sgd_on_the_code_loss():
    """The code's loop: torch.optim.SGD(lr 0.01, momentum 0.9, wd 1e-4) on the centroid
    layer, loss -cos(SK, softmax(normalize(Z) C^T / T)), rows renormalised after each step."""
    g = torch.Generator().manual_seed(0)
    Z = F.normalize(torch.randn(20, 6, generator=g), dim=1)
    C0 = torch.rand(5, 6, generator=g) - 0.5
    layer = nn.Linear(6, 5, bias=False)
    layer.weight.data.copy_(C0)
    opt = torch.optim.SGD(layer.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    for _ in range(4):
        with torch.no_grad():
            sk = sinkhorn_knopp(layer(Z), 25.0, 100)
        opt.zero_grad()
        loss = -F.cosine_similarity(sk, F.softmax(layer(F.normalize(Z, dim=1)) / 0.1, dim=1), dim=-1).mean()
        loss.backward()
        opt.step()
        with torch.no_grad():
            layer.weight.copy_(F.normalize(layer.weight, dim=1))
    C = global_clustering(C0, Z, 0.1, 4, 0.01, 0.9, 1e-4, 25.0, 100)
    torch.testing.assert_close(C, layer.weight.data, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(C, F.normalize(C0, dim=1), atol=1e-4)


# -- the local step ------------------------------------------------------------------------
def _model() -> FedModel:
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    heads = Orchestra.heads(OrchestraParams())
    return FedModel(features, 4, 3, projection_dim=5, heads=heads, projection_hidden=6, projection_bn=True,
                    projection_bias=False, projection_out_bn=True)


def _jobs(algo, model, sizes, memory):
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (sum(sizes), 3, 6, 6), dtype=torch.uint8, generator=g)
    y = torch.zeros(sum(sizes), dtype=torch.long)
    tf = eval_transform(None, None)
    C = F.normalize(torch.randn(7, 5, generator=g), dim=1)
    jobs, start = [], 0
    for cid, n in enumerate(sizes):
        rows = np.arange(start, start + n)
        start += n
        plan = make_plan(rows, 1, 8, True, tf.sample, algo.views, generator(0, "plan", cid))
        bank = F.normalize(torch.randn(memory, 5, generator=g), dim=1)
        task = algo.client_begin({"model": sd, "centroids": C}, {"memory": bank}, SimpleNamespace(round=1))
        jobs.append(Job(cid, task, [plan], seed=cid))
    return x, y, tf, jobs, sd


def _federation(model, sizes):
    names = tuple(n for n, _ in model.named_parameters())
    return Federation(len(sizes), 3, 2, 0.1, 1, 8, names, rep_dim=5, client_sizes=tuple(sizes))


def test_target_moves_before_each_step_and_memory_keeps_the_newest_projections():
    """One step of batch 8 with memory 12: the target is ``xi0 + (1 - ema)(theta0 - xi0)``
    with the online parameters from *before* the step, and the memory is the old rows
    8..11 followed by the normalised train-mode target projections of the batch's T1 view."""
    model = _model()
    sizes = [8]
    algo = Orchestra(OrchestraParams(ema=0.9, memory=12, local_clusters=4), _federation(model, sizes))
    x, y, tf, jobs, sd = _jobs(algo, model, sizes, memory=12)
    xi0 = {k: v + 0.5 for k, v in jobs[0].task.params["target"].items()}  # a target away from theta0
    jobs[0].task.params["target"] = xi0
    old_bank = jobs[0].task.params["memory"]["bank"].clone()
    net = FunctionalNet(model)
    work = Workload.single(x, y, tf, net, algo.stages(1), SGD(0.5, 0.0, 0.0))
    (result,) = SequentialExecutor(work).train(jobs)
    theta0 = jobs[0].task.params["model"]
    assert any(not torch.equal(result.params["model"][k], theta0[k]) for k in theta0)  # the step moved theta
    for k, xi in xi0.items():
        if not k.startswith("heads."):  # the rotation head is not part of the target network
            torch.testing.assert_close(result.params["target"][k], xi + 0.1 * (theta0[k] - xi), rtol=0, atol=1e-6)
    rows, aug = jobs[0].plans[0].batch(0)
    x1 = tf(x[rows], aug[0])
    target = {**result.params["target"], **{k: v.clone() for k, v in jobs[0].task.buffers["target"].items()}}
    t1 = F.normalize(net(target, x1, train=True).z, dim=1)
    bank = result.params["memory"]["bank"]
    torch.testing.assert_close(bank[:4], old_bank[8:], rtol=0, atol=0)
    torch.testing.assert_close(bank[4:], t1, rtol=1e-5, atol=1e-6)
    assert result.stats["cluster"] > 0 and result.stats["rotation"] > 0


def test_orchestra_agrees_across_executors():
    """In float64 (float32 differences grow quickly through the sharp cluster softmax),
    the vectorized executor reproduces the sequential one for clients of different
    lengths: EMA before each step, memory after it, the rotation view and its noise."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = _model().double()
        sizes = [24, 40, 16]
        algo = Orchestra(OrchestraParams(memory=16), _federation(model, sizes))
        results = []
        for executor in ("sequential", "vectorized"):
            x, y, tf, jobs, _ = _jobs(algo, model, sizes, memory=16)
            work = Workload.single(x, y, lambda raw, p, tf=tf: tf(raw, p).double(), FunctionalNet(model), algo.stages(1), SGD(0.05, 0.9, 1e-4))
            run = SequentialExecutor(work) if executor == "sequential" else VectorizedExecutor(work, 2**30)
            results.append(run.train(jobs))
    finally:
        torch.set_default_dtype(default)
    for a, b in zip(*results):
        for role in ("model", "target", "memory"):
            for k in a.params[role]:
                torch.testing.assert_close(b.params[role][k], a.params[role][k], rtol=0, atol=1e-12)
        torch.testing.assert_close(b.stats["loss"].double(), a.stats["loss"].double(), rtol=1e-6, atol=0)
        assert a.stats["rotation"] > 0


# -- rounds ------------------------------------------------------------------------------
def tiny_cifar(folder, rows=24, test_rows=12):
    """A CIFAR-10 of random pixels in the official format (``allow_subset=true``)."""
    write_cifar10(folder / "cifar-10-batches-py", rows=rows, test_rows=test_rows)
    return [f"data_dir={folder}", "dataset=cifar10", "allow_subset=true"]


ORCHESTRA = ["algorithm=orchestra", "num_clients=3", "rounds=3", "local_epochs=1", "batch_size=8", "knn_k=5",
             "augment=simclr", "model.projection_hidden=16", "model.projection_dim=8", "model.projection_bn=true",
             "model.projection_bias=false", "model.projection_out_bn=true", "algorithm.global_clusters=6",
             "algorithm.local_clusters=3", "algorithm.memory=8", "executor=sequential", "eval_personal=false"]


def test_round_zero_only_clusters_and_later_rounds_train(tmp_path):
    sim = Simulation(prepare(load_config(None, [*ORCHESTRA, *tiny_cifar(tmp_path)])), None, None)
    model0 = {k: v.clone() for k, v in sim.server.model.items()}
    C0 = sim.server.extras["centroids"].clone()
    row = sim.run_round(0)
    assert row["local_steps"] == 0 and row["bytes_up"]["local_centroids"] == 3 * 3 * 8 * 4
    assert all(torch.equal(v, model0[k]) for k, v in sim.server.model.items())
    C = sim.server.extras["centroids"]
    torch.testing.assert_close(C.norm(dim=1), torch.ones(6))
    assert not torch.allclose(C, F.normalize(C0, dim=1))
    memories = []
    for cid in range(3):
        state = sim.store.get(cid)["algorithm"]
        assert state["memory"].shape == (8, 8)
        torch.testing.assert_close(state["memory"].norm(dim=1), torch.ones(8))
        memories.append(state["memory"].clone())
    row = sim.run_round(1)
    assert row["local_steps"] > 0 and math.isfinite(row["train_loss"])
    assert any(not torch.equal(v, model0[k]) for k, v in sim.server.model.items())
    assert all(not torch.equal(sim.store.get(cid)["algorithm"]["memory"], memories[cid]) for cid in range(3))


def test_local_centroids_with_a_wrong_shape_are_rejected(tmp_path):
    sim = Simulation(prepare(load_config(None, [*ORCHESTRA, *tiny_cifar(tmp_path)])), None, None)
    message = sim.algorithm.broadcast(sim.server, 0)
    spec = sim.algorithm.reply_spec(message)
    good = {"model": message["model"], "local_centroids": torch.zeros(3, 8)}
    assert check_reply(Reply(0, 10, good), spec) is None
    why = check_reply(Reply(0, 10, {**good, "local_centroids": torch.zeros(4, 8)}), spec)
    assert "local_centroids" in why and "[3, 8]" in why


def test_more_local_clusters_than_memory_is_a_config_error(capsys):
    from contrafl.cli import main

    assert main(["run", "algorithm=orchestra", "algorithm.rotation=0", "algorithm.memory=8", "algorithm.local_clusters=9"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.local_clusters=9 exceeds algorithm.memory=8" in err and "Traceback" not in err


def test_rotation_on_vectors_is_a_config_error(capsys):
    from contrafl.cli import main

    assert main(["run", "algorithm=orchestra"]) == 2  # digits: 64-d vectors
    err = capsys.readouterr().err
    assert "algorithm.rotation=1.0 predicts quarter turns of square images" in err and "[64]" in err
    assert "Traceback" not in err
