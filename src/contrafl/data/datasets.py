"""The datasets, registered into :data:`~contrafl.data.registry.DATASETS` on import.

Every loader returns the official train and test splits in the row order of the official
files, so that a partitioner seeded like the reference code (MOON's Dirichlet split) assigns
the same samples to the same clients. Images are ``uint8 [N, C, H, W]``, tabular data
``float32 [N, D]``, labels ``int64``.

Files are checked before they are used: a missing file, or one whose md5 differs from the
official md5, stops the load with a one-line :class:`~contrafl.errors.DataError` that says how
to fix it. With ``LoadRequest.allow_subset`` a differing file is accepted if it is a
well-formed part of the official file (e.g. the 10 % CIFAR-10 subset in ``../shared/data``);
``info["subset"]`` then records it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import params as P
from ..errors import ConfigError, DataError
from .base import ArrayDataset, FederatedDataset
from .download import (
    EMNIST_ROWS,
    SOURCES,
    ImageTree,
    OfficialFile,
    download,
    file_md5,
    locate,
    matches,
    present,
)
from .formats import (
    ImageIndex,
    corrupted,
    decode_image,
    gunzip,
    index_tiny_imagenet,
    parse_emnist_mapping,
    parse_idx,
    read_cifar_batch,
    read_cifar_names,
    read_idx,
    read_zip_members,
)
from .registry import DATASETS, DatasetSpec, LoadRequest

__all__ = [
    "SyntheticOptions",
    "load_digits",
    "load_cifar10",
    "load_cifar100",
    "load_mnist",
    "load_fmnist",
    "load_emnist",
    "load_tinyimagenet",
    "load_synthetic",
    "generate_synthetic",
]

FMNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
EMNIST_BALANCED_CLASSES = list("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabdefghnqrt")
"""EMNIST balanced labels 0..46 (``emnist-balanced-mapping.txt``): digits, upper case, and the
11 lower-case letters that are not merged with their upper case."""

TINY_IMAGENET_CACHE = "contrafl-cache.npz"


def _split(x: np.ndarray, y: np.ndarray) -> ArrayDataset:
    """Arrays as tensors (copied only where they are read-only views of a file buffer)."""
    x = np.require(x, requirements=("C", "W"))
    return ArrayDataset(torch.from_numpy(x), torch.from_numpy(np.require(y, np.int64, ("C", "W"))))


class _Release:
    """The official files of one dataset in the folder a :class:`LoadRequest` points to,
    checked as the loader opens them."""

    def __init__(self, name: str, req: LoadRequest) -> None:
        if req.data_dir is None:
            raise ConfigError(
                f"dataset {name} needs data_dir=DIR; get the files with "
                f"`contrafl data download {name} --data-dir DIR`"
            )
        self.name, self.req, self.source = name, req, SOURCES[name]
        self.fix = f"`contrafl data download {name} --data-dir {req.data_dir}`"
        folder = locate(name, req.data_dir)
        if req.download and any(present(folder, f) is None for f in self.source.files):
            folder = download(name, req.data_dir)
        self.folder = folder
        self.subset = False

    def open(self, path: str) -> tuple[Path, OfficialFile]:
        """The file at ``path`` (or its uncompressed form) and the official file it must match.

        Raises DataError when it is missing, or when its checksum differs and either subsets
        are not allowed or it is larger than the official file.
        """
        official = self.source.file(path)
        form = present(self.folder, official)
        if form is None:
            alternative = f" (or {official.uncompressed.path})" if official.uncompressed else ""
            raise DataError(
                f"missing file {self.folder / path}{alternative}; get the official files with {self.fix}"
            )
        file = self.folder / form.path
        if matches(file, form):
            return file, form
        size = file.stat().st_size
        official_size = f"{form.size} bytes" if form.size is not None else "size unpublished"
        if not self.req.allow_subset:
            raise DataError(
                f"{file} is not the official {self.name} file ({size} bytes, md5 {file_md5(file)}; official: "
                f"{official_size}, md5 {form.md5}); re-download it with {self.fix}, or pass "
                f"allow_subset=true if it is a deliberate subset"
            )
        if form.size is not None and size > form.size:
            raise DataError(
                f"{file} is larger than the official file ({size} > {form.size} bytes), so it is not "
                f"a subset of it; re-download it with {self.fix}"
            )
        self.subset = True
        return file, form

    def check_rows(self, file: Path | str, rows: int, official_rows: int | None) -> None:
        if official_rows is not None and rows > official_rows:
            raise DataError(
                f"{file} has {rows} samples, more than the {official_rows} of the official file, "
                f"so it is not a subset of it; re-download it with {self.fix}"
            )

    def check_tree(self, counts: ImageTree) -> None:
        """Compare an image tree with the official counts (releases without checksums)."""
        official = self.source.tree
        if counts == official:
            return
        found = f"{counts.classes} classes, {counts.train} train and {counts.test} test images"
        expected = f"{official.classes}, {official.train} and {official.test}"
        if not self.req.allow_subset:
            raise DataError(
                f"{self.folder} holds {found}, the official {self.name} release has {expected}; "
                f"re-download it with {self.fix}, or pass allow_subset=true if it is a deliberate subset"
            )
        if counts.classes > official.classes or counts.train > official.train or counts.test > official.test:
            raise DataError(
                f"{self.folder} holds {found}, which is not a subset of the official {expected}; "
                f"re-download it with {self.fix}"
            )
        self.subset = True

    def dataset(
        self,
        train: ArrayDataset,
        test: ArrayDataset,
        classes: list[str],
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ) -> FederatedDataset:
        info = {
            "folder": str(self.folder),
            "subset": self.subset,
            "train_rows": len(train),
            "test_rows": len(test),
        }
        return FederatedDataset(self.name, train, test, classes, mean, std, info=info)


# ---------------------------------------------------------------------------------------------
# scikit-learn digits


def load_digits(req: LoadRequest) -> FederatedDataset:
    """scikit-learn's bundled 8x8 digits (1,797 samples), ``x = pixels / 16`` in ``[0, 1]``.

    The split is fixed, independent of the run seed: 25 % test, stratified, ``random_state=0``.
    """
    from sklearn.datasets import load_digits as sklearn_digits  # imported here: slow to import
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        bunch.data, bunch.target, test_size=0.25, random_state=0, stratify=bunch.target
    )
    return FederatedDataset(
        "digits",
        _split((x_train / 16).astype(np.float32), y_train),
        _split((x_test / 16).astype(np.float32), y_test),
        [str(c) for c in range(10)],
        info={"subset": False, "train_rows": len(y_train), "test_rows": len(y_test)},
    )


# ---------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python version)


@dataclass(frozen=True)
class _CifarLayout:
    """File names and pickle keys of a CIFAR python release."""

    train: tuple[str, ...]
    test: str
    meta: str
    batch_keys: frozenset[str]
    label_key: str
    meta_keys: frozenset[str]
    names_key: str
    num_classes: int


CIFAR10 = _CifarLayout(
    train=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test="test_batch",
    meta="batches.meta",
    batch_keys=frozenset({"batch_label", "labels", "data", "filenames"}),
    label_key="labels",
    meta_keys=frozenset({"num_cases_per_batch", "label_names", "num_vis"}),
    names_key="label_names",
    num_classes=10,
)
CIFAR100 = _CifarLayout(
    train=("train",),
    test="test",
    meta="meta",
    batch_keys=frozenset({"filenames", "batch_label", "fine_labels", "coarse_labels", "data"}),
    label_key="fine_labels",
    meta_keys=frozenset({"fine_label_names", "coarse_label_names"}),
    names_key="fine_label_names",
    num_classes=100,
)


def _load_cifar(
    name: str, layout: _CifarLayout, mean: tuple[float, ...], std: tuple[float, ...], req: LoadRequest
) -> FederatedDataset:
    release = _Release(name, req)

    def split(files: Sequence[str]) -> ArrayDataset:
        xs, ys = [], []
        for path in files:
            file, official = release.open(path)
            x, y = read_cifar_batch(file, layout.batch_keys, layout.label_key, layout.num_classes)
            release.check_rows(file, len(y), official.rows)
            xs.append(x)
            ys.append(y)
        return _split(np.concatenate(xs), np.concatenate(ys))

    meta, _ = release.open(layout.meta)
    classes = read_cifar_names(meta, layout.meta_keys, layout.names_key, layout.num_classes)
    return release.dataset(split(layout.train), split([layout.test]), classes, mean, std)


def load_cifar10(req: LoadRequest) -> FederatedDataset:
    """CIFAR-10: ``data_batch_1..5`` (train, in this order), ``test_batch``, ``batches.meta``.

    Normalisation constants of MOON's code: mean ``(125.3, 123.0, 113.9) / 255``, std
    ``(63.0, 62.1, 66.7) / 255``.
    """
    mean = (125.3 / 255, 123.0 / 255, 113.9 / 255)
    std = (63.0 / 255, 62.1 / 255, 66.7 / 255)
    return _load_cifar("cifar10", CIFAR10, mean, std, req)


def load_cifar100(req: LoadRequest) -> FederatedDataset:
    """CIFAR-100 with its 100 fine labels: ``train``, ``test``, ``meta`` (``fine_label_names``)."""
    return _load_cifar("cifar100", CIFAR100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), req)


# ---------------------------------------------------------------------------------------------
# MNIST family (IDX files)


def _idx_pair(images: np.ndarray, labels: np.ndarray, source: Path | str, num_classes: int) -> ArrayDataset:
    """Images ``[N, 28, 28]`` and labels ``[N]`` read from IDX files, as ``[N, 1, 28, 28]``."""
    if len(images) != len(labels):
        raise corrupted(source, f"{len(images)} images but {len(labels)} labels")
    if labels.size and labels.max() >= num_classes:
        raise corrupted(source, f"labels outside 0..{num_classes - 1}")
    return _split(images[:, None], labels)


def _load_mnist_like(
    name: str, classes: list[str], mean: tuple[float, ...], std: tuple[float, ...], req: LoadRequest
) -> FederatedDataset:
    release = _Release(name, req)

    def split(prefix: str) -> ArrayDataset:
        arrays = []
        for kind, item_shape in (("images-idx3", (28, 28)), ("labels-idx1", ())):
            file, official = release.open(f"{prefix}-{kind}-ubyte.gz")
            array = read_idx(file, item_shape)
            release.check_rows(file, len(array), official.rows)
            arrays.append(array)
        return _idx_pair(*arrays, release.folder / f"{prefix}-*", len(classes))

    return release.dataset(split("train"), split("t10k"), classes, mean, std)


def load_mnist(req: LoadRequest) -> FederatedDataset:
    """MNIST: the four official IDX files, gzipped or not."""
    return _load_mnist_like("mnist", [str(c) for c in range(10)], (0.1307,), (0.3081,), req)


def load_fmnist(req: LoadRequest) -> FederatedDataset:
    """Fashion-MNIST: the four official IDX files, gzipped or not."""
    return _load_mnist_like("fmnist", FMNIST_CLASSES, (0.2860,), (0.3530,), req)


def load_emnist(req: LoadRequest) -> FederatedDataset:
    """EMNIST balanced (47 classes), read from the official ``gzip.zip``.

    EMNIST stores each image transposed relative to MNIST; the loader transposes it back so
    that characters appear upright.
    """
    release = _Release("emnist", req)
    archive, _ = release.open("gzip.zip")
    mapping = "gzip/emnist-balanced-mapping.txt"
    names = {
        (split, kind): f"gzip/emnist-balanced-{split}-{kind}-ubyte.gz"
        for split in ("train", "test")
        for kind in ("images-idx3", "labels-idx1")
    }
    contents = read_zip_members(archive, [*names.values(), mapping])

    def member(split: str, kind: str, item_shape: tuple[int, ...]) -> np.ndarray:
        name = names[split, kind]
        if name not in contents:
            raise corrupted(archive, f"it has no member {name}")
        source = f"{archive}:{name}"
        array = parse_idx(gunzip(contents[name], source), item_shape, source)
        release.check_rows(source, len(array), EMNIST_ROWS[split])
        return array

    classes = (
        parse_emnist_mapping(contents[mapping].decode("ascii", "replace"), 47, f"{archive}:{mapping}")
        if mapping in contents
        else EMNIST_BALANCED_CLASSES
    )
    splits = [
        _idx_pair(
            member(split, "images-idx3", (28, 28)).transpose(0, 2, 1),
            member(split, "labels-idx1", ()),
            f"{archive}:gzip/emnist-balanced-{split}-*",
            len(classes),
        )
        for split in ("train", "test")
    ]
    return release.dataset(*splits, classes, (0.1751,), (0.3332,))


# ---------------------------------------------------------------------------------------------
# Tiny-ImageNet


def _fingerprint(folder: Path, files: Sequence[Path]) -> str:
    """sha256 of the relative path, size and mtime of ``files``: changes when any changes."""
    digest = hashlib.sha256()
    for path in files:
        st = path.stat()
        digest.update(f"{path.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _read_cache(path: Path, key: str) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as cache:
            if str(cache["key"]) != key:
                return None
            return cache["x_train"], cache["x_test"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None


def _write_cache(path: Path, key: str, x_train: np.ndarray, x_test: np.ndarray) -> None:
    """Write the cache atomically; silently skip it where the folder is read-only or full."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, key=np.array(key), x_train=x_train, x_test=x_test)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _decode_all(items: Sequence[tuple[Path, int]]) -> np.ndarray:
    x = np.empty((len(items), 3, 64, 64), dtype=np.uint8)
    for i, (path, _) in enumerate(items):
        x[i] = decode_image(path, (64, 64))
    return x


def _tiny_pixels(folder: Path, index: ImageIndex) -> tuple[np.ndarray, np.ndarray]:
    """Decoded train and test images, from ``folder/contrafl-cache.npz`` when it was made from
    the same files (decoding the 110,000 JPEGs is slow; loading the cache takes seconds)."""
    images = [path for path, _ in index.train + index.test]
    key = _fingerprint(folder, [*images, folder / "wnids.txt", folder / "val" / "val_annotations.txt"])
    cache = folder / TINY_IMAGENET_CACHE
    cached = _read_cache(cache, key)
    if cached is not None:
        return cached
    print(f"tinyimagenet: decoding {len(images)} images once (cached in {cache})", file=sys.stderr)
    x_train, x_test = _decode_all(index.train), _decode_all(index.test)
    _write_cache(cache, key, x_train, x_test)
    return x_train, x_test


def load_tinyimagenet(req: LoadRequest) -> FederatedDataset:
    """Tiny-ImageNet from the official ``tiny-imagenet-200`` folder; ``val`` is the test split.

    Order and labels as torchvision's ``ImageFolder`` gives them (MOON's loader): classes are
    the sorted wnids, images sorted by file name within a class; each val image is labelled
    by its line of ``val/val_annotations.txt``. Pixels are decoded by PIL as RGB.
    """
    release = _Release("tinyimagenet", req)
    for official in release.source.files:
        release.open(official.path)
    index = index_tiny_imagenet(release.folder)
    release.check_tree(ImageTree(len(index.wnids), len(index.train), len(index.test)))
    x_train, x_test = _tiny_pixels(release.folder, index)
    labels = [np.array([label for _, label in items], dtype=np.int64) for items in (index.train, index.test)]
    mean = std = (0.5, 0.5, 0.5)
    return release.dataset(_split(x_train, labels[0]), _split(x_test, labels[1]), index.names, mean, std)


# ---------------------------------------------------------------------------------------------
# FedProx Synthetic(alpha, beta)

SYNTHETIC_DIM = 60
SYNTHETIC_CLASSES = 10
SYNTHETIC_TRAIN_FRACTION = 0.9


@dataclass(frozen=True)
class SyntheticOptions:
    """Options of ``dataset=synthetic`` (``dataset.alpha=...``, ``dataset.beta=...``)."""

    alpha: float = P.param(
        1.0, P.Interval(0, None), "model heterogeneity: u_k ~ N(0, alpha), W_k, b_k ~ N(u_k, 1)"
    )
    beta: float = P.param(1.0, P.Interval(0, None), "data heterogeneity: B_k ~ N(0, beta), v_k ~ N(B_k, 1)")


def generate_synthetic(
    alpha: float, beta: float, num_clients: int, rng: np.random.Generator
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-client samples ``(x [n_k, 60], y [n_k])`` of Synthetic(alpha, beta).

    FedProx (Li et al., MLSys 2020; ``data/synthetic_*/generate_synthetic.py``), for client k:
    ``n_k = floor(LogNormal(4, 2)) + 50``; ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)``;
    ``W_k ~ N(u_k, 1)^{60x10}``, ``b_k ~ N(u_k, 1)^{10}``, ``v_k ~ N(B_k, 1)^{60}``;
    ``x ~ N(v_k, Sigma)`` with ``Sigma = diag(j^-1.2)``, ``j = 1..60``; and
    ``y = argmax softmax(W_k^T x + b_k)``. As in the FedProx code, ``alpha`` and ``beta`` are
    standard deviations (numpy's ``scale``).
    """
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + 50
    u = rng.normal(0, alpha, num_clients)
    b_mean = rng.normal(0, beta, num_clients)
    v = rng.normal(b_mean[:, None], 1, (num_clients, SYNTHETIC_DIM))
    sigma = np.arange(1, SYNTHETIC_DIM + 1, dtype=np.float64) ** -0.6  # sqrt(j^-1.2)
    clients = []
    for k in range(num_clients):
        w = rng.normal(u[k], 1, (SYNTHETIC_DIM, SYNTHETIC_CLASSES))
        b = rng.normal(u[k], 1, SYNTHETIC_CLASSES)
        x = v[k] + sigma * rng.standard_normal((sizes[k], SYNTHETIC_DIM))
        clients.append((x, np.argmax(x @ w + b, axis=1)))
    return clients


def load_synthetic(req: LoadRequest) -> FederatedDataset:
    """FedProx's Synthetic(alpha, beta) for ``req.num_clients`` clients, drawn from ``req.seed``.

    Each client keeps its first ``int(0.9 n_k)`` samples for training and the rest for testing
    (FedProx's split; its shuffle before splitting is immaterial, the samples being i.i.d.).
    ``natural_partition`` lists each client's rows of the concatenated train and test sets.
    """
    options = req.options if isinstance(req.options, SyntheticOptions) else SyntheticOptions()
    clients = generate_synthetic(
        options.alpha, options.beta, req.num_clients, np.random.default_rng(req.seed)
    )
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "test": []}
    for x, y in clients:
        cut = int(SYNTHETIC_TRAIN_FRACTION * len(y))
        parts["train"].append((x[:cut], y[:cut]))
        parts["test"].append((x[cut:], y[cut:]))
    splits, natural = {}, {}
    for split, chunks in parts.items():
        bounds = np.cumsum([0] + [len(y) for _, y in chunks])
        natural[split] = [
            list(range(lo, hi)) for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
        ]
        splits[split] = _split(
            np.concatenate([x for x, _ in chunks]).astype(np.float32), np.concatenate([y for _, y in chunks])
        )
    return FederatedDataset(
        "synthetic",
        splits["train"],
        splits["test"],
        [str(c) for c in range(SYNTHETIC_CLASSES)],
        natural_partition=natural,
        info={
            "alpha": options.alpha,
            "beta": options.beta,
            "subset": False,
            "train_rows": len(splits["train"]),
            "test_rows": len(splits["test"]),
        },
    )


# ---------------------------------------------------------------------------------------------
# Registration

_MOON_CIFAR = {"batch_size": 64, "rounds": 100, "local_epochs": 10}
_MNIST_LIKE = {"batch_size": 64, "rounds": 50, "local_epochs": 5}

_SPECS = (
    DatasetSpec(
        name="digits",
        summary="scikit-learn's 8x8 handwritten digits, 1,797 samples (bundled; for quick runs)",
        load=load_digits,
        default_model="mlp",
        augment="none",
        ssl_augment="scarf",
        recommended={"batch_size": 16, "rounds": 20, "local_epochs": 5},
        needs_data_dir=False,
    ),
    DatasetSpec(
        name="cifar10",
        summary="CIFAR-10: 60,000 32x32 colour images, 10 classes (official python version)",
        load=load_cifar10,
        default_model="moon_cnn",
        augment="cifar10",
        ssl_augment="simclr",
        recommended=_MOON_CIFAR,
        download=functools.partial(download, "cifar10"),
    ),
    DatasetSpec(
        name="cifar100",
        summary="CIFAR-100: 60,000 32x32 colour images, 100 fine classes (official python version)",
        load=load_cifar100,
        default_model="resnet50",
        augment="cifar100",
        ssl_augment="simclr",
        recommended=_MOON_CIFAR,
        download=functools.partial(download, "cifar100"),
    ),
    DatasetSpec(
        name="mnist",
        summary="MNIST: 70,000 28x28 handwritten digits",
        load=load_mnist,
        default_model="moon_cnn",
        augment="none",
        recommended=_MNIST_LIKE,
        download=functools.partial(download, "mnist"),
    ),
    DatasetSpec(
        name="fmnist",
        summary="Fashion-MNIST: 70,000 28x28 clothing images, 10 classes",
        load=load_fmnist,
        default_model="moon_cnn",
        augment="none",
        recommended=_MNIST_LIKE,
        download=functools.partial(download, "fmnist"),
    ),
    DatasetSpec(
        name="emnist",
        summary="EMNIST balanced: 131,600 28x28 handwritten characters, 47 classes",
        load=load_emnist,
        default_model="fedavg_cnn",
        augment="none",
        recommended=_MNIST_LIKE,
        download=functools.partial(download, "emnist"),
    ),
    DatasetSpec(
        name="tinyimagenet",
        summary="Tiny-ImageNet: 110,000 64x64 colour images, 200 classes (val is the test split)",
        load=load_tinyimagenet,
        default_model="resnet50",
        augment="none",
        recommended={"batch_size": 64, "rounds": 20, "local_epochs": 10},
        download=functools.partial(download, "tinyimagenet"),
    ),
    DatasetSpec(
        name="synthetic",
        summary="FedProx's Synthetic(alpha, beta): 60-d features, 10 classes, federated by construction",
        load=load_synthetic,
        default_model="mlp",
        augment="none",
        ssl_augment="scarf",
        recommended={"batch_size": 10, "rounds": 200, "local_epochs": 20},
        options=SyntheticOptions,
        needs_data_dir=False,
    ),
)
for _spec in _SPECS:
    DATASETS.add(_spec.name, _spec)
