"""``contrafl report --html``: one self-contained HTML page of runs, suites and sweeps.

Every number and figure comes from the run directories (``config.yaml``,
``metrics.jsonl``, ``summary.json``, ``representation/``, ``label_counts.json``) and the
records of the suites and sweeps that made them; images are embedded as PNG data, so
the file can be mailed or archived alone. A configuration is labelled by its suite's
method, its sweep's cell, or its algorithm and the options that differ from their
defaults (``moon mu=5``, :func:`group_runs`), the same label in every table, legend and
caption; legends and labels are wrapped to their figure's width. The page has:

- the results, a table per metric family: global models (test accuracy, mean ± std over
  seeds), personalised models (PFLlib's metric: the sample-weighted client accuracy at
  the final and best round with the std over clients), self-supervised encoders (kNN
  accuracy and the probes run with ``contrafl eval-repr``), the paper's number beside
  ours with the difference where a suite gives it, and the state of every run;
- with attackers or robust aggregators: the backdoor's success rate (a family of its
  own, lower is better for the defender) and the aggregators' precision and recall in
  finding the attackers (intervals over seeds);
- accuracy per round, the mean over seeds with a ± std band, a figure per family (an
  attack's success per round in figures of its own);
- the accuracy of every client (box and points) and the fairness summary: std over
  clients, the mean of the worst 10 %, min and max;
- the partition heatmaps, one per seed, and the t-SNE figures of ``contrafl plot-repr``;
- the list of runs (failed and stopped runs with their errors; the aggregator, attack,
  precision, recall and final backdoor success of each when some run had attackers or
  a robust aggregator) and the command that regenerates the page.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..errors import ContraflError
from ..metrics.history import mean_std
from .comparison import FAMILIES, bests, detection_table, family_tables, finals
from .groups import Group, Run, group_runs, suite_baseline
from .report import Metric, partition_label, robustness, robustness_cells, robustness_header, worst_fraction

PARTITION_LIMIT = 8
"""Partition heatmaps drawn on a page (the others are named under them)."""


# -- numbers ---------------------------------------------------------------------------


def _paper_value(paper: Any) -> float | None:
    """The first number of a paper cell (``"69.1 ± 0.4"`` -> 69.1), in %."""
    match = re.search(r"-?\d+(\.\d+)?", str(paper)) if paper is not None else None
    return float(match.group(0)) if match else None


def _paper_cells(group: Group, ours: float | None) -> list[str]:
    paper = _paper_value(group.paper)
    if paper is None:
        return ["", ""]
    diff = "" if ours is None else f"{100 * ours - paper:+.2f}"
    return [html.escape(str(group.paper)), diff]


def results_tables(groups: Sequence[Group], baseline: str | None = None) -> list[tuple[str, list[list[str]]]]:
    """(title, rows with a header row) of each metric family present
    (:func:`~contrafl.experiments.comparison.family_tables`, the paired differences against
    ``baseline``), with the paper's number beside ours in the family a group is judged
    by, and the state of every group's runs; then the attackers the aggregators found
    (:func:`~contrafl.experiments.comparison.detection_table`), if any run had some."""
    tables = []
    with_paper = any(g.paper is not None for g in groups)
    by_label = {g.label: g for g in groups}
    for table in family_tables(groups, baseline):
        header, *body = table.rows
        rows = [header + (["paper", "ours − paper"] if with_paper else []) + ["runs"]]
        for row in body:
            g = by_label[row[0]]
            paper = []
            if with_paper:
                ours = bests(g, table.metric.key) if table.metric.std else finals(g, table.metric.key)  # PFLlib's: the best round
                paper = _paper_cells(g, mean_std(list(ours.values()))[0]) if g.metric == table.metric else ["", ""]
            rows.append(row + paper + [g.states])
        tables.append((table.title, rows))
    detection = detection_table(groups)
    if detection is not None:
        tables.append((detection.title, detection.rows))
    idle = [g for g in groups if not g.families]
    if idle:
        tables.append(("Without a completed, evaluated run", [["configuration", "runs"]] + [[g.label, g.states] for g in idle]))
    return tables


def fairness_rows(groups: Sequence[Group]) -> list[list[str]]:
    """Per configuration with per-client evaluation, at its final round (mean over
    seeds): clients, std over clients, the mean of the worst 10 %, min and max."""
    rows = [["configuration", "clients", "client acc (%)", "std (%)", "worst 10% (%)", "min (%)", "max (%)"]]
    for g in groups:
        finals = [r.evaluated("client_acc")[-1] for r in g.completed if r.evaluated("client_acc")]
        if not finals:
            continue
        accs = [[a for a in f["client_acc"] if a is not None] for f in finals]
        rows.append([
            g.label,
            str(len(accs[0])),
            f"{100 * mean_std([f['personal_acc'] for f in finals])[0]:.2f}",
            f"{100 * mean_std([float(np.std(a)) for a in accs])[0]:.2f}",
            f"{100 * mean_std([worst_fraction(a) for a in accs])[0]:.2f}",
            f"{100 * mean_std([min(a) for a in accs])[0]:.2f}",
            f"{100 * mean_std([max(a) for a in accs])[0]:.2f}",
        ])
    return rows


# -- figures ---------------------------------------------------------------------------

def _figure(width: float, height: float):
    """A figure of ``width`` x ``height`` inches (:func:`~contrafl.experiments.plots.figure`:
    at most :data:`~contrafl.experiments.plots.PAGE_WIDTH` wide, shown at its own size in the
    page, laid out by constrained layout, which makes room for every label and legend
    where tight_layout gives up on long ones)."""
    from .plots import figure

    return figure(width, height)


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def curves_plot(groups: Sequence[Group], metric: Metric):
    """The figure of :func:`curves_figure` (None: nothing to draw)."""
    from matplotlib.ticker import MaxNLocator

    from .plots import legend_below

    fig = _figure(7, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    handles, labels = [], []
    for g in groups:
        if metric not in g.families:
            continue
        curves = [{r["round"]: r[metric.key] for r in run.evaluated(metric.key)} for run in g.completed]
        rounds = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not rounds:
            continue
        values = np.array([[100 * c[t] for t in rounds] for c in curves])
        mean, std = values.mean(axis=0), values.std(axis=0)
        (line,) = ax.plot(rounds, mean, marker="o" if len(rounds) < 15 else None, ms=3)
        if len(curves) > 1:
            ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)
        handles.append(line)
        labels.append(f"{g.label} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
    if not handles:
        return None
    drawn = sorted({x for line in handles for x in line.get_xdata()})
    if len(drawn) <= 12:  # a tick at every round (a single round's axis is no range of fractions)
        ax.set_xticks(drawn)
        if len(drawn) == 1:
            ax.set_xlim(drawn[0] - 1, drawn[0] + 1)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(f"{metric.label} (%)")
    ax.grid(alpha=0.3)
    legend_below(fig, ax, handles, labels)
    return fig


def curves_figure(groups: Sequence[Group], metric: Metric) -> bytes | None:
    """``metric`` per round of each configuration: the mean over its completed seeds
    (the rounds all of them evaluated) and a ± std band; the legend under the axes."""
    fig = curves_plot(groups, metric)
    return None if fig is None else _png(fig)


def clients_plot(groups: Sequence[Group]):
    """The figure of :func:`clients_figure` (None: nothing to draw)."""
    from .plots import CHAR_WIDTH, FONT, PAGE_WIDTH, chars as _chars, wrap as _wrap

    data = []
    for g in groups:
        accs = [100 * a for r in g.completed if r.evaluated("client_acc") for a in r.evaluated("client_acc")[-1]["client_acc"] if a is not None]
        if accs:
            data.append((g.label, accs))
    if not data:
        return None
    width = min(PAGE_WIDTH, max(5.0, 1.3 * len(data) + 2))
    share = (width - 1.2) / len(data)  # inches of a box's share of the width
    line = 1.3 * FONT / 72  # inches of a line of tick label
    chars = _chars(share) - 1
    upright = chars < 8  # too many boxes for labels under them: the labels upright, in as many lines as fit a share
    labels = [_wrap(label, chars) for label, _ in data]
    while upright and max(label.count("\n") + 1 for label in labels) > max(1, int(share / line)):
        chars += 4
        labels = [_wrap(label, chars) for label, _ in data]
    if upright:
        below = max(len(row) for label in labels for row in label.splitlines()) * CHAR_WIDTH * FONT / 72
    else:
        below = max(label.count("\n") + 1 for label in labels) * line
    fig = _figure(width, 3.8 + below)
    ax = fig.add_subplot(1, 1, 1)
    ax.boxplot([a for _, a in data], showfliers=False, widths=0.5)
    rng = np.random.default_rng(0)  # the points' horizontal jitter only
    for i, (_, accs) in enumerate(data, start=1):
        ax.scatter(i + rng.uniform(-0.15, 0.15, len(accs)), accs, s=9, alpha=0.6, color="tab:blue", zorder=3)
    ax.set_xticks(range(1, len(data) + 1), labels=labels, fontsize=FONT, rotation=90 if upright else 0)
    ax.set_ylabel("client accuracy at the final round (%)")
    ax.grid(alpha=0.3, axis="y")
    return fig


def clients_figure(groups: Sequence[Group]) -> bytes | None:
    """Every client's accuracy at the final round (all completed seeds), a box and the
    points of each configuration with per-client evaluation."""
    fig = clients_plot(groups)
    return None if fig is None else _png(fig)


def label_counts(run: Run) -> tuple[np.ndarray, list[str]] | None:
    """``[clients, classes]`` samples per client and class of a run's training
    partition, with the class names: from ``label_counts.json``, else counted from
    ``partition.json`` and the dataset's labels when the dataset loads here; None
    otherwise."""
    path = run.path / "label_counts.json"
    if path.is_file():
        data = json.loads(path.read_text())
        return np.asarray(data["counts"]), list(data["classes"])
    try:
        from ..config import load_config
        from ..data.partition import Partition
        from ..engine.setup import load_data, resolve

        data, _ = load_data(resolve(load_config(run.path / "config.yaml")))
        partition = Partition.load(run.path / "partition.json")
        return partition.counts(data.train.y.numpy(), data.num_classes), list(data.classes)
    except Exception:  # a dataset not on this machine: no heatmap for this run
        return None


def partitions(groups: Sequence[Group]) -> list[tuple[Run, list[str]]]:
    """Each distinct partition of the runs (a partition depends on the dataset, the
    partition's settings, the number of clients and the seed): a run that made it and
    the labels of the configurations that share it."""
    seen: dict[str, tuple[Run, list[str]]] = {}
    for g in groups:
        for run in g.runs:
            key = json.dumps([run.config.get(k) for k in ("dataset", "partition", "num_clients", "seed", "test_fraction", "pool")], default=str)
            labels = seen.setdefault(key, (run, []))[1]
            if g.label not in labels:
                labels.append(g.label)
    return list(seen.values())


def partition_title(run: Run) -> str:
    """``dirichlet beta=0.1, seed 0``: a run's partition and its seed."""
    return f"{partition_label(run.config.get('partition', '?'))}, seed {run.config.get('seed')}"


def partition_plots(groups: Sequence[Group], limit: int = PARTITION_LIMIT) -> list[tuple[str, Any]]:
    """The heatmap of each distinct partition of the runs (:func:`partitions`: one per
    seed), at most ``limit``, titled with the partition and seed, and its caption: the
    dataset, the number of clients and the configurations that share it."""
    from .plots import partition_heatmap

    figures = []
    for run, labels in partitions(groups)[:limit]:
        counts = label_counts(run)
        if counts is None:
            continue
        dataset = run.config.get("dataset", "?")
        dataset = dataset.get("name") if isinstance(dataset, Mapping) else dataset
        caption = f"{dataset}, {len(counts[0])} clients, {partition_title(run)}: {', '.join(labels)}"
        figures.append((caption, partition_heatmap(counts[0], classes=counts[1], title=partition_title(run))))
    return figures


def partition_figures(groups: Sequence[Group], limit: int = PARTITION_LIMIT) -> list[tuple[str, bytes]]:
    """The PNGs of :func:`partition_plots`, with their captions."""
    return [(caption, _png(fig)) for caption, fig in partition_plots(groups, limit)]


def tsne_figures(groups: Sequence[Group]) -> list[tuple[str, bytes]]:
    """The t-SNE figures ``contrafl plot-repr`` wrote in the runs."""
    return [
        (f"{g.label}, {run.name}", (run.path / "representation" / "tsne.png").read_bytes())
        for g in groups
        for run in g.runs
        if (run.path / "representation" / "tsne.png").is_file()
    ]


# -- the page --------------------------------------------------------------------------

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #111; background: #fff; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 0.85em; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: left; }
td { white-space: nowrap; } .wide { overflow-x: auto; max-width: 100%; }
th { background: #eee; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.4em 0; }
code, pre { background: #f4f4f4; padding: 0.1em 0.3em; }
.failed { color: #111; font-weight: bold; } .caption { font-size: 0.85em; color: #333; }
"""


def _table(rows: list[list[str]], escape: bool = True) -> str:
    head, *body = rows
    numeric = re.compile(r"^[-+]?\d[\d., ±%\[\]+-]*$")

    def cell(tag: str, value: str) -> str:
        text = html.escape(value) if escape else value
        cls = ' class="num"' if tag == "td" and numeric.match(value or "") else ""
        return f"<{tag}{cls}>{text}</{tag}>"

    lines = ['<div class="wide"><table>', "<tr>" + "".join(cell("th", h) for h in head) + "</tr>"]
    lines += ["<tr>" + "".join(cell("td", c) for c in row) + "</tr>" for row in body]
    return "\n".join(lines + ["</table></div>"])


def _image(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render(paths: Sequence[Path], command: str, title: str | None = None, baseline: str | None = None) -> str:
    """The HTML page of the runs below ``paths``; ``command`` regenerates it. Differences
    are paired against ``baseline`` (default: the baseline of the one suite given, else
    the first configuration)."""
    groups = group_runs(paths)
    if not groups:
        raise ContraflError(f"no runs in {', '.join(map(str, paths))}")
    runs = [r for g in groups for r in g.runs]
    title = title or "contrafl report: " + ", ".join(str(p) for p in paths)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="caption">{len(runs)} runs in {len(groups)} configurations; made by contrafl {__version__} on '
        f"{time.strftime('%Y-%m-%d %H:%M')} from the run directories. Regenerate with <code>{html.escape(command)}</code></p>",
        "<h2>Results</h2>",
    ]
    for caption, rows in results_tables(groups, baseline or suite_baseline(paths)):
        parts += [f'<p class="caption">{html.escape(caption)}</p>', _table(rows)]
    families = [m for m in FAMILIES if any(m in g.families for g in groups)]
    for heading, lower in (("Accuracy per round", False), ("Attack success per round", True)):
        parts += _curves_section(heading, groups, [m for m in families if m.lower_is_better == lower])
    fairness = fairness_rows(groups)
    if len(fairness) > 1:
        parts += [
            "<h2>Clients</h2>",
            '<p class="caption">Accuracy of every client at the final round (each completed seed), and the spread '
            "over clients (mean over seeds): std, the mean of the worst 10% of clients, min and max</p>",
        ]
        png = clients_figure(groups)
        if png:
            parts.append(_image(png, "client accuracies"))
        parts.append(_table(fairness))
    heatmaps = partition_figures(groups, limit=PARTITION_LIMIT)
    if heatmaps:
        parts.append("<h2>Partitions</h2>")
        for caption, png in heatmaps:
            parts += [f'<p class="caption">samples per client and class: {html.escape(caption)}</p>', _image(png, "partition heatmap")]
        left = partitions(groups)[PARTITION_LIMIT:]
        if left:
            more = ", ".join(f"{partition_title(run)} ({', '.join(labels)})" for run, labels in left)
            parts.append(f'<p class="caption">{len(left)} more partitions not drawn: {html.escape(more)}</p>')
    tsne = tsne_figures(groups)
    if tsne:
        parts.append("<h2>Representations (t-SNE)</h2>")
        for caption, png in tsne:
            parts += [f'<p class="caption">{html.escape(caption)}</p>', _image(png, "t-SNE of representations")]
    parts += ["<h2>Runs</h2>", _table(_run_rows(groups))]
    errors = [f"{r.name}: {r.status}: {r.summary['error']}" for r in runs if r.summary.get("error")]
    if errors:
        parts.append("<ul>" + "".join(f'<li class="failed">{html.escape(e)}</li>' for e in errors) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _curves_section(heading: str, groups: Sequence[Group], families: Sequence[Metric]) -> list[str]:
    """The parts of a page's section of per-round figures, one per family of
    ``families`` that has one (none: no section), each on its own axis."""
    curves = [(m, png) for m in families if (png := curves_figure(groups, m))]
    if not curves:
        return []
    parts = [f"<h2>{html.escape(heading)}</h2>"]
    for metric, png in curves:
        better = " (lower is better for the defender)" if metric.lower_is_better else ""
        parts += [f'<p class="caption">{html.escape(metric.label)}: mean over seeds, band ± std{better}</p>',
                  _image(png, f"{metric.label} per round")]
    return parts


def _run_rows(groups: Sequence[Group]) -> list[list[str]]:
    """A row per run: its state, rounds, metric and final value (%), seconds and
    executor, with its aggregator, attack, precision, recall and final backdoor success
    (:func:`~contrafl.experiments.report.robustness_cells`, in %) when some run had
    attackers or a robust aggregator."""
    attacked = any(robustness(run.config, run.rows) is not None for g in groups for run in g.runs)
    robust = robustness_header(" (%)") if attacked else []
    rows = [["run", "configuration", "status", "rounds", "metric", "final (%)", *robust, "seconds", "executor"]]
    for g in groups:
        for run in g.runs:
            metric = run.metric
            final = run.evaluated(metric.key)[-1][metric.key] if metric else None
            wall = run.summary.get("wall_time_s")
            rows.append([
                run.name,
                g.label,
                run.status,
                f"{run.rows[-1]['round'] if run.rows else 0}/{run.config.get('rounds', '?')}",
                metric.label if metric else "-",
                "-" if final is None else f"{100 * final:.2f}",
                *(robustness_cells(robustness(run.config, run.rows), scale=100, digits=2) if attacked else []),
                "-" if wall is None else f"{wall:.0f}",
                str(run.summary.get("executor", run.config.get("executor", "?"))),
            ])
    return rows


def write_html(paths: Sequence[Path], out: Path, argv: Sequence[str] | None = None, baseline: str | None = None) -> Path:
    """Write the report of ``paths`` to ``out``; ``argv`` is the regenerating command's
    arguments (default: ``contrafl report PATHS --html OUT``)."""
    argv = list(argv) if argv is not None else ["report", *map(str, paths), "--html", str(out)]
    page = render(paths, "contrafl " + shlex.join(argv), baseline=baseline)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
