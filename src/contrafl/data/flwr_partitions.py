"""Flower Datasets' partitioners (``flwr_datasets.partitioner``) as contrafl partitions.

Each ``partition=flwr_<name>`` runs the Flower Datasets partitioner itself on a dataset of
the training labels in their row order (``datasets.Dataset.from_dict({"label": labels,
"row": arange(n)})``), seeded with the partition's ``seed``, and gives client ``i`` the rows
of ``load_partition(i)``: the same samples, in the same order, that a Flower Datasets
experiment with that partitioner, seed and label order gets. With
``partition.shuffle_dataset=true`` the rows are first shuffled with the seed, as
``flwr_datasets.FederatedDataset(shuffle=True, seed=seed)`` does before partitioning (its
default, with ``seed=42``), so that ``seed=42 partition.shuffle_dataset=true`` matches such a
``FederatedDataset`` whose partitioner also has ``seed=42``.

The labels the partitioners see are the class indices ``0 .. K-1``; datasets whose labels
are ClassLabel indices (``dataset=huggingface``) keep them, others map their sorted label
values to them in order, which every partitioner here reads the same way (they sort the
unique labels).

``flwr_datasets`` (``pip install 'contrafl[huggingface]'``) is imported when a partition is
drawn, not when contrafl is imported.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import params as P
from ..errors import ConfigError
from .partition import PARTITIONS, PartitionSpec, SplitRequest

__all__ = [
    "FLOWER_PARTITIONERS",
    "FlwrDirichletOptions",
    "FlwrInnerDirichletOptions",
    "FlwrOptions",
    "FlwrPathologicalOptions",
    "FlwrShardOptions",
    "FlwrSizeOptions",
    "flower_partitioner",
]

EXTRA = "pip install 'contrafl[huggingface]'"


@dataclass(frozen=True)
class _Alpha:
    """Check: a concentration > 0, or a list of them."""

    per: str

    def __call__(self, value: Any) -> bool:
        values = value if isinstance(value, list) else [value]
        return len(values) > 0 and all(v > 0 for v in values)

    def __str__(self) -> str:
        return f"a number > 0, or a list of numbers > 0 (one per {self.per})"


@dataclass(frozen=True)
class _Sizes:
    """Check: a list of sizes >= 1."""

    def __call__(self, value: Any) -> bool:
        return len(value) > 0 and all(v >= 1 for v in value)

    def __str__(self) -> str:
        return "a list of integers >= 1, one per client, such as [100,200,300]"


_SHUFFLE_DOC = "shuffle each client's samples after assigning them (Flower's shuffle)"
_DATASET_DOC = (
    "shuffle the training rows with the seed before partitioning, as flwr_datasets.FederatedDataset(shuffle=True, seed=seed) does"
)


@dataclass(frozen=True)
class FlwrOptions:
    """Options of the Flower partitioners without options of their own."""

    shuffle_dataset: bool = P.param(False, None, _DATASET_DOC)


@dataclass(frozen=True)
class FlwrDirichletOptions:
    """``DirichletPartitioner``'s arguments."""

    alpha: float | list[float] = P.param(0.5, _Alpha("client"), "Dirichlet concentration (one value, or one per client); smaller is more skewed")
    min_partition_size: int = P.param(10, P.Interval(0, None), "redraw until every client holds this many samples (Flower gives up after 10 redraws)")
    self_balancing: bool = P.param(False, None, "give no more samples of later classes to clients already above the average size")
    shuffle: bool = P.param(True, None, _SHUFFLE_DOC)
    shuffle_dataset: bool = P.param(False, None, _DATASET_DOC)


@dataclass(frozen=True)
class FlwrPathologicalOptions:
    """``PathologicalPartitioner``'s arguments."""

    num_classes_per_partition: int = P.param(2, P.Interval(1, None), "classes held by each client")
    class_assignment_mode: str = P.param(
        "random",
        P.OneOf(("random", "deterministic", "first-deterministic")),
        "how classes are dealt: random, deterministic (client i: classes i, i+1, ...), first-deterministic (the paper's)",
    )
    shuffle: bool = P.param(True, None, _SHUFFLE_DOC)
    shuffle_dataset: bool = P.param(False, None, _DATASET_DOC)


@dataclass(frozen=True)
class FlwrShardOptions:
    """``ShardPartitioner``'s arguments (McMahan et al.'s shards of label-sorted samples)."""

    num_shards_per_partition: int | None = P.param(2, P.Interval(1, None), "shards per client (none: as many as shard_size allows)")
    shard_size: int | None = P.param(None, P.Interval(1, None), "samples per shard (auto: n / (num_clients x num_shards_per_partition))")
    keep_incomplete_shard: bool = P.param(False, None, "keep the last, smaller shard (with shard_size and no num_shards_per_partition)")
    shuffle: bool = P.param(True, None, _SHUFFLE_DOC)
    shuffle_dataset: bool = P.param(False, None, _DATASET_DOC)


@dataclass(frozen=True)
class FlwrInnerDirichletOptions:
    """``InnerDirichletPartitioner``'s arguments."""

    alpha: float | list[float] = P.param(0.5, _Alpha("class"), "Dirichlet concentration of each client's class prior (one value, or one per class)")
    partition_sizes: list[int] | None = P.param(None, _Sizes(), "samples of each client (auto: the training samples split as evenly as possible)")
    shuffle: bool = P.param(True, None, _SHUFFLE_DOC)
    shuffle_dataset: bool = P.param(False, None, _DATASET_DOC)


@dataclass(frozen=True)
class FlwrSizeOptions:
    """``SizePartitioner``'s arguments."""

    partition_sizes: list[int] | None = P.param(None, _Sizes(), "samples of each client, consecutive rows in order (required)")
    shuffle_dataset: bool = P.param(False, None, _DATASET_DOC)


def _even(n: int, clients: int) -> list[int]:
    return [len(part) for part in np.array_split(np.arange(n), clients)]


def _sizes(req: SplitRequest, name: str, auto: bool) -> list[int]:
    sizes = req.options.partition_sizes
    n = len(req.labels)
    if sizes is None:
        if auto:
            return _even(n, req.num_clients)
        raise ConfigError(f"partition={name} needs partition.partition_sizes=[s1,...,s{req.num_clients}], one size per client, summing to at most {n}")
    if len(sizes) != req.num_clients:
        raise ConfigError(
            f"partition.partition_sizes has {len(sizes)} sizes but num_clients={req.num_clients}; give one size per client"
        )
    if sum(sizes) > n:
        raise ConfigError(f"partition.partition_sizes sum to {sum(sizes)}, more than the {n} training samples; give smaller sizes")
    return [int(s) for s in sizes]


def _alpha(value: float | list[float], count: int, per: str) -> float | list[float]:
    if isinstance(value, list):
        if len(value) == 1:
            return float(value[0])
        if len(value) != count:
            raise ConfigError(f"partition.alpha has {len(value)} values but there are {count} {per}s; give one value, or one per {per}")
        return [float(v) for v in value]
    return float(value)


def _make(name: str, req: SplitRequest, module: Any) -> Any:
    """The Flower Datasets partitioner of ``name`` built from ``req``'s options and seed."""
    o, clients, seed = req.options, req.num_clients, req.seed
    cls = "".join(word.capitalize() for word in name.split("_")) + "Partitioner"
    if not hasattr(module, cls):
        raise ConfigError(f"partition=flwr_{name} needs flwr_datasets.partitioner.{cls}, which this flwr-datasets lacks; pip install -U flwr-datasets")
    if name == "iid":
        return module.IidPartitioner(clients)
    if name in ("linear", "square", "exponential"):
        return getattr(module, f"{name.capitalize()}Partitioner")(clients)
    if name == "dirichlet":
        return module.DirichletPartitioner(
            clients, "label", _alpha(o.alpha, clients, "client"), o.min_partition_size, o.self_balancing, o.shuffle, seed
        )
    if name == "pathological":
        present = len(np.unique(req.labels))
        if o.num_classes_per_partition > present:
            raise ConfigError(
                f"partition.num_classes_per_partition={o.num_classes_per_partition} is more than the {present} classes "
                f"of the training samples; choose partition.num_classes_per_partition <= {present}"
            )
        return module.PathologicalPartitioner(clients, "label", o.num_classes_per_partition, o.class_assignment_mode, o.shuffle, seed)
    if name == "shard":
        if o.num_shards_per_partition is None and o.shard_size is None:
            raise ConfigError("partition=flwr_shard needs partition.num_shards_per_partition or partition.shard_size (or both)")
        return module.ShardPartitioner(clients, "label", o.num_shards_per_partition, o.shard_size, o.keep_incomplete_shard, o.shuffle, seed)
    if name == "inner_dirichlet":
        sizes = _sizes(req, "flwr_inner_dirichlet", auto=True)
        present = np.unique(req.labels)
        classes = len(present)
        if present[-1] != classes - 1:  # Flower reads the classes as 0 .. classes-1
            missing = next(k for k in range(classes) if k not in set(present.tolist()))
            raise ConfigError(
                f"partition=flwr_inner_dirichlet needs training samples of every class up to the last, but class {missing} has none; "
                "choose another partition"
            )
        return module.InnerDirichletPartitioner(sizes, "label", _alpha(o.alpha, classes, "class"), o.shuffle, seed)
    if name == "size":
        return module.SizePartitioner(_sizes(req, "flwr_size", auto=False))
    raise ValueError(f"no Flower partitioner {name!r}")


def _import() -> Any:
    try:
        import datasets  # noqa: F401
        from flwr_datasets import partitioner
    except ImportError as exc:
        raise ConfigError(f"the flwr_* partitions need Flower Datasets ({exc}); {EXTRA}") from None
    return partitioner


def flower_partitioner(name: str, req: SplitRequest) -> list[np.ndarray]:
    """The rows of each client under Flower Datasets' partitioner ``name`` (``dirichlet``,
    ``iid``...) with ``req``'s options and seed."""
    module = _import()
    import datasets

    labels = np.asarray(req.labels, dtype=np.int64)
    n = len(labels)
    with warnings.catch_warnings():
        # Flower warns of unused classes or samples (the partition table shows them) and
        # pyarrow of a deprecated sort option Flower's ShardPartitioner uses
        warnings.simplefilter("ignore")
        table = datasets.Dataset.from_dict({"label": labels, "row": np.arange(n, dtype=np.int64)})
        if req.options.shuffle_dataset:
            table = table.shuffle(seed=req.seed)
        partitioner = _make(name, req, module)
        partitioner.dataset = table
        try:
            return [np.asarray(partitioner.load_partition(i).with_format("numpy")["row"], dtype=np.int64) for i in range(req.num_clients)]
        except (ValueError, TypeError, ZeroDivisionError) as exc:
            message = " ".join(str(exc).split())
            raise ConfigError(
                f"partition=flwr_{name} cannot split {n} samples among {req.num_clients} clients with these options: "
                f"Flower Datasets says \"{message}\"; change the partition.* options or num_clients"
            ) from None


FLOWER_PARTITIONERS: dict[str, tuple[str, type]] = {
    "iid": ("Flower Datasets' IidPartitioner: consecutive equal shards of the (shuffle_dataset: shuffled) rows", FlwrOptions),
    "dirichlet": ("Flower Datasets' DirichletPartitioner: class proportions ~ Dir(alpha) per class", FlwrDirichletOptions),
    "pathological": ("Flower Datasets' PathologicalPartitioner: num_classes_per_partition classes per client", FlwrPathologicalOptions),
    "shard": ("Flower Datasets' ShardPartitioner: shards of label-sorted samples (FedAvg's pathological non-IID)", FlwrShardOptions),
    "inner_dirichlet": ("Flower Datasets' InnerDirichletPartitioner: given sizes, class priors ~ Dir(alpha) per client", FlwrInnerDirichletOptions),
    "linear": ("Flower Datasets' LinearPartitioner: client i holds a share proportional to i (consecutive rows)", FlwrOptions),
    "square": ("Flower Datasets' SquarePartitioner: client i holds a share proportional to i^2 (consecutive rows)", FlwrOptions),
    "exponential": ("Flower Datasets' ExponentialPartitioner: client i holds a share proportional to e^i (consecutive rows)", FlwrOptions),
    "size": ("Flower Datasets' SizePartitioner: consecutive rows of the given partition_sizes", FlwrSizeOptions),
}
"""``partition=flwr_<name>``: the one-line summary and the options of each."""


def _split_of(name: str):
    def split(req: SplitRequest) -> list[np.ndarray]:
        return flower_partitioner(name, req)

    split.__name__ = split.__qualname__ = f"flwr_{name}"
    split.__doc__ = f"Flower Datasets' partitioner {name!r} (see :func:`flower_partitioner`)."
    return split


for _name, (_summary, _options) in FLOWER_PARTITIONERS.items():
    PARTITIONS.add(f"flwr_{_name}", PartitionSpec(f"flwr_{_name}", _summary, _split_of(_name), _options))
