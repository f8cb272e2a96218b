"""Comparisons a reviewer accepts (#54): one metric family per table and figure, bootstrap
intervals over seeds, paired differences and the cost of reaching a target."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from scipy.stats import bootstrap

from conftest import chromium_screenshot
from contrafl.cli import main
from contrafl.experiments.stats import UNKNOWN, interval, paired_difference, reached


def test_interval_is_scipys_bootstrap_of_the_mean():
    values = [0.61, 0.64, 0.60, 0.66, 0.58]
    ci = bootstrap((np.array(values),), np.mean, n_resamples=9999, method="BCa", rng=np.random.default_rng(0)).confidence_interval
    got = interval(values)
    assert got.n == 5 and got.mean == pytest.approx(np.mean(values))
    assert (got.low, got.high) == (pytest.approx(ci.low), pytest.approx(ci.high))
    assert got.low < got.mean < got.high and interval(values) == got  # the same table every time


def test_one_seed_has_no_interval_and_equal_values_a_point():
    one = interval([0.5])
    assert not one.known and one.text() == f"50.00 ({UNKNOWN})"
    assert interval([0.5, 0.5, 0.5]).text() == "50.00 [50.00, 50.00]"
    assert interval([]) is None


def test_paired_difference_uses_the_seeds_both_ran():
    method = {0: 0.70, 1: 0.72, 2: 0.69, 3: 0.99}
    base = {0: 0.60, 1: 0.63, 2: 0.58}
    diff = paired_difference(method, base)
    assert diff.n == 3 and diff.mean == pytest.approx(np.mean([0.10, 0.09, 0.11]))
    assert diff.excludes_zero and diff.text(signed=True).startswith("+10.00 [")
    noisy = paired_difference({0: 0.70, 1: 0.60, 2: 0.66}, {0: 0.65, 1: 0.66, 2: 0.64})
    assert noisy.known and not noisy.excludes_zero
    assert paired_difference({5: 0.1}, {0: 0.2}) is None


def test_rounds_bytes_and_seconds_to_a_target():
    rows = [
        {"round": 1, "test_acc": 0.2, "bytes_down": {"model": 10}, "bytes_up": {"model": 5}},
        {"round": 2, "test_acc": 0.5, "bytes_down": {"model": 10}, "bytes_up": {"model": 5}},
        {"round": 3, "test_acc": 0.4, "bytes_down": {"model": 10}, "bytes_up": {"model": 5}},
    ]
    got = reached([(rows, {1: 1.5, 2: 2.5, 3: 1.0}), (rows[:1], {1: 1.0}), (rows, {1: 1.0})], "test_acc", 0.45)
    assert got.rounds == [2, None, 2] and got.bytes == [30, None, 30] and got.seconds == [4.0, None, None]
    assert got.cell("rounds") == "2.0 (2/3 seeds)" and reached([(rows, {})], "test_acc", 0.9).cell("rounds") == "not reached"


def _tables(text: str) -> dict[str, list[list[str]]]:
    """Each printed table under its bold title: the rows of cells."""
    tables = {}
    for title, body in re.findall(r"\*\*(.+?): mean over seeds.*?\*\*\n\n((?:\|.*\n?)+)", text):
        lines = [line for line in body.strip().splitlines() if not line.startswith("|---")]
        tables[title] = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return tables


@pytest.mark.slow
def test_compare_prints_and_draws_one_metric_family_each(tmp_path, capsys):
    """The issue's command at a small size: FedAvg (global), MOON (global), FedCRL
    (personalised) and FedU2 (kNN) give three tables and three figures, every computed
    metric in the table of its family, never two families in one table, intervals over
    the seeds and paired differences to the first algorithm."""
    small = ["rounds=2", "local_epochs=1", "num_clients=3", "fedu2.predictor_hidden=32", "batch_size=32"]
    out = tmp_path / "cmp"
    assert main(["compare", "fedavg", "moon", "fedcrl", "fedu2", *small, "--seeds", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    tables = _tables(printed)
    assert list(tables) == ["Global model: test accuracy", "Personalised models: sample-weighted client accuracy",
                            "Self-supervised encoders: kNN accuracy of the global encoder"]
    global_, personal, knn = tables.values()
    assert [r[0] for r in global_[1:]] == ["fedavg", "moon"]
    assert [r[0] for r in personal[1:]] == ["fedcrl"] and [r[0] for r in knn[1:]] == ["fedu2 predictor_hidden=32"]
    results = json.loads((out / "results.json").read_text())["methods"]
    # the kNN accuracy FedU2 computed is shown, with its interval over the two seeds
    fedu2 = knn[1]
    assert fedu2[1] == "0, 1" and fedu2[2] == interval(results["fedu2 predictor_hidden=32"]["knn"]).text()
    # MOON against FedAvg on the same seeds
    moon = dict(zip(global_[0], global_[2]))
    diff = paired_difference(dict(enumerate(results["moon"]["test_acc"])), dict(enumerate(results["fedavg"]["test_acc"])))
    assert moon["Δ final vs fedavg (pp) [95% CI]"] == diff.text(signed=True)
    assert moon["excludes 0"] in ("yes", "no") and "rounds to target" in moon
    figures = sorted(p.name for p in out.glob("curves-*.png"))
    assert figures == ["curves-knn_acc.png", "curves-personal_acc.png", "curves-test_acc.png"]
    assert "curves.png" not in {p.name for p in out.iterdir()}
    assert (out / "results.md").read_text().count("**") == 6  # the same three tables
    # the HTML report in headless Chromium: the three tables and one figure per family
    page = tmp_path / "report.html"
    assert main(["report", str(out), "--html", str(page)]) == 0
    dom = chromium_screenshot(page, tmp_path / "shot.png", tmp_path, size=(1200, 1800))  # the tables and the first figure
    from matplotlib.image import imread

    shot = imread(tmp_path / "shot.png")[..., :3]
    assert shot.shape[:2] == (1800, 1200) and shot.std() > 0.05  # rendered, not blank
    for title in tables:
        assert f"{title}: mean over seeds" in dom
    captions = re.findall(r'alt="([^"]*) per round"', dom)
    assert captions == ["test acc", "client acc", "kNN acc"]  # one metric on each figure's axis


def test_compare_on_bad_data_exits_2_once_and_leaves_nothing(tmp_path, capsys):
    """A folder dataset with an unreadable image: one line, exit 2, no suite directory
    left behind, the error not repeated per run."""
    for part in ("train", "test"):
        for label in ("a", "b"):
            (tmp_path / "data" / part / label).mkdir(parents=True)
            (tmp_path / "data" / part / label / "x.png").write_text("not an image")
    out = tmp_path / "cmp"
    code = main(["compare", "fedavg", "moon", "dataset=folder", f"data_dir={tmp_path / 'data'}", "--out", str(out)])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("contrafl: error: ") and "x.png" in err[0]
    assert "FAILED" not in captured.out and "error.txt" not in captured.out + captured.err
    assert not out.exists()
