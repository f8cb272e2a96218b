"""``contrafl plot-repr``: t-SNE of a run's test representations (MOON's Figure 2)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from matplotlib.image import imread
from sklearn.metrics import silhouette_score

from contrafl.cli import main
from contrafl.experiments.tsne import loo_knn_accuracy
from conftest import strict_json

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["num_clients=3", "local_epochs=1", "eval_personal=false", "executor=sequential", "batch_size=32"]
SAMPLES = 200


@pytest.fixture(scope="module")
def avg_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("plot-repr") / "avg"
    assert main(["run", "--quiet", "--out", str(out), "rounds=2", *TINY]) == 0
    return out


def _plot(run, *args: str) -> dict:
    assert main(["plot-repr", str(run), "--samples", str(SAMPLES), *args]) == 0
    return strict_json((run / "representation" / "tsne.json").read_text())


def test_global_and_local_panels_of_a_trained_run(avg_run, capsys):
    record = _plot(avg_run, "--clients", "2,0")
    png = avg_run / "representation" / "tsne.png"
    assert record["png"] == "tsne.png" and record["round"] == record["local_from_round"] == 2
    assert record["global_trained"] is True and "note" not in record
    assert record["algorithm"] == "fedavg" and record["dataset"] == "digits" and record["classes"] == [str(c) for c in range(10)]
    assert [(p["model"], p["client"]) for p in record["panels"]] == [("global", None), ("local", 0), ("local", 2)]
    labels, indices = np.array(record["labels"]), record["indices"]
    assert record["samples"] == len(labels) == len(set(indices)) == SAMPLES
    assert np.bincount(labels, minlength=10).min() >= SAMPLES // 10 - 2  # class-stratified (digits is balanced)
    for panel in record["panels"]:
        xy = np.array(panel["coordinates"])
        assert xy.shape == (SAMPLES, 2) and np.isfinite(xy).all() and xy.std(axis=0).min() > 1
        # the scores describe the stored embedding and features; a trained model on digits is far above chance
        assert panel["silhouette"] == pytest.approx(silhouette_score(xy, labels), abs=1e-3)
        assert panel["silhouette"] > 0.1 and panel["knn_acc"] > 0.6  # chance: ~0 and 0.1
        assert round(panel["knn_acc"] * SAMPLES) == pytest.approx(panel["knn_acc"] * SAMPLES, abs=1e-9)
    # local training moved the models: their embeddings differ from the global one
    assert record["panels"][1]["coordinates"] != record["panels"][0]["coordinates"]
    image = imread(png)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 3 * image.shape[0] // 2  # three panels side by side
    assert image[..., :3].std() > 0.05 and (image[..., :3] < 0.9).any(axis=-1).mean() > 0.01  # not blank
    out = capsys.readouterr().out
    assert "global model silhouette" in out and "client 2, local model" in out and "tsne.png" in out
    # #35: its score is named as what it is, not "kNN" (eval-repr's weighted kNN accuracy is another metric)
    panel = record["panels"][0]
    assert f"leave-one-out {record['knn_k']}-NN accuracy {panel['knn_acc']:.3f}" in out and "kNN" not in out


@pytest.mark.slow
def test_same_seed_same_coordinates(avg_run, tmp_path):
    """The global panel alone (--no-local), written elsewhere (--out), twice with one seed:
    the same subset and coordinates, also those of the first test's global panel; another
    seed draws another subset."""
    runs = []
    for seed in ("3", "3", "4"):
        png = tmp_path / f"tsne-{len(runs)}.png"
        assert main(["plot-repr", str(avg_run), "--no-local", "--samples", str(SAMPLES), "--seed", seed, "--out", str(png)]) == 0
        runs.append(strict_json(png.with_suffix(".json").read_text()))
        assert png.is_file() and runs[-1]["png"] == png.name
    first, again, other = runs
    assert [p["model"] for p in first["panels"]] == ["global"] and "local_from_round" not in first
    assert first["indices"] == again["indices"] and first["panels"] == again["panels"]
    assert other["indices"] != first["indices"]


def test_errors_are_one_line(avg_run, tmp_path, capsys):
    empty = tmp_path / "no-checkpoint"
    empty.mkdir()
    shutil.copy(avg_run / "config.yaml", empty / "config.yaml")
    pooled = tmp_path / "pooled"  # the clients' test splits: 0.5% of their samples
    assert main(["run", "--quiet", "--out", str(pooled), "rounds=1", "pool=true", "test_fraction=0.005", *TINY]) == 0
    cases = [
        ([str(avg_run), "--clients", "3"], "'3' is not valid"),
        ([str(avg_run), "--clients", "0", "--no-local"], "exclude each other"),
        ([str(avg_run), "--samples", "5"], "--samples 5 is too few: give at least 20"),
        ([str(avg_run), "--perplexity", "0"], "--perplexity 0.0 must be positive"),
        ([str(empty)], "has no checkpoint yet"),
        ([str(tmp_path)], "not a run directory"),
        ([str(pooled)], "has 11 samples, too few for its 8 classes (at least 16)"),
    ]
    for args, message in cases:
        capsys.readouterr()
        assert main(["plot-repr", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_a_run_without_a_global_encoder_plots_local_models_only(tmp_path, capsys):
    run = tmp_path / "proto"
    assert main(["run", "--quiet", "--out", str(run), "algorithm=fedproto", "rounds=1", *TINY]) == 0
    record = _plot(run, "--clients", "1")
    assert record["global_trained"] is False and "fedproto trains no global encoder" in record["note"]
    assert [(p["model"], p["client"]) for p in record["panels"]] == [("local", 1)]
    assert "no global panel" in capsys.readouterr().out
    assert main(["plot-repr", str(run), "--no-local"]) == 2
    assert "--no-local leaves nothing to plot" in capsys.readouterr().err


def test_a_self_supervised_run(tmp_path):
    run = tmp_path / "simclr"
    settings = ["algorithm=fedsimclr", "rounds=1", "model.projection_hidden=16", "model.projection_dim=8", *TINY]
    assert main(["run", "--quiet", "--out", str(run), *settings]) == 0
    record = _plot(run, "--no-local", "--perplexity", "500")
    (panel,) = record["panels"]
    assert record["perplexity"] == SAMPLES - 1  # clipped below the number of samples
    assert np.isfinite(panel["silhouette"]) and panel["knn_acc"] > 0.3  # one round of SimCLR on digits; chance 0.1


def test_leave_one_out_knn_accuracy():
    # directions at 0, 5.7 and -5.7 degrees (class 0), 90 and 84.3 (class 1), and a stray
    # sample of class 1 at -20 degrees, next to class 0; lengths do not matter (cosine)
    features = torch.tensor([[1.0, 0.0], [2.0, 0.2], [1.0, -0.1], [0.0, 3.0], [0.1, 1.0], [1.0, -0.364]])
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    # k = 1: the stray sample's nearest neighbour is of class 0, every other one's of its own class
    assert loo_knn_accuracy(features, labels, 1) == pytest.approx(5 / 6)
    # k = 3: the class-0 samples see each other and the stray one; the others see 2 of class 0
    assert loo_knn_accuracy(features, labels, 3) == pytest.approx(3 / 6)
    # k = 5, all the others: the other class is the majority for everyone; k is clipped to N - 1
    assert loo_knn_accuracy(features, labels, 5) == loo_knn_accuracy(features, labels, 100) == 0
