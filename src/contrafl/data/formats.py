"""Readers of the official file formats: CIFAR python pickles, IDX (MNIST family), Tiny-ImageNet.

Every reader checks that what it reads is complete and well-formed (official keys, magic
numbers, consistent shapes, ``uint8`` pixels, labels in range) and otherwise raises a one-line
:class:`~contrafl.errors.DataError` ``"PATH is truncated or corrupted: WHY"``, so that a damaged
or foreign file never reaches training. Checksums are not this module's business
(:mod:`contrafl.data.download`).
"""

from __future__ import annotations

import gzip
import importlib
import math
import pickle
import zipfile
import zlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..errors import DataError

__all__ = [
    "corrupted",
    "read_pickle",
    "read_cifar_batch",
    "read_cifar_names",
    "parse_idx",
    "read_idx",
    "gunzip",
    "read_zip_members",
    "parse_emnist_mapping",
    "ImageIndex",
    "index_tiny_imagenet",
    "decode_image",
]

CIFAR_PIXELS = 3 * 32 * 32
IDX_UBYTE = 0x08
"""IDX type code of unsigned bytes, the third byte of the magic number (``0x00000803`` images)."""


def corrupted(source: str | Path, why: str) -> DataError:
    return DataError(f"{source} is truncated or corrupted: {why}")


def _numpy_global(module: str, name: str) -> Any:
    """numpy's reconstruction helpers, under the module name of numpy 1 or 2 that a file
    names (``numpy.core`` is ``numpy._core`` since numpy 2)."""
    for candidate in (module.replace("numpy.core", "numpy._core"), module):
        try:
            return getattr(importlib.import_module(candidate), name)
        except (ImportError, AttributeError):
            continue
    raise pickle.UnpicklingError(f"{module}.{name} is not available")


class ArrayUnpickler(pickle.Unpickler):
    """Builds numpy arrays and dtypes and plain Python containers; any other global (a
    function that could run code when called) is refused."""

    ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),  # numpy 1
            ("numpy._core.multiarray", "_reconstruct"),  # numpy 2
            ("numpy.core.numeric", "_frombuffer"),  # pickle protocol 5
            ("numpy._core.numeric", "_frombuffer"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("_codecs", "encode"),  # bytes pickled by Python 3 with protocol 2
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not read (a pickle can run code)")
        if module == "_codecs":
            return super().find_class(module, name)
        return _numpy_global(module, name)


def _text(value: Any) -> Any:
    """``bytes`` as ``str``: files re-pickled after ``pickle.load(f, encoding="bytes")`` (the
    loading recipe of the CIFAR page) hold bytes where the official files hold strings."""
    return value.decode("latin1") if isinstance(value, bytes) else value


def read_pickle(path: Path) -> dict[str, Any]:
    """The dict pickled in ``path``, which must hold exactly one pickle and nothing after it."""
    with open(path, "rb") as f:
        try:
            obj = ArrayUnpickler(f, encoding="latin1").load()
        # A damaged pickle can fail in many ways (EOFError, UnpicklingError, ValueError,
        # TypeError, IndexError, ...): all of them mean the file is unusable.
        except Exception as exc:
            raise corrupted(path, f"cannot unpickle it ({type(exc).__name__}: {exc})") from None
        if f.read(1):
            raise corrupted(path, "unexpected bytes after the pickled data")
    if not isinstance(obj, dict):
        raise corrupted(path, f"it holds a {type(obj).__name__}, expected a dict")
    return {_text(k): v for k, v in obj.items()}


def _check_keys(path: Path, found: Iterable[str], keys: Collection[str]) -> None:
    if set(found) != set(keys):
        raise corrupted(path, f"keys {sorted(found)}, expected the official keys {sorted(keys)}")


def _labels(path: Path, values: Any, key: str, num_classes: int) -> np.ndarray:
    labels = np.asarray(values)
    if labels.ndim != 1 or (labels.size and labels.dtype.kind not in "iu"):
        raise corrupted(path, f"'{key}' is not a list of integers")
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise corrupted(path, f"'{key}' has labels outside 0..{num_classes - 1}")
    return labels


def read_cifar_batch(
    path: Path, keys: Collection[str], label_key: str, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Images ``uint8 [N, 3, 32, 32]`` and labels ``int64 [N]`` of a CIFAR python batch.

    The file is a pickled dict with exactly ``keys``: ``data`` (``uint8 [N, 3072]``, each row
    R(1024) G(1024) B(1024) in row-major order), ``batch_label`` and one entry per row in every
    other key (labels, file names).
    """
    batch = read_pickle(path)
    _check_keys(path, batch, keys)
    data = batch["data"]
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != CIFAR_PIXELS
    ):
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise corrupted(path, f"'data' is {dtype} of shape {shape}, expected uint8 [N, {CIFAR_PIXELS}]")
    rows = data.shape[0]
    for key in sorted(set(keys) - {"data", "batch_label"}):
        if not isinstance(batch[key], list) or len(batch[key]) != rows:
            size = len(batch[key]) if isinstance(batch[key], list) else type(batch[key]).__name__
            raise corrupted(path, f"'{key}' has {size} entries for {rows} data rows")
    return data.reshape(rows, 3, 32, 32), _labels(path, batch[label_key], label_key, num_classes)


def read_cifar_names(path: Path, keys: Collection[str], names_key: str, num_classes: int) -> list[str]:
    """The class names stored under ``names_key`` of a CIFAR meta file (a pickled dict with
    exactly ``keys``)."""
    meta = read_pickle(path)
    _check_keys(path, meta, keys)
    names = [_text(n) for n in meta[names_key]] if isinstance(meta[names_key], list) else None
    if names is None or len(names) != num_classes or not all(isinstance(n, str) for n in names):
        raise corrupted(path, f"'{names_key}' is not a list of {num_classes} class names")
    return names


def parse_idx(buf: bytes, item_shape: tuple[int, ...], source: str | Path) -> np.ndarray:
    """The ``uint8`` array of an IDX file (LeCun's MNIST format).

    Layout: two zero bytes, the type code ``0x08`` (unsigned byte), the number of dimensions
    ``d``; then ``d`` big-endian ``uint32`` sizes; then the data in row-major order. The array
    must have shape ``[N, *item_shape]`` (magic ``0x00000803`` for ``28x28`` images,
    ``0x00000801`` for labels) and the file exactly the announced length.
    """
    ndim = 1 + len(item_shape)
    magic = int.from_bytes(buf[:4], "big") if len(buf) >= 4 else None
    if magic != (IDX_UBYTE << 8) | ndim:
        found = "no header" if magic is None else f"magic number 0x{magic:08x}"
        raise corrupted(source, f"{found}, expected 0x{(IDX_UBYTE << 8) | ndim:08x}")
    header = 4 + 4 * ndim
    if len(buf) < header:
        raise corrupted(source, f"{len(buf)} bytes, shorter than its {header}-byte header")
    dims = tuple(int.from_bytes(buf[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if dims[1:] != item_shape:
        raise corrupted(source, f"items of shape {list(dims[1:])}, expected {list(item_shape)}")
    expected = header + math.prod(dims)
    if len(buf) != expected:
        raise corrupted(source, f"{len(buf)} bytes, but its header announces {expected}")
    return np.frombuffer(buf, dtype=np.uint8, offset=header).reshape(dims)


def gunzip(buf: bytes, source: str | Path) -> bytes:
    try:
        return gzip.decompress(buf)
    except (OSError, EOFError, zlib.error) as exc:
        raise corrupted(source, f"invalid gzip data ({exc})") from None


def read_idx(path: Path, item_shape: tuple[int, ...]) -> np.ndarray:
    """:func:`parse_idx` of a file, gunzipped first when its name ends in ``.gz``."""
    buf = path.read_bytes()
    return parse_idx(gunzip(buf, path) if path.suffix == ".gz" else buf, item_shape, path)


def read_zip_members(path: Path, members: Iterable[str]) -> dict[str, bytes]:
    """The contents of those ``members`` that the zip archive holds (CRC-checked)."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            return {m: zf.read(m) for m in members if m in names}
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
        raise corrupted(path, f"invalid zip archive ({exc})") from None


def parse_emnist_mapping(text: str, num_classes: int, source: str) -> list[str]:
    """Class names from an EMNIST ``*-mapping.txt``: line ``i`` is ``"i ASCII_CODE"``."""
    rows = [line.split() for line in text.splitlines() if line.strip()]
    if len(rows) != num_classes or any(
        len(row) != 2 or row[0] != str(i) or not row[1].isdigit() for i, row in enumerate(rows)
    ):
        raise corrupted(
            source, f"expected {num_classes} lines 'LABEL ASCII_CODE' for labels 0..{num_classes - 1}"
        )
    return [chr(int(code)) for _, code in rows]


@dataclass(frozen=True)
class ImageIndex:
    """The images of a class-folder release, in the order torchvision's ``ImageFolder`` lists
    them: classes sorted by folder name, then files sorted by name within a class.

    Attributes:
        wnids: class folder names (WordNet ids), sorted; the index of a wnid is its label.
        names: human-readable name of each class.
        train, test: ``(path, label)`` pairs.
    """

    wnids: list[str]
    names: list[str]
    train: list[tuple[Path, int]]
    test: list[tuple[Path, int]]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise corrupted(path, f"not a text file ({exc})") from None


def _jpegs(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.suffix.lower() == ".jpeg" and p.is_file())


def index_tiny_imagenet(folder: Path) -> ImageIndex:
    """Index the official ``tiny-imagenet-200`` tree.

    Classes are the sorted wnids of ``wnids.txt`` named by ``words.txt``; training images are
    ``train/<wnid>/images/*.JPEG``. The test split is ``val/images/*.JPEG``, each labelled by
    its line of ``val/val_annotations.txt`` (``file<TAB>wnid<TAB>box``) and ordered as
    ``ImageFolder`` orders ``val`` once reorganised into class folders (MOON's setup): by
    class, then by file name.
    """
    wnids_file = folder / "wnids.txt"
    wnids = sorted(_read_text(wnids_file).split())
    if not wnids or len(set(wnids)) != len(wnids):
        raise corrupted(wnids_file, "expected one distinct wnid per line")
    label = {w: i for i, w in enumerate(wnids)}

    words = {}
    for line in _read_text(folder / "words.txt").splitlines():
        wnid, _, name = line.partition("\t")
        words[wnid] = name.strip()
    unnamed = [w for w in wnids if w not in words]
    if unnamed:
        raise corrupted(folder / "words.txt", f"no name for wnid {unnamed[0]}")

    train_dir = folder / "train"
    strays = (
        sorted(p.name for p in train_dir.iterdir() if p.is_dir() and p.name not in label)
        if train_dir.is_dir()
        else []
    )
    if strays:
        raise corrupted(train_dir, f"class folder {strays[0]} is not in wnids.txt")
    train = [
        (train_dir / w / "images" / f, label[w]) for w in wnids for f in _jpegs(train_dir / w / "images")
    ]

    annotations_file = folder / "val" / "val_annotations.txt"
    annotations = {}
    for n, line in enumerate(_read_text(annotations_file).splitlines(), start=1):
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in label:
            raise corrupted(annotations_file, f"line {n} does not name an image and a wnid of wnids.txt")
        annotations[fields[0]] = label[fields[1]]
    val_dir = folder / "val" / "images"
    files = _jpegs(val_dir)
    missing = [f for f in files if f not in annotations]
    if missing:
        raise corrupted(annotations_file, f"no line for val image {missing[0]}")
    test = sorted(((val_dir / f, annotations[f]) for f in files), key=lambda item: (item[1], item[0].name))
    return ImageIndex(wnids, [words[w] for w in wnids], train, test)


def decode_image(path: Path, size: tuple[int, int]) -> np.ndarray:
    """An image file decoded by PIL as RGB, ``uint8 [3, H, W]``; ``size`` is ``(W, H)``."""
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
    # PIL signals unreadable data with OSError (incl. UnidentifiedImageError), SyntaxError
    # or ValueError depending on the decoder.
    except (OSError, SyntaxError, ValueError) as exc:
        raise corrupted(path, f"cannot decode the image ({exc})") from None
    if rgb.size != size:
        raise corrupted(path, f"a {rgb.size[0]}x{rgb.size[1]} image, expected {size[0]}x{size[1]}")
    return np.asarray(rgb).transpose(2, 0, 1)
