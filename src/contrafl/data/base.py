"""In-memory dataset containers shared by loaders, partitioners and executors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError


@dataclass
class ArrayDataset:
    """Samples held in memory as tensors.

    ``x`` is ``uint8 [N, C, H, W]`` for images (raw pixel values, normalised later by the
    batched transforms) or ``float32 [N, D]`` for tabular data (already scaled).
    ``y`` is ``int64 [N]``.
    """

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x has {self.x.shape[0]} rows but y has {self.y.shape[0]}")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def to(self, device: torch.device | str) -> "ArrayDataset":
        """The same samples and labels on ``device``."""
        return ArrayDataset(self.x.to(device), self.y.to(device))


@dataclass
class FederatedDataset:
    """A dataset ready for federated simulation.

    Attributes:
        name: registry name (``cifar10``...).
        train, test: the official train and test splits.
        classes: class names; ``len(classes)`` is the number of classes.
        mean, std: per-channel normalisation constants (images) or ``None`` (tabular).
        natural_partition: for datasets that are federated by construction
            (FedProx's Synthetic, per-client folders or files), ``{"train": [...],
            "test": [...]}``: per client, its rows of ``train`` and of ``test``;
            ``None`` otherwise.
        local_test: the ``test`` lists of ``natural_partition`` are the clients' own test
            data, which become their local test splits with ``partition=natural``
            (FedProx's Synthetic: no, its clients' test rows only make the test set).
        client_names: the natural clients' names (a folder's or file's name), by client id.
        info: provenance, e.g. ``{"subset": True}`` when a checksum-mismatching subset was
            accepted explicitly.
    """

    name: str
    train: ArrayDataset
    test: ArrayDataset
    classes: list[str]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    natural_partition: dict[str, list[list[int]]] | None = None
    info: dict = field(default_factory=dict)
    local_test: bool = False
    client_names: list[str] | None = None

    def pooled(self) -> "FederatedDataset":
        """The official train and test sets as one training set (train rows first) and
        an empty test set: PFLlib pools them before partitioning and splits each
        client's share into local train and test parts."""
        if self.natural_partition is not None:
            raise ConfigError(f"dataset {self.name} is federated by construction and cannot be pooled; set pool=false")
        train = ArrayDataset(torch.cat([self.train.x, self.test.x]), torch.cat([self.train.y, self.test.y]))
        test = ArrayDataset(self.test.x[:0], self.test.y[:0])
        return dataclasses.replace(self, train=train, test=test, info={**self.info, "pooled": True})

    def with_local_tests(self) -> tuple["FederatedDataset", list[list[int]]]:
        """The dataset whose training split also holds the clients' own test data
        (``local_test``), appended after the training rows, and each client's rows of it:
        the local test splits of ``partition=natural``, which the engine takes from the
        training split as it does ``test_fraction``'s. The test split stays the union of
        the clients' test data (what the global model is evaluated on)."""
        if self.natural_partition is None or not self.local_test:
            raise ValueError(f"dataset {self.name} gives its clients no test data of their own")
        n = len(self.train)
        train = ArrayDataset(torch.cat([self.train.x, self.test.x]), torch.cat([self.train.y, self.test.y]))
        tests = [[n + int(i) for i in rows] for rows in self.natural_partition["test"]]
        return dataclasses.replace(self, train=train, info={**self.info, "local_tests_appended": True}), tests

    @property
    def num_classes(self) -> int:
        """Number of labels, ``len(classes)``."""
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. ``(3, 32, 32)`` or ``(64,)``."""
        return tuple(self.train.x.shape[1:])

    @property
    def is_image(self) -> bool:
        """Whether samples are images ``[C, H, W]`` (the training array is ``[N, C, H, W]``)."""
        return self.train.x.dim() == 4
