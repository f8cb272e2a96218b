"""contrafl report --html: the page's numbers against the run directories, and the page
rendered in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from conftest import check_screenshot, chromium_screenshot
from contrafl.cli import main
from contrafl.eval.report import read_run, worst_fraction
from contrafl.eval.metrics import mean_std

SMALL = ["num_clients=3", "local_epochs=1", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """FedAvg with seeds 0 and 1, a FedAvg run that failed, FedCRL (personalised) and
    FedBYOL (self-supervised) on digits."""
    root = tmp_path_factory.mktemp("runs")
    for name, args in {
        "avg-s0": ["rounds=2", "seed=0"],
        "avg-s1": ["rounds=2", "seed=1"],
        "crl": ["algorithm=fedcrl", "rounds=2"],
        "byol": ["algorithm=fedbyol", "rounds=1"],
    }.items():
        assert main(["run", *args, *SMALL, "--out", str(root / name)]) == 0
    broken = root / "broken"
    shutil.copytree(root / "avg-s0", broken)
    summary = json.loads((broken / "summary.json").read_text())
    summary |= {"status": "failed", "error": "RuntimeError: out of memory in round 2"}
    (broken / "summary.json").write_text(json.dumps(summary))
    lines = (broken / "metrics.jsonl").read_text().splitlines()
    (broken / "metrics.jsonl").write_text(lines[0] + "\n")
    return root


def _cells(page: str, label: str) -> list[str]:
    """The cells of the first table row whose first cell is ``label``."""
    row = re.search(rf"<tr><td>{re.escape(label)}</td>(.*?)</tr>", page)
    assert row, f"no row {label}"
    return re.findall(r"<td[^>]*>(.*?)</td>", row.group(1))


def _pct(values) -> str:
    mean, std = mean_std(list(values))
    return f"{100 * mean:.2f} ± {100 * std:.2f}" if len(values) > 1 else f"{100 * mean:.2f}"


def test_the_page_holds_the_numbers_of_the_run_directories(runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(runs), "--html", str(out)]) == 0
    assert "self-contained" in capsys.readouterr().out
    page = out.read_text()
    # self-contained: every image is embedded
    sources = re.findall(r'src="([^"]*)"', page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert f"contrafl report {runs} --html {out}" in page

    # global model: mean ± std over the completed seeds; the failed run is counted, not averaged
    finals = [read_run(runs / n)[1][-1]["test_acc"] for n in ("avg-s0", "avg-s1")]
    cells = _cells(page, "fedavg")
    assert cells[0] == _pct(finals) and cells[2] == "0, 1" and cells[-1] == "2 completed, 1 failed"

    # personalised: the final and best client accuracy, the std over clients, the best round
    rows = [r for r in read_run(runs / "crl")[1] if "personal_acc" in r]
    best = max(rows, key=lambda r: r["personal_acc"])
    cells = _cells(page, "fedcrl")
    assert cells[:5] == [
        _pct([rows[-1]["personal_acc"]]),
        f"{100 * rows[-1]['personal_acc_std']:.2f}",
        _pct([best["personal_acc"]]),
        f"{100 * best['personal_acc_std']:.2f}",
        str(best["round"]),
    ]
    # self-supervised: the kNN accuracy
    knn = read_run(runs / "byol")[1][-1]["knn_acc"]
    assert _cells(page, "fedbyol")[:2] == [_pct([knn]), _pct([knn])]
    assert "Self-supervised encoders: kNN accuracy" in page

    # clients: the per-client figure and the fairness row of FedCRL
    accs = rows[-1]["client_acc"]
    assert 'alt="client accuracies"' in page
    fairness = re.findall(r"<tr><td>fedcrl</td>(.*?)</tr>", page)[1]
    values = re.findall(r"<td[^>]*>(.*?)</td>", fairness)
    assert values == [
        "3",
        f"{100 * rows[-1]['personal_acc']:.2f}",
        f"{100 * float(np.std(accs)):.2f}",
        f"{100 * worst_fraction(accs):.2f}",
        f"{100 * min(accs):.2f}",
        f"{100 * max(accs):.2f}",
    ]
    # curves per metric family, partition heatmaps, and every run with its state and error
    assert page.count('per round"') == 3
    assert page.count('alt="partition heatmap"') >= 1
    assert "broken: failed: RuntimeError: out of memory in round 2" in page
    assert page.count("<td>completed</td>") == 4


def test_the_page_renders_in_headless_chromium(runs, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(runs / "crl"), str(runs / "byol"), "--html", str(out)]) == 0
    png = tmp_path / "shot.png"
    dom = chromium_screenshot(out, png, tmp_path)
    assert "Personalised models" in dom and "<td>fedcrl</td>" in dom and "<td>fedbyol</td>" in dom
    check_screenshot(png)


def test_report_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing"), "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("contrafl: error: ") and "does not exist" in err and "\n" not in err
