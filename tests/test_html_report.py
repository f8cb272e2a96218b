"""contrafl report --html: the page's numbers against the run directories, and the page
rendered in headless Chromium."""

from __future__ import annotations

import html
import json
import re
import shutil

import numpy as np
import pytest

from conftest import check_screenshot, chromium_screenshot
from contrafl.cli import main
from contrafl.experiments.report import read_run, worst_fraction

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


def _interval(values) -> str:
    """The cell of a mean and its 95% bootstrap interval, computed here with scipy."""
    from scipy.stats import bootstrap

    values = np.asarray(values, dtype=float)
    if len(values) == 1:
        return f"{100 * values[0]:.2f} (n=1: interval unknown)"
    ci = bootstrap((values,), np.mean, n_resamples=9999, method="BCa", rng=np.random.default_rng(0)).confidence_interval
    return f"{100 * values.mean():.2f} [{100 * ci.low:.2f}, {100 * ci.high:.2f}]"


def test_the_page_holds_the_numbers_of_the_run_directories(runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(runs), "--html", str(out)]) == 0
    assert "self-contained" in capsys.readouterr().out
    page = out.read_text()
    # self-contained: every image is embedded
    sources = re.findall(r'src="([^"]*)"', page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert f"contrafl report {runs} --html {out}" in page

    # global model: the mean over the completed seeds with its bootstrap interval (scipy's,
    # over seeds); the failed run is counted, not averaged
    finals = [read_run(runs / n)[1][-1]["test_acc"] for n in ("avg-s0", "avg-s1")]
    cells = _cells(page, "fedavg")
    assert cells[0] == "0, 1" and cells[1] == _interval(finals) and cells[-1] == "2 completed, 1 failed"

    # personalised: the final and best client accuracy (one seed: no interval), the std
    # over clients, and the interval of the mean over clients
    rows = [r for r in read_run(runs / "crl")[1] if "personal_acc" in r]
    best = max(rows, key=lambda r: r["personal_acc"])
    cells = _cells(page, "fedcrl")
    assert cells[:5] == [
        "0",
        _interval([rows[-1]["personal_acc"]]),
        _interval([best["personal_acc"]]),
        f"{100 * rows[-1]['personal_acc_std']:.2f}",
        _interval(rows[-1]["client_acc"]),
    ]
    # self-supervised: the kNN accuracy
    knn = read_run(runs / "byol")[1][-1]["knn_acc"]
    assert _cells(page, "fedbyol")[:3] == ["0", _interval([knn]), _interval([knn])]
    assert "Self-supervised encoders: kNN accuracy" in page
    # every metric in a table of its own: no table holds two families' configurations
    titles = re.findall(r'<p class="caption">([^<]*?): mean over seeds', page)
    assert titles[:3] == ["Global model: test accuracy", "Personalised models: sample-weighted client accuracy",
                          "Self-supervised encoders: kNN accuracy of the global encoder"]

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
    dom = chromium_screenshot(out, png, tmp_path, size=(1200, 3600))  # the page down to its heatmaps
    assert "Personalised models" in dom and "<td>fedcrl</td>" in dom and "<td>fedbyol</td>" in dom
    check_screenshot(png, size=(1200, 3600))


def test_report_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing"), "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("contrafl: error: ") and "does not exist" in err and "\n" not in err


# -- #35: reports that stay readable when runs differ ---------------------------------


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The issue's runs: FedCRL on 20 clients (Dirichlet 0.1, seeds 0 and 1, with the
    MLflow artifact copy a tracked run holds), two FedU2 runs that differ in lam_u, and
    a compare directory as `contrafl compare fedavg moon moon.mu=5` wrote it before
    (its MOON method named `moon`)."""
    from contrafl.experiments.suite import Suite, run_suite

    root = tmp_path_factory.mktemp("mixed")
    crl = ["algorithm=fedcrl", "rounds=2", "num_clients=20", "partition.beta=0.1"]
    u2 = ["algorithm=fedu2", "rounds=1", "algorithm.predictor_hidden=32", "batch_size=32"]
    for name, args in {
        "crl-s0": [*crl, "seed=0"],
        "crl-s1": [*crl, "seed=1"],
        "u2": u2,
        "u2-lam": [*u2, "algorithm.lam_u=0.5"],
    }.items():
        assert main(["run", *SMALL, *args, "--out", str(root / name)]) == 0
    copy = root / "crl-s0" / "mlflow" / "artifacts" / "1" / "artifacts"
    copy.mkdir(parents=True)
    for f in ("config.yaml", "metrics.jsonl", "summary.json"):
        shutil.copy(root / "crl-s0" / f, copy / f)
    suite = Suite(name="compare fedavg vs moon", base={"rounds": 2, "num_clients": 3, "local_epochs": 1},
                  methods={"fedavg": {"algorithm": {"name": "fedavg"}}, "moon": {"algorithm": {"name": "moon", "mu": "5"}}},
                  target={"from": "fedavg"})
    run_suite(suite, root / "cmp", log=lambda _: None)
    return root


LABELS = {"fedcrl", "fedu2 predictor_hidden=32", "fedu2 predictor_hidden=32 lam_u=0.5", "fedavg", "moon mu=5"}


def test_labels_are_the_algorithm_and_the_options_that_differ_from_its_defaults(mixed, capsys):
    from contrafl.experiments.html import group_runs

    groups = group_runs([mixed])
    assert {g.label for g in groups} == LABELS
    assert sorted(len(g.runs) for g in groups) == [1, 1, 1, 1, 2]  # FedCRL's two seeds; not its MLflow copy
    # the text report labels each run alike
    assert main(["report", str(mixed)]) == 0
    rows = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"cmp/fedavg/seed0", "cmp/moon/seed0", "crl-s0", "crl-s1", "u2", "u2-lam"}
    assert "  moon mu=5  " in rows["cmp/moon/seed0"] and "  fedu2 predictor_hidden=32 lam_u=0.5  " in rows["u2-lam"]


def test_labels_tell_apart_configurations_of_one_algorithm(tmp_path):
    """Two FedAvg configurations: the settings that differ are added; an algorithm's
    options at their defaults, or that do not apply, are not."""
    from contrafl.config import load_config
    from contrafl.engine.setup import resolve
    from contrafl.experiments.report import algorithm_label, configuration_labels

    def config(*overrides):
        return resolve(load_config(None, list(overrides))).to_dict()

    assert algorithm_label(config("algorithm=moon", "algorithm.mu=1")["algorithm"]) == "moon"  # mu=1 is MOON's default
    assert algorithm_label({"name": "moon", "mu": "5"}) == "moon mu=5"
    assert algorithm_label({"name": "fedsimclr", "ema": 0.5, "temperature": 0.07}) == "fedsimclr"  # ema: BYOL's option
    assert algorithm_label({"name": "not-installed", "x": 1}) == "not-installed"
    labels = configuration_labels([config("num_clients=5"), config("num_clients=20"), config("algorithm=moon")])
    assert labels == ["fedavg num_clients=5", "fedavg num_clients=20", "moon"]
    labels = configuration_labels([config("partition.beta=0.1"), config("partition.beta=0.5"), config("partition.beta=0.5")])
    assert labels == ["fedavg beta=0.1", "fedavg beta=0.5", "fedavg beta=0.5 #2"]


def _texts_inside(fig) -> None:
    """Everything ``fig`` draws (tick labels, axis labels, titles, legends, colour bar,
    the counts in cells) is inside the figure, and no legend is wider than its axes."""
    from matplotlib.transforms import Bbox

    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    drawn = fig.get_tightbbox(renderer)  # inches, of what is drawn
    width, height = fig.get_size_inches()
    slack = 1 / fig.dpi
    assert drawn.x0 >= -slack and drawn.y0 >= -slack and drawn.x1 <= width + slack and drawn.y1 <= height + slack, (
        f"drawn {drawn} beyond the figure {Bbox.from_bounds(0, 0, width, height)}"
    )
    for ax in fig.axes:
        for text in ax.texts:
            assert ax.bbox.x0 <= text.get_window_extent(renderer).x0 and text.get_window_extent(renderer).x1 <= ax.bbox.x1
    axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    for legend in fig.legends + [ax.get_legend() for ax in axes if ax.get_legend()]:
        assert legend.get_window_extent(renderer).width <= min(ax.get_window_extent(renderer).width for ax in axes)


def test_figures_keep_their_labels_inside(mixed):
    """The curves, the clients' box plot and the 20-client heatmap of the issue's runs:
    laid out without matplotlib's 'Tight layout not applied' (warnings are errors here),
    no label cut, no legend wider than its axes; the heatmap titled as people write
    it, one per seed, "client" on its axis, every count readable."""
    import warnings

    from contrafl.experiments.html import clients_plot, curves_plot, group_runs, partition_plots
    from contrafl.experiments.report import METRICS
    from contrafl.experiments.plots import DPI, PAGE_WIDTH

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = group_runs([mixed])
        figures = [curves_plot(groups, m) for m in METRICS] + [clients_plot(groups)]
        assert all(f is not None for f in figures)
        for fig in figures:
            _texts_inside(fig)
            legend = fig.legends[0] if fig.legends else None
            if legend is not None:
                labels = {t.get_text().replace("\n", " ") for t in legend.get_texts()}
                assert labels & {f"{label} (1 seed)" for label in LABELS} or "fedcrl (2 seeds)" in labels
        assert [t.get_text() for t in figures[-1].axes[0].get_xticklabels()] == ["fedcrl"]
        heatmaps = partition_plots(groups)
        for _, fig in heatmaps:
            _texts_inside(fig)
    heatmaps.sort(key=lambda h: h[0])
    captions = [caption for caption, _ in heatmaps]
    assert len(captions) == 3  # FedCRL's seeds 0 and 1, and the 3-client federation of the others
    assert captions[0] == "digits, 20 clients, dirichlet beta=0.1, seed 0: fedcrl"
    assert captions[1] == "digits, 20 clients, dirichlet beta=0.1, seed 1: fedcrl"
    assert captions[2].startswith("digits, 3 clients, dirichlet beta=0.5, seed 0: ")
    assert set(captions[2].split(": ")[1].split(", ")) == LABELS - {"fedcrl"}
    titles = [fig.axes[0].get_title() for _, fig in heatmaps]
    assert titles == ["dirichlet beta=0.1, seed 0", "dirichlet beta=0.1, seed 1", "dirichlet beta=0.5, seed 0"]
    for caption, fig in heatmaps[:2]:
        ax = fig.axes[0]
        assert ax.get_xlabel() == "client" and ax.get_ylabel() == "class"
        assert fig.get_figwidth() <= PAGE_WIDTH
        cell = ax.get_window_extent().width / 20  # pixels of a client's column
        counts = [t for t in ax.texts]
        assert len(counts) == 200 and min(t.get_fontsize() for t in counts) >= 7
        assert max(t.get_window_extent().width for t in counts) < cell  # a count fits its cell
        assert cell >= 0.3 * DPI


def _fake_group(label: str, rows: list[dict], tmp_path):
    from contrafl.experiments.html import Group, Run

    return Group(label, [Run(tmp_path, label, {"seed": 0}, rows, {"status": "completed"})])


@pytest.mark.parametrize("count", [2, 9, 24])
def test_long_labels_and_many_configurations_fit(tmp_path, count):
    """A sweep's long cell names: the legend wraps them to the axes' width, the box
    plot's tick labels do not overlap or leave the figure."""
    import warnings

    from contrafl.experiments.html import clients_plot, curves_plot
    from contrafl.experiments.report import METRICS

    groups = []
    for i in range(count):
        label = f"algorithm=moon moon.mu={i} partition.beta=0.{i} lr=0.05 num_clients=20 dataset=cifar10"
        rows = [{"round": t, "test_acc": 0.1 * t + 0.01 * i, "personal_acc": 0.5, "client_acc": [0.4 + 0.01 * i, 0.6, 0.5]} for t in (1, 2, 3)]
        groups.append(_fake_group(label, rows, tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        curves = curves_plot(groups, next(m for m in METRICS if m.key == "personal_acc"))
        box = clients_plot(groups)
        _texts_inside(curves)
        _texts_inside(box)
    renderer = box.canvas.get_renderer()
    ticks = [t.get_window_extent(renderer) for t in box.axes[0].get_xticklabels()]
    assert all(a.x1 <= b.x0 + 1 for a, b in zip(ticks, ticks[1:])), "tick labels overlap"


@pytest.mark.parametrize("clients, classes, named", [(3, 10, False), (20, 10, False), (20, 10, True), (35, 10, False),
                                                     (100, 10, True), (10, 100, False), (1000, 62, False)])
def test_heatmaps_of_any_size_are_readable(clients, classes, named):
    """Sized by the clients and classes: at most the page's width, a row per client
    beyond 30 clients, rows tall enough to read, counts only where they fit."""
    import warnings

    from contrafl.experiments.plots import DPI, PAGE_WIDTH, partition_heatmap

    counts = np.random.default_rng(0).integers(0, 3000, size=(clients, classes))
    names = [f"class name {c}" for c in range(classes)] if named else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = partition_heatmap(counts, names, title="dirichlet beta=0.1, seed 0")
        _texts_inside(fig)
    ax = fig.axes[0]
    assert fig.get_figwidth() <= PAGE_WIDTH + 1e-9 and {ax.get_xlabel(), ax.get_ylabel()} == {"client", "class"}
    if clients > 30:
        assert ax.get_ylabel() == "client"  # a row per client
    rows = counts.shape[0] if clients > 30 else classes
    renderer = fig.canvas.get_renderer()
    assert ax.get_window_extent(renderer).height / rows >= min(0.16, 20 / rows) * DPI * 0.8  # rows of a readable height
    for text in ax.texts:  # the counts written, each inside its cell
        assert text.get_fontsize() >= 7


MEASURE = """<script>
window.addEventListener('load', () => {
  const images = [...document.images].map(img => {
    const r = img.getBoundingClientRect();
    return [img.alt, img.naturalWidth, img.clientWidth, Math.round(r.right)];
  });
  const cells = [...document.querySelectorAll('table')].map(t => [...t.rows].slice(1).map(r => [r.cells[0].textContent, r.offsetHeight]));
  const pre = document.createElement('pre');
  pre.id = 'measured';
  pre.textContent = JSON.stringify({images, cells, width: window.innerWidth});
  document.body.appendChild(pre);
});
</script>"""


def test_the_page_of_different_algorithms_renders_readably(mixed, tmp_path):
    """The issue's report in headless Chromium: every table row one line high (labels,
    not every differing option), every figure at its own size (not scaled down: the
    heatmap of 20 clients stays readable) and inside the window."""
    out = tmp_path / "report.html"
    assert main(["report", str(mixed), "--html", str(out)]) == 0
    page = out.read_text()
    for label in LABELS:
        assert f"<td>{label}</td>" in page
    assert "None" not in page and "party" not in page and '"name"' not in page
    assert "dirichlet beta=0.1, seed 0: fedcrl" in page and "dirichlet beta=0.1, seed 1: fedcrl" in page
    assert page.count("<td>completed</td>") == 6  # not the MLflow copy
    measured = tmp_path / "measured.html"
    measured.write_text(page.replace("</body>", MEASURE + "</body>"))
    dom = chromium_screenshot(measured, tmp_path / "shot.png", tmp_path, size=(1200, 4000))
    check_screenshot(tmp_path / "shot.png", size=(1200, 4000))
    found = json.loads(html.unescape(re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S).group(1)))
    assert len(found["images"]) == 3 + 1 + 3  # curves of 3 metrics, the clients, 3 partitions
    for alt, natural, shown, right in found["images"]:
        assert shown == natural and right <= found["width"], (alt, natural, shown, right)
    heights = [h for table in found["cells"] for _, h in table]  # the rows below the headers
    assert max(heights) <= 1.5 * min(heights), [c for table in found["cells"] for c in table if c[1] > 1.5 * min(heights)]
