"""Representation evaluation: kNN monitor, linear probe, fine-tuning, spectrum."""

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from contrafl.metrics.knn import extract_features, knn_accuracy, knn_predict, knn_scores
from contrafl.experiments.representation import finetune, linear_probe, select_labeled, singular_spectrum

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tiny problems are dominated by intra-op thread hand-offs, which cost 100x on a
    loaded machine; one thread for this module, restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _clusters(n_per_class, num_classes, dim, seed, spread=0.3, scale=3.0):
    """Well separated Gaussian clusters around random centres; returns x, y."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=g) * scale
    y = torch.arange(num_classes).repeat_interleave(n_per_class)
    x = centres[y] + spread * torch.randn(len(y), dim, generator=g)
    return x, y


# ----------------------------------------------------------------------------- features


def test_extract_features_batches_in_order_without_grad():
    lin = nn.Linear(3, 2)
    x = torch.randn(7, 3)
    feats = extract_features(lin, x, lambda b: 2 * b, batch_size=3)
    assert not feats.requires_grad
    torch.testing.assert_close(feats, lin(2 * x).detach())


# ----------------------------------------------------------------------------- kNN


def _knn_toy():
    # train points (un-normalised on purpose): a=(3,0) y0, b=(.6,.8) y1, c=(0,2) y1, d=(-1,0) y0
    train = torch.tensor([[3.0, 0.0], [0.6, 0.8], [0.0, 2.0], [-1.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 0])
    # q1 = (1,0): cos to a,b,c,d = 1, .6, 0, -1;   q2 = (.8,.6)*5: cos = .8, .96, .6, -.8
    test = torch.tensor([[1.0, 0.0], [4.0, 3.0]])
    return train, labels, test


def test_knn_hand_computed_weights():
    """k = 2, t = 0.1: q1's neighbours a (cos 1, class 0) and b (cos .6, class 1) weigh
    exp(10) and exp(6); q2's neighbours b (cos .96, class 1) and a (cos .8, class 0)
    weigh exp(9.6) and exp(8)."""
    train, labels, test = _knn_toy()
    scores = knn_scores(train, labels, test, num_classes=2, k=2, temperature=0.1)
    expected = torch.tensor([[math.exp(10), math.exp(6)], [math.exp(8), math.exp(9.6)]])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=0)
    assert knn_predict(train, labels, test, 2, k=2, temperature=0.1).tolist() == [0, 1]


def test_knn_weights_beat_the_majority_at_low_temperature():
    """k = 3 for q1: one class-0 neighbour at cos 1 against two class-1 neighbours (cos .6
    and 0): exp(10) > exp(6) + exp(0) at t = 0.1, but at t = 100 the weights are ~1 and
    the majority (class 1) wins."""
    train, labels, test = _knn_toy()
    sharp = knn_scores(train, labels, test[:1], 2, k=3, temperature=0.1)
    torch.testing.assert_close(sharp, torch.tensor([[math.exp(10), math.exp(6) + 1.0]]), rtol=1e-5, atol=0)
    assert knn_predict(train, labels, test[:1], 2, k=3, temperature=0.1).item() == 0
    assert knn_predict(train, labels, test[:1], 2, k=3, temperature=100.0).item() == 1


@pytest.mark.parametrize("device", DEVICES)
def test_knn_separable_is_perfect_and_chunking_invariant(device):
    x, y = _clusters(30, 5, 16, seed=0)
    xt, yt = _clusters(10, 5, 16, seed=0)  # same centres (same seed), fresh draws below
    xt = xt + 0.1 * torch.randn(xt.shape, generator=torch.Generator().manual_seed(1))
    x, y, xt, yt = x.to(device), y.to(device), xt.to(device), yt.to(device)
    assert knn_accuracy(x, y, xt, yt, num_classes=5, k=20) == 1.0
    whole = knn_scores(x, y, xt, 5, k=20, chunk_size=1000)
    torch.testing.assert_close(knn_scores(x, y, xt, 5, k=20, chunk_size=7), whole)
    # k beyond the bank is clipped to every train sample
    assert knn_scores(x, y, xt, 5, k=10_000).shape == (len(xt), 5)


# ----------------------------------------------------------------------------- linear probe


@pytest.mark.parametrize("device", DEVICES)
def test_linear_probe_separable_reaches_100(device):
    x, y = _clusters(40, 4, 16, seed=2)
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(len(y), generator=g)
    tr, te = perm[:120], perm[120:]
    x, y = x.to(device), y.to(device)
    res = linear_probe(x[tr], y[tr], x[te], y[te], num_classes=4, epochs=100, batch_size=32,
                       generator=torch.Generator().manual_seed(0), eval_every=25)
    assert res.acc == 1.0
    assert [e for e, _ in res.history] == [25, 50, 75, 100]
    assert res.best_acc == max(a for _, a in res.history)
    again = linear_probe(x[tr], y[tr], x[te], y[te], num_classes=4, epochs=100, batch_size=32,
                         generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.weight, res.weight) and torch.equal(again.bias, res.bias)


def test_linear_probe_untrained_is_not_perfect():
    """The 100 % above comes from training: with zero epochs (the random init) it fails."""
    x, y = _clusters(40, 4, 16, seed=2)
    res = linear_probe(x, y, x, y, num_classes=4, epochs=0, generator=torch.Generator().manual_seed(0))
    assert res.acc < 0.9 and res.history == [(0, res.acc)]


# ----------------------------------------------------------------------------- labelled subset


def test_select_labeled_is_class_balanced_and_seeded():
    labels = torch.arange(10).repeat(100)  # balanced, 1000 samples
    idx = select_labeled(labels, 0.01, 10, torch.Generator().manual_seed(0))
    assert torch.bincount(labels[idx], minlength=10).tolist() == [1] * 10
    idx10 = select_labeled(labels, 0.1, 10, torch.Generator().manual_seed(0))
    assert torch.bincount(labels[idx10], minlength=10).tolist() == [10] * 10
    assert torch.equal(idx10, torch.sort(idx10).values) and len(set(idx10.tolist())) == 100
    assert torch.equal(idx10, select_labeled(labels, 0.1, 10, torch.Generator().manual_seed(0)))
    assert not torch.equal(idx10, select_labeled(labels, 0.1, 10, torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError):
        select_labeled(labels, 0.005, 10, torch.Generator())  # 5 samples < 10 classes


def test_select_labeled_allocation_matches_sklearn_stratify():
    sklearn_split = pytest.importorskip("sklearn.model_selection").train_test_split
    counts = [57, 31, 12]  # 13 % of 100: exact 7.41 / 4.03 / 1.56 -> 7 / 4 / 2
    labels = torch.cat([torch.full((c,), k) for k, c in enumerate(counts)])
    ours = torch.bincount(labels[select_labeled(labels, 0.13, 3, torch.Generator().manual_seed(0))], minlength=3)
    ref, _ = sklearn_split(np.arange(100), train_size=0.13, stratify=labels.numpy(), random_state=0)
    assert ours.tolist() == np.bincount(labels.numpy()[ref], minlength=3).tolist() == [7, 4, 2]


# ----------------------------------------------------------------------------- fine-tuning


class _SpyTransform:
    """Training transform on ``[x0, x1, sample id]`` rows: drops the id (recorded) and adds
    small noise drawn in ``sample``."""

    def __init__(self):
        self.seen = []

    def sample(self, n, generator):
        return {"noise": 0.05 * torch.randn(n, 2, generator=generator)}

    def __call__(self, x, params):
        self.seen.append(x[:, 2].long().cpu())
        return x[:, :2] + params["noise"].to(x.device)


def _finetune_problem():
    g = torch.Generator().manual_seed(4)
    corners = torch.tensor([[2.0, 2.0], [2.0, -2.0], [-2.0, 2.0], [-2.0, -2.0]])
    y = torch.arange(4).repeat(100)
    pts = corners[y] + 0.4 * torch.randn(len(y), 2, generator=g)
    x = torch.cat([pts, torch.arange(len(y)).unsqueeze(1).float()], 1)
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(2, 16), nn.BatchNorm1d(16), nn.ReLU())
    params = {k: v.detach().clone() for k, v in encoder.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in encoder.named_buffers()}

    def encode(state, xb, train):
        return functional_call(encoder.train(train), state, (xb,))

    return x, y, encoder, params, buffers, encode


def _run_finetune(epochs, seed=0, spy=None):
    x, y, _, params, buffers, encode = _finetune_problem()
    return finetune(
        params, buffers, encode, x[:300], y[:300], x[300:], y[300:], 4,
        transform=spy or _SpyTransform(), test_transform=lambda b: b[:, :2],
        generator=torch.Generator().manual_seed(seed), label_fraction=0.1,
        epochs=epochs, batch_size=8, eval_every=10,
    ), params, buffers


def test_finetune_improves_and_uses_exactly_the_labelled_subset():
    spy = _SpyTransform()
    res, params, buffers = _run_finetune(epochs=20, spy=spy)
    start, _, _ = _run_finetune(epochs=0)  # same seed: same subset, same head init
    assert torch.equal(start.labeled, res.labeled)
    assert start.acc < 0.8 and res.last_acc >= 0.97, (start.acc, res.history)
    assert [e for e, _ in res.history] == [10, 20] and res.acc == max(a for _, a in res.history)
    # class-balanced 10 % of 300 samples (75 per class): 30 labelled, 7 or 8 per class
    counts = torch.bincount(torch.arange(4).repeat(100)[res.labeled], minlength=4)
    assert counts.sum() == 30 and counts.min() >= 7 and counts.max() <= 8
    # every labelled sample, and nothing else, is seen once per epoch
    seen = torch.cat(spy.seen)
    assert torch.equal(torch.bincount(seen, minlength=300), torch.bincount(res.labeled, minlength=300) * 20)
    # inputs untouched, encoder and BatchNorm statistics moved
    fresh = _finetune_problem()[3]
    assert all(torch.equal(params[k], fresh[k]) for k in params)
    assert not torch.equal(res.params["0.weight"], params["0.weight"])
    assert not torch.equal(res.buffers["1.running_mean"], buffers["1.running_mean"])
    assert res.buffers["1.num_batches_tracked"].item() == 20 * 4  # ceil(30 / 8) batches per epoch


def test_finetune_is_deterministic_and_accepts_a_given_subset():
    a, _, _ = _run_finetune(epochs=3, seed=5)
    b, _, _ = _run_finetune(epochs=3, seed=5)
    assert torch.equal(a.labeled, b.labeled)
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params) and torch.equal(a.weight, b.weight)
    x, y, _, params, buffers, encode = _finetune_problem()
    given = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    spy = _SpyTransform()
    res = finetune(params, buffers, encode, x, y, x, y, 4, transform=spy, test_transform=lambda b: b[:, :2],
                   generator=torch.Generator().manual_seed(0), labeled=given, epochs=2, batch_size=3)
    assert torch.equal(res.labeled, given)
    assert sorted(torch.cat(spy.seen).tolist()) == sorted(given.tolist() * 2)


# ----------------------------------------------------------------------------- spectrum


def _orthogonal(d, seed):
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def test_spectrum_of_known_covariance():
    """Points with covariance exactly diag(4, 1, 0), rotated and shifted."""
    base = torch.tensor([[2.0, 1.0, 0.0], [-2.0, 1.0, 0.0], [2.0, -1.0, 0.0], [-2.0, -1.0, 0.0]], dtype=torch.float64)
    feats = base @ _orthogonal(3, 0).T + torch.tensor([5.0, -3.0, 1.0], dtype=torch.float64)
    spec = singular_spectrum(feats, normalize=False)
    torch.testing.assert_close(spec.singular_values, torch.tensor([4.0, 1.0, 0.0], dtype=torch.float64),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(spec.log_singular_values[:2], torch.tensor([math.log(4.0), 0.0], dtype=torch.float64))
    # numpy.cov (N - 1) agrees with correction=1
    np_sigma = np.linalg.svd(np.cov(feats.numpy().T), compute_uv=False)
    np.testing.assert_allclose(singular_spectrum(feats, normalize=False, correction=1).singular_values.numpy(),
                               np_sigma, atol=1e-12)


def test_spectrum_normalises_rows():
    """(5,0), (-2,0), (0,3), (0,-7) become +-e1, +-e2: covariance I/2 once normalised."""
    feats = torch.tensor([[5.0, 0.0], [-2.0, 0.0], [0.0, 3.0], [0.0, -7.0]])
    torch.testing.assert_close(singular_spectrum(feats).singular_values,
                               torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert not torch.allclose(singular_spectrum(feats, normalize=False).singular_values,
                              torch.tensor([0.5, 0.5], dtype=torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True])
def test_collapsed_features_have_one_nonzero_singular_value(device, normalize):
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(8, generator=g, dtype=torch.float64)
    t = torch.randn(50, 1, generator=g, dtype=torch.float64)  # both signs
    spec = singular_spectrum((t * direction).to(device), normalize=normalize)
    sigma = spec.singular_values.cpu()
    assert sigma[0] > 1e-3 and sigma[1:].abs().max() < 1e-12
    assert spec.log_singular_values[1:].max() < -20
