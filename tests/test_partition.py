"""Tests of contrafl.data.partition and the partition heatmap.

MOON's, PFLlib's and NIID-Bench's partition loops are transcribed here independently, using the
global ``np.random`` after ``np.random.seed(seed)`` exactly as the reference code does.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

import contrafl.data.partition as partition_module
from contrafl.data.partition import PARTITIONS, Partition, format_partition, make_partition
from contrafl.errors import ConfigError, DataError
from contrafl.experiments.plots import plot_partition_heatmap

DIGITS = load_digits().target
CIFAR_LIKE = np.random.RandomState(123).permutation(np.repeat(np.arange(10), 5000))
TINY = np.repeat(np.arange(4), 10)  # n / N = 10 exactly: clients reach the balancing threshold


@pytest.fixture
def global_numpy_rng():
    """Seed the global RNG for a reference transcription; restore it afterwards."""
    state = np.random.get_state()
    yield np.random.seed
    np.random.set_state(state)


def moon_labeldir(y_train, n_parties, beta, num_classes, min_require_size=10):
    """MOON utils.py::partition_data 'noniid-labeldir' (spec 1.6); returns (map, attempts)."""
    min_size = 0
    attempts = 0
    N = y_train.shape[0]
    while min_size < min_require_size:
        attempts += 1
        idx_batch = [[] for _ in range(n_parties)]
        for k in range(num_classes):
            idx_k = np.where(y_train == k)[0]
            np.random.shuffle(idx_k)
            proportions = np.random.dirichlet(np.repeat(beta, n_parties))
            proportions = np.array(
                [p * (len(idx_j) < N / n_parties) for p, idx_j in zip(proportions, idx_batch)]
            )
            proportions = proportions / proportions.sum()
            proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions))]
            min_size = min([len(idx_j) for idx_j in idx_batch])
    for j in range(n_parties):
        np.random.shuffle(idx_batch[j])
    return idx_batch, attempts


def pfllib_pat(dataset_label, num_clients, num_classes, balance, class_per_client, least_samples):
    """PFLlib dataset_utils.py::separate_data, partition 'pat' (float randint bounds as in PFLlib)."""
    idxs = np.array(range(len(dataset_label)))
    idx_for_each_class = [idxs[dataset_label == i] for i in range(num_classes)]
    dataidx_map = {}
    class_num_per_client = [class_per_client for _ in range(num_clients)]
    for i in range(num_classes):
        selected_clients = [c for c in range(num_clients) if class_num_per_client[c] > 0]
        if len(selected_clients) == 0:
            break
        selected_clients = selected_clients[: int(np.ceil((num_clients / num_classes) * class_per_client))]
        num_all_samples = len(idx_for_each_class[i])
        num_selected_clients = len(selected_clients)
        num_per = num_all_samples / num_selected_clients
        if balance:
            num_samples = [int(num_per) for _ in range(num_selected_clients - 1)]
        else:
            num_samples = np.random.randint(
                max(num_per / 10, least_samples / num_classes), num_per, num_selected_clients - 1
            ).tolist()
        num_samples.append(num_all_samples - sum(num_samples))
        idx = 0
        for client, num_sample in zip(selected_clients, num_samples):
            chunk = idx_for_each_class[i][idx : idx + num_sample]
            dataidx_map[client] = np.append(dataidx_map[client], chunk) if client in dataidx_map else chunk
            idx += num_sample
            class_num_per_client[client] -= 1
    return [dataidx_map[c] for c in range(num_clients)]


def niid_bench_quantity(n_train, n_parties, beta, integer_sizes=False):
    """NIID-Bench utils.py::partition_data 'iid-diff-quantity'; ``integer_sizes`` tests the sizes
    of the parts instead of ``n * q_j``, as contrafl does."""
    idxs = np.random.permutation(n_train)
    min_size = 0
    while min_size < 10:
        proportions = np.random.dirichlet(np.repeat(beta, n_parties))
        proportions = proportions / proportions.sum()
        min_size = np.min(proportions * len(idxs))
        if integer_sizes:
            cuts = (np.cumsum(proportions) * len(idxs)).astype(int)[:-1]
            min_size = np.diff(cuts, prepend=0, append=len(idxs)).min()
    proportions = (np.cumsum(proportions) * len(idxs)).astype(int)[:-1]
    return np.split(idxs, proportions)


def assert_same_parts(ours, reference):
    assert len(ours) == len(reference)
    for mine, theirs in zip(ours, reference):
        np.testing.assert_array_equal(mine, np.asarray(theirs, dtype=np.int64))


# --------------------------------------------------------------------------------------------
# Reproduction of the reference code


@pytest.mark.parametrize(
    "labels, seed, beta, clients, min_size, resampled",
    [
        (DIGITS, 0, 0.5, 10, 10, False),
        (DIGITS, 1, 0.1, 10, 10, False),
        (DIGITS, 3, 0.1, 20, 10, True),  # MOON needs 8 draws here: the resampling loop is exercised
        (DIGITS, 0, 0.5, 50, 10, True),
        (CIFAR_LIKE, 0, 0.5, 10, 10, False),
        (CIFAR_LIKE, 5, 0.1, 10, 10, False),
        (CIFAR_LIKE, 0, 0.1, 100, 10, True),  # 13 draws
        (CIFAR_LIKE, 1, 0.5, 100, 10, False),
        (TINY, 0, 1.0, 4, 2, False),
    ],
)
def test_dirichlet_reproduces_moon(global_numpy_rng, labels, seed, beta, clients, min_size, resampled):
    num_classes = int(labels.max()) + 1
    global_numpy_rng(seed)
    reference, attempts = moon_labeldir(labels, clients, beta, num_classes, min_size)
    assert (attempts > 1) == resampled
    ours = make_partition(labels, clients, "dirichlet", {"beta": beta, "min_size": min_size}, seed=seed)
    assert_same_parts(ours.train, reference)
    ref_counts = np.array([np.bincount(labels[idx], minlength=num_classes) for idx in reference])
    np.testing.assert_array_equal(ours.counts(labels, num_classes), ref_counts)


def test_dirichlet_draws_for_absent_classes_like_moon(global_numpy_rng):
    labels = DIGITS[DIGITS < 8]  # classes 8 and 9 absent but K = 10: MOON still draws for them
    global_numpy_rng(4)
    reference, _ = moon_labeldir(labels, 10, 0.5, num_classes=10)
    assert_same_parts(make_partition(labels, 10, "dirichlet", seed=4, num_classes=10).train, reference)


def test_iid_reproduces_moon_homo(global_numpy_rng):
    global_numpy_rng(7)
    reference = np.array_split(np.random.permutation(len(DIGITS)), 13)
    assert_same_parts(make_partition(DIGITS, 13, "iid", seed=7).train, reference)


@pytest.mark.parametrize(
    "balance, clients, per_client", [(False, 20, 2), (True, 20, 2), (False, 10, 3), (False, 7, 5)]
)
def test_pathological_reproduces_pfllib(global_numpy_rng, balance, clients, per_client):
    least = int(min(40, len(DIGITS) / clients / 2))
    global_numpy_rng(1)
    reference = pfllib_pat(DIGITS, clients, 10, balance, per_client, least)
    options = {"classes_per_client": per_client, "balance": balance}
    assert_same_parts(make_partition(DIGITS, clients, "pathological", options, seed=1).train, reference)


@pytest.mark.parametrize("seed, same_as_niid_bench", [(0, True), (1, True), (2, False), (3, True)])
def test_quantity_reproduces_niid_bench(global_numpy_rng, seed, same_as_niid_bench):
    ours = make_partition(DIGITS, 15, "quantity", {"beta": 0.5}, seed=seed).train
    global_numpy_rng(seed)
    assert_same_parts(ours, niid_bench_quantity(len(DIGITS), 15, 0.5, integer_sizes=True))
    # NIID-Bench rejects a draw with n * q_j < 10 even when the part gets 10 samples (seed 2).
    global_numpy_rng(seed)
    exact = niid_bench_quantity(len(DIGITS), 15, 0.5)
    assert all(np.array_equal(a, b) for a, b in zip(ours, exact)) == same_as_niid_bench


# --------------------------------------------------------------------------------------------
# Properties of every partitioner

NATURAL = [list(range(j, len(DIGITS), 10)) for j in range(10)]
CASES = [
    ("iid", {}, True),
    ("dirichlet", {"beta": 0.1}, True),
    ("dirichlet", {"beta": 0.5, "min_size": 60}, True),
    ("pathological", {"classes_per_client": 2}, True),
    ("pathological", {"classes_per_client": 3, "balance": True}, False),  # PFLlib's rule draws nothing
    ("quantity", {"beta": 0.5, "min_size": 30}, True),
    ("natural", {}, False),
]


def split(method, options, seed, test_fraction=0.0):
    natural = NATURAL if method == "natural" else None
    return make_partition(
        DIGITS, 10, method, options, seed=seed, test_fraction=test_fraction, natural=natural
    )


@pytest.mark.parametrize("method, options, random", CASES)
def test_every_sample_goes_to_exactly_one_client(method, options, random):
    part = split(method, options, seed=3)
    assert part.test is None and part.num_clients == 10
    flat = np.concatenate(part.train)
    np.testing.assert_array_equal(np.sort(flat), np.arange(len(DIGITS)))
    default_min_size = 10 if method in ("dirichlet", "quantity") else 1
    assert min(len(idx) for idx in part.train) >= options.get("min_size", default_min_size)
    assert all(idx.dtype == np.int64 for idx in part.train)


@pytest.mark.parametrize("method, options, random", CASES)
def test_deterministic_for_a_seed(method, options, random):
    first, again, other = (split(method, options, seed) for seed in (3, 3, 4))
    assert first.to_json() == again.to_json()
    changed = any(
        set(a.tolist()) != set(b.tolist()) for a, b in zip(first.train, other.train)
    )  # membership, not merely order
    assert changed == random


@pytest.mark.parametrize("method, options, random", CASES)
def test_local_test_split(method, options, random):
    whole = split(method, options, seed=3)
    part = split(method, options, seed=3, test_fraction=0.25)
    for train, test, idx in zip(part.train, part.test, whole.train):
        assert len(np.intersect1d(train, test)) == 0
        np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.sort(idx))
        assert len(test) == min(math.ceil(0.25 * len(idx)), len(idx) - 1)  # sklearn's train_size=0.75
        assert len(train) >= 1


def test_local_test_split_keeps_one_training_sample():
    labels = np.array([0, 1, 0, 1, 1])
    part = make_partition(labels, 5, "iid", seed=0, test_fraction=0.9)
    assert [len(t) for t in part.train] == [1] * 5 and [len(t) for t in part.test] == [0] * 5
    part = make_partition(labels, 2, "iid", seed=0, test_fraction=0.5)  # sizes 3, 2 -> test 2, 1
    assert [len(t) for t in part.test] == [2, 1] and [len(t) for t in part.train] == [1, 1]


def test_iid_sizes_differ_by_at_most_one():
    sizes = [len(idx) for idx in make_partition(DIGITS, 13, "iid", seed=0).train]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(DIGITS)


def test_pathological_limits_classes_per_client():
    for per_client, clients in [(1, 10), (2, 20), (3, 10), (5, 4)]:
        part = make_partition(DIGITS, clients, "pathological", {"classes_per_client": per_client}, seed=0)
        held = (part.counts(DIGITS, 10) > 0).sum(axis=1)
        assert held.max() <= per_client and held.min() >= 1


def test_pathological_balanced_by_hand():
    # ceil(5 / 10 * 2) = 1 client per class: client j takes classes 2j and 2j+1, whole.
    part = make_partition(DIGITS, 5, "pathological", {"classes_per_client": 2, "balance": True}, seed=0)
    for j, idx in enumerate(part.train):
        expected = np.concatenate([np.flatnonzero(DIGITS == 2 * j), np.flatnonzero(DIGITS == 2 * j + 1)])
        np.testing.assert_array_equal(idx, expected)


def test_quantity_skews_sizes_not_labels():
    labels = CIFAR_LIKE
    part = make_partition(labels, 10, "quantity", {"beta": 0.5}, seed=0)
    counts = part.counts(labels, 10)
    sizes = counts.sum(axis=1)
    assert sizes.max() > 3 * sizes.min()
    # every client's label mix is the global 10 % up to 4 binomial standard deviations
    deviation = np.abs(counts / sizes[:, None] - 0.1)
    assert np.all(deviation < 4 * np.sqrt(0.1 * 0.9 / sizes[:, None]))


def test_dirichlet_skews_labels_more_for_smaller_beta():
    def spread(beta):
        counts = make_partition(CIFAR_LIKE, 10, "dirichlet", {"beta": beta}, seed=0).counts(CIFAR_LIKE, 10)
        return np.abs(counts / counts.sum(axis=1, keepdims=True) - 0.1).mean()

    assert spread(0.1) > spread(0.5) > spread(5.0)


# --------------------------------------------------------------------------------------------
# Partition object


def test_counts_by_hand():
    labels = np.array([0, 1, 1, 2, 0, 2, 2])
    train = [np.array([0, 1]), np.array([2, 3, 4, 5])]
    part = Partition("iid", {}, 0, train, test=[np.array([6]), np.array([], int)])
    np.testing.assert_array_equal(part.counts(labels, 4), [[1, 1, 0, 0], [1, 1, 2, 0]])
    np.testing.assert_array_equal(part.counts(labels, 3, split="test"), [[0, 0, 1], [0, 0, 0]])


@pytest.mark.parametrize("test_fraction", [0.0, 0.25])
def test_json_round_trip_is_exact(tmp_path, test_fraction):
    part = make_partition(DIGITS, 8, "dirichlet", {"beta": 0.3}, seed=11, test_fraction=test_fraction)
    restored = Partition.from_json(json.loads(json.dumps(part.to_json())))
    assert restored.to_json() == part.to_json()
    part.save(tmp_path / "partition.json")
    loaded = Partition.load(tmp_path / "partition.json")
    assert (loaded.method, loaded.options, loaded.seed) == ("dirichlet", {"beta": 0.3, "min_size": 10}, 11)
    assert_same_parts(loaded.train, part.train)
    assert (loaded.test is None) == (test_fraction == 0)
    if loaded.test is not None:
        assert_same_parts(loaded.test, part.test)


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        Partition.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        Partition.load(tmp_path / "bad.json")
    (tmp_path / "keys.json").write_text(json.dumps({"method": "iid", "train": [[0]]}))
    with pytest.raises(DataError, match="expected"):
        Partition.load(tmp_path / "keys.json")
    data = {"method": "iid", "options": {}, "seed": 0, "train": [[0, -1]], "test": None}
    with pytest.raises(DataError, match="'train'"):
        Partition.from_json(data)


def test_format_partition_table():
    part = make_partition(DIGITS, 5, "pathological", {"classes_per_client": 2, "balance": True}, seed=0)
    lines = format_partition(part, DIGITS, [f"d{k}" for k in range(10)]).splitlines()
    assert lines[0].startswith("partition pathological (classes_per_client=2") and "5 clients" in lines[0]
    assert lines[1].split() == ["client", "train", "classes"] + [f"d{k}" for k in range(10)]
    counts = part.counts(DIGITS, 10)
    for j in range(5):
        expected = [j, counts[j].sum(), (counts[j] > 0).sum(), *counts[j]]
        assert [int(v) for v in lines[2 + j].split()] == expected
    labels = np.arange(300) % 30
    table = format_partition(make_partition(labels, 3, "iid", seed=0), labels, [f"c{k}" for k in range(30)])
    assert table.splitlines()[1].split()[-2:] == ["largest", "classes"]


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(method="dirichlet", options={"beta": 0}), ["partition.beta=0", "> 0"]),
        (dict(method="quantity", options={"beta": -1.0}), ["partition.beta=-1.0", "> 0"]),
        (dict(method="dirichlet", num_clients=0), ["num_clients=0", ">= 1"]),
        (
            dict(method="iid", num_clients=5000),
            ["num_clients=5000 is larger than the 1347 training samples; choose num_clients <= 1347"],
        ),
        (
            dict(method="pathological", options={"classes_per_client": 11}),
            ["partition.classes_per_client=11", "classes_per_client <= 10"],
        ),
        (dict(method="dirichlett"), ["unknown partition 'dirichlett'", "did you mean 'dirichlet'"]),
        (dict(method="dirichlet", options={"alpha": 0.1}), ["partition.alpha", "beta"]),
        (dict(method="natural"), ["partition=natural", "has none"]),
        (dict(method="dirichlet", num_clients=140), ["partition.min_size=10", "partition.min_size <= 9"]),
        (dict(method="iid", test_fraction=1.0), ["test_fraction=1.0", "< 1"]),
        (
            dict(method="pathological", num_clients=3, options={"classes_per_client": 2}),
            ["leaves classes [6, 7, 8, 9] without a client"],
        ),
    ],
)
def test_config_errors(kwargs, fragments):
    kwargs = {"labels": DIGITS[:1347], "num_clients": 10, "seed": 0, **kwargs}
    with pytest.raises(ConfigError) as info:
        make_partition(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("method", ["dirichlet", "quantity"])
def test_gives_up_after_bounded_attempts(monkeypatch, method):
    monkeypatch.setattr(partition_module, "MAX_ATTEMPTS", 20)
    with pytest.raises(ConfigError, match="in 20 draws.*larger partition.beta"):
        make_partition(DIGITS, 100, method, {"beta": 0.1}, seed=0)


def test_registry_lists_the_partitioners():
    own = ["iid", "dirichlet", "pathological", "quantity", "natural"]
    flower = ["flwr_iid", "flwr_dirichlet", "flwr_pathological", "flwr_shard", "flwr_linear", "flwr_square", "flwr_exponential",
              "flwr_inner_dirichlet", "flwr_size"]
    assert PARTITIONS.names()[:5] == own and sorted(PARTITIONS.names()[5:]) == sorted(flower)


# --------------------------------------------------------------------------------------------
# Heatmap

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_heatmap_writes_png_without_display(tmp_path):
    """Runs in a fresh interpreter without a display, and checks that pyplot (whose backend
    selection depends on the environment) is never imported."""
    target = tmp_path / "heatmap.png"
    script = (
        "import sys, numpy as np\n"
        "from contrafl.experiments.plots import plot_partition_heatmap\n"
        f"plot_partition_heatmap(np.arange(30).reshape(10, 3), {str(target)!r}, ['a', 'b', 'c'], 'title')\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    data = target.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 200 and height > 100


def test_heatmap_large_grid_and_bad_input(tmp_path):
    counts = make_partition(CIFAR_LIKE, 100, "dirichlet", {"beta": 0.1}, seed=0).counts(CIFAR_LIKE, 10)
    path = plot_partition_heatmap(counts, tmp_path / "big.png")
    assert Path(path).read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="class names"):
        plot_partition_heatmap(counts, tmp_path / "x.png", classes=["a"])


def test_pathological_can_leave_out_uncovered_classes_as_pfllib_does():
    """3 clients x 2 classes of 10: PFLlib's rule deals classes 0-5 and its code stops
    there; uncovered=drop keeps that partition, every client with its 2 classes."""
    labels = DIGITS[:1347]
    parts = make_partition(labels, 3, "pathological", {"classes_per_client": 2, "uncovered": "drop"}, seed=0).train
    held = [sorted(set(labels[p].tolist())) for p in parts]
    assert all(len(h) == 2 for h in held)
    assert sorted(c for h in held for c in h) == [0, 1, 2, 3, 4, 5]
    assert sum(len(p) for p in parts) == int(np.isin(labels, range(6)).sum())
