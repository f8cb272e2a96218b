"""The robust aggregation rules against ByzFL's and Flower's implementations, on the same
float64 inputs (honest updates around a common point, f far outliers)."""

import types

import numpy as np
import pytest
import torch

from contrafl.algorithms import robust
from conftest import BYZFL_MISSING, load_byzfl

SHAPES = [(2, 3), (4,)]  # the layers Flower sees: one row of updates is 10 numbers
D = 10
TOL = {"rtol": 1e-12, "atol": 1e-12}


byzfl = load_byzfl("aggregators")
needs_byzfl = pytest.mark.skipif(byzfl is None, reason=BYZFL_MISSING)


def updates(n: int, f: int, seed: int, d: int = D) -> np.ndarray:
    """``n`` rows: ``n - f`` honest ones near a common point, then ``f`` far outliers."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=d) + 0.3 * rng.normal(size=(n, d))
    x[n - f:] += 20.0 * rng.normal(size=(f, d))
    return x


def layers(row: np.ndarray) -> list[np.ndarray]:
    """One flattened update as Flower's list of layer arrays."""
    sizes = [int(np.prod(s)) for s in SHAPES]
    return [part.reshape(s) for part, s in zip(np.split(row, np.cumsum(sizes)[:-1]), SHAPES)]


def flat(arrays) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([np.asarray(a).ravel() for a in arrays]))


def results(x: np.ndarray, num_examples) -> list:
    """Flower's ``(NDArrays, num_examples)`` form of the rows of ``x``."""
    return [(layers(row), int(k)) for row, k in zip(x, num_examples)]


def replies(x: np.ndarray, num_examples) -> list:
    """Flower reply messages carrying the rows of ``x``, as a ServerApp strategy receives them."""
    from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict

    out = []
    for node, (row, k) in enumerate(zip(x, num_examples), start=1):
        query = Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
        content = RecordDict({"arrays": ArrayRecord(layers(row)), "metrics": MetricRecord({"num-examples": int(k)})})
        out.append(Message(content, reply_to=query))
    return out


def strategy_aggregate(strategy, x: np.ndarray, num_examples) -> torch.Tensor:
    arrays, _ = strategy.aggregate_train(1, replies(x, num_examples))
    return flat(arrays.to_numpy_ndarrays())


def flower_selection(x: np.ndarray, f: int, m: int) -> torch.Tensor:
    """The rows Flower's ServerApp MultiKrum / Bulyan selection keeps, as a mask."""
    from flwr.serverapp.strategy.multikrum import select_multikrum

    contents = [msg.content for msg in replies(x, [1] * len(x))]
    chosen = {id(c) for c in select_multikrum(contents, f, m)}
    return torch.tensor([id(c) in chosen for c in contents])


def mask(n: int, rows) -> torch.Tensor:
    kept = torch.zeros(n, dtype=torch.bool)
    kept[list(rows)] = True
    return kept


def row_index(x: np.ndarray, row) -> int:
    (index,) = np.flatnonzero((x == np.asarray(row)).all(axis=1))
    return int(index)


CASES = [(n, f, seed) for seed, n in enumerate((5, 6, 7, 11)) for f in sorted({1, (n - 3) // 2})]


@pytest.fixture
def flower(task_identity, monkeypatch):
    """Flower messages need the conftest's run, node and task ids; and its strategies
    need not run the garbage collector for every record they unpack (seconds a test)."""
    from flwr.app.message import arrayrecord

    monkeypatch.setattr(arrayrecord, "gc", types.SimpleNamespace(collect=lambda: 0))


@pytest.mark.parametrize("n,f,seed", CASES)
@needs_byzfl
def test_mean_is_byzfl_average_and_flower_fedavg(n, f, seed):
    x = updates(n, f, seed)
    counts = np.arange(1, n + 1) * 10
    torch.testing.assert_close(robust.mean(torch.from_numpy(x)).aggregate, torch.from_numpy(byzfl.Average()(x)), **TOL)
    from flwr.server.strategy.aggregate import aggregate

    got = robust.mean(torch.from_numpy(x), torch.from_numpy(counts))
    torch.testing.assert_close(got.aggregate, flat(aggregate(results(x, counts))), **TOL)
    torch.testing.assert_close(got.weights, torch.from_numpy(counts / counts.sum()), **TOL)


@pytest.mark.parametrize("n,f,seed", CASES)
@needs_byzfl
def test_median_is_byzfl_and_flower_median(n, f, seed, flower):
    from flwr.server.strategy.aggregate import aggregate_median
    from flwr.serverapp.strategy import FedMedian

    x = updates(n, f, seed)
    got = robust.median(torch.from_numpy(x)).aggregate
    torch.testing.assert_close(got, torch.from_numpy(byzfl.Median()(x)), rtol=0, atol=0)
    torch.testing.assert_close(got, flat(aggregate_median(results(x, range(1, n + 1)))), rtol=0, atol=0)
    torch.testing.assert_close(got, strategy_aggregate(FedMedian(), x, range(1, n + 1)), rtol=0, atol=0)


@pytest.mark.parametrize("n,f,seed", CASES)
@needs_byzfl
def test_trimmed_mean_is_byzfl_trmean(n, f, seed):
    x = updates(n, f, seed)
    for trim in range((n - 1) // 2 + 1):
        torch.testing.assert_close(robust.trimmed_mean(torch.from_numpy(x), f=trim).aggregate,
                                   torch.from_numpy(byzfl.TrMean(trim)(x)), **TOL)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.2, 0.3, 0.45])
@pytest.mark.parametrize("n,f,seed", CASES)
def test_trimmed_mean_beta_is_flower_fedtrimmedavg(n, f, seed, beta, flower):
    from flwr.server.strategy.aggregate import aggregate_trimmed_avg
    from flwr.serverapp.strategy import FedTrimmedAvg

    x = updates(n, f, seed)
    got = robust.trimmed_mean(torch.from_numpy(x), beta=beta).aggregate
    torch.testing.assert_close(got, flat(aggregate_trimmed_avg(results(x, range(1, n + 1)), beta)), **TOL)
    torch.testing.assert_close(got, strategy_aggregate(FedTrimmedAvg(beta=beta), x, range(1, n + 1)), **TOL)


@pytest.mark.parametrize("n,f,seed", CASES)
@needs_byzfl
def test_krum_is_flower_and_byzfl_krum(n, f, seed, flower):
    from flwr.server.strategy.aggregate import aggregate_krum
    from flwr.serverapp.strategy import Krum

    x = updates(n, f, seed)
    got = robust.krum(torch.from_numpy(x), f)
    chosen = aggregate_krum(results(x, range(1, n + 1)), f, 0)
    torch.testing.assert_close(got.aggregate, flat(chosen), rtol=0, atol=0)
    torch.testing.assert_close(got.kept, mask(n, [row_index(x, flat(chosen).numpy())]))
    torch.testing.assert_close(got.kept, flower_selection(x, f, 1))
    torch.testing.assert_close(got.aggregate, strategy_aggregate(Krum(num_malicious_nodes=f), x, range(1, n + 1)), **TOL)

    got = robust.krum(torch.from_numpy(x), f, variant="byzfl")
    chosen = byzfl.Krum(f)(x)
    torch.testing.assert_close(got.aggregate, torch.from_numpy(chosen), rtol=0, atol=0)
    torch.testing.assert_close(got.kept, mask(n, [row_index(x, chosen)]))


@needs_byzfl
def test_krum_variants_differ_in_neighbour_count():
    """Blanchard et al. (Flower) score over n - f - 2 neighbours, ByzFL over n - f - 1: on
    these rows they pick different updates, each matching its reference."""
    x = np.zeros((5, D))
    x[:, 0] = [0.0, 1.0, 1.9, 3.0, 6.1]
    assert robust.krum(torch.from_numpy(x), 1).kept.nonzero().item() == 1
    assert robust.krum(torch.from_numpy(x), 1, variant="byzfl").kept.nonzero().item() == 2
    from flwr.server.strategy.aggregate import aggregate_krum

    assert row_index(x, flat(aggregate_krum(results(x, [1] * 5), 1, 0)).numpy()) == 1
    assert row_index(x, byzfl.Krum(1)(x)) == 2


@pytest.mark.parametrize("n,f,seed", CASES)
@needs_byzfl
def test_multi_krum_is_byzfl_multikrum(n, f, seed):
    x = updates(n, f, seed)
    got = robust.multi_krum(torch.from_numpy(x), f, variant="byzfl")
    torch.testing.assert_close(got.aggregate, torch.from_numpy(byzfl.MultiKrum(f)(x)), **TOL)
    assert got.kept.sum() == n - f


@pytest.mark.parametrize("n,f,seed", CASES)
def test_multi_krum_is_flower_multikrum(n, f, seed, flower):
    from flwr.server.strategy.aggregate import aggregate_krum
    from flwr.serverapp.strategy import MultiKrum

    x = updates(n, f, seed)
    counts = np.arange(1, n + 1) * 10
    for m in (1, 2, n - f):
        got = robust.multi_krum(torch.from_numpy(x), f, m=m, weights=torch.from_numpy(counts))
        torch.testing.assert_close(got.aggregate, flat(aggregate_krum(results(x, counts), f, m)), **TOL)
        flower = MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m)
        torch.testing.assert_close(got.aggregate, strategy_aggregate(flower, x, counts), **TOL)
        torch.testing.assert_close(got.kept, flower_selection(x, f, m))
        kept_counts = counts * got.kept.numpy()
        torch.testing.assert_close(got.weights, torch.from_numpy(kept_counts / kept_counts.sum()), **TOL)


BULYAN_CASES = [(n, f, seed) for seed, n in enumerate((5, 7, 11, 12)) for f in range((n - 3) // 4 + 1)]


@pytest.mark.parametrize("n,f,seed", BULYAN_CASES)
def test_bulyan_is_flower_bulyan(n, f, seed, flower, monkeypatch):
    import flwr.server.strategy.aggregate as aggregate_module
    from flwr.server.strategy.aggregate import aggregate_bulyan, aggregate_krum
    from flwr.serverapp.strategy import Bulyan

    x = updates(n, f, seed)
    got = robust.bulyan(torch.from_numpy(x), f)
    chosen = []  # the rows Flower's recursive Krum picks, in order
    find = aggregate_module._find_reference_weights
    monkeypatch.setattr(aggregate_module, "_find_reference_weights",
                        lambda best, weights: chosen.append(row_index(x, flat(best).numpy())) or find(best, weights))
    expected = aggregate_bulyan(results(x, range(1, n + 1)), f, aggregate_krum, to_keep=0)
    torch.testing.assert_close(got.aggregate, flat(expected), **TOL)
    assert len(chosen) == n - 2 * f
    torch.testing.assert_close(got.kept, mask(n, chosen))

    got = robust.bulyan(torch.from_numpy(x), f, variant="multi_krum")
    torch.testing.assert_close(got.aggregate, strategy_aggregate(Bulyan(num_malicious_nodes=f), x, range(1, n + 1)), **TOL)
    torch.testing.assert_close(got.kept, flower_selection(x, f, n - 2 * f))


@pytest.mark.parametrize("nu,T", [(0.1, 3), (1e-3, 20), (0.5, 0)])
@pytest.mark.parametrize("n,f,seed", CASES)
@needs_byzfl
def test_geometric_median_is_byzfl(n, f, seed, nu, T):
    x = updates(n, f, seed)
    got = robust.geometric_median(torch.from_numpy(x), nu=nu, T=T)
    torch.testing.assert_close(got.aggregate, torch.from_numpy(byzfl.GeometricMedian(nu, T)(x)), **TOL)
    torch.testing.assert_close(got.weights.sum(), torch.tensor(1.0, dtype=torch.float64))
    # ByzFL leaves out rows with an infinite entry
    x[0, 3] = np.inf
    got = robust.geometric_median(torch.from_numpy(x), nu=nu, T=T)
    torch.testing.assert_close(got.aggregate, torch.from_numpy(byzfl.GeometricMedian(nu, T)(x)), **TOL)
    assert not got.kept[0] and got.kept[1:].all() and got.weights[0] == 0


def test_geometric_median_weighted_weiszfeld_step():
    x = torch.from_numpy(updates(7, 2, seed=1))
    w = torch.arange(1.0, 8.0, dtype=torch.float64)
    z = torch.full((D,), 0.5, dtype=torch.float64)
    b = w / (x - z).norm(dim=1).clamp(min=0.1)
    got = robust.geometric_median(x, T=1, weights=w, init=z)
    torch.testing.assert_close(got.aggregate, (b[:, None] * x).sum(0) / b.sum(), **TOL)
    torch.testing.assert_close(got.weights, b / b.sum(), **TOL)


@pytest.mark.parametrize("tau,L", [(100.0, 1), (1.0, 1), (0.5, 3), (2.0, 0)])
@pytest.mark.parametrize("n,f,seed", CASES)
@needs_byzfl
def test_centered_clipping_is_byzfl_over_rounds(n, f, seed, tau, L):
    ours, theirs = robust.CenteredClipping(tau=tau, L=L), byzfl.CenteredClipping(L=L, tau=tau)
    for round_ in range(3):
        x = updates(n, f, seed + 100 * round_)
        torch.testing.assert_close(ours(torch.from_numpy(x)).aggregate, torch.from_numpy(theirs(x)), **TOL)
    torch.testing.assert_close(ours.v, torch.from_numpy(theirs.m), **TOL)


def test_centered_clipping_weighted_step():
    x = torch.from_numpy(updates(5, 1, seed=2))
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    v0 = torch.ones(D, dtype=torch.float64)
    c = (w / w.sum()) * (1.0 / (x - v0).norm(dim=1)).clamp(max=1.0)
    got = robust.CenteredClipping(tau=1.0, v=v0)(x, w)
    torch.testing.assert_close(got.aggregate, v0 + (c[:, None] * (x - v0)).sum(0), **TOL)
    torch.testing.assert_close(got.weights, c, **TOL)


@pytest.mark.parametrize("tau", [0.5, 3.0, 1e6])
@pytest.mark.parametrize("n,f,seed", CASES)
@needs_byzfl
def test_norm_bound_is_byzfl_clipping_then_average(n, f, seed, tau):
    x = updates(n, f, seed)
    expected = byzfl.Average()(byzfl.Clipping(c=tau)(x.copy()))
    torch.testing.assert_close(robust.norm_bound(torch.from_numpy(x), tau).aggregate, torch.from_numpy(expected), **TOL)
    counts = torch.arange(1.0, n + 1, dtype=torch.float64)
    got = robust.norm_bound(torch.from_numpy(x), tau, counts)
    clipped = torch.from_numpy(byzfl.Clipping(c=tau)(x.copy()))
    torch.testing.assert_close(got.aggregate, (counts / counts.sum()) @ clipped, **TOL)


@pytest.mark.parametrize("n,f,seed", CASES)
@needs_byzfl
def test_mda_is_byzfl(n, f, seed):
    x = updates(n, f, seed)
    for trim in range((n - 1) // 2 + 1):
        got = robust.mda(torch.from_numpy(x), trim)
        torch.testing.assert_close(got.aggregate, torch.from_numpy(byzfl.MDA(trim)(x)), **TOL)
        assert got.kept.sum() == n - trim


def test_selections_drop_far_outliers():
    x = torch.from_numpy(updates(11, 2, seed=5))
    honest = torch.arange(11) < 9
    for result in (robust.krum(x, 2), robust.multi_krum(x, 2), robust.bulyan(x, 2), robust.mda(x, 2),
                   robust.bulyan(x, 2, variant="multi_krum")):
        assert not (result.kept & ~honest).any()
    assert (robust.geometric_median(x).weights[~honest] < robust.geometric_median(x).weights[honest].min()).all()


def test_float32_keeps_dtype():
    x = torch.from_numpy(updates(11, 2, seed=6))
    rules = [robust.mean, robust.median, lambda u: robust.trimmed_mean(u, 2), lambda u: robust.krum(u, 2),
             lambda u: robust.multi_krum(u, 2), lambda u: robust.bulyan(u, 2), robust.geometric_median,
             robust.CenteredClipping(tau=1.0), lambda u: robust.norm_bound(u, 1.0), lambda u: robust.mda(u, 2)]
    for rule in rules:
        got = rule(x.float()).aggregate
        assert got.dtype == torch.float32
        if not isinstance(rule, robust.CenteredClipping):  # stateful: the second call starts elsewhere
            torch.testing.assert_close(got, rule(x).aggregate.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule,n,f,requirement,fix", [
    ("trimmed_mean", 4, 2, "n > 2f", "set aggregator.f to at most 1"),
    ("krum", 6, 2, "n > 2f + 2", "set aggregator.f to at most 1"),
    ("multi_krum", 2, 0, "n > 2f + 2", "sample at least 3 clients"),
    ("bulyan", 10, 2, "n >= 4f + 3", "set aggregator.f to at most 1"),
    ("mda", 3, 2, "n > 2f", "set aggregator.f to at most 1"),
])
def test_too_few_clients_raise_one_line(rule, n, f, requirement, fix):
    call = {"trimmed_mean": lambda u: robust.trimmed_mean(u, f=f), "krum": lambda u: robust.krum(u, f),
            "multi_krum": lambda u: robust.multi_krum(u, f), "bulyan": lambda u: robust.bulyan(u, f),
            "mda": lambda u: robust.mda(u, f)}[rule]
    with pytest.raises(ValueError) as error:
        call(torch.zeros(n, 3))
    message = str(error.value)
    assert "\n" not in message
    assert f"aggregator={rule}" in message and f"f={f}" in message and f"n={n}" in message
    assert requirement in message and fix in message


def test_bad_options_raise():
    x = torch.zeros(5, 3)
    for call, text in [(lambda: robust.check_f("krum", 9, -1), "f=-1"),
                       (lambda: robust.trimmed_mean(x, beta=0.5), "beta=0.5"),
                       (lambda: robust.trimmed_mean(x), "exactly one"),
                       (lambda: robust.trimmed_mean(x, f=1, beta=0.2), "exactly one"),
                       (lambda: robust.multi_krum(x, 1, m=6), "m=6"),
                       (lambda: robust.krum(x, 1, variant="flower"), "'flower'"),
                       (lambda: robust.bulyan(torch.zeros(7, 3), 1, variant="x"), "'x'"),
                       (lambda: robust.norm_bound(x, -1.0), "tau=-1.0"),
                       (lambda: robust.CenteredClipping(L=-1), "L=-1")]:
        with pytest.raises(ValueError, match=text):
            call()
