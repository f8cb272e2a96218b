"""``contrafl report --update FILE``: the tables and figures of a markdown file (such as
docs/results.md) regenerated from run directories.

Two kinds of block are regenerated in place::

    <!-- report SUITE_DIR -->            the table of a suite or sweep directory
    ...                                  (contrafl report SUITE_DIR --markdown)
    <!-- end report -->

    <!-- figure SUITE_DIR KIND PNG -->   a figure of the runs below SUITE_DIR, written to
    ![...](PNG)                          PNG (relative to the markdown file) and linked;
    <!-- end figure -->                  KIND: curves (accuracy per round, seed bands),
                                         clients (per-client accuracy), partition (heatmap)

A block whose directory is not on this machine (a suite run elsewhere) is left as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ConfigError

REPORT_BLOCK = re.compile(r"(<!-- report (?P<dir>\S+) -->\n)(?P<body>.*?)(<!-- end report -->)", re.S)
FIGURE_BLOCK = re.compile(r"(<!-- figure (?P<dir>\S+) (?P<kind>\S+) (?P<png>\S+) -->\n)(?P<body>.*?)(<!-- end figure -->)", re.S)
FIGURES = ("curves", "clients", "partition")


def table(folder: Path) -> str:
    """The markdown table of a suite or sweep directory."""
    from .suite import SUITE_RECORD, suite_report
    from .sweep import SWEEP_RECORD, sweep_report, sweep_statistics

    if (folder / SWEEP_RECORD).is_file():
        return f"{sweep_report(folder)}\n\n{sweep_statistics(folder)}\n\nregenerate with `contrafl report {folder} --markdown`"
    if (folder / SUITE_RECORD).is_file():
        return suite_report(folder)
    raise ConfigError(f"{folder} has no {SUITE_RECORD} or {SWEEP_RECORD}; a report block needs the --out directory of a suite or sweep")


def figure(folder: Path, kind: str) -> bytes | None:
    """The PNG of figure ``kind`` of the runs below ``folder`` (None: nothing to draw)."""
    from .html import clients_figure, curves_figure, group_runs, partition_figures
    from .report import METRICS

    groups = group_runs([folder])
    if kind == "curves":
        metric = next((m for m in METRICS if any(g.metric == m for g in groups)), None)
        return None if metric is None else curves_figure(groups, metric)
    if kind == "clients":
        return clients_figure(groups)
    if kind == "partition":
        heatmaps = partition_figures(groups, limit=1)
        return heatmaps[0][1] if heatmaps else None
    raise ConfigError(f"figure kind '{kind}' is invalid; expected one of {', '.join(FIGURES)}")


def update(path: Path) -> tuple[list[str], list[str]]:
    """Regenerate every report and figure block of the markdown file ``path``; the
    blocks regenerated and those left (their directory is not here)."""
    path = Path(path)
    text = path.read_text()
    if not REPORT_BLOCK.search(text) and not FIGURE_BLOCK.search(text):
        raise ConfigError(f"{path} has no '<!-- report SUITE_DIR -->' or '<!-- figure SUITE_DIR KIND PNG -->' block to regenerate")
    done: list[str] = []
    left: list[str] = []

    def report_block(m: re.Match) -> str:
        folder = Path(m.group("dir"))
        if not folder.is_dir():
            left.append(str(folder))
            return m.group(0)
        done.append(str(folder))
        return m.group(1) + table(folder) + "\n" + m.group(4)

    def figure_block(m: re.Match) -> str:
        folder, kind, png = Path(m.group("dir")), m.group("kind"), m.group("png")
        what = f"{kind} of {folder}"
        if not folder.is_dir():
            left.append(what)
            return m.group(0)
        data = figure(folder, kind)
        if data is None:
            raise ConfigError(f"{path}: the runs in {folder} have nothing to draw as '{kind}'")
        target = path.parent / png
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        done.append(what)
        return m.group(1) + f"![{what}]({png})\n" + m.group(6)

    text = REPORT_BLOCK.sub(report_block, text)
    path.write_text(FIGURE_BLOCK.sub(figure_block, text))
    return done, left
