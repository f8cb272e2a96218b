"""A user's own data and model through the command line: an image tree of three sites
with different class mixes, an npz of arrays, a Hugging Face dataset saved to disk, a
PFLlib-layout folder, a LEAF-layout folder and an encoder of the user's own, each with
MOON, FedCRL and FedU2 (`contrafl run`), and the README's commands as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from contrafl.cli import main
from test_custom_model import docs_file
from test_user_datasets import leaf_file, pfllib_dataset

ALGORITHMS = {
    "moon": ["model.projection_dim=8"],
    "fedcrl": ["model.projection_dim=8"],
    "fedu2": ["model.projection_hidden=16", "model.projection_dim=8", "knn_k=5"],
}
COMMON = ["num_clients=3", "rounds=1", "local_epochs=1", "batch_size=4", "executor=sequential"]
RNG = np.random.default_rng(0)


def image_tree(folder: Path, counts: dict[str, int], size: int = 8) -> None:
    for c, n in counts.items():
        (folder / c).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(RNG.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / c / f"{i}.png")


def sites(root: Path) -> Path:
    """Three sites with different class mixes, each with its own test folder."""
    for name, classes in {"site-a": ["cat", "dog"], "site-b": ["dog", "owl"], "site-c": ["cat", "dog", "owl"]}.items():
        image_tree(root / "clients" / name / "train", dict.fromkeys(classes, 6))
        image_tree(root / "clients" / name / "test", dict.fromkeys(classes, 2))
    return root


def arrays(path: Path) -> Path:
    np.savez(path, x_train=RNG.integers(0, 256, (40, 8, 8, 3), dtype=np.uint8), y_train=np.arange(40) % 4,
             x_test=RNG.integers(0, 256, (12, 8, 8, 3), dtype=np.uint8), y_test=np.arange(12) % 4,
             classes=np.array(["a", "b", "c", "d"]))
    return path


def huggingface(path: Path) -> Path:
    datasets = pytest.importorskip("datasets")
    pictures = [Image.fromarray(RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(48)]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["ant", "bee", "cat"])})
    data = datasets.Dataset.from_dict({"img": pictures, "label": [i % 3 for i in range(48)]}, features=features)
    datasets.DatasetDict({"train": data.select(range(36)), "test": data.select(range(36, 48))}).save_to_disk(str(path))
    return path


def leaf(root: Path) -> Path:
    users = {"f0001": (12, 0), "f0002": (10, 2), "f0003": (9, 4)}
    leaf_file(root / "train" / "all_data_0_niid_0_keep_0_train_9.json", users, dim=64)
    leaf_file(root / "test" / "all_data_0_niid_0_keep_0_test_9.json", {u: (4, first) for u, (_, first) in users.items()}, dim=64)
    return root


ENCODER = '''\
from torch import nn


def encoder(width: int = 16):
    """A small convolutional encoder of the user's: [B, 3, H, W] -> [B, width]."""
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
'''


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, list[str]]:
    """Each source's settings: the data, and for SSL a two-view augmentation that fits."""
    root = tmp_path_factory.mktemp("own")
    (root / "nets.py").write_text(ENCODER)
    images, vectors = ["augment=flip"], ["augment=scarf"]
    return {
        "folder": ["dataset=folder", f"data_dir={sites(root / 'sites')}", "partition=natural", "model=mlp", *images],
        "arrays": ["dataset=arrays", f"data_dir={arrays(root / 'arrays.npz')}", "partition=iid", *images],
        "huggingface": ["dataset=huggingface", f"data_dir={huggingface(root / 'hf')}", "partition=dirichlet", "partition.min_size=2", *images],
        "pfllib": ["dataset=pfllib", f"data_dir={pfllib_dataset_in(root / 'pfllib')}", "partition=natural", *images],
        "leaf": ["dataset=leaf", f"data_dir={leaf(root / 'leaf')}", "partition=natural", *vectors],
        "encoder": ["dataset=folder", f"data_dir={root / 'sites'}", "partition=natural", f"model={root / 'nets.py'}:encoder", "model.width=8", *images],
    }


def pfllib_dataset_in(root: Path) -> Path:
    pfllib_dataset(root, [(12, 4), (9, 3), (10, 3)], num_classes=3, shape=(3, 8, 8))
    return root


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("source", ["folder", "arrays", "huggingface", "pfllib", "leaf", "encoder"])
def test_moon_fedcrl_and_fedu2_run_on_the_users_data_and_model(tmp_path, sources, source, algorithm):
    out = tmp_path / "run"
    settings = [f"algorithm={algorithm}", *COMMON, *ALGORITHMS[algorithm], *sources[source]]
    if algorithm != "fedu2":
        settings = [s for s in settings if not s.startswith("augment=")]
    assert main(["run", "--quiet", "--out", str(out), *settings]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 1
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    measured = {"moon": "test_acc", "fedcrl": "personal_acc", "fedu2": "knn_acc"}[algorithm]
    assert 0 <= row[measured] <= 1
    labels = json.loads((out / "label_counts.json").read_text())
    if source in ("folder", "encoder"):
        assert labels["classes"] == ["cat", "dog", "owl"] and [sum(c) for c in labels["counts"]] == [12, 12, 18]


def readme_commands() -> list[str]:
    section = Path(__file__).parents[1].joinpath("README.md").read_text().split("## Your own data and model")[1].split("\n## ")[0]
    block = section.split("```bash\n")[1].split("```")[0]
    return [line for line in block.splitlines() if line.strip()]


def test_the_readmes_own_data_commands_run_as_written(tmp_path, monkeypatch, sources):
    """The README's three commands, run in a folder holding the files they name (a
    shorter run: rounds=1 and fewer clients); its encoder is docs/extending.md's
    nets.py, whose factory the README names (issue #54)."""
    monkeypatch.chdir(tmp_path)
    image_tree(tmp_path / "my-images" / "train", dict.fromkeys(["a", "b"], 10), size=32)
    Path("nets.py").write_text(docs_file("nets.py"))  # docs/extending.md's encoder, which the README's command names
    arrays(tmp_path / "my-arrays.npz")
    huggingface(tmp_path / "my-hf-dataset")
    commands = readme_commands()
    assert len(commands) == 3
    for command in commands:
        args = command.split()[1:] + ["rounds=1", "num_clients=2", "batch_size=4", "executor=sequential", "partition.min_size=2"]
        assert main(args) == 0, command
    assert len(list(Path("runs").iterdir())) >= 3
    assert re.search(r"model=\./nets\.py:make_encoder", commands[0])


@pytest.mark.slow
def test_a_killed_run_on_the_users_folders_and_encoder_resumes_exactly(tmp_path, sources):
    """Killed in its second round (a subprocess, SIGKILL), resumed: the metrics of the run
    that was not interrupted, byte for byte; then `report` and `eval-repr` read it."""
    from test_resume import _killed_run

    settings = ["algorithm=moon", *COMMON, "rounds=3", "model.projection_dim=8", *sources["encoder"][:-1]]
    assert main(["run", "--quiet", "--out", str(tmp_path / "clean"), *settings]) == 0
    run = tmp_path / "run"
    _killed_run(run, "round", 3 + 2, settings)  # round 2, two of the three clients done
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 1
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == (tmp_path / "clean" / "metrics.jsonl").read_bytes()
    assert main(["report", str(run)]) == 0
    assert main(["eval-repr", str(run), "--protocol", "knn"]) == 0


@pytest.mark.slow
def test_a_sweep_over_the_users_arrays(tmp_path, sources):
    spec = tmp_path / "s.yaml"
    base = dict(s.split("=", 1) for s in [*COMMON, *sources["arrays"][:-1]])
    spec.write_text(json.dumps({"base": base, "grid": {"algorithm": ["fedavg", "moon"]}}))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--workers", "1"]) == 0
    assert "| 1 completed |" in (tmp_path / "out" / "results.md").read_text()


def test_an_encoder_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """`model=models/nets.py:encoder` whose file imports `blocks.py` from its folder (as
    `python models/nets.py` would), run from another folder and with the parallel
    executor, whose workers import it too."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "blocks.py").write_text("from torch import nn\n\n\ndef block(width):\n    return nn.Sequential(nn.Linear(64, width), nn.ReLU())\n")
    (tmp_path / "models" / "nets.py").write_text("from blocks import block\n\n\ndef encoder(width: int = 8):\n    return block(width)\n")
    monkeypatch.chdir(tmp_path)
    settings = ["dataset=digits", "model=models/nets.py:encoder", "algorithm=moon", *COMMON, "executor=parallel", "workers=2"]
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *settings]) == 0
