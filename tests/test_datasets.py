"""Tests of contrafl.data.datasets and contrafl.data.formats on small files written here in the
official formats (CIFAR python pickles, IDX, EMNIST's gzip.zip, the Tiny-ImageNet tree)."""

from __future__ import annotations

import dataclasses
import gzip
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from contrafl import params as P
from contrafl.data import datasets
from contrafl.data.download import SOURCES, ImageTree, file_md5
from contrafl.data.registry import DATASETS, LoadRequest
from contrafl.errors import ConfigError, DataError

SHARED_CIFAR10 = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar-10-batches-py"
CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def load(name: str, data_dir: Path | None = None, **kwargs) -> datasets.FederatedDataset:
    return DATASETS.get(name).load(LoadRequest(data_dir=data_dir, **kwargs))


def officialise(monkeypatch: pytest.MonkeyPatch, name: str, folder: Path) -> None:
    """Make the files now in ``folder`` the 'official' ones: patch their md5 and size into SOURCES."""

    def patched(official):
        if official is None:
            return None
        path = folder / official.path
        if not path.is_file():
            return dataclasses.replace(official, uncompressed=patched(official.uncompressed))
        return dataclasses.replace(
            official,
            md5=file_md5(path),
            size=path.stat().st_size,
            uncompressed=patched(official.uncompressed),
        )

    src = SOURCES[name]
    monkeypatch.setitem(SOURCES, name, dataclasses.replace(src, files=tuple(patched(f) for f in src.files)))


# ---------------------------------------------------------------------------------------------
# writers of the official formats


def write_cifar10(folder: Path, rows: int = 4, test_rows: int = 3, seed: int = 0) -> dict[str, dict]:
    """CIFAR-10 python batches with random pixels; returns the pickled dicts by file name."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    batches = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        n = test_rows if name == "test_batch" else rows
        batches[name] = {
            "batch_label": f"batch {i}",
            "labels": rng.integers(0, 10, n).tolist(),
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "filenames": [f"img_{i}_{j}.png" for j in range(n)],
        }
        (folder / name).write_bytes(pickle.dumps(batches[name], protocol=2))
    meta = {"num_cases_per_batch": 10000, "label_names": CIFAR10_NAMES, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=4))  # 152 bytes, official 158
    return batches


def write_cifar100(folder: Path, seed: int = 0) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, n in (("train", 5), ("test", 2)):
        files[name] = {
            "filenames": [f"{name}_{j}.png" for j in range(n)],
            "batch_label": f"{name}ing batch 1 of 1",
            "fine_labels": rng.integers(0, 100, n).tolist(),
            "coarse_labels": rng.integers(0, 20, n).tolist(),
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        }
        (folder / name).write_bytes(pickle.dumps(files[name], protocol=2))
    meta = {
        "fine_label_names": [f"fine{c}" for c in range(100)],
        "coarse_label_names": [f"c{c}" for c in range(20)],
    }
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
    return files


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX encoding: 0, 0, type 0x08, ndim, big-endian uint32 sizes, row-major data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def mnist_arrays(
    seed: int = 0, n_train: int = 5, n_test: int = 3, classes: int = 10
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, classes, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, classes, n_test, dtype=np.uint8),
    }


def write_idx_files(folder: Path, arrays: dict[str, np.ndarray], compressed: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        data = idx_bytes(array)
        if compressed:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)


def write_emnist_zip(path: Path, arrays: dict[str, np.ndarray], mapping: str | None) -> None:
    """EMNIST's gzip.zip: members gzip/emnist-balanced-{train,test}-*.gz (+ the mapping)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, array in arrays.items():
            split = "train" if name.startswith("train") else "test"
            zf.writestr(
                f"gzip/emnist-balanced-{split}-{name.split('-', 1)[1]}.gz", gzip.compress(idx_bytes(array))
            )
        if mapping is not None:
            zf.writestr("gzip/emnist-balanced-mapping.txt", mapping)


# ---------------------------------------------------------------------------------------------
# registry and digits


def test_every_dataset_is_registered_with_its_settings():
    expected = {
        "digits": ("mlp", "none", (16, 20, 5), False, False),
        "cifar10": ("moon_cnn", "cifar10", (64, 100, 10), True, True),
        "cifar100": ("resnet50", "cifar100", (64, 100, 10), True, True),
        "mnist": ("moon_cnn", "none", (64, 50, 5), True, True),
        "fmnist": ("moon_cnn", "none", (64, 50, 5), True, True),
        "emnist": ("fedavg_cnn", "none", (64, 50, 5), True, True),
        "tinyimagenet": ("resnet50", "none", (64, 20, 10), True, True),
        "synthetic": ("mlp", "none", (10, 200, 20), False, False),
    }
    for name, (model, augment, (batch, rounds, epochs), needs_dir, downloadable) in expected.items():
        spec = DATASETS.get(name)
        assert (spec.default_model, spec.augment, spec.needs_data_dir) == (model, augment, needs_dir), name
        assert dict(spec.recommended) == {"batch_size": batch, "rounds": rounds, "local_epochs": epochs}, name
        assert (spec.download is not None) == downloadable, name
    assert DATASETS.get("synthetic").options is datasets.SyntheticOptions


def test_digits_fixed_stratified_split_scaled_to_unit_interval():
    data = load("digits", seed=3)
    bunch = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        bunch.data, bunch.target, test_size=0.25, random_state=0, stratify=bunch.target
    )
    assert str(data.train.x.dtype) == "torch.float32"
    assert tuple(data.train.x.shape) == (1347, 64) and tuple(data.test.x.shape) == (450, 64)
    np.testing.assert_array_equal(data.train.x.numpy() * 16, x_train)
    np.testing.assert_array_equal(data.test.x.numpy() * 16, x_test)
    np.testing.assert_array_equal(data.train.y.numpy(), y_train)
    np.testing.assert_array_equal(data.test.y.numpy(), y_test)
    assert data.classes == [str(c) for c in range(10)] and data.mean is None and data.std is None
    assert np.array_equal(load("digits", seed=0).train.x.numpy(), data.train.x.numpy())  # seed-independent
    per_class = np.bincount(bunch.target)  # stratified: a quarter of each class in test
    assert np.abs(np.bincount(data.test.y.numpy()) - per_class / 4).max() <= 1


# ---------------------------------------------------------------------------------------------
# CIFAR


def test_cifar10_reads_the_official_layout_back_exactly(tmp_path, monkeypatch):
    folder = tmp_path / "cifar-10-batches-py"
    batches = write_cifar10(folder)
    officialise(monkeypatch, "cifar10", folder)
    for data_dir in (tmp_path, folder):  # the parent of the folder or the folder itself
        data = load("cifar10", data_dir)
        assert tuple(data.train.x.shape) == (20, 3, 32, 32) and str(data.train.x.dtype) == "torch.uint8"
        assert tuple(data.test.x.shape) == (3, 3, 32, 32) and str(data.train.y.dtype) == "torch.int64"
        train_rows = np.concatenate([batches[f"data_batch_{k}"]["data"] for k in range(1, 6)])
        # row r of data_batch_2 is training sample 4 + r; pixel (c, i, j) is byte c*1024 + i*32 + j
        assert data.train.x[4 + 1, 2, 5, 7] == batches["data_batch_2"]["data"][1, 2 * 1024 + 5 * 32 + 7]
        np.testing.assert_array_equal(data.train.x.numpy().reshape(20, -1), train_rows)
        train_labels = np.concatenate([batches[f"data_batch_{k}"]["labels"] for k in range(1, 6)])
        np.testing.assert_array_equal(data.train.y.numpy(), train_labels)
        np.testing.assert_array_equal(data.test.x.numpy().reshape(3, -1), batches["test_batch"]["data"])
        np.testing.assert_array_equal(data.test.y.numpy(), batches["test_batch"]["labels"])
        assert data.classes == CIFAR10_NAMES
        assert data.info["subset"] is False and data.info["folder"] == str(folder)
        np.testing.assert_allclose(data.mean, (125.3 / 255, 123.0 / 255, 113.9 / 255))
        np.testing.assert_allclose(data.std, (63.0 / 255, 62.1 / 255, 66.7 / 255))


def test_cifar10_checksum_mismatch_needs_allow_subset(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    with pytest.raises(DataError) as err:
        load("cifar10", tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(folder) in message
    assert "official: 31035704 bytes" in message or "official: 158 bytes" in message
    assert (
        f"`contrafl data download cifar10 --data-dir {tmp_path}`" in message
        and "allow_subset=true" in message
    )

    data = load("cifar10", tmp_path, allow_subset=True)
    assert data.info == {"folder": str(folder), "subset": True, "train_rows": 20, "test_rows": 3}


def test_cifar10_missing_file_names_the_path_and_the_download_command(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    (folder / "data_batch_3").unlink()
    with pytest.raises(DataError, match="missing file") as err:
        load("cifar10", tmp_path, allow_subset=True)
    assert str(folder / "data_batch_3") in str(err.value)
    assert f"`contrafl data download cifar10 --data-dir {tmp_path}`" in str(err.value)


def test_cifar10_without_data_dir_is_a_config_error():
    with pytest.raises(ConfigError, match="data_dir"):
        load("cifar10", None)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _rewrite(path: Path, change) -> None:
    batch = pickle.loads(path.read_bytes(), encoding="latin1")
    change(batch)
    path.write_bytes(pickle.dumps(batch, protocol=2))


@pytest.mark.parametrize(
    "damage, why",
    [
        (_truncate, "cannot unpickle"),
        (lambda p: p.write_bytes(p.read_bytes() + b"junk"), "unexpected bytes"),
        (lambda p: _rewrite(p, lambda b: b.pop("filenames")), "official keys"),
        (lambda p: _rewrite(p, lambda b: b.update(labels=b["labels"][:-1])), "'labels' has 3 entries for 4"),
        (
            lambda p: _rewrite(p, lambda b: b.update(filenames=b["filenames"] + ["x"])),
            "'filenames' has 5 entries",
        ),
        (lambda p: _rewrite(p, lambda b: b.update(labels=[10] * 4)), "outside 0..9"),
        (lambda p: _rewrite(p, lambda b: b.update(data=b["data"].astype(np.int16))), "expected uint8"),
        (lambda p: _rewrite(p, lambda b: b.update(data=b["data"][:, :3000])), "expected uint8 [N, 3072]"),
    ],
)
def test_cifar10_subset_must_be_well_formed(tmp_path, damage, why):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    damage(folder / "data_batch_2")
    with pytest.raises(DataError) as err:
        load("cifar10", tmp_path, allow_subset=True)
    assert f"{folder / 'data_batch_2'} is truncated or corrupted:" in str(err.value)
    assert why in str(err.value)


def test_cifar10_subset_cannot_exceed_the_official_file(tmp_path, monkeypatch):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    src = SOURCES["cifar10"]
    smaller = [dataclasses.replace(f, rows=3) if f.path == "data_batch_1" else f for f in src.files]
    monkeypatch.setitem(SOURCES, "cifar10", dataclasses.replace(src, files=tuple(smaller)))
    with pytest.raises(DataError, match="has 4 samples, more than the 3 of the official file"):
        load("cifar10", tmp_path, allow_subset=True)
    tiny = [dataclasses.replace(f, size=100) if f.path == "data_batch_1" else f for f in src.files]
    monkeypatch.setitem(SOURCES, "cifar10", dataclasses.replace(src, files=tuple(tiny)))
    with pytest.raises(DataError, match=r"is larger than the official file \(\d+ > 100 bytes\)"):
        load("cifar10", tmp_path, allow_subset=True)


class _Exploit:
    """Pickles as a call of ``open(path, "w")``: loading it would create ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_cifar_pickles_cannot_run_code(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    _rewrite(folder / "data_batch_1", lambda b: b.update(batch_label=_Exploit(tmp_path / "exploited")))
    with pytest.raises(
        DataError, match=r"is truncated or corrupted: cannot unpickle it \(UnpicklingError: it names .*, which is not read \(a pickle can run code\)"
    ):
        load("cifar10", tmp_path, allow_subset=True)
    assert not (tmp_path / "exploited").exists()


def test_cifar10_accepts_batches_repickled_with_bytes_keys(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    batches = write_cifar10(folder)
    raw = {k.encode(): v for k, v in batches["data_batch_1"].items()}
    (folder / "data_batch_1").write_bytes(pickle.dumps(raw))
    data = load("cifar10", tmp_path, allow_subset=True)
    np.testing.assert_array_equal(data.train.y.numpy()[:4], batches["data_batch_1"]["labels"])


@pytest.mark.skipif(not SHARED_CIFAR10.is_dir(), reason="the shared CIFAR-10 subset is not available")
def test_the_shared_cifar10_subset_loads_only_as_a_subset():
    with pytest.raises(DataError, match="allow_subset=true"):
        load("cifar10", SHARED_CIFAR10.parent)
    data = load("cifar10", SHARED_CIFAR10.parent, allow_subset=True)
    assert data.info["subset"] is True
    assert (data.info["train_rows"], data.info["test_rows"]) == (5085, 1017)
    assert tuple(data.train.x.shape) == (5085, 3, 32, 32) and data.classes == CIFAR10_NAMES
    # the subset keeps the first rows of each official batch: data_batch_1 starts with labels 6, 9, 9, 4, 1
    assert data.train.y[:5].tolist() == [6, 9, 9, 4, 1]
    counts = np.bincount(data.train.y.numpy(), minlength=10)
    assert counts.min() >= 475 and counts.max() <= 537  # per-class counts of the README


def test_cifar100_fine_labels_and_names(tmp_path, monkeypatch):
    folder = tmp_path / "cifar-100-python"
    files = write_cifar100(folder)
    officialise(monkeypatch, "cifar100", folder)
    data = load("cifar100", tmp_path)
    np.testing.assert_array_equal(data.train.x.numpy().reshape(5, -1), files["train"]["data"])
    np.testing.assert_array_equal(data.train.y.numpy(), files["train"]["fine_labels"])
    np.testing.assert_array_equal(data.test.y.numpy(), files["test"]["fine_labels"])
    assert data.classes == [f"fine{c}" for c in range(100)] and data.info["subset"] is False
    assert data.mean == (0.5071, 0.4865, 0.4409) and data.std == (0.2673, 0.2564, 0.2762)


# ---------------------------------------------------------------------------------------------
# MNIST family


@pytest.mark.parametrize("compressed", [True, False])
def test_mnist_reads_gzipped_and_raw_idx_files(tmp_path, monkeypatch, compressed):
    arrays = mnist_arrays()
    folder = tmp_path / "mnist"
    write_idx_files(folder, arrays, compressed)
    officialise(monkeypatch, "mnist", folder)
    data = load("mnist", tmp_path)
    assert tuple(data.train.x.shape) == (5, 1, 28, 28) and str(data.train.x.dtype) == "torch.uint8"
    np.testing.assert_array_equal(data.train.x.numpy()[:, 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(data.train.y.numpy(), arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(data.test.x.numpy()[:, 0], arrays["t10k-images-idx3-ubyte"])
    np.testing.assert_array_equal(data.test.y.numpy(), arrays["t10k-labels-idx1-ubyte"])
    assert data.classes == [str(c) for c in range(10)] and data.info["subset"] is False
    assert (data.mean, data.std) == ((0.1307,), (0.3081,))


def test_mnist_in_torchvision_layout_and_as_subset(tmp_path):
    arrays = mnist_arrays()
    write_idx_files(tmp_path / "MNIST" / "raw", arrays, compressed=True)
    with pytest.raises(
        DataError, match=r"train-images-idx3-ubyte.gz is not the official mnist file .*9912422 bytes"
    ):
        load("mnist", tmp_path)
    data = load("mnist", tmp_path, allow_subset=True)
    assert data.info["subset"] is True and (data.info["train_rows"], data.info["test_rows"]) == (5, 3)


def test_fmnist_class_names_and_normalisation(tmp_path):
    write_idx_files(tmp_path / "fashion-mnist", mnist_arrays(seed=1), compressed=False)
    data = load("fmnist", tmp_path, allow_subset=True)
    assert data.classes[0] == "T-shirt/top" and data.classes[9] == "Ankle boot" and len(data.classes) == 10
    assert (data.mean, data.std) == ((0.2860,), (0.3530,))


@pytest.mark.parametrize("compressed", [True, False])
@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda b: b[:-100], "but its header announces"),
        (lambda b: b + b"\0", "but its header announces"),
        (lambda b: b"\0\0\x08\x02" + b[4:], "magic number 0x00000802, expected 0x00000803"),
        (lambda b: b[:10], "shorter than its 16-byte header"),
    ],
)
def test_idx_truncated_or_corrupted(tmp_path, compressed, damage, why):
    arrays = mnist_arrays()
    folder = tmp_path / "mnist"
    write_idx_files(folder, arrays, compressed=False)
    name = "train-images-idx3-ubyte"
    data = damage((folder / name).read_bytes())
    if compressed:
        write_idx_files(folder, arrays, compressed=True)
        (folder / name).unlink()
        name += ".gz"
        data = gzip.compress(data)
    (folder / name).write_bytes(data)
    with pytest.raises(DataError, match=why) as err:
        load("mnist", tmp_path, allow_subset=True)
    assert f"{folder / name} is truncated or corrupted:" in str(err.value)


def test_truncated_gzip_is_reported(tmp_path):
    folder = tmp_path / "mnist"
    write_idx_files(folder, mnist_arrays(), compressed=True)
    _truncate(folder / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(
        DataError, match=re.escape("t10k-labels-idx1-ubyte.gz is truncated or corrupted: invalid gzip data")
    ):
        load("mnist", tmp_path, allow_subset=True)


def test_idx_labels_out_of_range_and_count_mismatch(tmp_path):
    arrays = mnist_arrays()
    arrays["train-labels-idx1-ubyte"][2] = 10
    write_idx_files(tmp_path / "mnist", arrays, compressed=True)
    with pytest.raises(DataError, match=r"train-\* is truncated or corrupted: labels outside 0..9"):
        load("mnist", tmp_path, allow_subset=True)
    arrays = mnist_arrays()
    arrays["t10k-labels-idx1-ubyte"] = arrays["t10k-labels-idx1-ubyte"][:2]
    write_idx_files(tmp_path / "mnist", arrays, compressed=True)
    with pytest.raises(DataError, match="3 images but 2 labels"):
        load("mnist", tmp_path, allow_subset=True)


def test_emnist_is_read_from_gzip_zip_and_transposed_upright(tmp_path, monkeypatch):
    arrays = mnist_arrays(seed=2, classes=47)
    arrays["train-images-idx3-ubyte"][0] = 0
    arrays["train-images-idx3-ubyte"][0, 3, 20] = 255  # stored row 3, column 20
    mapping = "".join(f"{i} {ord(c)}\n" for i, c in enumerate(datasets.EMNIST_BALANCED_CLASSES[::-1]))
    write_emnist_zip(tmp_path / "emnist" / "gzip.zip", arrays, mapping)
    officialise(monkeypatch, "emnist", tmp_path / "emnist")
    data = load("emnist", tmp_path)
    assert tuple(data.train.x.shape) == (5, 1, 28, 28) and data.info["subset"] is False
    assert data.train.x[0, 0, 20, 3] == 255 and int(data.train.x[0].sum()) == 255  # upright: row 20, column 3
    np.testing.assert_array_equal(
        data.test.x.numpy()[:, 0], arrays["t10k-images-idx3-ubyte"].transpose(0, 2, 1)
    )
    np.testing.assert_array_equal(data.train.y.numpy(), arrays["train-labels-idx1-ubyte"])
    assert data.classes == datasets.EMNIST_BALANCED_CLASSES[::-1]  # from the mapping file
    assert (data.mean, data.std) == ((0.1751,), (0.3332,))


def test_emnist_subset_without_mapping_and_damaged_archives(tmp_path):
    arrays = mnist_arrays(seed=3, classes=47)
    archive = tmp_path / "emnist" / "gzip.zip"
    write_emnist_zip(archive, arrays, mapping=None)
    with pytest.raises(DataError, match=r"not the official emnist file .*561753746 bytes"):
        load("emnist", tmp_path)
    data = load("emnist", tmp_path, allow_subset=True)
    assert data.info["subset"] is True and data.classes == list(
        "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabdefghnqrt"
    )

    del arrays["t10k-labels-idx1-ubyte"]
    write_emnist_zip(archive, arrays, mapping=None)
    with pytest.raises(
        DataError,
        match=re.escape(
            "gzip.zip is truncated or corrupted: it has no member gzip/emnist-balanced-test-labels"
        ),
    ):
        load("emnist", tmp_path, allow_subset=True)
    _truncate(archive)
    with pytest.raises(DataError, match=re.escape("gzip.zip is truncated or corrupted: invalid zip archive")):
        load("emnist", tmp_path, allow_subset=True)


# ---------------------------------------------------------------------------------------------
# Tiny-ImageNet

WNIDS = ["n03", "n01", "n02"]  # wnids.txt is not sorted; the class order is
VAL = {
    "val_0.JPEG": "n03",
    "val_1.JPEG": "n01",
    "val_10.JPEG": "n01",
    "val_2.JPEG": "n03",
    "val_3.JPEG": "n02",
}


def write_tiny(root: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    folder = root / "tiny-imagenet-200"
    folder.mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    (folder / "words.txt").write_text(
        "n00\tentity\nn01\tgoldfish, Carassius auratus\nn02\tsalamander\nn03\ttabby\n"
    )

    def image(path: Path, gray: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (64, 64) if gray else (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path, quality=90)

    for w in WNIDS:
        (folder / "train" / w).mkdir(parents=True)
        (folder / "train" / w / f"{w}_boxes.txt").write_text("")
        for j in (0, 2, 10):
            image(folder / "train" / w / "images" / f"{w}_{j}.JPEG", gray=(w, j) == ("n02", 2))
    lines = [f"{name}\t{wnid}\t0\t0\t63\t63" for name, wnid in VAL.items()]
    (folder / "val").mkdir()
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    for name in VAL:
        image(folder / "val" / "images" / name)
    return folder


def pil_rgb(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).transpose(2, 0, 1)


def test_tinyimagenet_order_labels_and_pixels(tmp_path, monkeypatch):
    folder = write_tiny(tmp_path)
    monkeypatch.setitem(
        SOURCES, "tinyimagenet", dataclasses.replace(SOURCES["tinyimagenet"], tree=ImageTree(3, 9, 5))
    )
    data = load("tinyimagenet", tmp_path)
    train_files = [
        folder / "train" / w / "images" / f"{w}_{j}.JPEG" for w in ("n01", "n02", "n03") for j in (0, 10, 2)
    ]
    test_files = [
        folder / "val" / "images" / n
        for n in ("val_1.JPEG", "val_10.JPEG", "val_3.JPEG", "val_0.JPEG", "val_2.JPEG")
    ]
    assert tuple(data.train.x.shape) == (9, 3, 64, 64) and str(data.train.x.dtype) == "torch.uint8"
    np.testing.assert_array_equal(data.train.x.numpy(), np.stack([pil_rgb(p) for p in train_files]))
    np.testing.assert_array_equal(data.test.x.numpy(), np.stack([pil_rgb(p) for p in test_files]))
    assert data.train.y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert data.test.y.tolist() == [0, 0, 1, 2, 2]
    gray = data.train.x[5]  # n02_2.JPEG, a grayscale JPEG converted to RGB
    assert bool((gray[0] == gray[1]).all() and (gray[1] == gray[2]).all())
    assert data.classes == ["goldfish, Carassius auratus", "salamander", "tabby"]
    assert data.info["subset"] is False and data.mean == data.std == (0.5, 0.5, 0.5)


def test_tinyimagenet_differs_from_official_counts_unless_subset(tmp_path):
    write_tiny(tmp_path)
    with pytest.raises(DataError) as err:
        load("tinyimagenet", tmp_path)
    assert (
        "3 classes, 9 train and 5 test images, the official tinyimagenet release has 200, 100000 and 10000"
        in str(err.value)
    )
    assert "allow_subset=true" in str(err.value)
    data = load("tinyimagenet", tmp_path, allow_subset=True)
    assert data.info["subset"] is True and (data.info["train_rows"], data.info["test_rows"]) == (9, 5)


def test_tinyimagenet_cache_is_reused_invalidated_and_optional(tmp_path, monkeypatch):
    folder = write_tiny(tmp_path)
    first = load("tinyimagenet", tmp_path, allow_subset=True)
    assert (folder / datasets.TINY_IMAGENET_CACHE).is_file()

    def no_decoding(path, size):
        raise AssertionError("decoded although the cache is valid")

    monkeypatch.setattr(datasets, "decode_image", no_decoding)
    again = load("tinyimagenet", tmp_path, allow_subset=True)
    np.testing.assert_array_equal(again.train.x.numpy(), first.train.x.numpy())
    monkeypatch.undo()

    changed = folder / "val" / "images" / "val_3.JPEG"
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(changed)
    assert load("tinyimagenet", tmp_path, allow_subset=True).test.x[2].sum() == pil_rgb(changed).sum()

    (folder / datasets.TINY_IMAGENET_CACHE).unlink()

    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(datasets.np, "savez", read_only)
    data = load("tinyimagenet", tmp_path, allow_subset=True)
    np.testing.assert_array_equal(data.train.x.numpy(), first.train.x.numpy())
    assert sorted(p.name for p in folder.iterdir()) == ["train", "val", "wnids.txt", "words.txt"]


def test_tinyimagenet_damaged_files(tmp_path):
    folder = write_tiny(tmp_path)
    (folder / "train" / "n01" / "images" / "n01_2.JPEG").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    with pytest.raises(
        DataError, match=re.escape("n01_2.JPEG is truncated or corrupted: cannot decode the image")
    ):
        load("tinyimagenet", tmp_path, allow_subset=True)
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(folder / "train" / "n01" / "images" / "n01_2.JPEG")
    with pytest.raises(DataError, match="a 32x32 image, expected 64x64"):
        load("tinyimagenet", tmp_path, allow_subset=True)
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(folder / "val" / "images" / "val_9.JPEG")
    with pytest.raises(
        DataError,
        match=re.escape("val_annotations.txt is truncated or corrupted: no line for val image val_9.JPEG"),
    ):
        load("tinyimagenet", tmp_path, allow_subset=True)
    (folder / "wnids.txt").unlink()
    with pytest.raises(DataError, match=f"missing file {folder / 'wnids.txt'}"):
        load("tinyimagenet", tmp_path, allow_subset=True)


# ---------------------------------------------------------------------------------------------
# FedProx Synthetic


def test_synthetic_is_deterministic_and_federated_by_construction():
    data = load("synthetic", num_clients=30, seed=7)
    same = load("synthetic", num_clients=30, seed=7)
    other = load("synthetic", num_clients=30, seed=8)
    assert np.array_equal(data.train.x.numpy(), same.train.x.numpy())
    assert not np.array_equal(data.train.y.numpy()[:50], other.train.y.numpy()[:50])
    assert str(data.train.x.dtype) == "torch.float32" and data.train.x.shape[1] == 60
    assert data.classes == [str(c) for c in range(10)] and set(data.train.y.tolist()) <= set(range(10))
    parts = data.natural_partition
    assert len(parts["train"]) == len(parts["test"]) == 30
    for split, dataset in (("train", data.train), ("test", data.test)):
        covered = np.sort(np.concatenate(parts[split]))
        np.testing.assert_array_equal(covered, np.arange(len(dataset)))  # every sample exactly once
    for train, test in zip(parts["train"], parts["test"], strict=True):
        n = len(train) + len(test)
        assert n >= 50 and len(train) == int(0.9 * n)  # lognormal + 50, FedProx's 90 % / 10 % split


def test_synthetic_follows_the_generator_statistics():
    rng = np.random.default_rng(0)
    clients = datasets.generate_synthetic(0.0, 0.0, 200, rng)
    sizes = np.array([len(y) for _, y in clients])
    assert sizes.min() >= 50
    assert 33 < np.median(sizes - 50) < 90  # median of LogNormal(4, 2) is e^4 = 54.6
    # within a client x ~ N(v_k, diag(j^-1.2)): pooled within-client variance of coordinate j
    centred = np.concatenate([x - x.mean(axis=0) for x, _ in clients])
    dof = sum(len(x) - 1 for x, _ in clients)
    variance = (centred**2).sum(axis=0) / dof
    np.testing.assert_allclose(variance, np.arange(1, 61) ** -1.2, rtol=0.05)
    # alpha = beta = 0: client means v_k ~ N(0, 1) per coordinate
    means = np.stack([x.mean(axis=0) for x, _ in clients])
    assert abs(means.mean()) < 0.05 and 0.85 < means.std() < 1.15


def test_synthetic_heterogeneity_options():
    opts = P.build(datasets.SyntheticOptions, {"alpha": "0.5", "beta": 0}, "dataset")
    assert (opts.alpha, opts.beta) == (0.5, 0.0)
    with pytest.raises(ConfigError, match=r"dataset.alpha=-1 is invalid: expected >= 0"):
        P.build(datasets.SyntheticOptions, {"alpha": -1}, "dataset")
    # beta scales the spread of the client means v_k ~ N(B_k, 1), B_k ~ N(0, beta)
    spread = {}
    for beta in (0.0, 10.0):
        data = load("synthetic", num_clients=40, seed=1, options=datasets.SyntheticOptions(0.0, beta))
        x = data.train.x.numpy()
        spread[beta] = np.std([x[idx].mean() for idx in data.natural_partition["train"]])
    assert spread[0.0] < 0.5 < 3 < spread[10.0]
    assert data.info["alpha"] == 0.0 and data.info["beta"] == 10.0
