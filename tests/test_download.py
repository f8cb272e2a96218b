"""End-to-end tests of contrafl.data.download without network: the URL table is patched to
``file://`` URLs of archives built here, with their md5 patched in."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from contrafl.data import download as dl
from contrafl.data.datasets import load_cifar10
from contrafl.data.download import SOURCES, Archive, ImageTree, OfficialFile, download, file_md5, locate
from contrafl.data.registry import DATASETS, LoadRequest
from contrafl.errors import ConfigError, DataError

CIFAR10_FILES = [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch", "batches.meta"]


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def cifar10_files(seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    files = {}
    for name in CIFAR10_FILES[:-1]:
        batch = {
            "batch_label": name,
            "labels": rng.integers(0, 10, 2).tolist(),
            "data": rng.integers(0, 256, (2, 3072), dtype=np.uint8),
            "filenames": ["a.png", "b.png"],
        }
        files[name] = pickle.dumps(batch, protocol=2)
    meta = {"num_cases_per_batch": 2, "label_names": [f"c{i}" for i in range(10)], "num_vis": 3072}
    files["batches.meta"] = pickle.dumps(meta, protocol=4)
    return files


def tar_gz(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def patch_source(
    monkeypatch,
    name: str,
    archives: list[tuple[Path | str, ...]],
    files: dict[str, bytes] | None = None,
    **changes,
):
    """Point SOURCES[name] to local archives (``(path, *more mirrors)``, md5 of the first
    existing one) and, given ``files``, make their md5 and size the official ones."""
    src = SOURCES[name]
    new_archives = []
    for archive, mirrors in zip(src.archives, archives, strict=True):
        real = next(Path(m) for m in mirrors if Path(m).is_file())
        urls = tuple(Path(m).resolve().as_uri() for m in mirrors)
        new_archives.append(dataclasses.replace(archive, md5=file_md5(real), urls=urls))
    official = src.files
    if files is not None:
        official = tuple(OfficialFile(n, md5(d), len(d), None) for n, d in files.items())
    monkeypatch.setitem(
        SOURCES, name, dataclasses.replace(src, archives=tuple(new_archives), files=official, **changes)
    )


@pytest.fixture
def cifar10_release(tmp_path, monkeypatch) -> dict[str, bytes]:
    files = cifar10_files()
    members = {f"cifar-10-batches-py/{n}": d for n, d in files.items()}
    members["cifar-10-batches-py/readme.html"] = b"<html></html>"
    tar_gz(tmp_path / "cifar-10-python.tar.gz", members)
    patch_source(monkeypatch, "cifar10", [(tmp_path / "cifar-10-python.tar.gz",)], files)
    return files


def test_cifar10_download_extracts_verifies_and_loads(tmp_path, cifar10_release, capsys):
    data_dir = tmp_path / "data"
    folder = download("cifar10", data_dir)
    assert folder == data_dir / "cifar-10-batches-py"
    for name, data in cifar10_release.items():
        assert (folder / name).read_bytes() == data
    assert (data_dir / "cifar-10-python.tar.gz").is_file()  # the archive is kept in data_dir
    assert not list(data_dir.glob(".*partial")) and not list(data_dir.glob("*.part"))
    err = capsys.readouterr().err
    assert f"downloading {(tmp_path / 'cifar-10-python.tar.gz').as_uri()}" in err and "MiB" in err

    data = load_cifar10(LoadRequest(data_dir=data_dir))
    assert data.info["subset"] is False and len(data.train) == 10 and data.classes[3] == "c3"
    expected = pickle.loads(cifar10_release["data_batch_2"], encoding="latin1")
    np.testing.assert_array_equal(data.train.x.numpy()[2:4].reshape(2, -1), expected["data"])


def test_download_is_idempotent(tmp_path, cifar10_release, monkeypatch, capsys):
    data_dir = tmp_path / "data"
    download("cifar10", data_dir)
    capsys.readouterr()
    src = SOURCES["cifar10"]
    gone = dataclasses.replace(src.archives[0], urls=((tmp_path / "nowhere.tar.gz").as_uri(),))
    monkeypatch.setitem(SOURCES, "cifar10", dataclasses.replace(src, archives=(gone,)))
    assert download("cifar10", data_dir) == data_dir / "cifar-10-batches-py"
    assert "already holds the verified official files" in capsys.readouterr().err

    # a damaged file is restored from the archive kept on disk, without fetching it again
    (data_dir / "cifar-10-batches-py" / "test_batch").write_bytes(b"damaged")
    download("cifar10", data_dir)
    assert "using the verified" in capsys.readouterr().err
    assert (data_dir / "cifar-10-batches-py" / "test_batch").read_bytes() == cifar10_release["test_batch"]


def test_download_into_the_dataset_folder_itself(tmp_path, cifar10_release):
    folder = tmp_path / "mine" / "cifar-10-batches-py"
    assert download("cifar10", folder) == folder
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*CIFAR10_FILES, "cifar-10-python.tar.gz", "readme.html"]
    )


def test_corrupted_archive_is_rejected_and_removed(tmp_path, cifar10_release, monkeypatch):
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(archive.read_bytes()[:-10])  # the md5 patched in is the intact archive's
    data_dir = tmp_path / "data"
    with pytest.raises(DataError) as err:
        download("cifar10", data_dir)
    message = str(err.value)
    assert (
        "\n" not in message
        and f"{archive.as_uri()} served a file with md5 {md5(archive.read_bytes())}" in message
    )
    assert f"the official md5 is {SOURCES['cifar10'].archives[0].md5}" in message
    assert f"download it manually from {archive.as_uri()} into {data_dir}" in message
    assert list(data_dir.iterdir()) == []  # neither the .part file nor extracted files are left


def test_network_error_names_the_url_and_the_manual_fix(tmp_path, monkeypatch):
    missing = tmp_path / "offline" / "cifar-10-python.tar.gz"
    src = SOURCES["cifar10"]
    monkeypatch.setitem(
        SOURCES,
        "cifar10",
        dataclasses.replace(src, archives=(dataclasses.replace(src.archives[0], urls=(missing.as_uri(),)),)),
    )
    with pytest.raises(
        DataError, match=f"could not download cifar-10-python.tar.gz \\({missing.as_uri()}: "
    ) as err:
        download("cifar10", tmp_path / "data")
    assert f"download it manually from {missing.as_uri()} into {tmp_path / 'data'} and rerun" in str(
        err.value
    )


def test_archive_members_outside_the_folder_are_refused(tmp_path, monkeypatch):
    files = cifar10_files()
    members = {f"cifar-10-batches-py/{n}": d for n, d in files.items()}
    members["cifar-10-batches-py/../../escape"] = b"x"
    tar_gz(tmp_path / "evil.tar.gz", members)
    patch_source(monkeypatch, "cifar10", [(tmp_path / "evil.tar.gz",)], files)
    with pytest.raises(
        DataError, match=r"has a member cifar-10-batches-py/\.\./\.\./escape outside its folder"
    ):
        download("cifar10", tmp_path / "data")
    assert not (tmp_path / "escape").exists() and not (tmp_path / "data" / "cifar-10-batches-py").exists()


def idx_gz(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.tobytes(), mtime=0)


def test_mnist_falls_back_to_the_second_mirror(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (4, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 4, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (2, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 2, dtype=np.uint8),
    }
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name, array in arrays.items():
        (mirror / f"{name}.gz").write_bytes(idx_gz(array))
    src = SOURCES["mnist"]
    files = tuple(
        dataclasses.replace(
            f, md5=file_md5(mirror / f.path), size=(mirror / f.path).stat().st_size, rows=None
        )
        for f in src.files
    )
    patch_source(
        monkeypatch, "mnist", [(tmp_path / "down" / a.filename, mirror / a.filename) for a in src.archives]
    )
    monkeypatch.setitem(SOURCES, "mnist", dataclasses.replace(SOURCES["mnist"], files=files))
    data_dir = tmp_path / "data"
    assert download("mnist", data_dir) == data_dir / "mnist"
    data = DATASETS.get("mnist").load(LoadRequest(data_dir=data_dir))
    np.testing.assert_array_equal(data.train.x.numpy()[:, 0], arrays["train-images-idx3-ubyte"])
    assert data.info["subset"] is False

    # the loader downloads missing files itself when asked to
    data_dir = tmp_path / "auto"
    with pytest.raises(DataError, match="missing file"):
        DATASETS.get("mnist").load(LoadRequest(data_dir=data_dir))
    data = DATASETS.get("mnist").load(LoadRequest(data_dir=data_dir, download=True))
    np.testing.assert_array_equal(data.test.y.numpy(), arrays["t10k-labels-idx1-ubyte"])


def test_emnist_archive_is_kept_whole_and_read_in_place(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    archive = tmp_path / "gzip.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for split, n in (("train", 3), ("test", 2)):
            zf.writestr(
                f"gzip/emnist-balanced-{split}-images-idx3-ubyte.gz",
                idx_gz(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)),
            )
            zf.writestr(
                f"gzip/emnist-balanced-{split}-labels-idx1-ubyte.gz",
                idx_gz(rng.integers(0, 47, n, dtype=np.uint8)),
            )
    patch_source(monkeypatch, "emnist", [(archive,)], {"gzip.zip": archive.read_bytes()})
    folder = DATASETS.get("emnist").download(tmp_path / "data")
    assert (
        folder == tmp_path / "data" / "emnist" and (folder / "gzip.zip").read_bytes() == archive.read_bytes()
    )
    data = DATASETS.get("emnist").load(LoadRequest(data_dir=tmp_path / "data"))
    assert (len(data.train), len(data.test), data.info["subset"]) == (3, 2, False)


def test_tinyimagenet_zip_is_unpacked_and_checked_against_the_official_counts(tmp_path, monkeypatch):
    archive = tmp_path / "tiny-imagenet-200.zip"
    jpeg = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(jpeg, format="JPEG")
    root = "tiny-imagenet-200"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(f"{root}/wnids.txt", "n02\nn01\n")
        zf.writestr(f"{root}/words.txt", "n01\tone\nn02\ttwo\n")
        zf.writestr(f"{root}/val/val_annotations.txt", "val_0.JPEG\tn02\t0\t0\t1\t1\n")
        zf.writestr(f"{root}/val/images/val_0.JPEG", jpeg.getvalue())
        for wnid in ("n01", "n02"):
            zf.writestr(f"{root}/train/{wnid}/images/{wnid}_0.JPEG", jpeg.getvalue())
    patch_source(monkeypatch, "tinyimagenet", [(archive,)], tree=ImageTree(2, 2, 1))
    folder = download("tinyimagenet", tmp_path / "data")
    assert folder == tmp_path / "data" / root and (folder / "val" / "images" / "val_0.JPEG").is_file()
    data = DATASETS.get("tinyimagenet").load(LoadRequest(data_dir=tmp_path / "data"))
    assert data.classes == ["one", "two"] and data.test.y.tolist() == [1] and data.info["subset"] is False

    # an incomplete tree is completed by a new download
    (folder / "train" / "n01" / "images" / "n01_0.JPEG").unlink()
    with pytest.raises(DataError, match="holds 2 classes, 1 train and 1 test images"):
        DATASETS.get("tinyimagenet").load(LoadRequest(data_dir=tmp_path / "data"))
    download("tinyimagenet", tmp_path / "data")
    assert (folder / "train" / "n01" / "images" / "n01_0.JPEG").is_file()

    monkeypatch.setitem(
        SOURCES, "tinyimagenet", dataclasses.replace(SOURCES["tinyimagenet"], tree=ImageTree(2, 3, 1))
    )
    with pytest.raises(DataError, match="does not hold the official tinyimagenet files after unpacking"):
        download("tinyimagenet", tmp_path / "data")


def test_datasets_without_download_and_locate_rules(tmp_path):
    with pytest.raises(ConfigError, match="dataset 'digits' has no official files to download"):
        download("digits", tmp_path)
    assert DATASETS.get("digits").download is None and DATASETS.get("synthetic").download is None
    assert locate("cifar10", tmp_path) == tmp_path / "cifar-10-batches-py"
    assert locate("cifar10", tmp_path / "cifar-10-batches-py") == tmp_path / "cifar-10-batches-py"
    (tmp_path / "FashionMNIST" / "raw").mkdir(parents=True)
    (tmp_path / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte").write_bytes(b"")
    assert locate("fmnist", tmp_path) == tmp_path / "FashionMNIST" / "raw"  # torchvision's layout


def test_file_md5_follows_changes(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    assert file_md5(path) == md5(b"abc")
    path.write_bytes(b"abcd")
    assert file_md5(path) == md5(b"abcd")
    assert dl.matches(path, OfficialFile("f", None)) and not dl.matches(path, OfficialFile("f", md5(b"abc")))


def test_official_tables_hold_torchvisions_checksums():
    assert SOURCES["cifar10"].archives[0] == Archive(
        "cifar-10-python.tar.gz",
        "c58f30108f718f92721af3b95e74349a",
        ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
    )
    assert SOURCES["cifar10"].file("data_batch_1").md5 == "c99cafc152244af753f735de768cd75f"
    assert SOURCES["cifar100"].file("train").md5 == "16019d7e3df5f24257cddd939b257f8d"
    mnist = SOURCES["mnist"]
    assert mnist.archives[0].urls == (
        "https://ossci-datasets.s3.amazonaws.com/mnist/train-images-idx3-ubyte.gz",
        "http://yann.lecun.com/exdb/mnist/train-images-idx3-ubyte.gz",
    )
    images = mnist.file("train-images-idx3-ubyte.gz")
    assert (images.md5, images.uncompressed.md5, images.uncompressed.size) == (
        "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "6bbc9ace898e44ae57da46a324031adb",
        16 + 60_000 * 28 * 28,
    )
    assert SOURCES["emnist"].archives[0].md5 == "58c8d27c78d21e728a6bc7b3cc06412e"
    assert SOURCES["tinyimagenet"].archives[0].md5 == "90528d7ca1a48142e341f4ef8d21d0de"
