"""Orchestra: Sinkhorn-Knopp, local and global clustering, the order of its per-step
updates (EMA before the step, memory after it) and its rounds."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from contrafl.algorithms import orchestra as orchestra_module
from contrafl.algorithms.base import Federation, Reply, TrainResult
from contrafl.algorithms.orchestra import Orchestra, OrchestraParams, global_clustering, local_clustering, sinkhorn_knopp
from contrafl.algorithms.ssl import quadrant, rotate_quarters, target_part
from contrafl.config import load_config
from contrafl.data.augment import eval_transform
from contrafl.execution.executor import FunctionalNet, Job, SequentialExecutor, Workload, draw_noise, noise_generator
from contrafl.execution.optim import SGD
from contrafl.execution.plan import make_plan
from contrafl.rng import generator
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.execution.validate import check_reply
from contrafl.execution.vectorized import VectorizedExecutor
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
        message = {"model": sd, "centroids": C, **({"target": target_part(sd)} if algo.official else {})}
        task = algo.client_begin(message, {"memory": bank}, SimpleNamespace(round=1))
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


@pytest.mark.parametrize("variant", ["fedu2", "official"])
def test_orchestra_agrees_across_executors(variant):
    """In float64 (float32 differences grow quickly through the sharp cluster softmax),
    the vectorized executor reproduces the sequential one for clients of different
    lengths: EMA before each step, memory after it, the rotation view and its noise (and
    the official variant's extra online forward)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = _model().double()
        sizes = [24, 40, 16]
        algo = Orchestra(OrchestraParams(memory=16, variant=variant), _federation(model, sizes))
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
        for role in ("model", "target"):
            for k in a.buffers[role]:
                torch.testing.assert_close(b.buffers[role][k], a.buffers[role][k], rtol=0, atol=1e-12)
        torch.testing.assert_close(b.stats["loss"].double(), a.stats["loss"].double(), rtol=1e-6, atol=0)
        assert a.stats["rotation"] > 0


def _code_steps(model, job, x, tf, stage, official, lr, momentum, weight_decay, ema, T):
    """A transcription of the local steps of the official ``orchestra.forward``
    (models.py:652-687) and ``ssl_train`` (client.py:44-70) on ``nn.Module`` copies,
    on the batches and rotation draws of ``job``'s plan; ``official=False`` drops the
    unused online forward of ``x1`` (FedU2's fedorche/client.py:184). Returns the online
    and target state dicts and the memory."""
    task = job.task
    online = copy.deepcopy(model).train()
    online.load_state_dict({**task.params["model"], **task.buffers["model"]})
    target = copy.deepcopy(online)
    target.load_state_dict({**task.params["target"], **task.buffers["target"]}, strict=False)
    for param in target.parameters():
        param.requires_grad_(False)
    optimizer = torch.optim.SGD(online.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    bank = task.params["memory"]["bank"].clone()
    C = task.consts["centroids"].T
    g = noise_generator(job, 0)
    plan = job.plans[0]
    for step in range(plan.steps):
        rows, aug = plan.batch(step)
        x1, x2, x3 = (tf(x[rows], a).double() for a in aug)
        deg_labels = quadrant(draw_noise(stage, g, x.device)["rotation"])
        x3 = rotate_quarters(x3, deg_labels)
        optimizer.zero_grad()
        if official:
            F.normalize(online(x1).z, dim=1)  # Z1, unused
        Z2 = F.normalize(online(x2).z, dim=1)
        logpZ2 = torch.log(F.softmax(Z2 @ C / T, dim=1))
        with torch.no_grad():
            for (name, t), o in zip(target.named_parameters(), online.parameters()):
                if not name.startswith("heads."):  # update_target: backbone and projector
                    t.data = ema * t.data + (1 - ema) * o.data
            tZ1 = F.normalize(target(x1).z, dim=1)
            tP1 = F.softmax(tZ1 @ C / T, dim=1)
        L_cluster = -torch.sum(tP1 * logpZ2, dim=1).mean()
        L_deg = F.cross_entropy(online(x3).extra["rotation"], deg_labels)  # deg_layer(projector(backbone(x3)))
        (L_cluster + L_deg).backward()
        optimizer.step()
        bank = torch.cat([bank, tZ1])[-len(bank):]  # update_memory
    return online.state_dict(), target.state_dict(), bank


@pytest.mark.parametrize("variant", ["official", "fedu2"])
def test_local_steps_match_a_transcription_of_the_code(variant):
    """Three steps of two clients (float64) against :func:`_code_steps` on identical
    tensors: online parameters and BatchNorm statistics, target, memory. The official
    variant's online statistics follow four train-mode forwards a step (x1, x2, x3 and
    the target's x1 on the target), FedU2's three; the parameters agree between the two
    (the unused forward changes no gradient), the statistics do not."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = _model().double()
        sizes = [24, 16]
        p = OrchestraParams(memory=12, local_clusters=4, ema=0.9, variant=variant)
        algo = Orchestra(p, _federation(model, sizes))
        x, y, tf, jobs, sd = _jobs(algo, model, sizes, memory=12)
        stage = algo.stages(1)[0]
        work = Workload.single(x, y, lambda raw, q, tf=tf: tf(raw, q).double(), FunctionalNet(model), [stage], SGD(0.05, 0.9, 1e-4))
        results = SequentialExecutor(work).train(jobs)
        for job, result in zip(jobs, results):
            online, target, bank = _code_steps(model, job, x, tf, stage, variant == "official", 0.05, 0.9, 1e-4, 0.9, p.temperature)
            ours = {**result.params["model"], **result.buffers["model"]}
            assert set(ours) == set(online)
            for k, v in online.items():
                torch.testing.assert_close(ours[k], v, rtol=0, atol=1e-10)
            for k, v in {**result.params["target"], **result.buffers["target"]}.items():
                torch.testing.assert_close(v, target[k], rtol=0, atol=1e-10)
            torch.testing.assert_close(result.params["memory"]["bank"], bank, rtol=0, atol=1e-10)
            tracked = "features.1.num_batches_tracked"
            assert int(ours[tracked] - sd[tracked]) == (3 if variant == "official" else 2) * job.plans[0].steps
    finally:
        torch.set_default_dtype(default)


def test_official_variant_sends_and_receives_the_target():
    """``variant=official``: the server holds a target (the initial model's encoder and
    projector) and sends it; the client trains from the received target even when it
    kept one, returns it with the model and keeps only its memory; the server averages
    the targets with the models' weights. ``variant=fedu2`` keeps the target on the
    client and sends none."""
    model = _model()
    sizes = [20, 7, 16]
    official = Orchestra(OrchestraParams(variant="official", memory=12, local_clusters=4), _federation(model, sizes))
    fedu2 = Orchestra(OrchestraParams(memory=12, local_clusters=4), _federation(model, sizes))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    server = official.init_server(sd)
    message = official.broadcast(server, 1)
    assert set(message) == {"model", "centroids", "target"} and set(message["target"]) == set(target_part(sd))
    assert "target" not in fedu2.broadcast(fedu2.init_server(sd), 1)

    received = {k: v + 1 if v.is_floating_point() else v for k, v in message["target"].items()}
    kept = {k: v - 1 if v.is_floating_point() else v for k, v in message["target"].items()}
    bank = F.normalize(torch.randn(12, 5, generator=torch.Generator().manual_seed(0)), dim=1)
    ctx = SimpleNamespace(round=1, cid=0, num_samples=20, generator=lambda *key: torch.Generator().manual_seed(1))
    for algo, want in ((official, received), (fedu2, kept)):
        task = algo.client_begin({**message, "target": received}, {"memory": bank, "target": kept}, ctx)
        target = {**task.params["target"], **task.buffers["target"]}
        for k, v in want.items():
            torch.testing.assert_close(target[k], v)
        result = TrainResult(task.params, task.buffers, {}, 0)
        reply, state = algo.client_end(task, result, {"memory": bank}, ctx)
        assert ("target" in reply.payload) is (algo is official) and ("target" in state) is (algo is fedu2)
        assert check_reply(reply, algo.reply_spec(message if algo is official else fedu2.broadcast(fedu2.init_server(sd), 1))) is None

    def reply(cid, n, value):
        shift = {k: torch.full_like(v, value) if v.is_floating_point() else v for k, v in sd.items()}
        return Reply(cid, n, {"model": shift, "target": target_part(shift), "local_centroids": torch.zeros(4, 5)})

    new = official.aggregate(server, [reply(0, 20, 1.0), reply(1, 7, 5.0), reply(2, 16, 3.0)], 1)
    # floor(n / 8) = 2, 0, 2: the client with fewer samples than a batch weighs nothing
    torch.testing.assert_close(new.extras["target"]["l1.weight"], torch.full_like(sd["l1.weight"], 2.0))
    torch.testing.assert_close(new.model["l1.weight"], torch.full_like(sd["l1.weight"], 2.0))
    kept_target = official.aggregate(server, [reply(0, 20, 1.0)], 0).extras["target"]  # round 0 trains nothing
    assert all(torch.equal(v, server.extras["target"][k]) for k, v in kept_target.items())


def test_weights_of_the_variants():
    """floor(n_k / B) (the official ``len`` of a ``drop_last`` loader) and ceil(n_k / B)
    (FedU2's loader), B = 8; ``weighting`` overrides the variant's."""
    model = _model()
    replies = [Reply(i, n, {}) for i, n in enumerate((20, 7, 16))]

    def weights(**kw):
        return Orchestra(OrchestraParams(**kw), _federation(model, [20, 7, 16])).weights(replies)

    assert weights(variant="official") == pytest.approx([2 / 4, 0, 2 / 4])
    assert weights() == pytest.approx([3 / 6, 1 / 6, 2 / 6])
    assert weights(variant="official", weighting="batches") == pytest.approx([3 / 6, 1 / 6, 2 / 6])
    assert weights(weighting="full_batches") == pytest.approx([2 / 4, 0, 2 / 4])
    assert weights(weighting="samples") == pytest.approx([20 / 43, 7 / 43, 16 / 43])
    tiny = [Reply(0, 3, {}), Reply(1, 5, {})]
    assert Orchestra(OrchestraParams(variant="official"), _federation(model, [3, 5])).weights(tiny) == [0.5, 0.5]


@pytest.mark.parametrize("variant, steps, want", [("official", None, 500), ("fedu2", None, 50), ("official", 7, 7)])
def test_global_clustering_steps_of_the_variants(monkeypatch, variant, steps, want):
    """500 SGD steps of global clustering in the official code (models.py:624), 50 in
    FedU2's (fedorche/server.py:98); ``global_steps`` overrides the variant's."""
    seen = []

    def record(C, Z, temperature, steps, *rest):
        seen.append(steps)
        return C

    monkeypatch.setattr(orchestra_module, "global_clustering", record)
    model = _model()
    algo = Orchestra(OrchestraParams(variant=variant, global_steps=steps, memory=12, local_clusters=4), _federation(model, [8]))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    server = algo.init_server(sd)
    algo.aggregate(server, [Reply(0, 8, {"model": sd, "target": target_part(sd), "local_centroids": torch.zeros(4, 5)})], 1)
    assert seen == [want]


# -- the first memory ------------------------------------------------------------------------
def _memory_ctx(n: int, net: FunctionalNet) -> SimpleNamespace:
    """A round-0 client of ``n`` random images whose "augmentation" draws from the
    generator, as the engine's does."""
    x = torch.randn(n, 3, 6, 6, generator=torch.Generator().manual_seed(3))

    def augmented_data(view, g):
        return x + 0.1 * torch.randn(x.shape, generator=g), torch.zeros(n, dtype=torch.long)

    return SimpleNamespace(round=0, cid=0, num_samples=n, net=net, augmented_data=augmented_data,
                           generator=lambda *key: torch.Generator().manual_seed(7))


def _code_reset_memory(model, target_state, x1, order, M, B, official):
    """A transcription of ``reset_memory`` on ``nn.Module`` copies, the loader shuffled
    by ``order``: FedU2's (fedorche/client.py:94-142, its loader without ``drop_last``,
    train_fedorche.py:66) or the official one (models.py:546-573, its ``drop_last``
    loader, utils.py:357). FedU2's saves and restores the online encoder's BatchNorm
    entries, which it never runs (nothing to do here); the official one restores every
    ``bn`` entry, the target's included. Returns the memory and the target's state."""
    target = copy.deepcopy(model).train()
    target.load_state_dict(target_state, strict=False)
    reset = copy.deepcopy(target.state_dict())
    loader = DataLoader(TensorDataset(x1), batch_size=B, sampler=order.tolist(), drop_last=official)
    proj_bank, n_samples = [], 0
    with torch.no_grad():
        for (x,) in loader:
            if n_samples >= M:
                break
            if not official and x.shape[0] == 1:
                x = x.repeat(16, 1, 1, 1)
            proj_bank.append(F.normalize(target(x).z, dim=1))
            n_samples += x.shape[0]
    proj_bank = torch.cat(proj_bank, dim=0)
    if n_samples > M:
        proj_bank = proj_bank[:M]
    elif n_samples < M:
        proj_bank = proj_bank.repeat(M // n_samples + 1, 1)[:M]
    if official:
        target.load_state_dict(reset)
    return proj_bank, target.state_dict()


@pytest.mark.parametrize("variant, n", [("fedu2", 40), ("official", 40), ("fedu2", 22), ("fedu2", 17), ("fedu2", 12)])
def test_first_memory_forwards_whole_batches_as_the_code_does(variant, n):
    """M = 20, B = 8: the memory is the first 20 rows of three whole batches of the
    shuffled samples (n = 40), not of batches 8, 8, 4 (train-mode BatchNorm makes a
    short batch's projections differ); the last batch is short only where the samples
    end (n = 22: 8, 8, 6), a batch of one sample is repeated 16 times (n = 17) and
    fewer rows than M are tiled (n = 12), as FedU2's code does. The target keeps the
    statistics of these forwards with ``variant=fedu2`` (FedU2's code restores the
    online encoder's) and not with ``official``; the broadcast model is untouched."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # a sample repeated 16 times has BatchNorm divide rounding by sqrt(eps)
    try:
        model = _model().double()
        M, B = 20, 8
        algo = Orchestra(OrchestraParams(memory=M, local_clusters=4, variant=variant), _federation(model, [n]))
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        message = {"model": sd, "centroids": torch.zeros(7, 5), **({"target": target_part(sd)} if algo.official else {})}
        ctx = _memory_ctx(n, FunctionalNet(model))
        task = algo.client_begin(message, {}, ctx)

        g = ctx.generator("orchestra-memory")
        x1, _ = ctx.augmented_data(0, g)
        order = torch.randperm(n, generator=g)
        bank, target = _code_reset_memory(model, target_part(sd), x1, order, M, B, algo.official)
    finally:
        torch.set_default_dtype(default)
    torch.testing.assert_close(task.params["memory"]["bank"], bank, rtol=0, atol=1e-10)
    for k, v in task.buffers["target"].items():
        torch.testing.assert_close(v, target[k], rtol=0, atol=1e-10)
    tracked = task.buffers["target"]["features.1.num_batches_tracked"] - sd["features.1.num_batches_tracked"]
    assert int(tracked) == (0 if algo.official else min(math.ceil(M / B), math.ceil(n / B)))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in sd.items())
    if n == 40:  # batches of 8, 8 and 4 of the first 20 rows: another memory
        short = _code_reset_memory(model, target_part(sd), x1[order[:M]], torch.arange(M), M, B, False)[0]
        assert (short - bank).abs().max() > 1e-2


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
        for k, v in state["target"].items():  # the fill's one batch (M = B = 8) updated the kept target's statistics
            if k.endswith("num_batches_tracked"):
                assert int(v - model0[k]) == 1
    row = sim.run_round(1)
    assert row["local_steps"] > 0 and math.isfinite(row["train_loss"])
    assert any(not torch.equal(v, model0[k]) for k, v in sim.server.model.items())
    assert all(not torch.equal(sim.store.get(cid)["algorithm"]["memory"], memories[cid]) for cid in range(3))


def test_official_rounds_carry_the_target(tmp_path):
    """A run of the official variant: the target is part of the message and of every
    reply (counted as its own kind), the server's target moves, the clients keep only
    their memory."""
    sim = Simulation(prepare(load_config(None, [*ORCHESTRA, "algorithm.variant=official", *tiny_cifar(tmp_path)])), None, None)
    target0 = {k: v.clone() for k, v in sim.server.extras["target"].items()}
    assert "target" in sim.algorithm.broadcast(sim.server, 0)
    row = sim.run_round(0)
    assert row["bytes_up"]["target"] > 0 and all(torch.equal(v, target0[k]) for k, v in sim.server.extras["target"].items())
    sim.run_round(1)
    assert any(not torch.equal(v, target0[k]) for k, v in sim.server.extras["target"].items() if v.is_floating_point())
    assert all(set(sim.store.get(cid)["algorithm"]) == {"memory"} for cid in range(3))


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


def test_orchestra_needs_no_facts_of_other_clients():
    """Its options have no ``even_steps`` (``node_data=own`` asked for one and failed)."""
    assert Orchestra.needs_all_clients_data(OrchestraParams(variant="official")) is None
