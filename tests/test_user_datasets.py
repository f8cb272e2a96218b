"""Datasets of the user's own files: dataset=folder, arrays, pfllib and leaf.

Each test builds small data in the official format in ``tmp_path`` (PNG/JPEG written by
Pillow, ``.npz`` by numpy, PFLlib's layout as its ``save_file`` writes it, LEAF's JSON) and
checks what is loaded, or that a bad input stops the load with a one-line error.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from contrafl import params as P
from contrafl.cli import main
from contrafl.data import DATASETS, LoadRequest
from contrafl.errors import ConfigError, DataError

RNG = np.random.default_rng(0)


def load(name: str, data_dir: Path, seed: int = 0, **options):
    spec = DATASETS.get(name)
    opts = P.build(spec.options, {k: v for k, v in options.items()}, "dataset")
    return spec.load(LoadRequest(data_dir=data_dir, options=opts, seed=seed))


def one_line_error(kind: type[BaseException], fragment: str, name: str, data_dir: Path, **options) -> str:
    with pytest.raises(kind) as info:
        load(name, data_dir, **options)
    text = str(info.value)
    assert "\n" not in text and fragment in text, text
    return text


def image(path: Path, size=(8, 8), mode="RGB", value: int | None = None) -> np.ndarray:
    """Write an image of ``size`` (H, W) and return its pixels as ``[C, H, W]``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = size if mode == "L" else (*size, 3)
    pixels = np.full(shape, value, np.uint8) if value is not None else RNG.integers(0, 256, shape, dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return pixels[None] if mode == "L" else pixels.transpose(2, 0, 1)


def tree(folder: Path, counts: dict[str, int], size=(8, 8), mode="RGB", ext=".png") -> dict[str, list[np.ndarray]]:
    return {c: [image(folder / c / f"img{i}{ext}", size, mode) for i in range(n)] for c, n in counts.items()}


# ---------------------------------------------------------------------------------------------
# dataset=folder


def test_folder_train_and_test(tmp_path):
    root = tmp_path / "data"
    train = tree(root / "train", {"dog": 3, "cat": 2})
    test = tree(root / "test", {"cat": 1, "dog": 2})
    # ignored: other files, hidden files and folders; extensions of any case are read
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    image(root / "train" / "cat" / ".hidden.png")
    image(root / "train" / ".thumbs" / "x.png")
    extra = image(root / "train" / "cat" / "sub" / "deep.PNG")
    ds = load("folder", root)
    assert ds.classes == ["cat", "dog"] and ds.natural_partition is None and not ds.local_test
    assert ds.train.x.dtype.is_floating_point is False and tuple(ds.train.x.shape) == (6, 3, 8, 8)
    assert ds.train.y.tolist() == [0, 0, 0, 1, 1, 1] and ds.test.y.tolist() == [0, 1, 1]
    # rows follow the natural order of the files, labels name the folders
    np.testing.assert_array_equal(ds.train.x[0].numpy(), train["cat"][0])
    np.testing.assert_array_equal(ds.train.x[2].numpy(), extra)
    np.testing.assert_array_equal(ds.train.x[5].numpy(), train["dog"][2])
    np.testing.assert_array_equal(ds.test.x[2].numpy(), test["dog"][1])
    assert len(ds.mean) == 3 and all(0 < s for s in ds.std)


def test_folder_colour_jpeg_and_grayscale(tmp_path):
    root = tmp_path / "gray"
    tree(root / "train", {"a": 2, "b": 2}, mode="L", ext=".JPG")
    assert tuple(load("folder", root, color="auto").train.x.shape[1:]) == (1, 8, 8)
    assert tuple(load("folder", root, color="rgb").train.x.shape[1:]) == (3, 8, 8)
    image(root / "train" / "b" / "colour.jpeg", mode="RGB")
    assert tuple(load("folder", root).train.x.shape[1:]) == (3, 8, 8)
    assert tuple(load("folder", root, color="gray").train.x.shape[1:]) == (1, 8, 8)


def test_folder_test_fraction_split_is_fixed(tmp_path):
    root = tmp_path / "data"
    tree(root, {"a": 10, "b": 5})  # ROOT/<class>/: the training tree, test split off
    ds = load("folder", root)
    assert ds.test.y.tolist() == [0, 0, 1] and len(ds.train) == 12
    again = load("folder", root, seed=7)
    assert (again.test.x == ds.test.x).all()  # independent of the run's seed
    assert len(load("folder", root, test_fraction=0).test) == 0
    assert len(load("folder", root, test_fraction=0.5).test) == 5 + 3  # half of 10, and 2.5 of 5 rounded up


def test_folder_natural_clients(tmp_path):
    root = tmp_path / "fed"
    for name, classes in (("site10", {"a": 2}), ("site2", {"a": 1, "b": 4}), ("site1", {"b": 3, "c": 2})):
        tree(root / "clients" / name / "train", classes)
    tree(root / "clients" / "site1" / "test", {"b": 1, "c": 1})
    tree(root / "clients" / "site10" / "test", {"a": 2})
    (root / "clients" / "README").write_text("ignored")
    ds = load("folder", root)
    assert ds.client_names == ["site1", "site2", "site10"] and ds.local_test
    assert ds.classes == ["a", "b", "c"]
    assert [len(r) for r in ds.natural_partition["train"]] == [5, 4, 2]
    assert [len(r) for r in ds.natural_partition["test"]] == [2, 1, 2]  # site2: 0.2 of its b images
    assert ds.train.y[ds.natural_partition["train"][0]].tolist() == [1, 1, 1, 2, 2]
    assert ds.test.y[ds.natural_partition["test"][2]].tolist() == [0, 0]
    alone = load("folder", root / "clients" / "site2")  # what site2's SuperNode reads: the same split
    assert (alone.test.x == ds.test.x[ds.natural_partition["test"][1]]).all()
    assert (alone.train.x == ds.train.x[ds.natural_partition["train"][1]]).all()
    no_split = load("folder", root, test_fraction=0)
    assert [len(r) for r in no_split.natural_partition["test"]] == [2, 0, 2]


def test_folder_one_client_as_a_supernode_reads_it(tmp_path):
    root = tmp_path / "fed"
    tree(root / "clients" / "site-a" / "train", {"b": 2, "c": 1})
    tree(root / "clients" / "site-a" / "test", {"b": 1})
    ds = load("folder", root / "clients" / "site-a", classes="[a,b,c,d]", mean="[0.5]", std="[0.25]")
    assert ds.natural_partition is None and ds.classes == ["a", "b", "c", "d"]
    assert ds.train.y.tolist() == [1, 1, 2] and ds.mean == (0.5,) * 3 and ds.std == (0.25,) * 3
    one_line_error(DataError, "'c'", "folder", root / "clients" / "site-a", classes="[a,b]")


def test_folder_sizes(tmp_path):
    root = tmp_path / "data"
    tree(root / "train", {"a": 2}, size=(8, 8))
    image(root / "train" / "b" / "big.png", size=(10, 12))
    text = one_line_error(DataError, "dataset.size=N", "folder", root)
    assert "big.png is 10x12" in text and "img0.png is 8x8" in text
    assert tuple(load("folder", root, size=6).train.x.shape) == (3, 3, 6, 6)
    assert tuple(load("folder", root, size="[4,5]").train.x.shape) == (3, 3, 4, 5)
    # bilinear, as torchvision's Resize on PIL images
    flat = tmp_path / "flat"
    image(flat / "train" / "a" / "x.png", size=(8, 8), value=77)
    assert (load("folder", flat, size=3).train.x == 77).all()
    with pytest.raises(ConfigError):
        load("folder", root, size=0)


def test_folder_cache_reused_and_invalidated(tmp_path):
    root = tmp_path / "data"
    tree(root / "train", {"a": 2, "b": 2})
    first = load("folder", root)
    assert first.info["cached"] is False and len(list((root / ".contrafl-cache").glob("*.npz"))) == 1
    second = load("folder", root)
    assert second.info["cached"] is True and (second.train.x == first.train.x).all()
    # other options: another cache file
    assert load("folder", root, size=4).info["cached"] is False and load("folder", root, size=4).info["cached"] is True
    # a changed or added file: decoded again
    path = root / "train" / "a" / "img0.png"
    new = image(path, value=3)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    third = load("folder", root)
    assert third.info["cached"] is False and (third.train.x[0].numpy() == new).all()
    image(root / "train" / "b" / "img9.png")
    grown = load("folder", root)
    assert grown.info["cached"] is False and len(grown.train) + len(grown.test) == 5


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs a folder this user cannot write")
def test_folder_read_only_loads_without_cache(tmp_path):
    root = tmp_path / "data"
    tree(root / "train", {"a": 2})
    os.chmod(root, 0o555)
    try:
        assert load("folder", root).info["cached"] is False
        assert not (root / ".contrafl-cache").exists()
    finally:
        os.chmod(root, 0o755)


def test_folder_unwritable_cache_is_skipped(tmp_path):
    root = tmp_path / "data"
    tree(root / "train", {"a": 2})
    (root / ".contrafl-cache").write_text("a file where the cache folder would be")
    assert load("folder", root).info["cached"] is False and load("folder", root).info["cached"] is False


def test_folder_bad_inputs(tmp_path):
    root = tmp_path / "bad"
    tree(root / "train", {"a": 2})
    (root / "train" / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    one_line_error(DataError, "broken.png is not a readable image", "folder", root)
    good = (root / "train" / "a" / "img0.png").read_bytes()
    (root / "train" / "a" / "broken.png").write_bytes(good[: len(good) // 2])  # truncated: header fine, pixels not
    one_line_error(DataError, "broken.png is not a readable image", "folder", root)
    (root / "train" / "a" / "broken.png").unlink()
    (root / "train" / "empty").mkdir()
    one_line_error(DataError, "class folder", "folder", root)
    (root / "train" / "empty").rmdir()
    one_line_error(DataError, "would take", "folder", root, max_memory_gb=1e-7)
    fed = tmp_path / "fed"
    (fed / "clients").mkdir(parents=True)
    one_line_error(DataError, "holds no client folders", "folder", fed)
    (fed / "clients" / "site1").mkdir()
    one_line_error(DataError, "has no train folder", "folder", fed)
    (fed / "clients" / "site1" / "train").mkdir()
    one_line_error(DataError, "no class folders", "folder", fed)
    one_line_error(DataError, "is not a folder", "folder", root / "train" / "a" / "img0.png")


# ---------------------------------------------------------------------------------------------
# dataset=arrays


def test_arrays_npz_images_and_class_names(tmp_path):
    x_train = RNG.integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)  # NHWC
    x_test = RNG.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    path = tmp_path / "d.npz"
    np.savez(path, x_train=x_train, y_train=np.array([0, 1, 2, 0, 1, 2]), x_test=x_test, y_test=np.array([2, 0]),
             classes=np.array(["zebra", "ant", "cat"]))
    ds = load("arrays", path)
    assert ds.classes == ["zebra", "ant", "cat"]  # the file's order: label values kept
    assert tuple(ds.train.x.shape) == (6, 3, 8, 8) and ds.train.x.dtype.is_floating_point is False
    np.testing.assert_array_equal(ds.train.x[1].numpy(), x_train[1].transpose(2, 0, 1))
    assert ds.test.y.tolist() == [2, 0] and ds.natural_partition is None
    # NCHW given as such, or forced
    np.savez(path, x_train=x_train.transpose(0, 3, 1, 2), y_train=np.arange(6) % 2)
    assert tuple(load("arrays", path).train.x.shape[1:]) == (3, 8, 8) and len(load("arrays", path).test) == 2
    assert tuple(load("arrays", path, layout="nhwc").train.x.shape[1:]) == (8, 3, 8)


def test_arrays_npy_folder_vectors_and_string_labels(tmp_path):
    folder = tmp_path / "npy"
    folder.mkdir()
    np.save(folder / "x_train.npy", RNG.normal(size=(10, 5)))
    np.save(folder / "y_train.npy", np.array(["yes", "no"] * 5))
    (folder / "notes.txt").write_text("ignored")
    ds = load("arrays", folder)
    (tmp_path / "one").mkdir()
    np.savez(tmp_path / "one" / "only.npz", x_train=np.ones((3, 2)), y_train=np.zeros(3, int))
    assert load("arrays", tmp_path / "one").info["path"].endswith("only.npz")  # a folder of one .npz: that file
    assert ds.classes == ["no", "yes"] and ds.train.x.dtype.is_floating_point and tuple(ds.train.x.shape[1:]) == (5,)
    assert len(ds.test) == 2 and ds.mean is None
    np.save(folder / "x_train.npy", RNG.integers(0, 256, (10, 7, 9), dtype=np.uint8))  # grayscale [N, H, W]
    assert tuple(load("arrays", folder).train.x.shape[1:]) == (1, 7, 9)


def test_arrays_natural_clients(tmp_path):
    path = tmp_path / "fed.npz"
    x = RNG.normal(size=(20, 4)).astype(np.float32)
    y = np.arange(20) % 2
    clients = np.array([10, 2] * 10)
    np.savez(path, x_train=x, y_train=y, client_train=clients, x_test=x[:4], y_test=y[:4], client_test=np.array([2, 2, 10, 2]))
    ds = load("arrays", path)
    assert ds.client_names == ["2", "10"] and ds.local_test
    assert [len(r) for r in ds.natural_partition["train"]] == [10, 10]
    assert [len(r) for r in ds.natural_partition["test"]] == [3, 1]
    np.testing.assert_array_equal(ds.train.x[ds.natural_partition["train"][0]].numpy(), x[1::2])
    np.savez(path, x_train=x, y_train=y, client_train=np.array(["b", "a"] * 10))  # tests split off per client
    ds = load("arrays", path, test_fraction=0.4)
    assert ds.client_names == ["a", "b"] and [len(r) for r in ds.natural_partition["test"]] == [4, 4]


def test_arrays_bad_inputs(tmp_path):
    path = tmp_path / "bad.npz"
    x = RNG.integers(0, 256, (4, 8, 8), dtype=np.uint8)
    np.savez(path, x_train=x, y_train=np.array([0, 1, 3, 1]), classes=np.array(["a", "b"]))
    text = one_line_error(DataError, "label 3", "arrays", path)
    assert "y_train" in text
    np.savez(path, x_train=x, y_train=np.array([0, 1, 1]))
    one_line_error(DataError, "3 labels but x_train has 4 samples", "arrays", path)
    np.savez(path, x_train=np.array([{"x": 1}] * 4, dtype=object), y_train=np.zeros(4, int))
    one_line_error(DataError, "pickled Python objects", "arrays", path)
    np.savez(path, x_train=x, y_train=np.zeros(4, int), x_tset=x)
    one_line_error(DataError, "did you mean 'x_test'", "arrays", path)
    np.savez(path, x_train=x, y_train=np.zeros(4, int), x_test=x)
    one_line_error(DataError, "without y_test", "arrays", path)
    np.savez(path, x_train=x, y_train=np.array([0, -1, 0, 0]))
    one_line_error(DataError, "label -1", "arrays", path)
    np.savez(path, X=x, Y=np.zeros(4))
    one_line_error(DataError, "not one of the arrays", "arrays", path)
    np.savez(path, x_train=x.astype(np.int64) * 300, y_train=np.zeros(4, int))
    one_line_error(DataError, "outside 0..255", "arrays", path)
    np.savez(path, x_train=x, y_train=np.zeros(4, int), client_train=np.array([0, 0, 1]))
    one_line_error(DataError, "one client id per sample", "arrays", path)
    np.savez(path, x_train=x, y_train=np.zeros(4, int), x_test=x, y_test=np.zeros(4, int), client_train=np.array([0, 0, 1, 1]),
             client_test=np.array([0, 0, 5, 1]))
    one_line_error(DataError, "client 5", "arrays", path)
    np.savez(path, x_train=x, y_train=np.zeros(4, int), x_test=x, y_test=np.array(["a"] * 4))
    one_line_error(DataError, "different kinds", "arrays", path)
    np.savez(path, x_train=x, y_train=np.array(["a", "b", "a", "c"]), classes=np.array(["a", "b"]))
    one_line_error(DataError, "label 'c'", "arrays", path)
    np.savez(path, x_train=x, y_train=np.zeros(4, int))
    one_line_error(DataError, "would take", "arrays", path, max_memory_gb=1e-8)
    path.write_bytes(b"not a zip")
    one_line_error(DataError, "not a readable .npz", "arrays", path)


# ---------------------------------------------------------------------------------------------
# dataset=pfllib


def pfllib_dataset(root: Path, clients: list[tuple[int, int]], num_classes=3, shape=(1, 8, 8), config=True):
    """Files as PFLlib's ``save_file`` writes them: per client ``train/<cid>.npz`` and
    ``test/<cid>.npz`` holding ``np.savez_compressed(f, data={'x': X, 'y': y})`` with the
    normalised float32 images of ``ToTensor + Normalize``, and ``config.json``."""
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    for cid, (n_train, n_test) in enumerate(clients):
        for split, n in (("train", n_train), ("test", n_test)):
            data = {"x": RNG.uniform(-1, 1, (n, *shape)).astype(np.float32), "y": RNG.integers(0, num_classes, n).astype(np.int64)}
            with open(root / split / f"{cid}.npz", "wb") as f:
                np.savez_compressed(f, data=data)
    if config:
        (root / "config.json").write_text(json.dumps({
            "num_clients": len(clients), "num_classes": num_classes, "non_iid": True, "balance": False,
            "partition": "dir", "Size of samples for labels in clients": [], "alpha": 0.1, "batch_size": 10,
        }))


def test_pfllib_layout(tmp_path):
    root = tmp_path / "MNIST"
    pfllib_dataset(root, [(6, 2), (5, 2), (7, 3)], num_classes=4)
    ds = load("pfllib", root)
    assert ds.client_names == ["0", "1", "2"] and ds.local_test and ds.classes == ["0", "1", "2", "3"]
    assert ds.train.x.dtype.is_floating_point and tuple(ds.train.x.shape) == (18, 1, 8, 8)
    assert [len(r) for r in ds.natural_partition["test"]] == [2, 2, 3]
    with np.load(root / "train" / "1.npz", allow_pickle=True) as f:  # PFLlib's own read_data
        data = f["data"].tolist()
    np.testing.assert_array_equal(ds.train.x[ds.natural_partition["train"][1]].numpy(), data["x"])
    assert ds.train.y[ds.natural_partition["train"][1]].tolist() == data["y"].tolist()
    assert len(ds.mean) == 1 and np.isfinite(ds.mean + ds.std).all()


def test_pfllib_file_of_numpy_1_and_pickle_protocol_2(tmp_path):
    root = tmp_path / "old"
    pfllib_dataset(root, [(3, 1)])
    data = {"x": RNG.uniform(-1, 1, (3, 1, 8, 8)).astype(np.float32), "y": np.array([0, 2, 1])}
    obj = np.empty((), dtype=object)
    obj[()] = data
    old = pickle.dumps(obj, protocol=2).replace(b"numpy._core", b"numpy.core")  # as numpy 1 names it
    assert b"numpy.core.multiarray" in old and b"_codecs" in old
    with zipfile.ZipFile(root / "train" / "0.npz", "w") as zf, zf.open("data.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
        f.write(old)
    ds = load("pfllib", root)
    np.testing.assert_array_equal(ds.train.x.numpy(), data["x"])
    assert ds.train.y.tolist() == [0, 2, 1]


def test_pfllib_one_client_folder(tmp_path):
    root = tmp_path / "node"
    pfllib_dataset(root, [(4, 2), (4, 2)])
    for split in ("train", "test"):
        (root / split / "0.npz").unlink()
    ds = load("pfllib", root)  # config.json says 2 clients: one client's share is accepted
    assert ds.client_names == ["1"] and ds.classes == ["0", "1", "2"]


def test_pfllib_bad_inputs(tmp_path):
    root = tmp_path / "p"
    pfllib_dataset(root, [(4, 2), (4, 2)], num_classes=2)
    (root / "config.json").write_text(json.dumps({"num_clients": 3, "num_classes": 2}))
    one_line_error(DataError, "num_clients=3", "pfllib", root)
    (root / "config.json").write_text(json.dumps({"num_clients": 2, "num_classes": 1}))
    one_line_error(DataError, "outside the 1 classes", "pfllib", root)
    (root / "config.json").unlink()
    with open(root / "train" / "1.npz", "wb") as f:
        np.savez_compressed(f, data=np.zeros((3, 4)))
    one_line_error(DataError, "not the dict", "pfllib", root)
    with open(root / "train" / "1.npz", "wb") as f:
        np.savez_compressed(f, data={"x": [[1, 2]], "y": np.zeros(1)})
    one_line_error(DataError, "not an array of numbers", "pfllib", root)
    (root / "test" / "7.npz").write_bytes(b"")
    one_line_error(DataError, "has no training file", "pfllib", root)
    one_line_error(DataError, "holds no .npz files", "pfllib", tmp_path)
    pfllib_dataset(tmp_path / "q", [(4, 1)])
    one_line_error(DataError, "would take", "pfllib", tmp_path / "q", max_memory_gb=1e-8)


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["object_array", "raw_pickle"])
def test_pfllib_crafted_pickle_runs_no_code(tmp_path, payload):
    root = tmp_path / "evil"
    pfllib_dataset(root, [(4, 2)])
    marker = tmp_path / "pwned"
    path = root / "train" / "0.npz"
    if payload == "object_array":  # what np.savez_compressed writes for a dict holding the object
        with open(path, "wb") as f:
            np.savez_compressed(f, data={"x": _Exploit(marker), "y": np.zeros(1)})
    else:  # an .npy header of a 0-d object array followed by any pickle
        header = {"descr": "|O", "fortran_order": False, "shape": ()}
        with zipfile.ZipFile(path, "w") as zf, zf.open("data.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, header)
            f.write(pickle.dumps(_Exploit(marker)))
    text = one_line_error(DataError, "posix.system, which is not read", "pfllib", root)
    assert "0.npz" in text and not marker.exists()


# ---------------------------------------------------------------------------------------------
# dataset=leaf


def leaf_file(path: Path, users: dict[str, tuple[int, int]], dim=16, classes=62):
    """A LEAF data file (``split_data.py``'s output): users, num_samples, user_data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "users": list(users),
        "num_samples": [n for n, _ in users.values()],
        "user_data": {
            u: {"x": RNG.uniform(0, 1, (n, dim)).round(4).tolist(), "y": [int(first + i % 2) for i in range(n)]}
            for u, (n, first) in users.items()
        },
    }
    path.write_text(json.dumps(data))
    return data


def test_leaf_users_are_clients(tmp_path):
    root = tmp_path / "femnist"
    a = leaf_file(root / "train" / "all_data_1_niid_0_keep_0_train_9.json", {"f3": (5, 0), "f1": (4, 8)})
    leaf_file(root / "train" / "all_data_0_niid_0_keep_0_train_9.json", {"f9": (3, 2)})
    leaf_file(root / "test" / "all_data_0_niid_0_keep_0_test_9.json", {"f1": (2, 9), "f9": (1, 2)})
    leaf_file(root / "test" / "all_data_1_niid_0_keep_0_test_9.json", {"f3": (1, 0)})
    ds = load("leaf", root)
    assert ds.client_names == ["f9", "f3", "f1"] and ds.local_test
    assert ds.classes == [str(i) for i in range(11)] and tuple(ds.train.x.shape) == (12, 16) and ds.mean is None
    assert [len(r) for r in ds.natural_partition["test"]] == [1, 1, 2]
    np.testing.assert_allclose(ds.train.x[ds.natural_partition["train"][1]].numpy(), np.array(a["user_data"]["f3"]["x"]), rtol=1e-6)
    assert ds.train.y[ds.natural_partition["train"][2]].tolist() == [8, 9, 8, 9]
    images = load("leaf", root, shape="[1,4,4]")
    assert tuple(images.train.x.shape) == (12, 1, 4, 4) and len(images.mean) == 1
    assert tuple(load("leaf", root, shape="[4,4]").train.x.shape) == (12, 1, 4, 4)
    one_line_error(DataError, "dataset.shape=[3, 4, 4]", "leaf", root, shape="[3,4,4]")


def test_leaf_bad_inputs(tmp_path):
    root = tmp_path / "leaf"
    leaf_file(root / "train" / "a.json", {"u1": (3, 0)})
    leaf_file(root / "test" / "a.json", {"u2": (2, 0)})
    one_line_error(DataError, "test user 'u2' has no training data", "leaf", root)
    leaf_file(root / "test" / "a.json", {"u1": (2, 0), "s": (1, 0)})
    (root / "train" / "b.json").write_text(json.dumps({"users": ["s"], "num_samples": [1], "user_data": {"s": {"x": ["to be or"], "y": ["n"]}}}))
    one_line_error(DataError, "not vectors of numbers", "leaf", root)
    (root / "train" / "b.json").write_text("{broken")
    one_line_error(DataError, "not readable JSON", "leaf", root)
    (root / "train" / "b.json").write_text(json.dumps({"users": ["s"], "num_samples": [2], "user_data": {"s": {"x": [[1.0] * 16], "y": [1]}}}))
    one_line_error(DataError, "num_samples says 2", "leaf", root)
    (root / "train" / "b.json").write_text(json.dumps({"users": ["s"], "user_data": {"s": {"x": [[1.0] * 16, [1.0] * 3], "y": [1, 2]}}}))
    one_line_error(DataError, "one length", "leaf", root)
    (root / "train" / "b.json").write_text(json.dumps({"users": ["u1"], "user_data": {"u1": {"x": [[1.0] * 16], "y": [1]}}}))
    one_line_error(DataError, "appears twice", "leaf", root)
    (root / "train" / "b.json").unlink()
    leaf_file(root / "test" / "a.json", {"u1": (2, 0)})
    one_line_error(DataError, "would take", "leaf", root, max_memory_gb=1e-9)
    one_line_error(DataError, "holds no .json files", "leaf", tmp_path)


# ---------------------------------------------------------------------------------------------
# Through the command line

FAST_RUN = ["rounds=1", "local_epochs=1", "batch_size=8", "executor=sequential", "--quiet"]


def cli(tmp_path, *args: str) -> int:
    return main(["run", "--out", str(tmp_path / "run"), *FAST_RUN, *args])


def test_cli_folder_natural_moon(tmp_path):
    root = tmp_path / "fed"
    for name in ("site1", "site2", "site3"):
        tree(root / "clients" / name / "train", {"a": 10, "b": 10}, size=(16, 16))
        tree(root / "clients" / name / "test", {"a": 2, "b": 2}, size=(16, 16))
    assert cli(tmp_path, "dataset=folder", f"data_dir={root}", "partition=natural", "num_clients=3",
               "algorithm=moon", "model.projection_dim=8") == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1


def test_cli_arrays_pfllib_leaf(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=RNG.normal(size=(40, 6)), y_train=np.arange(40) % 3)
    assert main(["run", "--out", str(tmp_path / "a"), *FAST_RUN, "dataset=arrays", f"data_dir={path}", "num_clients=2",
                 "model.hidden=[8]"]) == 0
    pfl = tmp_path / "pfl"
    pfllib_dataset(pfl, [(20, 4)] * 3, shape=(12,))
    assert main(["run", "--out", str(tmp_path / "p"), *FAST_RUN, "dataset=pfllib", f"data_dir={pfl}", "partition=natural",
                 "num_clients=3", "model.hidden=[8]"]) == 0
    leaf = tmp_path / "leaf"
    leaf_file(leaf / "train" / "t.json", {"u1": (20, 0), "u2": (20, 3)})
    leaf_file(leaf / "test" / "t.json", {"u1": (4, 0), "u2": (4, 3)})
    assert main(["run", "--out", str(tmp_path / "l"), *FAST_RUN, "dataset=leaf", f"data_dir={leaf}", "partition=natural",
                 "num_clients=2", "dataset.shape=[1,4,4]", "model.hidden=[8]"]) == 0


def test_cli_bad_input_is_one_line_and_no_run_dir(tmp_path, capsys):
    root = tmp_path / "bad"
    tree(root / "train", {"a": 3}, size=(16, 16))
    (root / "train" / "a" / "broken.jpg").write_bytes(b"garbage")
    assert cli(tmp_path, "dataset=folder", f"data_dir={root}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken.jpg is not a readable image" in err[0]
    assert not (tmp_path / "run").exists()
    assert cli(tmp_path, "dataset=folder", f"data_dir={root}", "dataset.colour=rgb") == 2
    assert "did you mean 'color'" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_cli_subprocess_pickled_arrays(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=np.array([object()] * 3, dtype=object), y_train=np.zeros(3, int))
    proc = subprocess.run([sys.executable, "-m", "contrafl", "run", "--out", str(tmp_path / "run"), "dataset=arrays", f"data_dir={path}"],
                          capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "pickled Python objects" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_specs_listed(capsys):
    for name in ("folder", "arrays", "pfllib", "leaf"):
        spec = DATASETS.get(name)
        assert spec.needs_data_dir and spec.augment == "none" and spec.ssl_augment is None
        assert spec.default_model == ("moon_cnn" if name == "folder" else "mlp")
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "dataset.test_fraction=0.2" in out and "dataset.layout=auto" in out and "dataset.color=auto" in out
