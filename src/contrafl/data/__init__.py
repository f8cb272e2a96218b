"""Datasets, partitions and batched augmentation.

Importing this package registers every dataset (:data:`DATASETS`), partitioner
(:data:`~contrafl.data.partition.PARTITIONS`) and augmentation pipeline
(:data:`~contrafl.data.augment.AUGMENTATIONS`).
"""

from . import augment, datasets, partition, flwr_partitions, huggingface, folder, arrays, pfllib, leaf  # noqa: F401  (registration)
from .base import ArrayDataset, FederatedDataset
from .registry import DATASETS, DatasetSpec, LoadRequest

__all__ = ["DATASETS", "ArrayDataset", "DatasetSpec", "FederatedDataset", "LoadRequest"]
