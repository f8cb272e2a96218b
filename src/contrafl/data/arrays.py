"""``dataset=arrays``: the user's numpy arrays, an ``.npz`` file or a folder of ``.npy`` files.

The arrays (``np.savez(PATH, x_train=..., y_train=...)``, or ``x_train.npy``... in a folder):

* ``x_train``, ``y_train``: the training samples and their labels (required);
* ``x_test``, ``y_test``: the test samples (optional; without them ``dataset.test_fraction``
  of each class is split off the training samples, the same split for every run);
* ``classes``: the class names, label ``i`` being ``classes[i]`` (optional);
* ``client_train`` (and ``client_test``): each sample's client id, for naturally federated
  data (``partition=natural`` and ``num_clients`` the ids', the defaults; one client per
  id in sorted order, named ``str(id)``).

Samples are images ``uint8 [N, H, W, C]`` or ``[N, C, H, W]`` (``dataset.layout``; ``auto``
takes a last axis of 1, 3 or 4 that the second axis is not as the channels), ``[N, H, W]``
(grayscale), float images (kept as they are), or feature vectors ``[N, D]`` (as
``float32``, values as given: standardise them first, or give ``dataset.mean`` and
``dataset.std``). Labels are integers ``0..K-1`` (the class list is then ``0..max`` or
``classes``, so that label values are kept) or strings (the class names themselves).

Files are read with ``allow_pickle=False``: an array of Python objects (which could run code
when read) is refused. The module also holds what the other loaders of arrays share:
:func:`as_samples`, :func:`label_indices` (:func:`~contrafl.data.user.split_test` splits off a test part).
"""

from __future__ import annotations

import dataclasses
import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import params as P
from ..errors import ConfigError, DataError
from .base import FederatedDataset
from .registry import DATASETS, DatasetSpec, LoadRequest
from .user import CommonOptions, Part, assemble, check_memory, natural_key, split_test

__all__ = ["ArraysOptions", "as_samples", "label_indices", "load_arrays"]

KEYS = ("x_train", "y_train", "x_test", "y_test", "classes", "client_train", "client_test")
FIX_PICKLE = "save plain numeric or string arrays (e.g. np.asarray(x, dtype=np.uint8)) without Python objects"


@dataclass(frozen=True)
class ArraysOptions(CommonOptions):
    """Options of ``dataset=arrays``."""

    layout: str = P.param(
        "auto", P.OneOf(("auto", "nhwc", "nchw")),
        "axis order of 4-d image arrays (auto: channels last when the last axis is 1, 3 or 4 and the second is not)",
    )
    test_fraction: float = P.param(
        0.2, P.Interval(0, 1, "left"),
        "share of each class (and client) split off as test data when x_test is not given; the same split in every run",
    )


# ---------------------------------------------------------------------------------------------
# Shared by the loaders of arrays (arrays, pfllib, leaf) and of folders


def as_samples(x: np.ndarray, source: str, layout: str = "auto") -> np.ndarray:
    """``x`` as samples :func:`~contrafl.data.user.assemble` takes: images ``uint8`` or
    ``float32 [N, C, H, W]`` (4-d arrays in ``layout``, 3-d arrays as grayscale), or
    ``float32 [N, D]`` feature vectors. Integer images must hold pixels ``0..255``; floats
    must be finite. :class:`DataError` naming ``source`` otherwise."""
    if x.dtype.hasobject:
        raise DataError(f"{source} holds Python objects, not numbers; {FIX_PICKLE}")
    if x.dtype.kind in "USV" or x.dtype.kind not in "biuf":
        raise DataError(f"{source} holds {x.dtype} values, not numbers; give pixel or feature values")
    if x.ndim not in (2, 3, 4):
        raise DataError(
            f"{source} has shape {list(x.shape)}; give images [N, H, W, C], [N, C, H, W] or [N, H, W], or feature vectors [N, D]"
        )
    if x.ndim == 2:
        x = x.astype(np.float32, copy=False)
    else:
        if x.ndim == 3:
            x = x[:, None]
        elif layout == "nhwc" or (layout == "auto" and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4)):
            x = x.transpose(0, 3, 1, 2)
        if x.dtype.kind == "f":
            x = x.astype(np.float32, copy=False)
        elif x.dtype != np.uint8:
            if x.size and (x.min() < 0 or x.max() > 255):
                raise DataError(
                    f"{source} holds integer pixels outside 0..255 ({x.min()}..{x.max()}); give uint8 pixels or float values"
                )
            x = x.astype(np.uint8)
    if x.dtype == np.float32 and not np.isfinite(x).all():
        raise DataError(f"{source} holds NaN or infinite values; remove or replace those samples")
    return np.ascontiguousarray(x)


def label_indices(y: np.ndarray, names: Sequence[str] | None, source: str) -> tuple[np.ndarray, list[str]]:
    """Labels as indices into a list of class names, and that list: integer labels index
    ``names`` (when given; a label outside it is an error naming ``source``) or
    ``0..max`` (``["0", "1", ...]``); string labels are names themselves (indices into
    ``names`` when given, else into their sorted set)."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        hint = " (one-hot labels: give y.argmax(1))" if y.ndim == 2 else ""
        raise DataError(f"{source} has shape {list(y.shape)}; give one label per sample, shape [N]{hint}")
    if y.dtype.kind in "US":
        text = y.astype(str).tolist()
        if names is None:
            names = sorted(set(text), key=natural_key)
        index = {n: i for i, n in enumerate(names)}
        unknown = next((t for t in text if t not in index), None)
        if unknown is not None:
            raise DataError(f"{source} has label {unknown!r}, which is not one of the {len(names)} classes; list every class")
        return np.array([index[t] for t in text], dtype=np.int64), list(names)
    if y.dtype.kind == "f" and y.size and not (np.isfinite(y).all() and (y == np.round(y)).all()):
        bad = y[~(np.isfinite(y) & (y == np.round(y)))][0]
        raise DataError(f"{source} has label {bad}, not a whole number; give integer labels 0..K-1 or class names")
    if y.dtype.kind not in "biuf":
        raise DataError(f"{source} holds {y.dtype} values; give integer labels 0..K-1 or class names")
    labels = y.astype(np.int64)
    if labels.size and labels.min() < 0:
        raise DataError(f"{source} has label {labels.min()}; give integer labels 0..K-1 or class names")
    if names is None:
        names = [str(i) for i in range(int(labels.max()) + 1 if labels.size else 0)]
    elif labels.size and labels.max() >= len(names):
        raise DataError(
            f"{source} has label {labels.max()}, outside the {len(names)} classes (0..{len(names) - 1}); "
            "give labels 0..K-1 or list every class"
        )
    return labels, list(names)


# ---------------------------------------------------------------------------------------------
# Reading .npz / .npy without unpickling


def npy_header(f) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from the header of an ``.npy`` stream (nothing else is read)."""
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
    return tuple(shape), dtype


class _Arrays:
    """The arrays of an ``.npz`` file or of a folder of ``.npy`` files, by name."""

    def __init__(self, path: Path) -> None:
        if path.is_dir():
            files = {p.stem: p for p in sorted(path.glob("*.npy")) if not p.name.startswith(".")}
            npz = sorted(p for p in path.glob("*.npz") if not p.name.startswith("."))
            if not files and len(npz) == 1:  # a folder holding one .npz: that file
                path = npz[0]
            elif not files:
                also = f" and {len(npz)} .npz files" if npz else ""
                raise DataError(
                    f"{path} holds no .npy files{also}; give data_dir=FILE.npz, or a folder of x_train.npy, y_train.npy[, x_test.npy, y_test.npy]"
                )
        self.path = path
        self.npz = not path.is_dir()
        if self.npz:
            try:
                with zipfile.ZipFile(path) as zf:
                    names = [n for n in zf.namelist() if n.endswith(".npy")]
            except (zipfile.BadZipFile, OSError) as exc:
                raise DataError(f"{path} is not a readable .npz file ({exc}); save the arrays with np.savez") from None
            self.members = {n[: -len(".npy")]: n for n in names}
        else:
            self.members = files
        unknown = [k for k in self.members if k not in KEYS]
        if unknown:
            raise DataError(
                f"{self.where(unknown[0])} is not one of the arrays dataset=arrays reads{P.suggest(unknown[0], KEYS)} "
                f"({', '.join(KEYS)}); rename or remove it"
            )

    def where(self, key: str) -> str:
        return f"{self.path}:{key}" if self.npz else str(self.members.get(key, self.path / f"{key}.npy"))

    def __contains__(self, key: str) -> bool:
        return key in self.members

    def header(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        try:
            if self.npz:
                with zipfile.ZipFile(self.path) as zf, zf.open(self.members[key]) as f:
                    return npy_header(f)
            with open(self.members[key], "rb") as f:
                return npy_header(f)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise DataError(f"{self.where(key)} is not a readable .npy array ({exc}); save it with np.save or np.savez") from None

    def load(self, key: str) -> np.ndarray:
        if self.header(key)[1].hasobject:
            raise DataError(f"{self.where(key)} holds pickled Python objects, which are not read (they could run code); {FIX_PICKLE}")
        try:
            if self.npz:
                with np.load(self.path, allow_pickle=False) as npz:
                    return npz[key]
            return np.load(self.members[key], allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise DataError(f"{self.where(key)} is truncated or corrupted ({exc}); save it again") from None


# ---------------------------------------------------------------------------------------------
# dataset=arrays


def _client_ids(arrays: _Arrays, key: str, rows: int) -> np.ndarray:
    ids = arrays.load(key)
    if ids.ndim != 1 or len(ids) != rows:
        raise DataError(f"{arrays.where(key)} has shape {list(ids.shape)}; give one client id per sample, shape [{rows}]")
    if ids.dtype.kind not in "iuUS":
        raise DataError(f"{arrays.where(key)} holds {ids.dtype} values; give integer or string client ids")
    return ids.astype(str) if ids.dtype.kind == "S" else ids


def _client_order(ids: np.ndarray) -> list:
    """The distinct client ids of ``ids``, one client each, in order: numbers as numbers,
    text naturally (``c2 < c10``)."""
    return np.unique(ids).tolist() if ids.dtype.kind in "iu" else sorted(set(ids.tolist()), key=natural_key)


def arrays_clients(req: LoadRequest) -> list[str] | None:
    """The clients of ``client_train`` at ``req.data_dir``, named ``str(id)``, read
    without the samples (only the ids and ``x_train``'s header), or ``None`` without
    ``client_train``."""
    if req.data_dir is None:
        raise ConfigError("dataset arrays needs data_dir=PATH, an .npz file or a folder of .npy files")
    arrays = _Arrays(Path(req.data_dir))
    if "client_train" not in arrays or "x_train" not in arrays:
        return None
    shape = arrays.header("x_train")[0]
    return [str(cid) for cid in _client_order(_client_ids(arrays, "client_train", shape[0] if shape else 0))]


def load_arrays(req: LoadRequest) -> FederatedDataset:
    """The arrays at ``req.data_dir`` (see the module docstring)."""
    options = req.options if isinstance(req.options, ArraysOptions) else ArraysOptions()
    if req.data_dir is None:
        raise ConfigError("dataset arrays needs data_dir=PATH, an .npz file or a folder of .npy files")
    arrays = _Arrays(Path(req.data_dir))
    for key in ("x_train", "y_train"):
        if key not in arrays:
            held = ", ".join(arrays.members) or "nothing"
            raise DataError(f"{arrays.path} has no {key} array (it holds: {held}); save the arrays as x_train, y_train[, x_test, y_test]")
    if ("x_test" in arrays) != ("y_test" in arrays):
        have, missing = ("x_test", "y_test") if "x_test" in arrays else ("y_test", "x_test")
        raise DataError(f"{arrays.where(have)} is given without {missing}; give both test arrays or neither")
    if "client_test" in arrays and "client_train" not in arrays:
        raise DataError(f"{arrays.where('client_test')} is given without client_train; give each training sample's client too")
    if "client_test" in arrays and "x_test" not in arrays:
        raise DataError(f"{arrays.where('client_test')} is given without x_test and y_test; give the test samples too, or remove it")
    if "client_train" in arrays and "x_test" in arrays and "client_test" not in arrays:
        raise DataError(f"{arrays.where('client_train')} is given but not client_test; give each test sample's client too")
    splits = ("train", "test") if "x_test" in arrays else ("train",)
    headers = {s: arrays.header(f"x_{s}") for s in splits}
    check_memory(sum(math.prod(shape) * dtype.itemsize for shape, dtype in headers.values()), options, f"the arrays of {arrays.path}")

    names = None
    if "classes" in arrays:
        raw = arrays.load("classes")
        if raw.ndim != 1 or raw.dtype.kind not in "iuUS":
            raise DataError(f"{arrays.where('classes')} has shape {list(raw.shape)} ({raw.dtype}); give the class names as a list of strings")
        names = [str(n) for n in (raw.astype(str) if raw.dtype.kind == "S" else raw).tolist()]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise DataError(f"{arrays.where('classes')} lists {twice!r} twice; list each class once")
    x, y, clients = {}, {}, {}
    for s in splits:
        x[s] = as_samples(arrays.load(f"x_{s}"), arrays.where(f"x_{s}"), options.layout)
        y[s] = arrays.load(f"y_{s}")
        if len(y[s]) != len(x[s]):
            raise DataError(f"{arrays.where(f'y_{s}')} has {len(y[s])} labels but x_{s} has {len(x[s])} samples; give one label per sample")
        if f"client_{s}" in arrays:
            clients[s] = _client_ids(arrays, f"client_{s}", len(x[s]))
    kinds = {y[s].dtype.kind in "US" for s in splits}
    if len(kinds) > 1:
        raise DataError(f"{arrays.where('y_test')} and y_train hold labels of different kinds (names and numbers); give both as one or the other")
    if kinds == {True} and names is None:
        names = sorted({str(t) for s in splits for t in y[s].astype(str).tolist()}, key=natural_key)
    found = {s: label_indices(y[s], names, arrays.where(f"y_{s}")) for s in splits}
    labels = {s: found[s][0] for s in splits}
    if names is None:  # integer labels keep their values: classes 0..max
        names = max((found[s][1] for s in splits), key=len)
    if options.classes is None:
        options = dataclasses.replace(options, classes=list(names))
    if "train" in clients:
        ids = clients["train"]
        order = _client_order(ids)
        if "test" in clients:
            strays = sorted(set(clients["test"].tolist()) - set(order), key=lambda c: natural_key(str(c)))
            if strays:
                raise DataError(
                    f"{arrays.where('client_test')} has samples of client {strays[0]!r}, which has no training samples in client_train; "
                    "give every client training samples"
                )
        parts = []
        for cid in order:
            rows = np.flatnonzero(ids == cid)
            source = f"{arrays.where('client_train')} (client {cid})"
            if "test" in clients:
                test_rows = np.flatnonzero(clients["test"] == cid)
                parts.append(Part(str(cid), x["train"][rows], labels["train"][rows], x["test"][test_rows], labels["test"][test_rows], names, source))
            else:
                keep, held = split_test(labels["train"][rows], names, options.test_fraction)
                parts.append(Part(str(cid), x["train"][rows[keep]], labels["train"][rows[keep]], x["train"][rows[held]], labels["train"][rows[held]], names, source))
        return assemble("arrays", parts, options, True, {"path": str(arrays.path)})
    if "test" in x:
        part = Part("", x["train"], labels["train"], x["test"], labels["test"], names, str(arrays.path))
    else:
        keep, held = split_test(labels["train"], names, options.test_fraction)
        part = Part("", x["train"][keep], labels["train"][keep], x["train"][held], labels["train"][held], names, str(arrays.path))
    return assemble("arrays", [part], options, False, {"path": str(arrays.path)})


DATASETS.add(
    "arrays",
    DatasetSpec(
        name="arrays",
        summary="your numpy arrays: data_dir=FILE.npz (or a folder of .npy) with x_train, y_train[, x_test, y_test, classes, client_train, client_test]",
        load=load_arrays,
        clients=arrays_clients,
        default_model="mlp",
        augment="none",
        ssl_augment=None,
        recommended={"batch_size": 32, "rounds": 20, "local_epochs": 5},
        options=ArraysOptions,
        needs_data_dir=True,
    ),
)
