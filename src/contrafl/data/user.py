"""What every dataset of the user's own files shares: its common options, the class list,
normalisation statistics, the memory check and the assembly of per-client parts into a
naturally federated :class:`~contrafl.data.base.FederatedDataset`.

A loader of the user's data (``folder``, ``arrays``, ``huggingface``, ``pfllib``, ``leaf``)
reads its files into :class:`Part` s, one per client for naturally federated data or one
for the whole dataset, with labels given by class *name*; :func:`assemble` maps the names
to the class list (the option ``classes`` when given, else the sorted union of the names
found), checks the parts and computes what is not given.

The same loader reads a SuperNode's own data in a deployment where each node holds its own
(``data=PATH``, :mod:`contrafl.flower.node`): the run config's ``classes``, ``mean`` and
``std`` (what the federation agreed on) are then given, so that the node maps its labels and
normalises its inputs as every other node does.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import params as P
from ..errors import DataError
from .base import ArrayDataset, FederatedDataset

MEMORY_FRACTION = 0.5
"""The share of the machine's memory a dataset may take when ``max_memory_gb`` is not set."""


@dataclass(frozen=True)
class CommonOptions:
    """Options of every dataset of the user's files (``dataset.<option>=...``)."""

    classes: list[str] | None = P.param(
        None, None,
        "class names in label order (auto: the sorted names found); labels are matched by name, and a name not listed is an error",
    )
    mean: list[float] | None = P.param(
        None, None, "per-channel mean of images (auto: from the training data), or per-feature mean of vectors to standardise them (auto: none)"
    )
    std: list[float] | None = P.param(None, None, "per-channel std of images (auto: from the training data), or per-feature std of vectors")
    shape: list[int] | None = P.param(
        None, None, "the shape of a sample, [C, H, W] or [D] (auto: the data's); samples of another shape are an error"
    )
    max_memory_gb: float | None = P.param(
        None, P.Interval(0, None, "neither"), "the most memory the decoded data may take (auto: half of this machine's)"
    )


@dataclass
class Part:
    """Samples read from the user's files: one client's (naturally federated data) or the
    whole dataset's.

    Attributes:
        name: the client's name (its folder or file; ``""`` for a whole dataset).
        x_train, x_test: ``uint8 [N, C, H, W]`` images or ``float32 [N, D]`` features.
        y_train, y_test: each sample's class name index into ``names``.
        names: the class names ``y`` indexes (the part's own, in any order).
        source: where the part comes from, for messages.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    names: Sequence[str]
    source: str


def split_test(y: np.ndarray, names: Sequence[str], fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``(train, test)`` of a stratified split: ``round(fraction n_c)`` samples of each
    class ``c`` (at most ``n_c - 1``) go to the test part, the others stay, both in their
    original order. The choice within a class is drawn from a generator seeded by the class
    name alone, not the run seed: every run gets the same split, a class's split does not
    change when other classes do, and a client's split is the same whether its data are
    loaded with the other clients' (``partition=natural``) or alone (a SuperNode's own data)."""
    test = np.zeros(len(y), dtype=bool)
    if fraction > 0:
        for label in np.unique(y):
            rows = np.flatnonzero(y == label)
            k = min(math.floor(len(rows) * fraction + 0.5), len(rows) - 1)
            if k <= 0:
                continue
            seed = int.from_bytes(hashlib.sha256(str(names[label]).encode()).digest()[:8], "little")
            test[rows[np.random.default_rng(seed).permutation(len(rows))[:k]]] = True
    return np.flatnonzero(~test), np.flatnonzero(test)


def natural_key(name: str) -> list:
    """Sort key putting ``client2`` before ``client10`` (numbers compared as numbers)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def memory_limit(options: CommonOptions) -> int:
    """Bytes the decoded data may take: ``max_memory_gb``, else :data:`MEMORY_FRACTION` of
    the machine's physical memory."""
    if options.max_memory_gb is not None:
        return int(options.max_memory_gb * 2**30)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    return int(total * MEMORY_FRACTION)


def check_memory(nbytes: int, options: CommonOptions, what: str) -> None:
    """:class:`DataError` before loading when ``nbytes`` exceed :func:`memory_limit`."""
    limit = memory_limit(options)
    if nbytes > limit:
        raise DataError(
            f"{what} would take {nbytes / 2**30:.2f} GiB in memory, more than the {limit / 2**30:.2f} GiB it may use; "
            "use a smaller dataset or image size (dataset.size), or raise dataset.max_memory_gb"
        )


def class_list(parts: Sequence[Part], options: CommonOptions) -> list[str]:
    """The classes: ``options.classes`` (checked to hold every name the parts use), else
    the sorted union of the names the parts' samples use."""
    used = {str(p.names[i]) for p in parts for y in (p.y_train, p.y_test) for i in np.unique(y)}
    if options.classes is None:
        return sorted(used, key=natural_key)
    classes = [str(c) for c in options.classes]
    if len(set(classes)) != len(classes):
        twice = next(c for c in classes if classes.count(c) > 1)
        raise DataError(f"dataset.classes lists {twice!r} twice; list each class once")
    unknown = sorted(used - set(classes), key=natural_key)
    if unknown:
        where = next(p.source for p in parts if unknown[0] in {str(p.names[i]) for y in (p.y_train, p.y_test) for i in np.unique(y)})
        raise DataError(
            f"{where} has samples of class {unknown[0]!r}, which dataset.classes ({', '.join(classes)}) does not list; "
            "add it to dataset.classes or remove those samples"
        )
    return classes


def _relabel(y: np.ndarray, names: Sequence[str], classes: list[str]) -> np.ndarray:
    index = {c: i for i, c in enumerate(classes)}
    table = np.array([index.get(str(n), -1) for n in names], dtype=np.int64)
    return table[y] if len(y) else np.zeros(0, dtype=np.int64)


def statistics(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of images ``[N, C, H, W]`` (``uint8`` pixels taken as
    ``x / 255``, as :class:`~contrafl.data.augment.Normalize` takes them), or per-feature
    of vectors ``[N, D]`` (std of a constant channel or feature: 1), in float64."""
    if x.ndim == 4:
        mean = np.zeros(x.shape[1])
        sq = np.zeros(x.shape[1])
        scale = 255.0 if x.dtype == np.uint8 else 1.0
        for lo in range(0, len(x), 4096):  # in chunks: no float copy of the whole set
            chunk = x[lo: lo + 4096].astype(np.float64) / scale
            mean += chunk.sum(axis=(0, 2, 3))
            sq += (chunk**2).sum(axis=(0, 2, 3))
        count = len(x) * x.shape[2] * x.shape[3]
    else:
        values = x.astype(np.float64)
        mean, sq, count = values.sum(axis=0), (values**2).sum(axis=0), len(x)
    mean = mean / count
    std = np.sqrt(np.maximum(sq / count - mean**2, 0.0))
    std[std == 0] = 1.0
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def _given(values: list[float] | None, width: int, name: str) -> tuple[float, ...] | None:
    if values is None:
        return None
    if len(values) not in (1, width):
        raise DataError(f"dataset.{name} has {len(values)} values but the samples have {width} channels or features; give {width} values (or one)")
    return tuple(float(v) for v in values) * (width if len(values) == 1 else 1)


def assemble(name: str, parts: Sequence[Part], options: CommonOptions, natural: bool, info: dict | None = None) -> FederatedDataset:
    """A :class:`FederatedDataset` of ``parts``: one per client when ``natural`` (their
    rows in client order; ``local_test`` when any client has test data), else one, the
    whole dataset. Raises :class:`DataError` for parts of different sample shapes or
    kinds, a client without training samples, or no samples at all."""
    if not parts:
        raise DataError(f"dataset {name}: no data found; check data_dir")
    first = parts[0]
    for part in parts:
        for split, x, y in (("train", part.x_train, part.y_train), ("test", part.x_test, part.y_test)):
            if len(x) != len(y):
                raise DataError(f"{part.source}: {len(x)} {split} samples but {len(y)} labels; give one label per sample")
            if len(x) and (x.shape[1:] != first.x_train.shape[1:] or x.dtype != first.x_train.dtype):
                raise DataError(
                    f"{part.source}: {split} samples of shape {list(x.shape[1:])} ({x.dtype}), but {first.source} has "
                    f"{list(first.x_train.shape[1:])} ({first.x_train.dtype}); give every sample the same shape (dataset.size for images)"
                )
        if not len(part.x_train):
            what = f"client {part.name!r}" if natural else "the dataset"
            raise DataError(f"{part.source}: {what} has no training samples; add some or remove it")
    if options.shape is not None and list(first.x_train.shape[1:]) != [int(d) for d in options.shape]:
        raise DataError(
            f"{first.source}: samples of shape {list(first.x_train.shape[1:])}, but dataset.shape={list(options.shape)}; "
            "give the samples that shape (dataset.size for images) or change dataset.shape"
        )
    classes = class_list(parts, options)
    x_train = np.concatenate([p.x_train for p in parts])
    x_test = np.concatenate([p.x_test.reshape(-1, *x_train.shape[1:]).astype(x_train.dtype) for p in parts])
    y_train = np.concatenate([_relabel(p.y_train, p.names, classes) for p in parts])
    y_test = np.concatenate([_relabel(p.y_test, p.names, classes) for p in parts])
    width = x_train.shape[1]
    mean, std = _given(options.mean, width, "mean"), _given(options.std, width, "std")
    if (mean is None) != (std is None):
        raise DataError("dataset.mean and dataset.std are given together (or neither, to compute them from the training data)")
    if x_train.ndim == 4 and mean is None:
        mean, std = statistics(x_train)
    elif x_train.ndim == 2 and mean is not None:  # feature vectors are standardised once, here
        shift, scale = np.asarray(mean, np.float32), np.asarray(std, np.float32)
        x_train, x_test = ((x - shift) / scale for x in (x_train.astype(np.float32), x_test.astype(np.float32)))
        mean = std = None
    natural_partition = None
    if natural:
        bounds = {
            split: np.cumsum([0] + [len(getattr(p, f"y_{split}")) for p in parts]).tolist() for split in ("train", "test")
        }
        natural_partition = {
            split: [list(range(lo, hi)) for lo, hi in zip(b[:-1], b[1:])] for split, b in bounds.items()
        }
    return FederatedDataset(
        name,
        ArrayDataset(torch.from_numpy(np.ascontiguousarray(x_train)), torch.from_numpy(y_train)),
        ArrayDataset(torch.from_numpy(np.ascontiguousarray(x_test)), torch.from_numpy(y_test)),
        classes,
        mean,
        std,
        natural_partition=natural_partition,
        info={"subset": False, "train_rows": len(y_train), "test_rows": len(y_test), **(info or {})},
        local_test=natural and len(y_test) > 0,
        client_names=[p.name for p in parts] if natural else None,
    )
