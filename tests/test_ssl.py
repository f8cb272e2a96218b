"""Self-supervised objectives and FedSimCLR / FedBYOL / FedSimSiam."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from contrafl.algorithms.base import Batch, Federation, Reply, TaskView
from contrafl.algorithms.fedu2 import FedU2, FedU2Params
from contrafl.algorithms.ssl import (
    FedBYOL,
    FedSimCLR,
    FedSimSiam,
    SSLParams,
    byol_loss,
    nt_xent,
    quadrant,
    rotate_quarters,
    simsiam_loss,
)
from contrafl.cli import main
from contrafl.config import Config, fingerprint
from contrafl.data.augment import eval_transform
from contrafl.execution.executor import FunctionalNet, Job, SequentialExecutor, Workload
from contrafl.execution.optim import SGD
from contrafl.execution.plan import make_plan
from contrafl.rng import generator
from contrafl.execution.vectorized import VectorizedExecutor
from contrafl.models.base import FedModel, Heads

pytestmark = pytest.mark.usefixtures("one_thread")


# -- objectives -----------------------------------------------------------------------------
def _nt_xent_by_hand(z1, z2, t, zero_self=False):
    rows = [F_normalize(v) for v in z1 + z2]
    n = len(z1)
    total = 0.0
    for i, u in enumerate(rows):
        positive = (i + n) % (2 * n)
        logits = {j: sum(a * b for a, b in zip(u, v)) / t for j, v in enumerate(rows) if j != i}
        denominator = sum(math.exp(s) for s in logits.values()) + (1.0 if zero_self else 0.0)
        total += -math.log(math.exp(logits[positive]) / denominator)
    return total / (2 * n)


def F_normalize(v):
    norm = math.sqrt(sum(a * a for a in v))
    return [a / norm for a in v]


@pytest.mark.parametrize("self_similarity", ["mask", "zero"])
def test_nt_xent_on_four_samples_by_hand(self_similarity):
    z1 = [[1.0, 0.0], [0.0, 2.0]]
    z2 = [[3.0, 1.0], [-1.0, 1.0]]
    got = nt_xent(torch.tensor(z1), torch.tensor(z2), 0.5, self_similarity)
    want = _nt_xent_by_hand(z1, z2, 0.5, zero_self=self_similarity == "zero")
    assert got.item() == pytest.approx(want, rel=1e-6)
    # the two readings differ: the zeroed diagonal adds exp(0) to every denominator
    other = _nt_xent_by_hand(z1, z2, 0.5, zero_self=self_similarity != "zero")
    assert abs(want - other) > 1e-3


def test_byol_and_simsiam_stop_gradients():
    g = torch.Generator().manual_seed(0)
    p1, p2, z1, z2, t = (torch.randn(5, 4, generator=g, requires_grad=True) for _ in range(5))
    grads = torch.autograd.grad(byol_loss(p1, t), [p1, t], allow_unused=True)
    assert grads[0].abs().sum() > 0 and grads[1] is None
    grads = torch.autograd.grad(simsiam_loss(p1, p2, z1, z2), [p1, p2, z1, z2], allow_unused=True)
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() > 0
    assert grads[2] is None and grads[3] is None
    # the value: mean(2 - 2 cos) and -1/2 (cos(p1, z2) + cos(p2, z1))
    cos = torch.nn.functional.cosine_similarity
    assert byol_loss(p1, t).item() == pytest.approx((2 - 2 * cos(p1, t)).mean().item())
    want = -0.5 * (cos(p1, z2).mean() + cos(p2, z1).mean())
    assert simsiam_loss(p1, p2, z1, z2).item() == pytest.approx(want.item())


def test_quadrant_is_uniform_and_rotations_match_rot90():
    a = quadrant(torch.randn(40000, generator=torch.Generator().manual_seed(0)))
    counts = torch.bincount(a, minlength=4).double() / len(a)
    assert torch.allclose(counts, torch.full((4,), 0.25, dtype=torch.float64), atol=0.01)
    x = torch.arange(4 * 2 * 5 * 5, dtype=torch.float32).view(4, 2, 5, 5)
    turns = torch.tensor([0, 1, 2, 3])
    out = rotate_quarters(x, turns)
    for i in range(4):
        assert torch.equal(out[i], torch.rot90(x[i], i, dims=(-2, -1)))


# -- the algorithms ---------------------------------------------------------------------------
def _federation(names, sizes=(1000, 300, 50), batch_size=16):
    return Federation(len(sizes), 3, 2, 0.1, 5, batch_size, tuple(names), client_sizes=tuple(sizes))


def test_even_steps_epochs_and_batch_weights():
    """FedU2's EvenClient with sizes 1000/300/50, B = 128, E = 5: max_steps =
    (1000 // 128 + 1) 5 = 40; epochs 40 // 8 = 5, min(40 // 3, 10) = 10, min(40, 10) = 10."""
    algo = FedSimCLR(SSLParams(even_steps=True, weighting="batches"), _federation(("w",), batch_size=128))
    assert [algo.even_epochs(n) for n in (1000, 300, 50)] == [5, 10, 10]
    replies = [Reply(i, n, {}) for i, n in enumerate((1000, 300, 50))]
    assert algo.weights(replies) == pytest.approx([8 / 12, 3 / 12, 1 / 12])


def _conv_model(rotation: bool, seed: int = 0) -> FedModel:
    torch.manual_seed(seed)
    features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    heads = Heads(predictor_hidden=6, classifier=False, extra=(("rotation", 4),) if rotation else ())
    return FedModel(features, 4, 3, projection_dim=5, heads=heads, projection_hidden=6, projection_bn=True)


def _byol_jobs(algo, model, sizes, views, lr_state=None):
    names = {n for n, _ in model.named_parameters()}
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    other = {k: v + 0.5 for k, v in sd.items() if k in names}  # a target that differs from the online model
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (sum(sizes), 3, 6, 6), dtype=torch.uint8, generator=g)
    y = torch.zeros(sum(sizes), dtype=torch.long)
    tf = eval_transform(None, None)
    jobs, start = [], 0
    for cid, n in enumerate(sizes):
        rows = np.arange(start, start + n)
        start += n
        plan = make_plan(rows, 1, 8, True, tf.sample, views, generator(0, "plan", cid))
        state = {"target": {**{k: v for k, v in sd.items() if k not in names}, **other}} if cid % 2 else {}
        task = algo.client_begin({"model": sd}, state, SimpleNamespace(num_samples=n))
        jobs.append(Job(cid, task, [plan], seed=cid))
    return x, y, tf, jobs, sd, other


def test_byol_target_is_the_ema_of_the_online_network():
    """With lr 0 the online network stays at theta, so after k steps the target is
    ``theta + ema^k (xi_0 - theta)`` (client 1 starts from a target xi_0 = theta + 0.5);
    the target gets no gradient and its BatchNorm statistics follow its forwards."""
    model = _conv_model(rotation=False)
    names = [n for n, _ in model.named_parameters()]
    algo = FedBYOL(SSLParams(ema=0.9), _federation(names, batch_size=8))
    x, y, tf, jobs, sd, other = _byol_jobs(algo, model, [24, 24], views=2)
    net = FunctionalNet(model)
    work = Workload.single(x, y, tf, net, algo.stages(0), SGD(0.0, 0.0, 0.0))
    first, second = SequentialExecutor(work).train(jobs)
    k = 3
    for result, start in ((first, sd), (second, {**sd, **other})):
        for name in names:
            if name.startswith(("predictor.", "heads.")):
                continue
            want = sd[name] + 0.9**k * (start[name] - sd[name])
            torch.testing.assert_close(result.params["target"][name], want, rtol=0, atol=1e-6)
            torch.testing.assert_close(result.params["model"][name], sd[name], rtol=0, atol=0)
    assert not torch.equal(first.buffers["target"]["l1_bn.running_mean"], sd["l1_bn.running_mean"])


def test_byol_with_rotation_agrees_across_executors():
    """Target EMA (a non-gradient update), the rotation view and its per-step noise,
    clients of different lengths: the vectorized executor reproduces the sequential one."""
    model = _conv_model(rotation=True)
    names = [n for n, _ in model.named_parameters()]
    algo = FedBYOL(SSLParams(ema=0.9, rotation=1.0), _federation(names, batch_size=8))
    assert algo.views == 3
    results = []
    for executor in ("sequential", "vectorized"):
        x, y, tf, jobs, *_ = _byol_jobs(algo, model, [24, 40, 16], views=3)
        work = Workload.single(x, y, tf, FunctionalNet(model), algo.stages(0), SGD(0.05, 0.9, 1e-4))
        run = SequentialExecutor(work) if executor == "sequential" else VectorizedExecutor(work, 2**30)
        results.append(run.train(jobs))
    for a, b in zip(*results):
        for role in ("model", "target"):
            for k in a.params[role]:
                torch.testing.assert_close(b.params[role][k], a.params[role][k], rtol=1e-5, atol=1e-5)
            for k in a.buffers[role]:
                torch.testing.assert_close(b.buffers[role][k].float(), a.buffers[role][k].float(), rtol=1e-5, atol=1e-5)
        assert a.stats["rotation"] > 0
        torch.testing.assert_close(b.stats["loss"], a.stats["loss"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "algorithm, params, fixed",
    [
        (FedU2, FedU2Params(rotation=1.0), True),  # FedU2-BYOL: fedbyol_client.py:125-130
        (FedU2, FedU2Params(rotation=1.0, method="simclr"), False),  # fedsimclr_client.py:106-109
        (FedU2, FedU2Params(rotation=1.0, method="simsiam"), False),  # fedsimsiam_client.py:105-108
        (FedU2, FedU2Params(rotation=1.0, rotation_head="train"), False),
        (FedU2, FedU2Params(rotation=1.0, method="simclr", rotation_head="fixed"), True),
        (FedBYOL, SSLParams(rotation=1.0), False),  # the baselines' clients train it (byol_local/client.py:150-156)
        (FedSimSiam, SSLParams(rotation=1.0, rotation_head="fedu2"), False),
        (FedBYOL, SSLParams(rotation=1.0, rotation_head="fedu2"), True),
    ],
)
def test_which_rotation_heads_stay_fixed(algorithm, params, fixed):
    assert algorithm(params, _federation(("w",))).rotation_head_fixed is fixed


def test_rotation_head_applies_only_with_rotation():
    assert FedU2.inapplicable(FedU2Params())["rotation_head"] == "rotation=1"
    assert "rotation_head" not in FedU2.inapplicable(FedU2Params(rotation=1.0))


def _fedu2_byol_results(rotation_head, executor, sizes):
    model = _conv_model(rotation=True)
    names = [n for n, _ in model.named_parameters()]
    params = FedU2Params(rotation=1.0, rotation_head=rotation_head, uniformity="none", predictor_hidden=6, ema=0.9)
    algo = FedU2(params, _federation(names, sizes=sizes, batch_size=8))
    x, y, tf, jobs, sd, _ = _byol_jobs(algo, model, sizes, views=3)
    work = Workload.single(x, y, tf, FunctionalNet(model), algo.stages(0), SGD(0.05, 0.9, 1e-3))
    run = SequentialExecutor(work) if executor == "sequential" else VectorizedExecutor(work, 2**30)
    return run.train(jobs), sd


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_fedu2_byol_rotation_head_stays_at_its_initialisation(executor):
    """FedU2's ByolEvenClient optimises the online encoder, projector and predictor only
    (fedbyol_client.py:125-130): under SGD with momentum and weight decay the rotation
    head keeps its initial values exactly while the rotation loss, through it, still
    trains the encoder; ``rotation_head=train`` moves the head. One step (8 samples) in
    both: everything but the head is the same, the head's gradient being the only
    difference."""
    sizes = [8, 24]
    fixed, sd = _fedu2_byol_results("fedu2", executor, sizes)
    trained, _ = _fedu2_byol_results("train", executor, sizes)
    heads = [k for k in sd if k.startswith("heads.rotation.")]
    assert heads
    for f, t in zip(fixed, trained):
        for k in heads:
            torch.testing.assert_close(f.params["model"][k], sd[k], rtol=0, atol=0)
            assert not torch.allclose(t.params["model"][k], sd[k])
        assert not torch.allclose(f.params["model"]["features.0.weight"], sd["features.0.weight"])
        assert f.stats["rotation"] > 0
    one_step_fixed, one_step_trained = fixed[0], trained[0]
    for k, v in one_step_fixed.params["model"].items():
        if k not in heads:
            torch.testing.assert_close(v, one_step_trained.params["model"][k], rtol=1e-6, atol=1e-7)


def test_rotated_view_leaves_the_predictor_statistics_alone():
    """FedU2's BYOL forward on identical tensors (contrastive_model.py:83-97): the online
    encoder, projector and predictor on x1 and x2, then ``deg_layer(projector(encoder(x3)))``
    without the predictor. Every BatchNorm of the online network ends with the running
    statistics of that transcription: the encoder's and projector's saw the rotated view,
    the predictor's did not."""
    model = _conv_model(rotation=True)
    names = [n for n, _ in model.named_parameters()]
    algo = FedBYOL(SSLParams(rotation=1.0), _federation(names, batch_size=8))
    x, y, tf, jobs, sd, _ = _byol_jobs(algo, model, [8], views=3)
    task = jobs[0].task
    rows, aug = jobs[0].plans[0].batch(0)
    views = [tf(x[rows], a) for a in aug]
    noise = {"rotation": torch.randn(8, generator=torch.Generator().manual_seed(3))}
    buffers = {role: {k: v.clone() for k, v in sd_.items()} for role, sd_ in task.buffers.items()}
    algo.local_loss(TaskView(task.params, buffers, {}, {}), Batch(torch.stack(views), y[rows], noise), FunctionalNet(model))

    code = _conv_model(rotation=True).train()
    code.load_state_dict(sd)
    with torch.no_grad():
        code(views[0]), code(views[1])  # p1, p2 = predictor(online_projector(online_encoder(x)))
        x3 = rotate_quarters(views[2], quadrant(noise["rotation"]))
        code.heads["rotation"](code.project(code.features(x3)))  # deg_layer(online_projector(online_encoder(x3)))
    want = {k: v for k, v in code.state_dict().items() if k not in names}
    assert set(want) == set(buffers["model"])
    for k, v in want.items():
        torch.testing.assert_close(buffers["model"][k], v, rtol=1e-5, atol=1e-6)
    assert not torch.equal(buffers["model"]["l1_bn.running_mean"], sd["l1_bn.running_mean"])


def test_shared_target_is_averaged_and_local_target_stays_on_the_client():
    model = _conv_model(rotation=False)
    names = [n for n, _ in model.named_parameters()]
    sd = model.state_dict()
    local = FedBYOL(SSLParams(), _federation(names))
    shared = FedBYOL(SSLParams(share_target=True), _federation(names))
    assert "target" not in local.broadcast(local.init_server(sd), 0)
    message = shared.broadcast(shared.init_server(sd), 0)
    assert set(message) == {"model", "target"} and not any(k.startswith("predictor.") for k in message["target"])
    t1 = {k: torch.ones_like(v) for k, v in message["target"].items()}
    t2 = {k: 3 * torch.ones_like(v) for k, v in message["target"].items()}
    replies = [Reply(0, 10, {"model": sd, "target": t1}), Reply(1, 30, {"model": sd, "target": t2})]
    server = shared.aggregate(shared.init_server(sd), replies, 0)
    assert all(torch.allclose(v.float(), torch.full_like(v.float(), 2.5)) for v in server.extras["target"].values() if v.is_floating_point())


def test_heads_of_the_methods():
    assert FedSimCLR.heads(SSLParams()) == Heads(None, classifier=False)
    assert FedBYOL.heads(SSLParams(rotation=1)) == Heads(2048, classifier=False, extra=(("rotation", 4),))


# -- runs -------------------------------------------------------------------------------------
def test_self_supervised_run_reports_knn_and_no_test_accuracy(tmp_path):
    out = tmp_path / "run"
    settings = ["algorithm=fedsimclr", "num_clients=3", "rounds=2", "local_epochs=1", "knn_k=5",
                "model.projection_bn=true", "model.projection_hidden=32", "model.projection_dim=16"]
    assert main(["run", "--quiet", "--out", str(out), *settings]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("knn_acc" in r and "test_acc" not in r for r in rows)
    assert all(0.3 < r["knn_acc"] <= 1 for r in rows)  # digits: 10 classes, chance 0.1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_knn_acc"] == max(r["knn_acc"] for r in rows)


def test_new_settings_at_neutral_values_keep_old_fingerprints():
    cfg = Config().to_dict()
    old = {k: v for k, v in cfg.items() if not k.startswith("knn_")}
    assert fingerprint({**old, "knn_every": 0, "knn_k": 200, "knn_temperature": 0.1}) == fingerprint(old)
    assert fingerprint({**old, "knn_every": 1}) != fingerprint(old)
    model = {"name": "mlp", "dropout": 0.0}
    assert fingerprint({**old, "model": {**model, "projection_bn": False, "projection_hidden": None}}) == fingerprint({**old, "model": model})
    assert fingerprint({**old, "model": {**model, "projection_bn": True}}) != fingerprint({**old, "model": model})


def test_personal_evaluation_of_a_self_supervised_run_is_a_config_error(tmp_path, capsys):
    assert main(["run", "--quiet", "--out", str(tmp_path / "r"), "algorithm=fedsimclr", "eval_personal=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert "eval_personal=true" in err and "fedsimclr" in err and len(err.splitlines()) == 1


def test_eval_repr_protocols_on_a_finished_run(tmp_path, capsys):
    out = tmp_path / "run"
    settings = ["algorithm=fedsimclr", "num_clients=3", "rounds=1", "local_epochs=1", "knn_k=5",
                "model.projection_hidden=16", "model.projection_dim=8"]
    assert main(["run", "--quiet", "--out", str(out), *settings]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert main(["eval-repr", str(out), "--protocol", "knn"]) == 0
    knn = json.loads((out / "representation" / "knn.json").read_text())
    assert knn["acc"] == summary["best_knn_acc"] and knn["k"] == 5  # the same computation as during training
    assert main(["eval-repr", str(out), "--protocol", "linear", "--epochs", "30"]) == 0
    linear = json.loads((out / "representation" / "linear.json").read_text())
    assert linear["acc"] > 0.3 and linear["epochs"] == 30  # digits: chance is 0.1
    assert main(["eval-repr", str(out), "--protocol", "finetune", "--epochs", "2", "--label-fraction", "0.1"]) == 0
    tuned = json.loads((out / "representation" / "finetune-10%.json").read_text())
    assert tuned["labeled"] == pytest.approx(0.1 * tuned["train_samples"], abs=10)
    assert main(["eval-repr", str(out), "--protocol", "spectrum"]) == 0
    values = json.loads((out / "representation" / "spectrum.json").read_text())["singular_values"]
    assert values == sorted(values, reverse=True) and (out / "representation" / "spectrum.png").is_file()
    capsys.readouterr()
    assert main(["eval-repr", str(tmp_path), "--protocol", "knn"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a run directory" in err and len(err.splitlines()) == 1


SSL_RUNS = {
    "fedsimclr": [], "fedbyol": ["algorithm.predictor_hidden=16"], "fedsimsiam": ["algorithm.predictor_hidden=16"],
    "fedu2": ["algorithm.predictor_hidden=16"], "fedu": ["algorithm.predictor_hidden=16"],
    "fedema": ["algorithm.predictor_hidden=16"], "feddecorr": ["algorithm.predictor_hidden=16"],
    "ldawa": ["algorithm.predictor_hidden=16"], "fedx": [], "orchestra": ["algorithm.memory=8", "algorithm.global_clusters=6", "algorithm.local_clusters=3"],
}


@pytest.mark.parametrize("algorithm", sorted(SSL_RUNS))
def test_labels_never_reach_the_local_objective(tmp_path, algorithm):
    """Two rounds with the training labels replaced by a random permutation of them
    (after partitioning, which uses them) train exactly as with the true labels: same
    per-round training metrics and the same global model, to the last bit."""
    from contrafl.config import load_config
    from contrafl.data.base import ArrayDataset
    from contrafl.engine.setup import prepare
    from contrafl.engine.simulation import Simulation
    from test_orchestra import tiny_cifar

    settings = [f"algorithm={algorithm}", "num_clients=2", "rounds=2", "local_epochs=1", "batch_size=8", "knn_k=5",
                "augment=simclr", "executor=sequential", "eval_personal=false", "model.projection_hidden=16",
                "model.projection_dim=8", *SSL_RUNS[algorithm], *tiny_cifar(tmp_path, rows=12, test_rows=4)]
    sims = [Simulation(prepare(load_config(None, settings)), None, None) for _ in range(2)]
    y = sims[1].train.y
    sims[1].train = ArrayDataset(sims[1].train.x, y[torch.randperm(len(y), generator=torch.Generator().manual_seed(3))])
    assert not torch.equal(sims[1].train.y, y)
    rows = [[sim.run_round(t) for t in range(2)] for sim in sims]
    for row in rows[0] + rows[1]:
        row.pop("knn_acc", None)  # evaluation: the memory bank's labels
    assert rows[0] == rows[1] and rows[0][1]["local_steps"] > 0
    assert all(torch.equal(v, sims[1].server.model[k]) for k, v in sims[0].server.model.items())
