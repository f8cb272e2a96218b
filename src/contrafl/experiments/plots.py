"""Figures written as PNG files.

Figures are drawn on a :class:`matplotlib.figure.Figure` with the Agg canvas, never through
``pyplot``: no display is needed and the global backend of the calling program is untouched.
They are laid out by matplotlib's constrained layout, which makes room for every label,
colour bar and legend (``tight_layout`` gives up, with a warning, on long ones).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["figure", "legend_below", "partition_heatmap", "plot_partition_heatmap"]

DPI = 110
"""Pixels per inch of the figures."""
PAGE_WIDTH = 9.5
"""Inches: the widest figure (1045 pixels), which ``contrafl report --html`` shows at its
own size in its page's 1100-pixel column, its text as large as drawn."""
CELL_FONT = 7
"""Points of the counts written in a heatmap's cells (and of its tick labels: 8)."""
MAX_COLUMNS = 30
"""Clients drawn as columns (MOON's Figure 5: x is the client); more are drawn as rows,
one per client, the figure as tall as they need."""


def figure(width: float, height: float) -> Figure:
    """A figure of ``width`` x ``height`` inches at :data:`DPI` on the Agg canvas, with
    constrained layout."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


FONT = 8
"""Points of the legends' and tick labels' text."""
CHAR_WIDTH = 0.62
"""The mean width of a character of the figures' font (DejaVu Sans), in em."""


def wrap(text: str, chars: int) -> str:
    """``text`` broken into lines of at most ``chars`` characters (at spaces when it can)."""
    return "\n".join(textwrap.wrap(text, max(chars, 4), break_on_hyphens=False)) or text


def chars(inches: float, size: float = FONT) -> int:
    """How many characters of ``size`` points fit in ``inches``."""
    return int(inches * 72 / (CHAR_WIDTH * size))


def legend_below(fig: Figure, ax, handles: list, labels: Sequence[str]):
    """The legend of ``handles`` under the axes ``ax`` of a constrained-layout figure,
    never wider than the axes: in as many columns as fit, each label wrapped to fit;
    the figure grows by the legend's height, so that the axes keep theirs."""
    width, height = fig.get_size_inches()
    fig.draw_without_rendering()  # places the axes
    axes = ax.get_window_extent().width / fig.dpi
    line_chars = max(10, chars(axes - 0.6))  # a legend line's handle and padding: about 0.6 inch
    for _ in range(8):
        wrapped = [wrap(label, line_chars) for label in labels]
        longest = max(len(line) for w in wrapped for line in w.splitlines())
        columns = max(1, min(len(labels), int(axes // (longest * CHAR_WIDTH * FONT / 72 + 0.7))))
        rows = [wrapped[i : i + columns] for i in range(0, len(wrapped), columns)]
        lines = sum(max(w.count("\n") + 1 for w in row) for row in rows)
        fig.set_size_inches(width, height + 0.25 + lines * 1.5 * FONT / 72)
        legend = fig.legend(handles, wrapped, loc="outside lower center", ncols=columns, fontsize=FONT, frameon=False)
        fig.draw_without_rendering()
        if legend.get_window_extent().width <= ax.get_window_extent().width:
            return legend
        legend.remove()
        line_chars = max(4, int(line_chars * 0.8))
    return fig.legend(handles, wrapped, loc="outside lower center", ncols=1, fontsize=FONT, frameon=False)


def partition_heatmap(counts: np.ndarray, classes: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """The class-by-client heatmap of a partition (:func:`plot_partition_heatmap`), as a
    figure sized by the number of clients and classes: every cell and label readable at
    :data:`DPI` within :data:`PAGE_WIDTH`.

    Up to :data:`MAX_COLUMNS` clients, the x axis is the client (MOON's Figure 5) and the
    y axis the class; with more, clients are the rows. Each cell shows its count when
    the cells are wide enough for it; the colour always does.
    """
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"counts must be a [clients, classes] matrix, got shape {counts.shape}")
    num_clients, num_classes = counts.shape
    if classes is not None and len(classes) != num_classes:
        raise ValueError(f"{len(classes)} class names for {num_classes} classes")
    names = [str(c) for c in classes] if classes is not None else [str(c) for c in range(num_classes)]
    by_column = num_clients <= MAX_COLUMNS
    grid = counts.T if by_column else counts  # rows: classes (or clients), columns: clients (or classes)
    rows, cols = grid.shape
    row_names = names if by_column else [str(c) for c in range(num_clients)]
    col_names = [str(c) for c in range(num_clients)] if by_column else names

    label_width = max(len(n) for n in row_names) * 0.62 * 8 / 72  # inches of the longest y tick label
    margins = 1.6 + label_width  # y label and ticks, colour bar
    cell_w = min(0.55, (PAGE_WIDTH - margins) / cols)
    digits = len(f"{grid.max():g}") if grid.size else 1
    annotate = cell_w >= (digits * 0.62 * CELL_FONT / 72 + 0.06) and rows <= 60
    cell_h = 0.3 if annotate else (0.22 if rows <= 60 else min(0.16, 20 / rows))  # at most 20 inches of rows
    upright = max(len(n) for n in col_names) * 0.62 * 8 / 72 > cell_w  # x tick labels wider than a cell
    bottom = 0.9 + (max(len(n) for n in col_names) * 0.62 * 8 / 72 if upright else 0.2)
    fig = figure(cols * cell_w + margins, rows * cell_h + bottom + (0.45 if title else 0.1))
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="YlGnBu", aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="number of samples", fraction=0.05, pad=0.02, aspect=30)
    ax.set_xlabel("client" if by_column else "class")
    ax.set_ylabel("class" if by_column else "client")
    ax.set_xticks(range(cols), labels=col_names, fontsize=8, rotation=90 if upright else 0)
    if cell_h * 72 >= 9:  # a tick label per row
        ax.set_yticks(range(rows), labels=row_names, fontsize=8)
    else:
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(nbins=max(2, int(rows * cell_h / 0.25)), integer=True))
        ax.tick_params(axis="y", labelsize=8)
    if title:
        ax.set_title("\n".join(textwrap.wrap(title, max(20, int(fig.get_figwidth() * 72 / (0.62 * 10))))), fontsize=10)
    if annotate:
        threshold = (grid.max() + grid.min()) / 2
        for (row, col), value in np.ndenumerate(grid):
            colour = "white" if value > threshold else "black"
            ax.text(col, row, f"{value:g}", ha="center", va="center", fontsize=CELL_FONT, color=colour)
    return fig


def plot_partition_heatmap(
    counts: np.ndarray,
    path: str | Path | BinaryIO,
    classes: Sequence[str] | None = None,
    title: str | None = None,
) -> Path | BinaryIO:
    """Write the class-by-client heatmap of a partition, like MOON's Figure 5.

    Args:
        counts: ``[clients, classes]`` number of samples of each class held by each client
            (:meth:`contrafl.data.partition.Partition.counts`).
        path: PNG file to write (its parent directory must exist), or a binary file object.
        classes: class names (class ids when ``None``).
        title: figure title.

    The colour is the number of samples; the layout is :func:`partition_heatmap`'s.
    """
    fig = partition_heatmap(counts, classes, title)
    path = path if hasattr(path, "write") else Path(path)
    fig.savefig(path, format="png")
    return path
