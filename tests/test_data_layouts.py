"""Data split per client by their files (PFLlib's folders, LEAF's users, ``ROOT/clients/``),
issue #54: each folder is checked whole (a missing, empty or unreadable file of any
client is a one-line error), its clients fix ``partition=natural`` and ``num_clients``
(counted from names, before any sample is read), and a run on it records the evaluation
docs/data.md describes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from contrafl.cli import main
from contrafl.config import load_config
from contrafl.data import arrays, folder, leaf
from contrafl.engine.setup import resolve
from contrafl.errors import ConfigError, DataError
from test_user_datasets import leaf_file, one_line_error, pfllib_dataset, tree

FAST_RUN = ["rounds=1", "local_epochs=1", "batch_size=8", "executor=sequential", "--quiet"]
DOCS = Path(__file__).parents[1] / "docs" / "data.md"


def pfllib_folder(root: Path) -> Path:
    pfllib_dataset(root, [(20, 4), (16, 4), (18, 5)], shape=(12,))
    return root


def leaf_folder(root: Path) -> Path:
    leaf_file(root / "train" / "all_data_0_niid_0_keep_0_train_9.json", {"f1": (20, 0), "f2": (18, 3)})
    leaf_file(root / "test" / "all_data_0_niid_0_keep_0_test_9.json", {"f1": (4, 0), "f2": (4, 3)})
    return root


def sites(root: Path) -> Path:
    for name in ("site1", "site2", "site10"):
        tree(root / "clients" / name / "train", {"a": 4, "b": 4})
        tree(root / "clients" / name / "test", {"a": 1, "b": 1})
    return root


def save_pfllib(path: Path, n: int, shape=(12,)) -> None:
    with open(path, "wb") as f:
        np.savez_compressed(f, data={"x": np.zeros((n, *shape), np.float32), "y": np.zeros(n, np.int64)})


def one_line_exit(capsys, *args: str) -> str:
    assert main(["run", *FAST_RUN, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ---------------------------------------------------------------------------------------------
# Checked whole


@pytest.mark.parametrize(
    "damage,fragment",
    [
        (lambda root: (root / "test" / "1.npz").unlink(), "test/1.npz is missing: client 1 has training file"),
        (lambda root: (root / "test" / "2.npz").write_bytes(b""), "test/2.npz is empty (0 bytes)"),
        (lambda root: (root / "train" / "0.npz").write_bytes(b""), "train/0.npz is empty (0 bytes)"),
        (lambda root: save_pfllib(root / "test" / "1.npz", 0), "test/1.npz holds no samples"),
        (lambda root: save_pfllib(root / "train" / "2.npz", 0), "train/2.npz holds no samples"),
        (lambda root: (root / "test" / "0.npz").write_bytes(b"not a zip"), "test/0.npz is not a readable .npz file"),
    ],
    ids=["missing-test", "empty-test", "empty-train", "no-test-samples", "no-train-samples", "unreadable-test"],
)
def test_a_pfllib_folder_is_checked_whole(tmp_path, capsys, damage, fragment):
    root = pfllib_folder(tmp_path / "p")
    damage(root)
    text = one_line_error(DataError, fragment, "pfllib", root)
    assert str(root) in text and ("generate" in text or "copy" in text)
    line = one_line_exit(capsys, "--out", str(tmp_path / "run"), "dataset=pfllib", f"data_dir={root}", "model.hidden=[8]")
    assert fragment in line and not (tmp_path / "run").exists()


def test_a_leaf_folder_is_checked_whole(tmp_path):
    root = leaf_folder(tmp_path / "l")
    test_file = root / "test" / "all_data_0_niid_0_keep_0_test_9.json"
    leaf_file(test_file, {"f1": (4, 0)})  # the test file lacks a user of the training file
    text = one_line_error(DataError, "user 'f2' has no test samples", "leaf", root)
    assert "train_9.json" in text and "-t sample" in text
    leaf_file(test_file, {"f1": (4, 0), "f2": (0, 3)})  # an empty user
    one_line_error(DataError, "(user f2): no test samples", "leaf", root)
    leaf_file(root / "train" / "all_data_0_niid_0_keep_0_train_9.json", {"f1": (20, 0), "f2": (0, 3)})
    leaf_file(test_file, {"f1": (4, 0), "f2": (4, 3)})
    one_line_error(DataError, "(user f2): no train samples", "leaf", root)
    leaf_folder(root)
    test_file.unlink()
    one_line_error(DataError, "test holds no .json files", "leaf", root)


# ---------------------------------------------------------------------------------------------
# The files fix partition=natural and num_clients


def test_files_split_per_client_make_the_natural_partition_the_default(tmp_path):
    cases = {"pfllib": (pfllib_folder(tmp_path / "p"), 3), "leaf": (leaf_folder(tmp_path / "l"), 2), "folder": (sites(tmp_path / "s"), 3)}
    for name, (root, clients) in cases.items():
        cfg = resolve(load_config(None, [f"dataset={name}", f"data_dir={root}"]))
        assert (cfg.partition.name, cfg.num_clients) == ("natural", clients), name
        same = resolve(load_config(None, [f"dataset={name}", f"data_dir={root}", "partition=natural", f"num_clients={clients}"]))
        assert same == cfg
    tree(tmp_path / "plain" / "train", {"a": 4, "b": 4})  # not split per client: the general defaults
    cfg = resolve(load_config(None, ["dataset=folder", f"data_dir={tmp_path / 'plain'}"]))
    assert (cfg.partition.name, cfg.num_clients) == ("dirichlet", 10)
    assert resolve(load_config(None, ["dataset=folder", f"data_dir={tmp_path / 'plain'}", "num_clients=3", "partition=iid"])).num_clients == 3


def test_leaf_users_are_counted_without_parsing_the_samples(tmp_path, monkeypatch):
    root = leaf_folder(tmp_path / "l")
    monkeypatch.setattr(leaf, "_read", lambda path: pytest.fail(f"{path} was parsed to count its users"))
    assert resolve(load_config(None, ["dataset=leaf", f"data_dir={root}"])).num_clients == 2


@pytest.mark.parametrize(
    "setting,fragments",
    [
        ("num_clients=2", ["num_clients=2", "split into 3 clients (site1, site2, site10)", "set num_clients=3"]),
        ("partition=dirichlet", ["partition=dirichlet", "split into 3 clients", "partition=natural"]),
    ],
)
def test_a_conflicting_setting_is_one_line_before_any_image_is_decoded(tmp_path, capsys, monkeypatch, setting, fragments):
    root = sites(tmp_path / "s")
    monkeypatch.setattr(folder, "_pixels", lambda *args: pytest.fail("images decoded before the settings were checked"))
    line = one_line_exit(capsys, "--out", str(tmp_path / "run"), "dataset=folder", f"data_dir={root}", setting)
    assert all(f in line for f in fragments), line
    assert not (tmp_path / "run").exists() and not (root / folder.CACHE_DIR).exists()
    with pytest.raises(ConfigError, match="num_clients=5, but the files of"):
        resolve(load_config(None, ["dataset=pfllib", f"data_dir={pfllib_folder(tmp_path / 'p')}", "num_clients=5"]))


def test_a_column_of_client_ids_makes_the_natural_partition_the_default(tmp_path, capsys, monkeypatch):
    """Arrays' ``client_train`` and a Hugging Face ``dataset.client`` column fix the
    clients as the files of the other layouts do: counted from the ids alone (no sample
    read), ``partition=natural`` and ``num_clients`` the defaults, other values refused in
    one line; then ``dataset=arrays data_dir=FILE`` is the whole command."""
    path = tmp_path / "sites.npz"
    np.savez(path, x_train=np.zeros((24, 4), np.float32), y_train=np.arange(24) % 2, client_train=np.array(["c10", "c2", "c1"] * 8))
    with monkeypatch.context() as m:
        m.setattr(arrays, "as_samples", lambda *args: pytest.fail("samples read to count the clients"))
        cfg = resolve(load_config(None, ["dataset=arrays", f"data_dir={path}"]))
        assert (cfg.partition.name, cfg.num_clients) == ("natural", 3)
        line = one_line_exit(capsys, "--out", str(tmp_path / "bad"), "dataset=arrays", f"data_dir={path}", "num_clients=2")
        assert f"num_clients=2, but the files of data_dir={path} are split into 3 clients (c1, c2, c10)" in line, line
        assert "partition=natural" in one_line_exit(capsys, "--out", str(tmp_path / "bad"), "dataset=arrays", f"data_dir={path}", "partition=iid")
    assert main(["run", *FAST_RUN, "--out", str(tmp_path / "run"), "dataset=arrays", f"data_dir={path}", "model.hidden=[8]"]) == 0
    assert len(json.loads((tmp_path / "run" / "partition.json").read_text())["train"]) == 3
    np.savez(path, x_train=np.zeros((24, 4), np.float32), y_train=np.arange(24) % 2)  # no client ids: the general defaults
    cfg = resolve(load_config(None, ["dataset=arrays", f"data_dir={path}"]))
    assert (cfg.partition.name, cfg.num_clients) == ("dirichlet", 10)

    datasets = pytest.importorskip("datasets")
    from contrafl.data import huggingface

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = {"f": [float(i) for i in range(20)], "label": [i % 2 for i in range(20)], "site": ["b", "a"] * 8 + ["c"] * 4}
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "hf")
    common = ["dataset=huggingface", f"data_dir={tmp_path / 'hf'}", "dataset.features=f"]
    monkeypatch.setattr(huggingface, "_vectors", lambda *args: pytest.fail("samples read to count the clients"))
    cfg = resolve(load_config(None, [*common, "dataset.client=site"]))
    assert (cfg.partition.name, cfg.num_clients) == ("natural", 3)
    with pytest.raises(ConfigError, match=r"^partition=iid, but the files of data_dir=.* are split into 3 clients \(a, b, c\)"):
        resolve(load_config(None, [*common, "dataset.client=site", "partition=iid"]))
    with pytest.raises(ConfigError, match="dataset.client=who: .* has no such column"):
        resolve(load_config(None, [*common, "dataset.client=who"]))
    assert resolve(load_config(None, common)).num_clients == 10  # no client column


def test_a_deployment_counts_the_clients_the_files_fix(tmp_path):
    pytest.importorskip("flwr")
    from contrafl.flower.deploy import check_settings

    check_settings(load_config(None, []), 60.0, 10)  # num_clients unset: 10 clients
    with pytest.raises(ConfigError, match="min_replies=4 must be between 0 and num_clients=3"):
        check_settings(load_config(None, ["dataset=pfllib", f"data_dir={pfllib_folder(tmp_path / 'p')}"]), 60.0, 4)


# ---------------------------------------------------------------------------------------------
# What a natural run evaluates, as docs/data.md says


def test_a_natural_run_records_the_evaluation_docs_data_md_describes(tmp_path):
    root = pfllib_folder(tmp_path / "p")
    runs = {}
    for evaluation in ("auto", "federated"):
        out = tmp_path / evaluation
        assert main(["run", "--out", str(out), *FAST_RUN, "dataset=pfllib", f"data_dir={root}", "model.hidden=[8]",
                     f"global_eval={evaluation}"]) == 0
        saved = yaml.safe_load((out / "config.yaml").read_text())
        runs[evaluation] = saved, json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    (saved, server), (_, federated) = runs["auto"], runs["federated"]
    assert (saved["partition"], saved["num_clients"], saved["global_eval"]) == ("natural", 3, "server")
    bullet = " ".join(DOCS.read_text().split("- **Test data.**")[1].split("\n- **")[0].split())
    assert f"`global_eval=auto` is recorded as `{saved['global_eval']}`" in bullet
    assert server["test_acc"] == federated["test_acc"] and federated["test_clients"] == 3
    assert server["test_loss"] == pytest.approx(federated["test_loss"], rel=1e-5)
