"""dataset=huggingface (Hugging Face ``datasets``) and partition=flwr_* (Flower Datasets' partitioners)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # flwr-datasets and pyarrow, called directly
Image = pytest.importorskip("PIL.Image")

from contrafl.cli import main  # noqa: E402
from contrafl.data.datasets import load_digits  # noqa: E402
from contrafl.data.huggingface import HuggingFaceOptions, load_huggingface  # noqa: E402
from contrafl.data.partition import make_partition  # noqa: E402
from contrafl.data.registry import LoadRequest  # noqa: E402
from contrafl.errors import ConfigError, DataError  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """``load_dataset``'s cache in the test's folder, not the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def load(path, **options):
    return load_huggingface(LoadRequest(data_dir=None if path is None else Path(path), options=HuggingFaceOptions(**options)))


def pictures(n, size=(8, 8), mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0]) + ((3,) if mode == "RGB" else ())
    arrays = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(n)]
    return arrays, [Image.fromarray(a) for a in arrays]


def image_dataset(labels, names=("zebra", "ant", "cat"), mode="RGB", size=(8, 8), seed=0, **extra):
    arrays, images = pictures(len(labels), size, mode, seed)
    columns = {"img": images, "label": list(labels), **extra}
    features = {"img": datasets.Image(), "label": datasets.ClassLabel(names=list(names))}
    features.update({k: datasets.Value("string") for k in extra})
    return datasets.Dataset.from_dict(columns, features=datasets.Features(features)), arrays


def one_line(exc):
    text = str(exc.value)
    assert "\n" not in text
    return text


# --------------------------------------------------------------------------------------------
# Loading


def test_save_to_disk_dataset_images_labels_and_held_out_test(tmp_path):
    labels = [0, 1, 2, 0, 1, 2, 0, 1, 2, 1]
    ds, arrays = image_dataset(labels)
    ds.save_to_disk(tmp_path / "ds")
    data = load(tmp_path / "ds")
    assert data.classes == ["zebra", "ant", "cat"]  # the ClassLabel's order: class k is label k
    assert data.input_shape == (3, 8, 8) and data.train.x.dtype.is_floating_point is False
    assert len(data.train) + len(data.test) == 10 and len(data.test) == 3  # round(0.2 n_c) of each class: 1 + 1 + 1
    assert data.natural_partition is None and not data.local_test
    # the held-out rows are fixed, and each row keeps its image and label
    again = load(tmp_path / "ds")
    assert np.array_equal(again.train.y.numpy(), data.train.y.numpy())
    by_pixels = {a.transpose(2, 0, 1).tobytes(): y for a, y in zip(arrays, labels)}
    for x, y in zip(np.concatenate([data.train.x.numpy(), data.test.x.numpy()]), np.concatenate([data.train.y.numpy(), data.test.y.numpy()])):
        assert by_pixels[x.tobytes()] == y
    assert len(data.mean) == 3 and data.info["samples"] == "images"


def test_dataset_dict_with_test_split_grayscale_and_color(tmp_path):
    train, train_arrays = image_dataset([0, 1, 0, 1, 1], names=("no", "yes"), mode="L")
    test, _ = image_dataset([1, 0], names=("no", "yes"), mode="L", seed=1)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(tmp_path / "dd")
    data = load(tmp_path / "dd")
    assert data.input_shape == (1, 8, 8) and len(data.train) == 5 and len(data.test) == 2
    assert np.array_equal(data.train.x.numpy()[:, 0], np.stack(train_arrays))  # the rows in order
    assert data.train.y.tolist() == [0, 1, 0, 1, 1] and data.test.y.tolist() == [1, 0]
    assert load(tmp_path / "dd", color="rgb").input_shape == (3, 8, 8)
    resized = load(tmp_path / "dd", size=[4, 6])
    assert resized.input_shape == (1, 4, 6)
    with pytest.raises(ConfigError) as exc:
        load(tmp_path / "dd", test_split="validation")
    assert "'test', 'train'" in one_line(exc) or "'train', 'test'" in one_line(exc)


def test_parquet_file_and_folder_of_split_files(tmp_path):
    train, _ = image_dataset([0, 1, 2, 2, 1, 0])
    test, _ = image_dataset([2, 1], seed=3)
    train.to_parquet(str(tmp_path / "one.parquet"))
    data = load(tmp_path / "one.parquet", test_fraction=0.5)
    assert data.classes == ["zebra", "ant", "cat"] and len(data.train) == 3 and len(data.test) == 3
    (tmp_path / "split").mkdir()
    train.to_parquet(str(tmp_path / "split" / "train.parquet"))
    test.to_parquet(str(tmp_path / "split" / "test.parquet"))
    data = load(tmp_path / "split")
    assert len(data.train) == 6 and data.test.y.tolist() == [2, 1] and data.info["test_split"] == "test"


def test_csv_feature_vectors_and_string_labels(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=12), rng.normal(size=12)
    kind = ["dog", "cat", "emu"] * 4
    datasets.Dataset.from_dict({"a": a, "b": b, "kind": kind, "note": ["x"] * 12}).to_csv(str(tmp_path / "train.csv"), index=False)
    data = load(tmp_path / "train.csv", features=["a", "b"], label="kind", test_fraction=0.25)
    assert data.classes == ["cat", "dog", "emu"] and data.input_shape == (2,) and data.mean is None
    rows = np.concatenate([data.train.x.numpy(), data.test.x.numpy()])
    assert np.allclose(np.sort(rows[:, 0]), np.sort(a.astype(np.float32)))
    everything = load(tmp_path / "train.csv", features=["*"], label="kind")
    assert everything.input_shape == (2,)  # 'note' is text, 'kind' the label
    standardised = load(tmp_path / "train.csv", features=["a"], label="kind", mean=[1.0], std=[2.0])
    plain = load(tmp_path / "train.csv", features=["a"], label="kind")
    assert np.allclose(standardised.train.x.numpy() * 2 + 1, plain.train.x.numpy(), atol=1e-6)


def test_list_columns_are_flattened_and_integer_labels_sorted_numerically(tmp_path):
    ds = datasets.Dataset.from_dict({"v": [[i, i + 1.0, i + 2.0] for i in range(6)], "s": list(range(6)), "y": [10, 9, 10, 2, 9, 2]})
    ds.save_to_disk(tmp_path / "v")
    data = load(tmp_path / "v", features=["v", "s"], label="y", test_fraction=0)
    assert data.input_shape == (4,) and data.classes == ["2", "9", "10"]
    assert data.train.x.numpy()[1].tolist() == [1, 2, 3, 1] and data.train.y.tolist() == [2, 1, 2, 0, 1, 0]
    assert len(data.test) == 0


def test_client_column_is_a_natural_partition(tmp_path):
    labels = [0, 1, 2, 0, 1, 2, 0, 1]
    clients = ["c10", "c2", "c10", "c2", "c1", "c1", "c2", "c1"]
    train, _ = image_dataset(labels, user=clients)
    test, _ = image_dataset([2, 0, 1], user=["c1", "c2", "c10"], seed=2)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(tmp_path / "fed")
    data = load(tmp_path / "fed", client="user")
    assert data.client_names == ["c1", "c2", "c10"] and data.local_test
    per_client = [[labels[i] for i in range(8) if clients[i] == c] for c in data.client_names]
    assert [[int(data.train.y[i]) for i in rows] for rows in data.natural_partition["train"]] == per_client
    assert [[int(data.test.y[i]) for i in rows] for rows in data.natural_partition["test"]] == [[2], [0], [1]]
    # without a test split: round(test_fraction n_c) of each class of each client, at least one kept for training
    held = load(tmp_path / "fed" / "train", client="user", test_fraction=0.5)
    assert [len(r) for r in held.natural_partition["test"]] == [1, 1, 0]  # round(0.5 n_c) of each class, at most n_c - 1: single samples stay
    assert [len(r) for r in held.natural_partition["train"]] == [2, 2, 2]


def test_mixed_sizes_need_size(tmp_path):
    _, small = pictures(2, (8, 8))
    _, large = pictures(2, (10, 6), seed=1)
    ds = datasets.Dataset.from_dict({"image": small + large, "label": [0, 1, 0, 1]}, features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}))
    ds.save_to_disk(tmp_path / "mixed")
    with pytest.raises(DataError) as exc:
        load(tmp_path / "mixed")
    assert "dataset.size" in one_line(exc) and "8x8" in one_line(exc)
    assert load(tmp_path / "mixed", size=12).input_shape == (3, 12, 12)


@pytest.mark.parametrize(
    "options,error,fragment",
    [
        ({"label": "lable"}, ConfigError, "dataset.label=lable"),
        ({"client": "who"}, ConfigError, "dataset.client=who"),
        ({"image": "picture"}, ConfigError, "dataset.image=picture"),
        ({"image": "label"}, ConfigError, "not images"),
        ({"features": ["nope"]}, ConfigError, "dataset.features=nope"),
        ({"features": ["img"]}, ConfigError, "not of numbers"),
        ({"train_split": "training"}, ConfigError, "no such split"),
        ({"max_memory_gb": 1e-9}, DataError, "dataset.max_memory_gb"),
        ({"classes": ["zebra", "ant"]}, DataError, "'cat'"),
    ],
)
def test_bad_options_are_one_line_errors_naming_the_columns(tmp_path, options, error, fragment):
    train, _ = image_dataset([0, 1, 2, 0])
    datasets.DatasetDict({"train": train}).save_to_disk(tmp_path / "d")
    with pytest.raises(error) as exc:
        load(tmp_path / "d", **options)
    assert fragment in one_line(exc)
    if "no such column" in str(exc.value):
        assert "img (Image), label (ClassLabel)" in str(exc.value)


def test_bad_data_is_a_one_line_error(tmp_path, monkeypatch):
    outside, _ = image_dataset([0, -1, 1])
    outside.save_to_disk(tmp_path / "outside")
    with pytest.raises(DataError) as exc:
        load(tmp_path / "outside")
    assert "-1 in row 1" in one_line(exc)
    (tmp_path / "empty.csv").write_text("a,label\n")
    with pytest.raises(DataError) as exc:  # datasets' own words: 'Instruction "train" corresponds to no data!'
        load(tmp_path / "empty.csv", features=["a"])
    assert "empty.csv" in one_line(exc)
    datasets.Dataset.from_dict({"a": [1, 2], "label": [0, 1]}).save_to_disk(tmp_path / "noimage")
    with pytest.raises(ConfigError) as exc:
        load(tmp_path / "noimage")
    assert "dataset.features" in one_line(exc) and "a (int64), label (int64)" in one_line(exc)
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match="holds no dataset"):
        load(tmp_path / "nothing")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError) as exc:
        load(tmp_path / "bad.parquet")
    assert "cannot be read" in one_line(exc)
    with pytest.raises(ConfigError, match="data_dir=PATH .* or dataset.hub=ID"):
        load(None)
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "missing")
    empty = datasets.Dataset.from_dict({"a": [1.0], "label": [0]}).filter(lambda row: False)
    monkeypatch.setattr(datasets, "load_from_disk", lambda path: empty)  # (datasets saves an empty dataset it cannot read back)
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    with pytest.raises(DataError, match="no rows"):
        load(tmp_path / "saved", features=["a"])


def test_hub_offline_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as exc:
        load(None, hub="someone/not-cached-here")
    assert "offline" in one_line(exc) and "save_to_disk" in one_line(exc)


def test_missing_packages_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"pip install 'contrafl\[huggingface\]'"):
        load(None, hub="x/y")
    monkeypatch.setitem(sys.modules, "flwr_datasets", None)
    with pytest.raises(ConfigError, match=r"pip install 'contrafl\[huggingface\]'"):
        make_partition(np.arange(20) % 2, 2, "flwr_iid")


def test_importing_contrafl_data_imports_neither_package():
    code = "import sys, contrafl.data; print('datasets' in sys.modules, 'flwr_datasets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# --------------------------------------------------------------------------------------------
# Flower Datasets' partitioners


def flower_rows(partitioner, labels, shuffle_seed=None):
    table = datasets.Dataset.from_dict({"label": np.asarray(labels), "row": np.arange(len(labels))})
    partitioner.dataset = table if shuffle_seed is None else table.shuffle(seed=shuffle_seed)
    return [list(partitioner.load_partition(i)["row"]) for i in range(partitioner.num_partitions)]


def ours(labels, clients, method, seed, **options):
    return [idx.tolist() for idx in make_partition(np.asarray(labels), clients, method, options, seed=seed).train]


LABELS = np.random.default_rng(5).integers(0, 6, 400)


@pytest.mark.parametrize("seed", [0, 7])
def test_flwr_partitions_equal_flower_datasets(seed):
    fp = pytest.importorskip("flwr_datasets.partitioner")
    cases = [
        ("flwr_iid", {}, fp.IidPartitioner(5)),
        ("flwr_dirichlet", {"alpha": 0.5}, fp.DirichletPartitioner(5, "label", 0.5, seed=seed)),
        ("flwr_dirichlet", {"alpha": "[0.3,0.5,1,2,4]", "min_partition_size": 5, "self_balancing": True, "shuffle": False},
         fp.DirichletPartitioner(5, "label", [0.3, 0.5, 1.0, 2.0, 4.0], 5, True, False, seed=seed)),
        ("flwr_pathological", {"num_classes_per_partition": 2}, fp.PathologicalPartitioner(5, "label", 2, seed=seed)),
        ("flwr_pathological", {"num_classes_per_partition": 3, "class_assignment_mode": "first_deterministic"},
         fp.PathologicalPartitioner(5, "label", 3, "first-deterministic", seed=seed)),
        ("flwr_shard", {}, fp.ShardPartitioner(5, "label", 2, seed=seed)),
        ("flwr_shard", {"num_shards_per_partition": None, "shard_size": 30, "keep_incomplete_shard": True},
         fp.ShardPartitioner(5, "label", None, 30, True, seed=seed)),
        ("flwr_inner_dirichlet", {"alpha": 0.5}, fp.InnerDirichletPartitioner([80] * 5, "label", 0.5, seed=seed)),
        ("flwr_linear", {}, fp.LinearPartitioner(5)),
        ("flwr_square", {}, fp.SquarePartitioner(5)),
        ("flwr_exponential", {}, fp.ExponentialPartitioner(5)),
        ("flwr_size", {"partition_sizes": "[10,50,100,40,200]"}, fp.SizePartitioner([10, 50, 100, 40, 200])),
    ]
    for method, options, partitioner in cases:
        assert ours(LABELS, 5, method, seed, **options) == flower_rows(partitioner, LABELS), method
    # shuffle_dataset: the rows shuffled first, as FederatedDataset(shuffle=True, seed=seed) does
    assert ours(LABELS, 5, "flwr_iid", seed, shuffle_dataset=True) == flower_rows(fp.IidPartitioner(5), LABELS, shuffle_seed=seed)


def test_flwr_shuffle_dataset_equals_a_federated_dataset(tmp_path):
    fds_module = pytest.importorskip("flwr_datasets")
    from flwr_datasets.partitioner import DirichletPartitioner

    (tmp_path / "data").mkdir()
    datasets.Dataset.from_dict({"label": LABELS, "row": np.arange(len(LABELS))}).to_parquet(str(tmp_path / "data" / "train.parquet"))
    fds = fds_module.FederatedDataset(dataset=str(tmp_path / "data"), partitioners={"train": DirichletPartitioner(4, "label", 0.3, seed=42)})
    expected = [list(fds.load_partition(i)["row"]) for i in range(4)]
    assert ours(LABELS, 4, "flwr_dirichlet", 42, alpha=0.3, shuffle_dataset=True) == expected


def test_flwr_partition_errors_are_one_line():
    pytest.importorskip("flwr_datasets")
    cases = [
        ("flwr_size", {}, "partition.partition_sizes"),
        ("flwr_size", {"partition_sizes": "[1,2]"}, "num_clients=5"),
        ("flwr_dirichlet", {"alpha": "[1,2]"}, "one per client"),
        ("flwr_dirichlet", {"alpha": 0.01, "min_partition_size": 70}, "Flower Datasets says"),
        ("flwr_pathological", {"num_classes_per_partition": 7}, "the 6 classes"),
        ("flwr_shard", {"num_shards_per_partition": None}, "num_shards_per_partition or partition.shard_size"),
        ("flwr_shard", {"num_shards_per_partition": 20, "shard_size": 10}, "Flower Datasets says"),
    ]
    for method, options, fragment in cases:
        with pytest.raises(ConfigError) as exc:
            make_partition(LABELS, 5, method, options, seed=0)
        assert fragment in one_line(exc), (method, str(exc.value))
    with pytest.raises(ConfigError, match="partition.alpha=0 is invalid"):
        make_partition(LABELS, 5, "flwr_dirichlet", {"alpha": 0})


# --------------------------------------------------------------------------------------------
# Command line


def test_cli_run_on_a_huggingface_dataset(tmp_path, capsys):
    labels = [i % 3 for i in range(40)]
    ds, _ = image_dataset(labels, size=(10, 10), user=[f"u{i % 2}" for i in range(40)])
    ds.save_to_disk(tmp_path / "ds")
    common = ["rounds=1", "local_epochs=1", "batch_size=8", "dataset=huggingface", f"data_dir={tmp_path / 'ds'}", "num_clients=2"]
    assert main(["run", "--quiet", "--out", str(tmp_path / "r1"), *common, "dataset.size=8", "algorithm=moon", "partition=iid"]) == 0
    assert main(["run", "--quiet", "--out", str(tmp_path / "r2"), *common, "dataset.client=user", "partition=natural"]) == 0
    partition = json.loads((tmp_path / "r2" / "partition.json").read_text())
    assert [len(rows) for rows in partition["train"]] == [17, 17] and [len(rows) for rows in partition["test"]] == [3, 3]


def test_cli_flwr_dirichlet_on_digits_equals_flower_datasets(tmp_path):
    fp = pytest.importorskip("flwr_datasets.partitioner")
    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), "dataset=digits", "rounds=1", "local_epochs=1", "num_clients=5",
                 "partition=flwr_dirichlet", "partition.alpha=0.5", "seed=3"]) == 0
    partition = json.loads((out / "partition.json").read_text())
    labels = load_digits(LoadRequest()).train.y.numpy()
    assert partition["method"] == "flwr_dirichlet" and partition["options"]["alpha"] == 0.5
    assert partition["train"] == flower_rows(fp.DirichletPartitioner(5, "label", 0.5, seed=3), labels)


def test_decoding_many_images_prints_one_line(tmp_path, monkeypatch, capsys):
    import contrafl.data.huggingface as hf

    monkeypatch.setattr(hf, "PROGRESS_IMAGES", 4)
    ds, _ = image_dataset([0, 1, 2, 0, 1])
    ds.save_to_disk(tmp_path / "ds")
    capsys.readouterr()
    load(tmp_path / "ds")
    lines = [line for line in capsys.readouterr().err.splitlines() if "contrafl" in line]
    assert len(lines) == 1 and "decoding 5 images" in lines[0]
