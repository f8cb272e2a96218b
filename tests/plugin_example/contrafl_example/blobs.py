"""A generated dataset: one Gaussian blob of feature vectors per class."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contrafl import params as P
from contrafl.data.base import ArrayDataset, FederatedDataset
from contrafl.data.registry import DatasetSpec, LoadRequest


@dataclass(frozen=True)
class BlobsOptions:
    """Options of ``blobs`` (``dataset.OPTION=VALUE``)."""

    samples: int = P.param(1000, P.Interval(20, None), "number of samples (a quarter of them is the test set)")
    dim: int = P.param(16, P.Interval(1, None), "dimension of the feature vectors")
    classes: int = P.param(4, P.Interval(2, None), "number of classes, one blob each")
    spread: float = P.param(1.0, P.Interval(0, None, "neither"), "standard deviation of a blob around its centre")


def load_blobs(req: LoadRequest) -> FederatedDataset:
    """``x = centre[y] + spread * noise`` with centres ``~ N(0, 4 I)``, all drawn from a
    fixed seed: the data are the same in every run, whatever the run's seed."""
    opt = req.options
    g = torch.Generator().manual_seed(0)
    centres = 2 * torch.randn(opt.classes, opt.dim, generator=g)
    y = torch.randint(opt.classes, (opt.samples,), generator=g)
    x = centres[y] + opt.spread * torch.randn(opt.samples, opt.dim, generator=g)
    n = opt.samples * 3 // 4
    return FederatedDataset(
        name="blobs",
        train=ArrayDataset(x[:n], y[:n]),
        test=ArrayDataset(x[n:], y[n:]),
        classes=[f"blob{c}" for c in range(opt.classes)],
    )


BLOBS = DatasetSpec(
    name="blobs",
    summary="Gaussian blobs of feature vectors, one per class (generated)",
    load=load_blobs,
    default_model="mlp",
    augment="none",
    ssl_augment="scarf",
    recommended={"batch_size": 32, "rounds": 20, "local_epochs": 1},
    options=BlobsOptions,
    needs_data_dir=False,
)
