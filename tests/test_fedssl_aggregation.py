"""L-DAWA (divergence-aware aggregation of SSL clients) and FedX (cross knowledge
distillation): the rules by hand on tiny tensors, executor agreement and short runs."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from contrafl.algorithms.base import Federation, Reply
from contrafl.algorithms.fedx import FedX, FedXParams, fedx_losses, relational_loss
from contrafl.algorithms.ldawa import LDAWA, LDAWAParams, divergence_cosines, ldawa_groups
from contrafl.algorithms.ssl import nt_xent
from contrafl.cli import main
from contrafl.data.augment import eval_transform
from contrafl.execution.executor import FunctionalNet, Job, SequentialExecutor, Workload
from contrafl.execution.optim import SGD
from contrafl.execution.plan import make_plan
from contrafl.rng import generator
from contrafl.execution.vectorized import VectorizedExecutor
from contrafl.models.base import FedModel, Heads

T = torch.float64
R2 = math.sqrt(2)


def _t(*values):
    return torch.tensor(values, dtype=T)


# -- L-DAWA -----------------------------------------------------------------------------------
def _ldawa(names, **kw) -> LDAWA:
    return LDAWA(LDAWAParams(**kw), Federation(2, 3, 1, 0.1, 1, 4, tuple(names)))


def _layer_case():
    """Global w = (1, 0), v = (1, 1), a 0-dim counter 4; clients A and B."""
    model = {"w": _t(1, 0), "v": _t(1, 1), "n": torch.tensor(4)}
    a = {"w": _t(1, 1), "v": _t(2, 2), "n": torch.tensor(6)}
    b = {"w": _t(0, 3), "v": _t(0, -1), "n": torch.tensor(9)}
    return model, [Reply(0, 10, {"model": a}), Reply(1, 30, {"model": b})]


def test_layer_wise_weights_by_hand():
    """c_A^w = 1/sqrt2, c_B^w = 0; c_A^v = 1, c_B^v = -1/sqrt2 (a negative cosine flips the
    tensor, as the code); W = sum_k c_k W_k / K, no sample weights; the 0-dim counter is
    the plain mean (15 / 2, truncated)."""
    algo = _ldawa(("w", "v"))
    model, replies = _layer_case()
    new = algo.aggregate(algo.init_server(model), replies, 0)
    torch.testing.assert_close(new.model["w"], _t(1 / R2, 1 / R2) / 2)
    torch.testing.assert_close(new.model["v"], (_t(2, 2) - _t(0, -1) / R2) / 2)
    assert new.model["n"].item() == 7 and new.model["n"].dtype == torch.int64
    mean_cos = {0: (1 / R2 + 1) / 2, 1: (0 - 1 / R2) / 2}
    assert new.extras["ldawa_cosine"] == pytest.approx(mean_cos)


def test_renormalized_weights_by_hand():
    """renormalize: W = sum_k c_k W_k / sum_k c_k."""
    algo = _ldawa(("w", "v"), renormalize=True)
    model, replies = _layer_case()
    new = algo.aggregate(algo.init_server(model), replies, 0)
    torch.testing.assert_close(new.model["w"], _t(1, 1))
    torch.testing.assert_close(new.model["v"], (_t(2, 2) - _t(0, -1) / R2) / (1 - 1 / R2))
    assert new.model["n"].item() == 7


def test_buffers_averaged_and_warmup_is_fedavg():
    """buffers=average: the counter gets the sample-weighted mean 6/4 + 9 * 3/4 = 8.25;
    in a warm-up round everything is FedAvg."""
    model, replies = _layer_case()
    algo = _ldawa(("w", "v"), buffers="average")
    assert algo.aggregate(algo.init_server(model), replies, 0).model["n"].item() == 8
    warm = _ldawa(("w", "v"), warmup_rounds=1)
    new = warm.aggregate(warm.init_server(model), replies, 0)
    torch.testing.assert_close(new.model["w"], _t(0.25, 2.5))  # 1/4 (1, 1) + 3/4 (0, 3)
    assert "ldawa_cosine" not in new.extras
    torch.testing.assert_close(warm.aggregate(warm.init_server(model), replies, 1).model["w"], _t(1 / R2, 1 / R2) / 2)


def test_cosine_is_clipped_at_one_and_zero_vectors_count_as_one():
    g = torch.rand(7, generator=torch.Generator().manual_seed(1), dtype=T)
    w = 3 * g
    assert float(g @ w) / float(g.norm() * w.norm()) > 1  # rounding
    cos = divergence_cosines({"g": g, "z": torch.zeros(2, dtype=T)}, [{"g": w, "z": _t(1, 2)}], {"g": ["g"], "z": ["z"]})
    assert cos == {"g": [1.0], "z": [1.0]}
    # a zero global tensor (BatchNorm's bias at initialisation) is averaged unscaled
    algo = _ldawa(("b",))
    replies = [Reply(0, 1, {"model": {"b": _t(1, 2)}}), Reply(1, 1, {"model": {"b": _t(3, 4)}})]
    torch.testing.assert_close(algo.aggregate(algo.init_server({"b": _t(0, 0)}), replies, 0).model["b"], _t(2, 3))


def _module_state(enc_w, mean, count, l1, l2):
    return {
        "features.0.weight": enc_w,
        "features.1.running_mean": mean,
        "features.1.num_batches_tracked": torch.tensor(count),
        "l1.weight": l1,
        "l2.weight": l2,
        "predictor.0.weight": _t(1),
        "heads.rotation.weight": _t(2),
    }


def test_module_groups_and_weights_by_hand():
    """FedU2's module-wise cosine over each block's whole state dict, buffers and the
    counter included: encoder vectors G = (1, 0, 1, 1), A = (1, 1, 1, 1), B = (-1, 0, -1, 1)
    give c_A = 3 / (2 sqrt3), c_B = -1/3; projector (l1, l2): G = (2, 0), A = (3, 0),
    B = (0, 5) give c = 1, 0."""
    names = ("features.0.weight", "l1.weight", "l2.weight", "predictor.0.weight", "heads.rotation.weight")
    model = _module_state(_t(1, 0), _t(1), 1, _t(2), _t(0))
    a = _module_state(_t(1, 1), _t(1), 1, _t(3), _t(0))
    b = _module_state(_t(-1, 0), _t(-1), 1, _t(0), _t(5))
    groups = ldawa_groups(model, "module")
    assert groups == {
        "encoder": ["features.0.weight", "features.1.running_mean", "features.1.num_batches_tracked"],
        "projector": ["l1.weight", "l2.weight"],
        "predictor": ["predictor.0.weight"],
        "heads.rotation": ["heads.rotation.weight"],
    }
    assert ldawa_groups(model, "model") == {"model": list(model)}
    assert "features.1.num_batches_tracked" not in ldawa_groups(model, "layer")
    algo = _ldawa(names, granularity="module")
    new = algo.aggregate(algo.init_server(model), [Reply(0, 10, {"model": a}), Reply(1, 10, {"model": b})], 0).model
    ca, cb = 3 / (2 * math.sqrt(3)), -1 / 3
    torch.testing.assert_close(new["features.0.weight"], (ca * _t(1, 1) + cb * _t(-1, 0)) / 2)
    torch.testing.assert_close(new["features.1.running_mean"], _t((ca + 1 / 3) / 2))
    assert new["features.1.num_batches_tracked"].item() == int((ca + cb) / 2)  # scaled and truncated, as FedU2's code
    torch.testing.assert_close(new["l1.weight"], _t(1.5))
    torch.testing.assert_close(new["l2.weight"], _t(0.0))
    torch.testing.assert_close(new["predictor.0.weight"], _t(1.0))


def test_shared_target_is_aggregated_against_the_global_target():
    algo = LDAWA(LDAWAParams(method="byol", share_target=True), Federation(2, 3, 1, 0.1, 1, 4, ("w", "predictor.w")))
    server = algo.init_server({"w": _t(1, 0), "predictor.w": _t(1)})
    assert set(server.extras["target"]) == {"w"}
    replies = [
        Reply(0, 10, {"model": {"w": _t(1, 0), "predictor.w": _t(1)}, "target": {"w": _t(1, 1)}}),
        Reply(1, 10, {"model": {"w": _t(1, 0), "predictor.w": _t(1)}, "target": {"w": _t(0, 1)}}),
    ]
    new = algo.aggregate(server, replies, 0)
    torch.testing.assert_close(new.extras["target"]["w"], _t(1 / R2, 1 / R2) / 2)
    torch.testing.assert_close(new.model["w"], _t(1, 0))


# -- FedX -------------------------------------------------------------------------------------
def _cos(u, v):
    return sum(x * y for x, y in zip(u, v)) / math.sqrt(sum(x * x for x in u) * sum(y * y for y in v))


def _softmax(row, t):
    e = [math.exp(s / t) for s in row]
    return [x / sum(e) for x in e]


def _relational_by_hand(a, b, r, t, t2, exclude_self=False):
    total = 0.0
    for i in range(len(a)):
        cols = [j for j in range(len(r)) if not (exclude_self and j == i)]
        sa = [_cos(a[i], r[j]) for j in cols]
        sb = [_cos(b[i], r[j]) for j in cols]
        m = [(x + y) / 2 for x, y in zip(_softmax(sa, t2), _softmax(sb, t2))]
        for s in (sa, sb):
            q = _softmax(s, t)
            total += 0.5 * sum(mj * math.log(mj / qj) for mj, qj in zip(m, q))
    return total / len(a)


A3 = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
B3 = [[1.0, 1.0], [0.0, 2.0], [-1.0, 1.0]]
R3 = [[1.0, 0.0], [0.0, 1.0], [-1.0, -2.0]]


@pytest.mark.parametrize("exclude_self", [False, True])
def test_relational_loss_on_three_samples_by_hand(exclude_self):
    """Temperatures 0.5 (predicted) and 0.2 (target) differ, so swapping them shows."""
    got = relational_loss(torch.tensor(A3, dtype=T), torch.tensor(B3, dtype=T), torch.tensor(R3, dtype=T), 0.5, 0.2, exclude_self)
    assert got.item() == pytest.approx(_relational_by_hand(A3, B3, R3, 0.5, 0.2, exclude_self), rel=1e-10)
    swapped = _relational_by_hand(A3, B3, R3, 0.2, 0.5, exclude_self)
    assert abs(got.item() - swapped) > 1e-3


def test_relational_target_is_not_detached():
    """The gradient flows through m too (FedX's code): it differs from the gradient of
    the same loss with m held constant."""
    a = torch.tensor(A3, dtype=T, requires_grad=True)
    b, r = torch.tensor(B3, dtype=T), torch.tensor(R3, dtype=T)
    (grad,) = torch.autograd.grad(relational_loss(a, b, r, 0.5, 0.2), [a])
    nf = torch.nn.functional
    sa, sb = nf.normalize(a, dim=1) @ nf.normalize(r, dim=1).T, nf.normalize(b, dim=1) @ nf.normalize(r, dim=1).T
    m = ((nf.softmax(sa / 0.2, 1) + nf.softmax(sb / 0.2, 1)) / 2).detach()
    held = 0.5 * (nf.kl_div(nf.log_softmax(sa / 0.5, 1), m, reduction="batchmean") + nf.kl_div(nf.log_softmax(sb / 0.5, 1), m, reduction="batchmean"))
    (grad_held,) = torch.autograd.grad(held, [a])
    assert (grad - grad_held).abs().max() > 1e-3


def test_fedx_terms_pair_the_views_and_models_as_the_paper():
    g = torch.Generator().manual_seed(0)
    proj, pred, glob = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g), torch.randn(2, 4, 5, generator=g)
    terms = fedx_losses(proj, pred, glob, 0.1, 0.3, 0.7, exclude_self=False)
    assert terms["nt_local"].item() == pytest.approx(nt_xent(proj[0], proj[1], 0.1).item())
    assert terms["nt_global"].item() == pytest.approx(nt_xent(pred[0], glob[0], 0.1).item())
    assert terms["js_local"].item() == pytest.approx(relational_loss(proj[0], proj[1], proj[2], 0.1, 0.7).item())
    assert terms["js_global"].item() == pytest.approx(relational_loss(pred[0], pred[1], glob[1], 0.1, 0.3).item())


def _conv_model(seed: int = 0) -> FedModel:
    torch.manual_seed(seed)
    features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    heads = FedX.heads(FedXParams(predictor_hidden=6))
    return FedModel(features, 4, 3, projection_dim=5, heads=heads, projection_hidden=6, projection_bn=True)


def _federation(names, batch_size=8):
    return Federation(3, 3, 2, 0.1, 1, batch_size, tuple(names))


def test_fedx_heads_and_local_loss_wiring():
    """No classifier, a predictor without BatchNorm; the loss is one train-mode forward
    over (x, x+, x_r) and the global model's eval-mode projections of (x+, x_r), which stays
    frozen in the task."""
    assert FedX.heads(FedXParams()) == Heads(256, classifier=False, predictor_bn=False)
    model = _conv_model()
    algo = FedX(FedXParams(), _federation([n for n, _ in model.named_parameters()]))
    assert algo.views == 3 and algo.init_client(None) == {}
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    task = algo.client_begin({"model": sd}, {}, SimpleNamespace())
    assert task.frozen["global"] is sd
    net = FunctionalNet(model)
    x = torch.randn(3, 6, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    batch = SimpleNamespace(x=x, noise={})
    def buffers():  # the executors train copies: a train-mode forward updates BatchNorm statistics in place
        return {"model": {k: v.clone() for k, v in task.buffers["model"].items()}}

    view = SimpleNamespace(params=task.params, buffers=buffers(), frozen=task.frozen, consts={})
    _, stats = algo.local_loss(view, batch, net)
    out = net({**task.params["model"], **buffers()["model"]}, torch.cat(list(x)), train=True)
    lp, lq = out.z.view(3, 6, -1), out.p.view(3, 6, -1)
    gp = torch.stack([net(sd, x[1], train=False).z, net(sd, x[2], train=False).z])
    want = fedx_losses(lp, lq, gp, 0.1, 0.1, 0.1, exclude_self=True)
    for k, v in want.items():
        assert stats[k].item() == pytest.approx(v.item(), rel=1e-5)
    assert stats["loss"].item() == pytest.approx(sum(v.item() for v in want.values()), rel=1e-5)


def test_fedx_agrees_across_executors():
    """Three views, a frozen global model shared by the clients, clients of different
    lengths: the vectorized executor reproduces the sequential one."""
    model = _conv_model()
    names = [n for n, _ in model.named_parameters()]
    algo = FedX(FedXParams(predictor_hidden=6), _federation(names))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sizes = [24, 40, 16]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (sum(sizes), 3, 6, 6), dtype=torch.uint8, generator=g)
    y = torch.zeros(sum(sizes), dtype=torch.long)
    tf = eval_transform(None, None)
    results = []
    for executor in ("sequential", "vectorized"):
        jobs, start = [], 0
        for cid, n in enumerate(sizes):
            rows = np.arange(start, start + n)
            start += n
            plan = make_plan(rows, 1, 8, True, tf.sample, algo.views, generator(0, "plan", cid))
            jobs.append(Job(cid, algo.client_begin({"model": sd}, {}, SimpleNamespace(num_samples=n)), [plan], seed=cid))
        work = Workload.single(x, y, tf, FunctionalNet(model), algo.stages(0), SGD(0.05, 0.9, 1e-4))
        run = SequentialExecutor(work) if executor == "sequential" else VectorizedExecutor(work, 2**30)
        results.append(run.train(jobs))
    for a, b in zip(*results):  # float32 sums in other orders: up to 2.5e-5 apart with one torch thread
        for k in a.params["model"]:
            torch.testing.assert_close(b.params["model"][k], a.params["model"][k], rtol=0, atol=1e-4)
        for k in a.buffers["model"]:
            torch.testing.assert_close(b.buffers["model"][k].float(), a.buffers["model"][k].float(), rtol=1e-5, atol=1e-5)
        for k in ("loss", "nt_local", "nt_global", "js_local", "js_global"):
            torch.testing.assert_close(b.stats[k], a.stats[k], rtol=1e-5, atol=1e-5)
        # the views are the same image (no augmentation), so both relational terms are 0 up to
        # rounding, of either sign (its sign differs between CPUs); the global model's term is not
        assert abs(a.stats["js_local"]) < 1e-6 and abs(a.stats["js_global"]) < 1e-6
        assert a.stats["nt_global"] > 0 and not torch.equal(a.params["model"]["predictor.0.weight"], sd["predictor.0.weight"])


# -- runs -------------------------------------------------------------------------------------
COMMON = ["num_clients=3", "rounds=2", "local_epochs=1", "knn_k=5",
          "model.projection_hidden=16", "model.projection_dim=8", "algorithm.predictor_hidden=16"]


@pytest.mark.parametrize("settings", [
    ["algorithm=ldawa", "algorithm.method=simsiam", "algorithm.granularity=module"],
    ["algorithm=fedx"],
], ids=["ldawa", "fedx"])
def test_short_runs(tmp_path, settings):
    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), *settings, *COMMON]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0.3 < r["knn_acc"] <= 1 and math.isfinite(r["train_loss"]) for r in rows)
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    if settings[0] == "algorithm=ldawa":
        assert sorted(checkpoint["server"]["extras"]["ldawa_cosine"]) == [0, 1, 2]
    else:
        assert not any(k.startswith("predictor.1.running") for k in checkpoint["server"]["model"])
