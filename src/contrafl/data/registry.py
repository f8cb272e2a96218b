"""The dataset registry: how to load each dataset and its recommended settings."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import params as P
from ..registry import Registry
from .base import FederatedDataset


@dataclass(frozen=True)
class LoadRequest:
    """Everything a loader needs.

    Attributes:
        data_dir: directory holding the dataset files (``None`` for bundled/generated data).
        allow_subset: accept files that fail the official checksum but are well-formed,
            e.g. the 10% CIFAR-10 subset in ``../shared/data``; corruption is still detected.
        download: fetch missing official files into ``data_dir`` first.
        options: the dataset's own options (an instance of ``DatasetSpec.options``).
        num_clients, seed: for datasets generated per client (FedProx Synthetic).
    """

    data_dir: Path | None = None
    allow_subset: bool = False
    download: bool = False
    options: Any = field(default_factory=P.NoOptions)
    num_clients: int = 10
    seed: int = 0


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset.

    Attributes:
        name: registry name.
        summary: one line for ``contrafl list``.
        load: ``LoadRequest -> FederatedDataset``.
        default_model: model used when ``model=auto``.
        augment: name of the training augmentation pipeline in :mod:`contrafl.data.augment`.
        ssl_augment: the pipeline of self-supervised algorithms, whose two views of a
            sample must differ (FedU2's SimCLR pipeline on CIFAR, SCARF's feature
            corruption on feature vectors); ``None``: none is known to suit the data, and
            such a run must name its augmentation.
        recommended: defaults for ``auto`` settings (``batch_size``, ``rounds``,
            ``local_epochs``) taken from the papers that use the dataset.
        options: dataclass of dataset-specific options (``dataset.<option>=...``).
        download: ``(data_dir: Path) -> Path`` fetching the official archive and verifying
            its checksum; ``None`` for bundled or generated datasets.
        needs_data_dir: whether ``data_dir`` must be given.
        clients: ``LoadRequest -> names``: the clients the files at ``data_dir`` are split
            into by their layout (one per PFLlib file pair, LEAF user or client folder) or
            by a column of client ids (arrays' ``client_train``, a Hugging Face
            ``dataset.client``), read from file and folder names, a file's list of users
            or the ids without decoding a sample, or ``None`` where these data are not
            split per client.
            :func:`~contrafl.engine.setup.resolve` makes them the run's ``partition=natural``
            and ``num_clients`` (``auto``) and refuses other values before any sample is read.
            ``None`` (the field): the dataset's files never fix its clients.
    """

    name: str
    summary: str
    load: Callable[[LoadRequest], FederatedDataset]
    default_model: str
    augment: str
    recommended: Mapping[str, Any]
    ssl_augment: str | None = None
    options: type = P.NoOptions
    download: Callable[[Path], Path] | None = None
    needs_data_dir: bool = True
    clients: Callable[[LoadRequest], list[str] | None] | None = None


DATASETS: Registry[DatasetSpec] = Registry("dataset", "contrafl.datasets", DatasetSpec)
"""The datasets by name (``dataset=NAME``); plugins join from the entry-point group ``contrafl.datasets``."""
