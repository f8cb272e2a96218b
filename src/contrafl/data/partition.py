"""Federated partitioners: which training samples each client holds.

Every partitioner draws its randomness from one ``np.random.RandomState(seed)`` and consumes
it in the same order as the reference code consumes the global ``np.random`` after
``np.random.seed(seed)``, so that the same seed, labels and settings give the reference's
partition, index for index:

* ``iid``: MOON's ``homo`` (``utils.py::partition_data``);
* ``dirichlet``: MOON's ``noniid-labeldir`` label skew, ``p_k ~ Dir_N(beta)`` per class;
* ``pathological``: PFLlib's ``pat`` (``dataset_utils.py::separate_data``), a few classes per client;
* ``quantity``: NIID-Bench's ``iid-diff-quantity`` quantity skew, client sizes ``~ Dir_N(beta)``;
* ``natural``: the dataset's own per-client split (FedProx's Synthetic).

:func:`make_partition` validates the settings, runs a partitioner and optionally splits each
client's samples into a local train and test part (PFLlib's 75 % / 25 % protocol).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import params as P
from ..errors import ConfigError, DataError
from ..registry import Registry

__all__ = [
    "PARTITIONS",
    "PartitionSpec",
    "SplitRequest",
    "DirichletOptions",
    "PathologicalOptions",
    "QuantityOptions",
    "Partition",
    "make_partition",
    "format_partition",
]

MAX_ATTEMPTS = 1000
"""Resampling attempts of ``dirichlet`` and ``quantity`` before giving up on ``min_size``."""

_POSITIVE = P.Interval(0, None, "neither")
_MIN_SIZE_DOC = "redraw until every client holds at least this many samples (and at least 1)"


@dataclass(frozen=True)
class DirichletOptions:
    """Label skew of MOON: class ``k`` is spread over the clients by ``p_k ~ Dir_N(beta)``."""

    beta: float = P.param(0.5, _POSITIVE, "Dirichlet concentration; smaller is more skewed")
    min_size: int = P.param(10, P.Interval(0, None), _MIN_SIZE_DOC)


@dataclass(frozen=True)
class PathologicalOptions:
    """PFLlib's pathological setting: each client holds ``classes_per_client`` classes."""

    classes_per_client: int = P.param(2, P.Interval(1, None), "classes held by each client")
    balance: bool = P.param(False, None, "equal shares of each class instead of PFLlib's random ones")
    least_samples: int = P.param(
        40, P.Interval(0, None), "PFLlib's least_samples (batch 10 / test share 0.25), capped at n/N/2"
    )
    uncovered: str = P.param(
        "error",
        P.OneOf(("error", "drop")),
        "classes the rule deals to no client (e.g. EMNIST's 47 with 20 clients x 10): an error, or left out as PFLlib's code does",
    )


@dataclass(frozen=True)
class QuantityOptions:
    """Quantity skew of NIID-Bench: client sizes ``n * q`` with ``q ~ Dir_N(beta)``, labels IID."""

    beta: float = P.param(0.5, _POSITIVE, "Dirichlet concentration of the client sizes")
    min_size: int = P.param(10, P.Interval(0, None), _MIN_SIZE_DOC)


@dataclass(frozen=True)
class SplitRequest:
    """Everything a partitioner needs.

    Attributes:
        labels: ``int [n]`` class of each training sample.
        num_clients: ``N``.
        num_classes: ``K``; classes are ``0 .. K-1`` (some may have no samples).
        options: an instance of the partitioner's ``PartitionSpec.options``.
        rng: the partition's random state, consumed in the reference code's order.
        natural: the dataset's own per-client index lists, when it has them.
        seed: the partition's seed, for partitioners that draw from their own generator
            (Flower Datasets' ``np.random.default_rng(seed)``) rather than from ``rng``.
    """

    labels: np.ndarray
    num_clients: int
    num_classes: int
    options: Any
    rng: np.random.RandomState
    natural: list[list[int]] | None = None
    seed: int = 0


@dataclass(frozen=True)
class PartitionSpec:
    """A registered partitioner.

    Attributes:
        name: registry name (``partition=<name>``).
        summary: one line for ``contrafl list``.
        split: ``SplitRequest -> list of index arrays``, one per client.
        options: dataclass of the partitioner's options (``partition.<option>=...``).
    """

    name: str
    summary: str
    split: Callable[[SplitRequest], list[np.ndarray]]
    options: type = P.NoOptions


PARTITIONS: Registry[PartitionSpec] = Registry("partition", "contrafl.partitions", PartitionSpec)
"""The partitioners by name (``partition=NAME``): contrafl's and Flower Datasets'; plugins join from the
entry-point group ``contrafl.partitions``."""


def _register(spec: PartitionSpec) -> None:
    PARTITIONS.add(spec.name, spec)


# --------------------------------------------------------------------------------------------
# Partitioners


def _iid(req: SplitRequest) -> list[np.ndarray]:
    """A random permutation cut into ``N`` parts whose sizes differ by at most one."""
    return np.array_split(req.rng.permutation(len(req.labels)), req.num_clients)


def _check_min_size(req: SplitRequest) -> None:
    n, clients, min_size = len(req.labels), req.num_clients, req.options.min_size
    if clients * min_size > n:
        raise ConfigError(
            f"partition.min_size={min_size} cannot be met: {clients} clients x {min_size} samples exceeds "
            f"the {n} training samples; choose partition.min_size <= {n // clients} or fewer clients"
        )


def _least(req: SplitRequest) -> int:
    """The fewest samples a client may hold: ``min_size``, and at least one (a draw that leaves
    a client empty is redrawn even with ``min_size=0``, where the reference would keep it)."""
    return max(req.options.min_size, 1)


def _give_up(req: SplitRequest) -> ConfigError:
    o = req.options
    return ConfigError(
        f"no partition with every client holding >= {_least(req)} samples (partition.min_size={o.min_size}) "
        f"was found in {MAX_ATTEMPTS} draws (beta={o.beta:g}, {req.num_clients} clients, {len(req.labels)} samples); "
        f"choose a smaller partition.min_size or a larger partition.beta"
    )


def _dirichlet_pass(
    by_class: list[np.ndarray], clients: int, beta: float, rng: np.random.RandomState
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray] | None:
    """One pass of MOON's loop over the classes: each class's shuffled samples with their cut
    points, and the resulting client sizes; ``None`` when every client that may still receive
    samples drew ``p_j = 0`` (possible only for tiny ``beta``, where MOON divides by zero)."""
    n = sum(len(members) for members in by_class)
    sizes = np.zeros(clients, dtype=np.int64)
    draws = []
    for members in by_class:
        idx_k = members.copy()
        rng.shuffle(idx_k)
        p = rng.dirichlet(np.repeat(beta, clients))
        if len(idx_k) == 0:
            continue
        p = p * (sizes < n / clients)
        total = p.sum()
        if not total > 0:
            return None
        cuts = (np.cumsum(p / total) * len(idx_k)).astype(int)[:-1]
        sizes += np.diff(cuts, prepend=0, append=len(idx_k))
        draws.append((idx_k, cuts))
    return draws, sizes


def _dirichlet(req: SplitRequest) -> list[np.ndarray]:
    """MOON's label-skew loop, repeated until every client holds ``>= max(min_size, 1)`` samples.

    For each class ``k`` (samples ``I_k`` shuffled): draw ``p ~ Dir_N(beta)``, set ``p_j = 0`` for
    clients already holding ``>= n/N`` samples, renormalise, and give client ``j`` the slice of
    ``I_k`` between ``floor(|I_k| * sum_{i<j} p_i)`` and ``floor(|I_k| * sum_{i<=j} p_i)``.
    Finally each client's list is shuffled.
    """
    _check_min_size(req)
    by_class = [np.flatnonzero(req.labels == k) for k in range(req.num_classes)]
    for _ in range(MAX_ATTEMPTS):
        result = _dirichlet_pass(by_class, req.num_clients, req.options.beta, req.rng)
        if result is None or result[1].min() < _least(req):
            continue
        parts: list[list[np.ndarray]] = [[] for _ in range(req.num_clients)]
        for idx_k, cuts in result[0]:
            for j, chunk in enumerate(np.split(idx_k, cuts)):
                parts[j].append(chunk)
        out = [np.concatenate(chunks) for chunks in parts]
        for idx in out:
            req.rng.shuffle(idx)
        return out
    raise _give_up(req)


def _deals_every_class(clients: int, num_classes: int, per_client: int) -> bool:
    """Whether PFLlib's ``pat`` rule finds a client for every class (it always does when
    ``clients * per_client`` is a multiple of ``num_classes``)."""
    remaining = np.full(clients, per_client)
    width = math.ceil(clients / num_classes * per_client)
    for _ in range(num_classes):
        selected = np.flatnonzero(remaining > 0)[:width]
        if len(selected) == 0:
            return False
        remaining[selected] -= 1
    return True


def _uncovered(clients: int, num_classes: int, per_client: int, missing: list[int]) -> ConfigError:
    """The error for settings under which PFLlib's rule leaves ``missing`` classes undealt,
    naming the nearest settings that work."""
    k = next(k for k in range(per_client, num_classes + 1) if _deals_every_class(clients, num_classes, k))
    n = next(n for n in itertools.count(clients) if _deals_every_class(n, num_classes, per_client))
    return ConfigError(
        f"partition.classes_per_client={per_client} with num_clients={clients} leaves classes {missing} "
        f"without a client under PFLlib's rule; choose partition.classes_per_client={k} or num_clients={n} "
        f"(num_clients * classes_per_client a multiple of {num_classes} always works), "
        f"or partition.uncovered=drop to leave them out as PFLlib's code does"
    )


def _pathological(req: SplitRequest) -> list[np.ndarray]:
    """PFLlib's ``pat`` rule.

    Classes are dealt in order ``c = 0 .. K-1``. Class ``c`` goes to the first
    ``s = ceil(N / K * classes_per_client)`` clients that still have a class to take; its samples,
    in dataset order, are cut into ``s`` consecutive shares: ``floor(n_c / s)`` each when balanced,
    else ``randint(max(n_c / s / 10, least / K), n_c / s)`` (bounds truncated to integers, as
    numpy does with PFLlib's float bounds) with ``least = min(least_samples, n / N / 2)``; the last
    client takes the remainder. A class without samples is dealt empty shares without a draw
    (PFLlib's unbalanced draw fails there).
    """
    o, labels, rng = req.options, req.labels, req.rng
    clients, num_classes, n = req.num_clients, req.num_classes, len(req.labels)
    if o.classes_per_client > num_classes:
        raise ConfigError(
            f"partition.classes_per_client={o.classes_per_client} is larger than the {num_classes} classes "
            f"of the dataset; choose partition.classes_per_client <= {num_classes}"
        )
    least = int(min(o.least_samples, n / clients / 2))
    width = math.ceil(clients / num_classes * o.classes_per_client)  # PFLlib's float expression
    remaining = np.full(clients, o.classes_per_client)
    parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
    for c in range(num_classes):
        idx_c = np.flatnonzero(labels == c)
        selected = np.flatnonzero(remaining > 0)[:width]
        if len(selected) == 0:
            missing = [k for k in range(c, num_classes) if np.any(labels == k)]
            if missing and o.uncovered == "error":
                raise _uncovered(clients, num_classes, o.classes_per_client, missing)
            break
        share = len(idx_c) / len(selected)
        if o.balance or len(idx_c) == 0:
            sizes = [int(share)] * (len(selected) - 1)
        elif len(selected) > 1:
            low, high = int(max(share / 10, least / num_classes)), int(share)
            if low >= high:
                raise ConfigError(
                    f"class {c} has {len(idx_c)} samples, too few for random shares among {len(selected)} "
                    f"clients with partition.balance=false; set partition.balance=true or use fewer clients"
                )
            sizes = rng.randint(low, high, len(selected) - 1).tolist()
        else:
            sizes = []
        sizes.append(len(idx_c) - sum(sizes))
        for client, chunk in zip(selected, np.split(idx_c, np.cumsum(sizes)[:-1])):
            parts[client].append(chunk)
        remaining[selected] -= 1
    return [np.concatenate(chunks) if chunks else np.empty(0, np.int64) for chunks in parts]


def _quantity(req: SplitRequest) -> list[np.ndarray]:
    """NIID-Bench's quantity skew.

    A random permutation of all samples is cut at ``floor(n * sum_{i<=j} q_i)`` with
    ``q ~ Dir_N(beta)``, redrawing ``q`` until every part holds ``>= max(min_size, 1)`` samples.
    NIID-Bench tests ``n * q_j >= min_size`` instead, which can leave a part one sample short;
    both draw the same random numbers.
    """
    _check_min_size(req)
    n, clients, rng = len(req.labels), req.num_clients, req.rng
    idxs = rng.permutation(n)
    for _ in range(MAX_ATTEMPTS):
        q = rng.dirichlet(np.repeat(req.options.beta, clients))
        total = q.sum()
        if not total > 0:
            continue
        cuts = (np.cumsum(q / total) * n).astype(int)[:-1]
        if np.diff(cuts, prepend=0, append=n).min() >= _least(req):
            return np.split(idxs, cuts)
    raise _give_up(req)


def _natural(req: SplitRequest) -> list[np.ndarray]:
    """The dataset's own per-client split, unchanged."""
    if req.natural is None:
        raise ConfigError(
            "partition=natural needs a dataset split per client by construction (e.g. dataset=synthetic), "
            "but this dataset has none; choose partition=dirichlet or partition=iid"
        )
    if len(req.natural) != req.num_clients:
        raise ConfigError(
            f"num_clients={req.num_clients} differs from the dataset's {len(req.natural)} natural clients; "
            f"set num_clients={len(req.natural)}"
        )
    parts = [np.asarray(idx, dtype=np.int64).reshape(-1) for idx in req.natural]
    flat = np.concatenate(parts)
    n = len(req.labels)
    if len(flat) != n or not np.array_equal(np.sort(flat), np.arange(n)):
        raise DataError(
            f"the dataset's natural partition does not assign each of its {n} training samples to exactly "
            f"one client; regenerate the dataset files"
        )
    return parts


_register(PartitionSpec("iid", "IID: a random permutation cut into equal parts (MOON's homo)", _iid))
_register(
    PartitionSpec(
        "dirichlet",
        "label skew, class proportions ~ Dir(beta) per class (MOON's noniid-labeldir)",
        _dirichlet,
        DirichletOptions,
    )
)
_register(
    PartitionSpec(
        "pathological",
        "classes_per_client classes per client (PFLlib's pat)",
        _pathological,
        PathologicalOptions,
    )
)
_register(
    PartitionSpec(
        "quantity",
        "quantity skew, client sizes ~ Dir(beta), labels IID (NIID-Bench's iid-diff-quantity)",
        _quantity,
        QuantityOptions,
    )
)
_register(PartitionSpec("natural", "the dataset's own per-client split (FedProx Synthetic)", _natural))


# --------------------------------------------------------------------------------------------
# The partition object

_JSON_TYPES = {"method": str, "options": dict, "seed": int, "train": None, "test": None}
"""Keys of :meth:`Partition.to_json` and the types of the scalar ones."""


@dataclass(eq=False)
class Partition:
    """Indices into the dataset's training split held by each client.

    Attributes:
        method: partitioner name.
        options: the partitioner's validated options.
        seed: seed of the partition's random state.
        train: per client, indices of its training samples.
        test: per client, indices of its local test samples (also into the training split)
            when a per-client train/test split was requested, else ``None``.
    """

    method: str
    options: dict[str, Any]
    seed: int
    train: list[np.ndarray]
    test: list[np.ndarray] | None = None

    @property
    def num_clients(self) -> int:
        """Number of clients, one list of training indices each."""
        return len(self.train)

    @classmethod
    def one_client(
        cls, method: str, options: dict[str, Any], seed: int, num_clients: int, cid: int, n_train: int, n_test: int | None,
    ) -> Partition:
        """The partition as client ``cid`` sees it when it holds its own data alone: its
        training rows ``0 .. n_train - 1``, then ``n_test`` test rows (``None``: no local
        test split), and the other clients none."""
        empty = np.zeros(0, dtype=np.int64)

        def only(own: np.ndarray) -> list[np.ndarray]:
            return [own if c == cid else empty for c in range(num_clients)]

        test = None if n_test is None else only(np.arange(n_train, n_train + n_test))
        return cls(method, dict(options), seed, train=only(np.arange(n_train)), test=test)

    def counts(self, labels: np.ndarray, num_classes: int, split: str = "train") -> np.ndarray:
        """``int64 [clients, classes]``: samples of each class held by each client."""
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r} is invalid; expected 'train' or 'test'")
        parts = self.train if split == "train" else self.test
        if parts is None:
            raise ValueError("this partition has no per-client test split; use split='train'")
        labels = np.asarray(labels)
        if labels.size and labels.max() >= num_classes:
            raise ValueError(f"labels go up to {labels.max()} but num_classes={num_classes}")
        return np.stack([np.bincount(labels[idx], minlength=num_classes) for idx in parts]).astype(np.int64)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict; :meth:`from_json` restores it exactly."""
        return {
            "method": self.method,
            "options": dict(self.options),
            "seed": self.seed,
            "train": [idx.tolist() for idx in self.train],
            "test": None if self.test is None else [idx.tolist() for idx in self.test],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Partition:
        """Rebuild a partition from :meth:`to_json` output; raise DataError if malformed."""
        if not isinstance(data, Mapping) or set(data) != set(_JSON_TYPES):
            keys = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise DataError(
                f"partition data has keys {keys}, expected {list(_JSON_TYPES)}; "
                f"regenerate it with make_partition"
            )
        for key, kind in _JSON_TYPES.items():
            if kind is not None and not isinstance(data[key], kind):
                raise DataError(
                    f"partition field '{key}' is {data[key]!r}, expected {kind.__name__}; "
                    f"regenerate it with make_partition"
                )

        def parts(value: Any, name: str) -> list[np.ndarray]:
            if not isinstance(value, list) or not all(
                isinstance(idx, list) and all(isinstance(i, int) and i >= 0 for i in idx) for idx in value
            ):
                raise DataError(
                    f"partition field '{name}' is not a list of per-client lists of sample indices; "
                    f"regenerate it with make_partition"
                )
            return [np.asarray(idx, dtype=np.int64) for idx in value]

        return cls(
            method=data["method"],
            options=dict(data["options"]),
            seed=data["seed"],
            train=parts(data["train"], "train"),
            test=None if data["test"] is None else parts(data["test"], "test"),
        )

    def save(self, path: str | Path) -> None:
        """Write the partition to ``path`` as JSON (``partition.json`` of a run directory)."""
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> Partition:
        """Read a partition written by :meth:`save`; DataError naming the file when it is missing or malformed."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DataError(f"partition file {path} does not exist; check the path") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"partition file {path} is not valid JSON ({exc}); regenerate it") from None
        try:
            return cls.from_json(data)
        except DataError as exc:
            raise DataError(f"{path}: {exc}") from None


# --------------------------------------------------------------------------------------------
# Entry points


def _random_state(seed: int) -> np.random.RandomState:
    """``RandomState(seed)`` as MOON's ``np.random.seed(seed)``; seeds of ``2**32`` and more are
    given as their little-endian 32-bit words."""
    if seed < 2**32:
        return np.random.RandomState(seed)
    words = []
    while seed:
        words.append(seed & 0xFFFFFFFF)
        seed >>= 32
    return np.random.RandomState(np.array(words, dtype=np.uint32))


def _local_test_split(
    train: list[np.ndarray], fraction: float, rng: np.random.RandomState
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per client ``i`` (in order): shuffle its ``n_i`` indices with ``rng``; the first
    ``t_i = min(ceil(fraction * n_i), n_i - 1)`` are its test samples, the rest its training
    samples. ``ceil`` matches scikit-learn's ``train_test_split(train_size=1 - fraction)`` used by
    PFLlib; the cap keeps at least one training sample.
    """
    kept, held_out = [], []
    for idx in train:
        shuffled = rng.permutation(idx)
        t = min(math.ceil(round(fraction * len(idx), 9)), len(idx) - 1)
        held_out.append(shuffled[:t])
        kept.append(shuffled[t:])
    return kept, held_out


def make_partition(
    labels: np.ndarray,
    num_clients: int,
    method: str,
    options: Mapping[str, Any] | None = None,
    seed: int = 0,
    test_fraction: float = 0.0,
    natural: list[list[int]] | None = None,
    num_classes: int | None = None,
) -> Partition:
    """Partition the training samples with ``labels`` among ``num_clients`` clients.

    Args:
        labels: ``int [n]`` class of each training sample.
        num_clients: ``N >= 1``, at most ``n``.
        method: a name registered in :data:`PARTITIONS`.
        options: the partitioner's options (``partition.<option>``), validated.
        seed: seed of the ``np.random.RandomState`` driving the partition.
        test_fraction: in ``[0, 1)``; when positive, each client's samples are split into a
            local train and test part after partitioning (see :func:`_local_test_split`).
        natural: the dataset's own per-client index lists (``partition=natural``).
        num_classes: ``K``; defaults to ``max(labels) + 1``. MOON's loop draws one Dirichlet
            vector per class, also for classes without samples, so give it when the top
            classes may be absent.

    Raises:
        ConfigError: an invalid setting, or a partition that cannot satisfy its options.
    """
    spec = PARTITIONS.get(method)
    opts = P.build(spec.options, options, "partition")
    labels = np.asarray(labels)
    valid = labels.ndim == 1 and labels.size > 0 and np.issubdtype(labels.dtype, np.integer)
    if not valid or labels.min() < 0:
        raise ValueError(
            f"labels must be a non-empty 1-D array of class indices >= 0, got {labels.dtype} {labels.shape}"
        )
    n = len(labels)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ConfigError(
            f"num_clients={num_clients!r} is invalid: expected an integer >= 1; set num_clients=N"
        )
    if num_clients > n:
        raise ConfigError(
            f"num_clients={num_clients} is larger than the {n} training samples; choose num_clients <= {n}"
        )
    if not 0 <= test_fraction < 1:
        raise ConfigError(
            f"test_fraction={test_fraction!r} is invalid: expected a number >= 0 and < 1 (PFLlib uses 0.25); "
            f"set test_fraction=0.25"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed={seed!r} is invalid: expected an integer >= 0; set seed=0")
    top = int(labels.max()) + 1
    num_classes = top if num_classes is None else num_classes
    if num_classes < top:
        raise ValueError(f"num_classes={num_classes} but labels go up to {top - 1}")
    rng = _random_state(int(seed))
    request = SplitRequest(labels, int(num_clients), int(num_classes), opts, rng, natural, seed=int(seed))
    train = [np.asarray(idx, dtype=np.int64) for idx in spec.split(request)]
    empty = [j for j, idx in enumerate(train) if len(idx) == 0]
    if empty:
        raise ConfigError(
            f"partition '{spec.name}' leaves client {empty[0]} of {num_clients} without samples; choose fewer "
            f"clients or other partition.* options (see `contrafl list`)"
        )
    test = None
    if test_fraction > 0:
        train, test = _local_test_split(train, test_fraction, rng)
    return Partition(spec.name, P.to_dict(opts), int(seed), train, test)


def format_partition(partition: Partition, labels: np.ndarray, classes: list[str]) -> str:
    """Per-client statistics as a text table.

    With up to 10 classes there is one column of sample counts per class; with more, the number
    of classes held and the three largest ``class:count`` entries.
    """
    counts = partition.counts(labels, len(classes))
    sizes = counts.sum(axis=1)
    held = (counts > 0).sum(axis=1)
    options = ", ".join(f"{k}={v}" for k, v in partition.options.items())
    title = (
        f"partition {partition.method}{f' ({options})' if options else ''}, seed {partition.seed}: "
        f"{partition.num_clients} clients, {int(sizes.sum())} training samples"
    )
    if partition.test is not None:
        title += f", {sum(len(t) for t in partition.test)} local test samples"
    lines = [title]
    header = ["client", "train"] + (["test"] if partition.test is not None else []) + ["classes"]
    wide = len(classes) <= 10
    header += [name[:8] for name in classes] if wide else ["largest classes"]
    rows = []
    for j in range(partition.num_clients):
        row = [str(j), str(sizes[j])]
        if partition.test is not None:
            row.append(str(len(partition.test[j])))
        row.append(str(held[j]))
        if wide:
            row += [str(c) for c in counts[j]]
        else:
            top = np.argsort(-counts[j], kind="stable")[:3]
            row.append(" ".join(f"{classes[k]}:{counts[j, k]}" for k in top if counts[j, k] > 0))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        cells = [c.rjust(w) for c, w in zip(r, widths)]
        if not wide:
            cells[-1] = r[-1].ljust(widths[-1])
        lines.append("  ".join(cells).rstrip())
    lines.append(
        f"train samples per client: min {sizes.min()}, mean {sizes.mean():.1f}, max {sizes.max()}; "
        f"classes per client: mean {held.mean():.1f}"
    )
    return "\n".join(lines)
