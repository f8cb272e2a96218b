"""``dataset=folder``: the user's images, one folder per class.

Layouts of ``data_dir=ROOT`` (folder names are class names; files ``.png``, ``.jpg``,
``.jpeg``, ``.bmp``, ``.webp`` in any letter case, in the class folder or below it; hidden
files and folders, and other files, are ignored):

* ``ROOT/train/<class>/...`` and ``ROOT/test/<class>/...``: a dataset with its test split;
  without ``ROOT/test``, ``dataset.test_fraction`` of each class is split off the training
  images (the same split in every run, whatever the seed);
* ``ROOT/<class>/...``: the same as ``ROOT/train`` without a test folder;
* ``ROOT/clients/<name>/train/<class>/...`` (and ``.../<name>/test/<class>/...``): naturally
  federated data, one client per folder in natural order (``site2`` before ``site10``), named
  by it: ``partition=natural`` with one client per folder, the default for this layout (the
  folders counted by name, :func:`folder_clients`, before any image is opened); each client's
  test folder is its own test data (a client without one gets ``dataset.test_fraction`` of
  its images as test data). A ``clients`` folder makes ``ROOT`` this layout, whatever else
  it holds.

A client's folder given as ``data_dir`` (``ROOT/clients/site-a``) is a dataset of the first
layout: what a SuperNode holding its own data reads.

Images are decoded by Pillow into ``uint8 [N, C, H, W]``: ``dataset.color`` chooses RGB or
grayscale (``auto``: grayscale when every image is, else RGB), ``dataset.size`` resizes
(bilinear, torchvision's ``Resize`` default; ``N`` is ``N x N``). The decoded arrays are
cached in ``ROOT/.contrafl-cache/`` and used again while the files (their paths, sizes and
modification times) and these options stay the same; where ``ROOT`` is read-only the images
are decoded every time.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .. import params as P
from ..errors import ConfigError, DataError
from . import pictures
from .base import FederatedDataset
from .datasets import _fingerprint
from .registry import DATASETS, DatasetSpec, LoadRequest
from .user import CommonOptions, Part, assemble, check_memory, natural_key, split_test

__all__ = ["FolderOptions", "folder_clients", "load_folder", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp"})
CACHE_DIR = ".contrafl-cache"
GRAY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"})
"""Pillow modes of one-channel images (``color=auto`` keeps one channel when every image has one)."""
PROGRESS_FROM = 1000
"""Decoding more images than this prints one line to stderr."""


@dataclass(frozen=True)
class _Color(P.OneOf):
    """:class:`~contrafl.params.OneOf` that also reads ``gray`` (and ``grey``,
    ``greyscale``) as ``grayscale``."""

    def canonical(self, value):
        return "grayscale" if isinstance(value, str) and P.fold(value) in ("gray", "grey", "greyscale") else super().canonical(value)


@dataclass(frozen=True)
class FolderOptions(CommonOptions):
    """Options of ``dataset=folder``."""

    size: int | list[int] | None = P.param(
        None, pictures.Size(), "resize every image to N x N or [H,W] pixels, bilinear (auto: keep the size, which must then be the same for all)"
    )
    color: str = P.param(
        "auto", _Color(("auto", "rgb", "grayscale")), "channels: rgb (3), grayscale (1; also 'gray'), or auto: grayscale if every image is, else rgb"
    )
    test_fraction: float = P.param(
        0.2, P.Interval(0, 1, "left"),
        "share of each class split off as test images where there is no test folder; the same split in every run",
    )


@dataclass
class _Tree:
    """A client's (or the dataset's) images: ``train`` and ``test`` ``(path, class index)``
    lists, ``test`` ``None`` when there is no test folder."""

    name: str
    source: Path
    names: list[str]
    train: list[tuple[Path, int]]
    test: list[tuple[Path, int]] | None


def _visible(path: Path) -> bool:
    return not path.name.startswith(".")


def _images(folder: Path) -> list[Path]:
    """The image files in ``folder`` and below it (hidden ones skipped), in natural order of
    their relative paths."""
    found = []
    for top, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(top, f) for f in files if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS]
    return sorted(found, key=lambda p: natural_key(p.relative_to(folder).as_posix()))


def _classes(folder: Path) -> dict[str, list[Path]]:
    """The class folders of ``folder`` and their images; a one-line error for a folder
    without class folders or a class folder without images."""
    subfolders = sorted((p for p in folder.iterdir() if p.is_dir() and _visible(p)), key=lambda p: natural_key(p.name))
    if not subfolders:
        loose = any(p.suffix.lower() in IMAGE_EXTENSIONS for p in folder.iterdir())
        raise DataError(
            f"{folder} has {'images but ' if loose else ''}no class folders; put each class's images in {folder}/<class>/"
        )
    classes = {}
    for sub in subfolders:
        images = _images(sub)
        if not images:
            raise DataError(
                f"class folder {sub} holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))}); add some or remove the folder"
            )
        classes[sub.name] = images
    return classes


def _tree(name: str, train: Path, test: Path | None) -> _Tree:
    train_classes = _classes(train)
    test_classes = _classes(test) if test is not None else {}
    names = sorted(set(train_classes) | set(test_classes), key=natural_key)
    index = {n: i for i, n in enumerate(names)}

    def items(classes: dict[str, list[Path]]) -> list[tuple[Path, int]]:
        return [(path, index[c]) for c, paths in classes.items() for path in paths]

    return _Tree(name, train, names, items(train_classes), items(test_classes) if test is not None else None)


def _client_folders(root: Path) -> list[Path] | None:
    """The client folders of ``root`` (``ROOT/clients/<name>``, in natural order of their
    names, each checked to hold a train folder), or ``None`` when ``root`` is not
    naturally federated."""
    if not root.is_dir():
        raise DataError(f"data_dir={root} is not a folder; dataset=folder reads ROOT/train/<class>/*.png (see `contrafl list datasets`)")
    clients = root / "clients"
    if not clients.is_dir():
        return None
    folders = sorted((p for p in clients.iterdir() if p.is_dir() and _visible(p)), key=lambda p: natural_key(p.name))
    if not folders:
        raise DataError(f"{clients} holds no client folders; put each client's images in {clients}/<name>/train/<class>/")
    for folder in folders:
        if not (folder / "train").is_dir():
            raise DataError(f"client folder {folder} has no train folder; put its images in {folder}/train/<class>/, or remove it")
    return folders


def folder_clients(req: LoadRequest) -> list[str] | None:
    """The clients of ``ROOT/clients/<name>/...`` at ``req.data_dir``, named by their
    folders (read from the folder names, no image opened), or ``None`` for the layouts of
    a dataset that is not split per client."""
    if req.data_dir is None:
        raise ConfigError("dataset folder needs data_dir=DIR, a folder of class folders of images")
    folders = _client_folders(Path(req.data_dir))
    return None if folders is None else [folder.name for folder in folders]


def _layout(root: Path) -> tuple[list[_Tree], bool]:
    """The image trees of ``root`` (one per client when naturally federated) and whether
    it is."""
    folders = _client_folders(root)
    if folders is not None:
        trees = []
        for folder in folders:
            test = folder / "test"
            trees.append(_tree(folder.name, folder / "train", test if test.is_dir() else None))
        return trees, True
    if (root / "train").is_dir():
        test = root / "test"
        return [_tree("", root / "train", test if test.is_dir() else None)], False
    if (root / "test").is_dir():
        raise DataError(f"{root} has a test folder but no train folder; put the training images in {root}/train/<class>/")
    try:
        return [_tree("", root, None)], False
    except DataError as exc:
        raise DataError(
            f"{exc}; dataset=folder reads ROOT/train/<class>/ (and ROOT/test/<class>/), ROOT/<class>/, or ROOT/clients/<name>/train/<class>/"
        ) from None


# ---------------------------------------------------------------------------------------------
# Decoding


def _open_error(path: Path, exc: BaseException) -> DataError:
    why = " ".join(str(exc).split()) or type(exc).__name__
    return DataError(f"{path} is not a readable image ({why}); replace or remove it")


def _headers(paths: Sequence[Path]) -> list[tuple[tuple[int, int], str]]:
    """``((width, height), mode)`` of each image, from its header."""
    out = []
    for path in paths:
        try:
            with Image.open(path) as img:
                out.append((img.size, img.mode))
        except pictures.PIL_ERRORS as exc:
            raise _open_error(path, exc) from None
    return out


def _target(paths: Sequence[Path], headers, options: FolderOptions) -> tuple[int, int, str]:
    """``(height, width, Pillow mode)`` every image is decoded to."""
    if options.size is not None:
        height, width = pictures.sides(options.size)
    else:
        (width, height), _ = headers[0]
        other = next((i for i, (size, _) in enumerate(headers) if size != (width, height)), None)
        if other is not None:
            w, h = headers[other][0]
            raise DataError(
                f"{paths[other]} is {h}x{w} pixels (HxW) but {paths[0]} is {height}x{width}; resize them all with "
                f"dataset.size=N (N x N) or dataset.size=[H,W]"
            )
    gray = options.color == "grayscale" or (options.color == "auto" and all(mode in GRAY_MODES for _, mode in headers))
    return height, width, "L" if gray else "RGB"


def _decode(paths: Sequence[Path], height: int, width: int, mode: str) -> np.ndarray:
    x = np.empty((len(paths), 1 if mode == "L" else 3, height, width), dtype=np.uint8)
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as img, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # palette transparency notes
                if img.mode.startswith("I;16"):  # 16-bit: scaled to 8 bits (Pillow's convert clips at 255)
                    img = Image.fromarray(np.round(np.asarray(img, dtype=np.float64) / 257).astype(np.uint8))
                x[i] = pictures.pixels(img, height, width, mode)
        except pictures.PIL_ERRORS as exc:
            raise _open_error(path, exc) from None
    return x


def _cache_path(root: Path, options: FolderOptions) -> Path:
    settings = f"size={options.size}\0color={options.color}"
    return root / CACHE_DIR / f"folder-{hashlib.sha256(settings.encode()).hexdigest()[:16]}.npz"


def _read_cache(path: Path, key: str, count: int, options: FolderOptions) -> np.ndarray | None:
    try:
        with np.load(path, allow_pickle=False) as cache:
            if str(cache["key"]) != key:
                return None
            shape = tuple(int(s) for s in cache["shape"])
            if len(shape) != 4 or shape[0] != count:
                return None
            check_memory(int(np.prod(shape)), options, f"the {count} images of the cache {path}")
            x = cache["x"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    return x if x.shape == shape and x.dtype == np.uint8 else None


def _write_cache(path: Path, key: str, x: np.ndarray) -> None:
    """Write the cache atomically; silently skip it where the folder is read-only or full."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, key=np.array(key), shape=np.array(x.shape), x=x)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _pixels(root: Path, paths: list[Path], options: FolderOptions) -> tuple[np.ndarray, bool]:
    """The decoded images of ``paths``, and whether they came from the cache."""
    cache = _cache_path(root, options)
    key = hashlib.sha256(f"{_fingerprint(root, paths)}\0{cache.name}".encode()).hexdigest()
    cached = _read_cache(cache, key, len(paths), options)
    if cached is not None:
        return cached, True
    headers = _headers(paths)
    height, width, mode = _target(paths, headers, options)
    channels = 1 if mode == "L" else 3
    check_memory(len(paths) * channels * height * width, options, f"the {len(paths)} images of {root}")
    if len(paths) > PROGRESS_FROM:
        print(f"folder: decoding {len(paths)} images of {root} (cached in {cache.parent} where writable)", file=sys.stderr)
    x = _decode(paths, height, width, mode)
    _write_cache(cache, key, x)
    return x, False


# ---------------------------------------------------------------------------------------------
# dataset=folder


def load_folder(req: LoadRequest) -> FederatedDataset:
    """The images at ``req.data_dir`` (see the module docstring)."""
    options = req.options if isinstance(req.options, FolderOptions) else FolderOptions()
    if req.data_dir is None:
        raise ConfigError("dataset folder needs data_dir=DIR, a folder of class folders of images")
    root = Path(req.data_dir)
    trees, natural = _layout(root)
    paths = [path for tree in trees for items in (tree.train, tree.test or []) for path, _ in items]
    x, cached = _pixels(root, paths, options)
    parts, start = [], 0
    for tree in trees:  # x holds each tree's train then test images; rows are views where they are ranges
        test = tree.test or []
        middle, end = start + len(tree.train), start + len(tree.train) + len(test)
        train_rows, test_rows = slice(start, middle), slice(middle, end)
        y_train = np.array([label for _, label in tree.train], dtype=np.int64)
        y_test = np.array([label for _, label in test], dtype=np.int64)
        if tree.test is None:
            keep, held = split_test(y_train, tree.names, options.test_fraction)
            train_rows, test_rows, y_train, y_test = start + keep, start + held, y_train[keep], y_train[held]
        parts.append(Part(tree.name, x[train_rows], y_train, x[test_rows], y_test, tree.names, str(tree.source.parent if natural else root)))
        start = end
    return assemble("folder", parts, options, natural, {"folder": str(root), "cached": cached})


DATASETS.add(
    "folder",
    DatasetSpec(
        name="folder",
        summary="your images in class folders: data_dir/train/<class>/*.png [and test/<class>/], or data_dir/clients/<name>/train/<class>/ per client",
        load=load_folder,
        default_model="moon_cnn",
        augment="none",
        ssl_augment=None,
        recommended={"batch_size": 32, "rounds": 20, "local_epochs": 5},
        options=FolderOptions,
        needs_data_dir=True,
        clients=folder_clients,
    ),
)
