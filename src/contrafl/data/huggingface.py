"""``dataset=huggingface``: any Hugging Face ``datasets`` dataset as a contrafl dataset.

``data_dir`` is one of

* a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``;
* a parquet, arrow, csv or json(l) file (the training split), or a folder of such files,
  whose names give the splits as on the Hugging Face Hub (``train.parquet``,
  ``test-00000-of-00001.parquet``, ``data/train/...``; files of no split name are the
  training split);

or ``dataset.hub=ID`` names a dataset of the Hugging Face Hub, loaded with
``datasets.load_dataset(ID)`` (``data_dir``, when given, is then its cache folder).

The samples are the images of an ``Image`` column (``dataset.image``; auto: the first),
decoded by PIL to RGB or greyscale and optionally resized (``dataset.size``), or feature
vectors made of numeric columns (``dataset.features``). Labels come from ``dataset.label``
(auto: ``label``, else the first ``ClassLabel`` column): the classes are the ClassLabel's
names in its order (so that class ``k`` is the dataset's label ``k``), else the sorted label
values. With ``dataset.client``, a column of client ids, the dataset is federated by
construction: one client per id (in sorted order); ``partition=natural`` and
``num_clients`` the ids' are the defaults (:func:`huggingface_clients`).

The rows keep the order of the splits, so that ``partition=flwr_*`` assigns the samples a
Flower Datasets experiment on the same split assigns.

``datasets`` (``pip install 'contrafl[huggingface]'``) is imported by the loader only.
"""

from __future__ import annotations

import dataclasses
import io
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import params as P
from ..errors import ConfigError, DataError
from . import pictures
from .base import FederatedDataset
from .registry import DATASETS, DatasetSpec, LoadRequest
from .user import CommonOptions, Part, assemble, check_memory, natural_key, split_test

__all__ = ["HuggingFaceOptions", "load_huggingface"]

EXTRA = "pip install 'contrafl[huggingface]'"
FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
"""Data file extensions and the ``datasets`` builder that reads them."""
GREY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"})
"""PIL modes of greyscale images (``color=auto`` keeps one channel when every image has one)."""
PROGRESS_IMAGES = 10_000
"""Decoding at least this many images prints one line on stderr first."""


@dataclass(frozen=True)
class HuggingFaceOptions(CommonOptions):
    """Options of ``dataset=huggingface`` (``dataset.<option>=...``)."""

    hub: str | None = P.param(None, None, "a Hugging Face Hub dataset id, loaded with datasets.load_dataset (data_dir: its cache folder)")
    subset: str | None = P.param(None, None, "the hub dataset's configuration (subset) name, for datasets with several")
    image: str | None = P.param(None, None, "the column of images (auto: the first Image column, if any)")
    features: list[str] | None = P.param(
        None, None, "numeric columns (scalars or fixed-length lists) making the feature vectors, instead of images; * for every numeric column"
    )
    label: str | None = P.param(None, None, "the column of labels (auto: 'label', else the first ClassLabel column)")
    client: str | None = P.param(None, None, "a column of client ids: one client per id, in sorted order (partition=natural)")
    train_split: str = P.param("train", None, "the split of training samples")
    test_split: str | None = P.param(None, None, "the split of test samples (auto: 'test' if present, else test_fraction of the training split)")
    test_fraction: float = P.param(
        0.2, P.Interval(0, 1, "left"), "without a test split: the share of each client's (or the dataset's) training rows held out as test rows (fixed draw)"
    )
    size: int | list[int] | None = P.param(
        None, pictures.Size(), "resize every image to N x N or [H,W] pixels, bilinear (auto: keep the size, which must then be the same for all)"
    )
    color: str = P.param(
        "auto", P.OneOf(("auto", "rgb", "grayscale")), "channels of the images: rgb (3), grayscale (1), or auto: grayscale if every image is, else rgb"
    )


# --------------------------------------------------------------------------------------------
# Opening the dataset


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"dataset=huggingface needs the datasets package; {EXTRA}") from None
    return datasets


class _QuietProgress:
    """Hugging Face's progress bars off (for local files, read in a moment), restored after."""

    def __init__(self, datasets: Any) -> None:
        self.datasets = datasets

    def __enter__(self) -> None:
        self.was = not self.datasets.utils.are_progress_bars_disabled()
        self.datasets.utils.disable_progress_bars()

    def __exit__(self, *exc: Any) -> None:
        if self.was:
            self.datasets.utils.enable_progress_bars()


def _as_splits(loaded: Any, datasets: Any) -> dict[str, Any]:
    if isinstance(loaded, datasets.DatasetDict):
        return {str(name): ds for name, ds in loaded.items()}
    return {"": loaded}  # one Dataset: the training split, whatever its name


def _from_hub(req: LoadRequest, o: HuggingFaceOptions, datasets: Any) -> dict[str, Any]:
    from datasets.exceptions import DatasetNotFoundError

    try:
        loaded = datasets.load_dataset(o.hub, o.subset, cache_dir=None if req.data_dir is None else str(req.data_dir))
    except DatasetNotFoundError:
        raise ConfigError(
            f"dataset.hub={o.hub} is not a dataset of the Hugging Face Hub (or it is gated: log in with `hf auth login`); check the id"
        ) from None
    except ConnectionError as exc:
        raise ConfigError(
            f"dataset.hub={o.hub} cannot be fetched: this machine is offline or cannot reach the Hugging Face Hub ({_first_line(exc)}); "
            f"load it once where online (it is then cached), or save it there with datasets.load_dataset('{o.hub}').save_to_disk(DIR) and give data_dir=DIR"
        ) from None
    except OSError as exc:
        raise ConfigError(f"dataset.hub={o.hub} cannot be loaded ({_first_line(exc)}); check the id") from None
    except ValueError as exc:  # e.g. "Config name is missing"
        raise ConfigError(f"dataset.hub={o.hub}: {_first_line(exc)} (dataset.subset=NAME names a configuration)") from None
    return _as_splits(loaded, datasets)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _data_files(path: Path, datasets: Any) -> tuple[str, dict[str, list[str]]]:
    """The builder and the files of each split of a data file or a folder of them."""
    if path.is_file():
        fmt = FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise DataError(f"{path} is not a parquet, arrow, csv or json file; give one, a folder of them, or a save_to_disk folder")
        return fmt, {"train": [str(path)]}
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        found = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except FileNotFoundError:
        found = {}
    files = {str(split): [f for f in names if Path(f).suffix.lower() in FORMATS] for split, names in found.items()}
    files = {split: names for split, names in files.items() if names}
    formats = sorted({FORMATS[Path(f).suffix.lower()] for names in files.values() for f in names})
    if not formats:
        raise DataError(
            f"{path} holds no dataset: neither a save_to_disk folder (dataset_info.json, state.json or dataset_dict.json) "
            "nor parquet, arrow, csv or json files"
        )
    if len(formats) > 1:
        raise DataError(f"{path} holds data files of several formats ({', '.join(formats)}); keep the files of one format there")
    return formats[0], files


def _from_files(path: Path, datasets: Any) -> dict[str, Any]:
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        try:
            with _QuietProgress(datasets):
                return _as_splits(datasets.load_from_disk(str(path)), datasets)
        except Exception as exc:  # noqa: BLE001  (OSError, ValueError; IndexError for an empty dataset)
            raise DataError(f"{path} cannot be read as a save_to_disk folder ({type(exc).__name__}: {_first_line(exc)}); save it again") from None
    fmt, files = _data_files(path, datasets)
    try:
        with _QuietProgress(datasets), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _as_splits(datasets.load_dataset(fmt, data_files=files), datasets)
    except Exception as exc:  # the builders raise many kinds (DatasetGenerationError, ArrowInvalid, ...)
        cause = exc.__cause__ or exc
        raise DataError(f"{path}: the {fmt} files cannot be read ({_first_line(cause)}); check them") from None


def _open(req: LoadRequest, o: HuggingFaceOptions, datasets: Any) -> tuple[dict[str, Any], str]:
    """The splits of the dataset and the words naming it in messages."""
    if o.hub is not None:
        return _from_hub(req, o, datasets), f"dataset.hub={o.hub}"
    if req.data_dir is None:
        raise ConfigError(
            "dataset huggingface needs data_dir=PATH (a save_to_disk folder, or parquet/arrow/csv/json files) or dataset.hub=ID"
        )
    path = Path(req.data_dir)
    if not path.exists():
        raise ConfigError(f"data_dir={req.data_dir} does not exist; point it to a save_to_disk folder or to parquet/arrow/csv/json files")
    return _from_files(path, datasets), str(path)


def _pick_splits(splits: dict[str, Any], o: HuggingFaceOptions, source: str) -> tuple[tuple[str, Any], tuple[str, Any] | None]:
    """``(name, train split)`` and ``(name, test split)`` (``None``: hold out ``test_fraction``)."""
    names = ", ".join(repr(s) for s in splits if s) or "none"
    if "" in splits:  # one Dataset
        train = ("train", splits[""])
        if o.test_split is not None:
            raise ConfigError(f"dataset.test_split={o.test_split}: {source} is one dataset without splits; leave dataset.test_split out (test_fraction holds test rows out)")
        return train, None
    if o.train_split not in splits:
        raise ConfigError(f"dataset.train_split={o.train_split}: {source} has no such split; its splits are: {names}{P.suggest(o.train_split, list(splits))}")
    test_name = "test" if o.test_split is None else o.test_split
    if test_name not in splits:
        if o.test_split is None:
            return (o.train_split, splits[o.train_split]), None
        raise ConfigError(f"dataset.test_split={o.test_split}: {source} has no such split; its splits are: {names}{P.suggest(o.test_split, list(splits))}")
    if test_name == o.train_split:
        raise ConfigError(f"dataset.test_split={test_name} is also the training split; name another split, or hold test rows out with dataset.test_fraction")
    return (o.train_split, splits[o.train_split]), (test_name, splits[test_name])


# --------------------------------------------------------------------------------------------
# Columns


def _columns(ds: Any) -> str:
    return ", ".join(f"{name} ({_kind(feature)})" for name, feature in ds.features.items())


def _kind(feature: Any) -> str:
    """A column's feature type in a few words (``Image``, ``ClassLabel``, ``int64``, ``list``)."""
    name = type(feature).__name__
    if name == "Value":
        return str(feature.dtype)
    return name


def _column(ds: Any, name: str, option: str, where: str) -> str:
    if name not in ds.column_names:
        raise ConfigError(
            f"dataset.{option}={name}: {where} has no such column{P.suggest(name, ds.column_names)}; its columns are: {_columns(ds)}"
        )
    return name


def _label_column(ds: Any, o: HuggingFaceOptions, where: str, datasets: Any) -> str:
    if o.label is not None:
        return _column(ds, o.label, "label", where)
    if "label" in ds.column_names:
        return "label"
    for name, feature in ds.features.items():
        if isinstance(feature, datasets.ClassLabel):
            return name
    raise ConfigError(
        f"{where} has no column 'label' and no ClassLabel column; name the label column with dataset.label=COLUMN (its columns are: {_columns(ds)})"
    )


def _image_column(ds: Any, o: HuggingFaceOptions, where: str, datasets: Any) -> str | None:
    if o.image is not None:
        if o.features is not None:
            raise ConfigError("dataset.image and dataset.features are both given; the samples are images or feature vectors, give one of them")
        _column(ds, o.image, "image", where)
        if not isinstance(ds.features[o.image], datasets.Image):
            raise ConfigError(
                f"dataset.image={o.image}: column {o.image!r} of {where} holds {_kind(ds.features[o.image])}, not images; "
                "name an Image column, or give numeric columns with dataset.features"
            )
        return o.image
    if o.features is not None:
        return None
    return next((name for name, feature in ds.features.items() if isinstance(feature, datasets.Image)), None)


def _numeric(feature: Any, datasets: Any) -> bool:
    """Whether a column holds numbers, or (nested) lists of numbers."""
    if isinstance(feature, datasets.Value):
        return feature.dtype == "bool" or feature.dtype.startswith(("int", "uint", "float"))
    if isinstance(feature, datasets.ClassLabel):
        return False
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    if inner is not None:
        return _numeric(inner, datasets)
    if type(feature).__name__.startswith("Array"):
        return feature.dtype == "bool" or feature.dtype.startswith(("int", "uint", "float"))
    return False


def _feature_columns(ds: Any, o: HuggingFaceOptions, skip: Sequence[str], where: str, datasets: Any) -> list[str]:
    if o.features == ["*"]:
        names = [n for n, f in ds.features.items() if n not in skip and _numeric(f, datasets)]
        if not names:
            raise ConfigError(f"dataset.features=*: {where} has no numeric column besides the label and client columns; its columns are: {_columns(ds)}")
        return names
    assert o.features is not None
    if not o.features:
        raise ConfigError("dataset.features is empty; name the numeric columns of the feature vectors (or * for all)")
    for name in o.features:
        _column(ds, name, "features", where)
        if name in skip:
            raise ConfigError(f"dataset.features lists {name!r}, which is the label or client column; leave it out")
        if not _numeric(ds.features[name], datasets):
            raise ConfigError(
                f"dataset.features lists {name!r}, a column of {_kind(ds.features[name])} in {where}, not of numbers; list numeric columns only"
            )
    return list(o.features)


# --------------------------------------------------------------------------------------------
# Labels and clients


def _values(ds: Any, column: str) -> list[Any]:
    return list(ds.with_format(None)[column])


def _sort(values: set[Any]) -> list[Any]:
    """Label values or client ids in order: numbers as numbers, text naturally (``c2 < c10``)."""
    if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values):
        return sorted(values)
    try:
        return sorted(values, key=lambda v: natural_key(str(v)))
    except TypeError:
        return sorted(values, key=str)


def _check_missing(values: list[Any], column: str, where: str) -> None:
    for row, value in enumerate(values):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise DataError(f"{where}: column {column!r} has no value in row {row}; fill it in or drop the row")
        if isinstance(value, (list, dict)):
            raise DataError(f"{where}: column {column!r} holds {type(value).__name__}s (row {row}), not single values; name a column of single values")


def _labels(
    splits: list[tuple[str, Any]], column: str, datasets: Any, source: str
) -> tuple[list[str], list[np.ndarray]]:
    """The class names (the ClassLabel's, else the sorted values) and each split's labels as
    indices into them."""
    first = splits[0][1].features[column]
    if isinstance(first, datasets.ClassLabel):
        names = [str(n) for n in first.names]
        ys = []
        for split, ds in splits:
            feature = ds.features.get(column)
            where = f"{source} split {split!r}"
            if isinstance(feature, datasets.ClassLabel) and list(feature.names) != list(first.names):
                raise DataError(f"{where}: the ClassLabel of column {column!r} names other classes than the training split's; give the splits one ClassLabel")
            values = _values(ds, column)
            _check_missing(values, column, where)
            y = np.asarray(values, dtype=np.int64)
            outside = np.flatnonzero((y < 0) | (y >= len(names)))
            if len(outside):
                row = int(outside[0])
                raise DataError(
                    f"{where}: column {column!r} holds {int(y[row])} in row {row} ({len(outside)} rows in all), outside its ClassLabel's "
                    f"classes 0..{len(names) - 1}; drop those rows (e.g. unlabelled ones) first"
                )
            ys.append(y)
        return names, ys
    raw = []
    for split, ds in splits:
        values = _values(ds, column)
        _check_missing(values, column, f"{source} split {split!r}")
        raw.append(values)
    order = _sort({v for values in raw for v in values})
    index = {v: i for i, v in enumerate(order)}
    return [str(v) for v in order], [np.asarray([index[v] for v in values], dtype=np.int64) for values in raw]


# --------------------------------------------------------------------------------------------
# Samples


def _open_image(value: Any, row: int, where: str) -> Any:
    from PIL import Image

    if value is None or (value.get("bytes") is None and value.get("path") is None):
        raise DataError(f"{where}: row {row} has no image; fill it in or drop the row")
    try:
        return Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") is not None else value["path"])
    except pictures.PIL_ERRORS as exc:
        raise DataError(f"{where}: the image of row {row} cannot be decoded ({_first_line(exc)}); replace or drop it") from None


def _image_rows(ds: Any, column: str, datasets: Any):
    """Each row's undecoded image (``{"bytes", "path"}``), in batches."""
    raw = ds.select_columns([column]).cast_column(column, datasets.Image(decode=False))
    for batch in raw.iter(batch_size=1000):
        yield from batch[column]


def _images(
    splits: list[tuple[str, Any, str]], column: str, o: HuggingFaceOptions, datasets: Any, source: str
) -> list[np.ndarray]:
    """The images of each ``(split, dataset, where)`` decoded into ``uint8 [N, C, H, W]``: the
    headers are read first (sizes and modes), the memory checked, then the pixels decoded."""
    sizes: dict[tuple[int, int], tuple[str, int]] = {}
    grey = True
    for split, ds, where in splits:
        for row, value in enumerate(_image_rows(ds, column, datasets)):
            with _open_image(value, row, where) as img:
                sizes.setdefault(img.size, (where, row))
                grey = grey and img.mode in GREY_MODES
    total = sum(len(ds) for _, ds, _ in splits)
    if o.size is not None:
        height, width = pictures.sides(o.size)
    elif len(sizes) > 1:
        (a, (wa, ra)), (b, (wb, rb)) = list(sizes.items())[:2]
        raise DataError(
            f"{source}: the images have {len(sizes)} sizes, e.g. {a[0]}x{a[1]} ({wa}, row {ra}) and {b[0]}x{b[1]} ({wb}, row {rb}); "
            "set dataset.size=N (or H,W) to resize them all"
        )
    else:
        (width, height), = sizes
    mode = {"auto": "L" if grey else "RGB", "rgb": "RGB", "grayscale": "L"}[o.color]
    channels = 1 if mode == "L" else 3
    check_memory(total * channels * height * width, o, f"the {total} images of {source} at {channels}x{height}x{width}")
    if total >= PROGRESS_IMAGES:
        print(f"contrafl: decoding {total:,} images of {source} ({channels}x{height}x{width}) ...", file=sys.stderr, flush=True)
    out = []
    for split, ds, where in splits:
        x = np.empty((len(ds), channels, height, width), dtype=np.uint8)
        for row, value in enumerate(_image_rows(ds, column, datasets)):
            with _open_image(value, row, where) as img, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # palette transparency notes
                try:
                    x[row] = pictures.pixels(img, height, width, mode)
                except pictures.PIL_ERRORS as exc:
                    raise DataError(f"{where}: the image of row {row} cannot be decoded ({_first_line(exc)}); replace or drop it") from None
        out.append(x)
    return out


def _vectors(splits: list[tuple[str, Any, str]], columns: list[str], o: HuggingFaceOptions, source: str) -> list[np.ndarray]:
    """The feature vectors of each split: the columns' values (lists flattened) side by side."""
    first = splits[0][1]
    width = 0
    for name in columns:
        sample = np.asarray(first.with_format("numpy")[:1][name])
        width += int(np.prod(sample.shape[1:], dtype=np.int64)) if sample.ndim > 1 else 1
    total = sum(len(ds) for _, ds, _ in splits)
    check_memory(total * width * 4, o, f"the {total} feature vectors of {source} ({width} values each)")
    out = []
    for _, ds, where in splits:
        blocks = []
        for name in columns:
            try:
                values = np.asarray(ds.with_format("numpy")[name])
                block = values.astype(np.float32).reshape(len(ds), -1)
            except (ValueError, TypeError):
                raise DataError(
                    f"{where}: column {name!r} has missing values or lists of different lengths; fill them in, or leave the column out of dataset.features"
                ) from None
            bad = np.flatnonzero(~np.isfinite(block).all(axis=1))
            if len(bad):
                raise DataError(f"{where}: column {name!r} has a missing or infinite value in row {int(bad[0])}; fill it in or drop the row")
            blocks.append(block)
        x = np.concatenate(blocks, axis=1) if blocks else np.zeros((len(ds), 0), np.float32)
        if x.shape[1] != width:
            raise DataError(f"{where}: the feature vectors have {x.shape[1]} values, the training split's {width}; give the splits the same columns")
        out.append(x)
    return out


def huggingface_clients(req: LoadRequest) -> list[str] | None:
    """The clients of the ``dataset.client`` column (``None`` without it), one per id of
    the training and test splits, named ``str(id)`` in the loader's order, read from the
    column alone."""
    o: HuggingFaceOptions = req.options
    if o.client is None:
        return None
    splits, source = _open(req, o, _import_datasets())
    train, test = _pick_splits(splits, o, source)
    ids: set[Any] = set()
    for split, ds in [train] + ([test] if test is not None else []):
        where = source if "" in splits else f"{source} split {split!r}"
        values = _values(ds.select_columns([_column(ds, o.client, "client", where)]), o.client)
        _check_missing(values, o.client, where)
        ids.update(values)
    return [str(cid) for cid in _sort(ids)]


# --------------------------------------------------------------------------------------------
# The loader


def load_huggingface(req: LoadRequest) -> FederatedDataset:
    """The dataset of ``req.data_dir`` or ``dataset.hub`` (see the module's docstring)."""
    o: HuggingFaceOptions = req.options
    datasets = _import_datasets()
    splits, source = _open(req, o, datasets)
    (train_name, train), test = _pick_splits(splits, o, source)
    where = source if "" in splits else f"{source} split {train_name!r}"
    if len(train) == 0:
        raise DataError(f"{where}: the training split has no rows; give a dataset with samples")
    label = _label_column(train, o, where, datasets)
    client = None if o.client is None else _column(train, o.client, "client", where)
    image = _image_column(train, o, where, datasets)
    if image is None and o.features is None:
        raise ConfigError(
            f"{where} has no Image column; name the image column with dataset.image=COLUMN, or numeric columns with dataset.features=A,B "
            f"(dataset.features=* for all); its columns are: {_columns(train)}"
        )
    if image is not None and image in (label, client):
        raise ConfigError(f"dataset.image={image} is also the label or client column; name different columns")
    columns = None if image is not None else _feature_columns(train, o, [label] + ([client] if client else []), where, datasets)
    parts_of = [(train_name, train, where)]
    if test is not None:
        test_where = f"{source} split {test[0]!r}"
        for name in [label, client, image, *(columns or [])]:
            if name is not None and name not in test[1].column_names:
                raise ConfigError(f"{test_where} has no column {name!r}, which the training split has; its columns are: {_columns(test[1])}")
        parts_of.append((test[0], test[1], test_where))

    names, ys = _labels([(s, ds) for s, ds, _ in parts_of], label, datasets, source)
    ids = None  # each split's rows of each client id
    if client is not None:
        ids = []
        for split, ds, w in parts_of:
            values = _values(ds, client)
            _check_missing(values, client, w)
            rows: dict[Any, list[int]] = {}
            for row, value in enumerate(values):
                rows.setdefault(value, []).append(row)
            ids.append(rows)
        if test is None:
            ids.append({})
    if image is not None:
        xs = _images(parts_of, image, o, datasets, source)
    else:
        xs = _vectors(parts_of, columns, o, source)
    if test is None:  # an empty test split, for the hold-out below
        xs.append(xs[0][:0])
        ys.append(ys[0][:0])

    def holdout(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keep, held = split_test(ys[0][rows], names, o.test_fraction)
        return rows[keep], rows[held]

    groups: list[tuple[str, np.ndarray, np.ndarray, str]] = []  # (client, train rows, test rows, where)
    if ids is None:
        rows = np.arange(len(ys[0]))
        train_rows, test_rows = (rows, np.arange(len(ys[1]))) if test is not None else holdout(rows)
        groups.append(("", train_rows, test_rows, where))
    else:
        for cid in _sort(set(ids[0]) | set(ids[1])):
            mine, theirs = (np.asarray(split.get(cid, []), dtype=np.int64) for split in ids)
            if test is None:
                mine, theirs = holdout(mine)
            groups.append((str(cid), mine, theirs, f"{where}, client {str(cid)!r}"))
    held_out = test is None
    parts = []
    for cid, train_rows, test_rows, w in groups:
        x_test, y_test = (xs[0], ys[0]) if held_out else (xs[1], ys[1])
        parts.append(Part(cid, xs[0][train_rows], ys[0][train_rows], x_test[test_rows], y_test[test_rows], names, w))
    options = o if o.classes is not None else dataclasses.replace(o, classes=names)
    info = {
        "source": source,
        "train_split": train_name,
        "test_split": test[0] if test is not None else f"{o.test_fraction:g} of {train_name} held out",
        "samples": "images" if image is not None else "features",
    }
    return assemble("huggingface", parts, options, natural=client is not None, info=info)


DATASETS.add(
    "huggingface",
    DatasetSpec(
        name="huggingface",
        summary="a Hugging Face datasets dataset: a save_to_disk folder, parquet/arrow/csv/json files, or dataset.hub=ID",
        load=load_huggingface,
        clients=huggingface_clients,
        default_model="mlp",
        augment="none",
        recommended={"batch_size": 32, "rounds": 20, "local_epochs": 5},
        options=HuggingFaceOptions,
        needs_data_dir=False,
    ),
)
