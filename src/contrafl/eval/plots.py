"""Figures written as PNG files.

Figures are drawn on a :class:`matplotlib.figure.Figure` with the Agg canvas, never through
``pyplot``: no display is needed and the global backend of the calling program is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["plot_partition_heatmap"]

ANNOTATE_MAX_CELLS = 400
"""Counts are written in the cells when the grid has at most this many cells (e.g. 10 x 40)."""


def plot_partition_heatmap(
    counts: np.ndarray,
    path: str | Path | BinaryIO,
    classes: Sequence[str] | None = None,
    title: str | None = None,
) -> Path | BinaryIO:
    """Write the class-by-party heatmap of a partition, like MOON's Figure 5.

    Args:
        counts: ``[clients, classes]`` number of samples of each class held by each party
            (:meth:`contrafl.data.partition.Partition.counts`).
        path: PNG file to write (its parent directory must exist), or a binary file object.
        classes: class names for the y axis (class ids when ``None``).
        title: figure title.

    The x axis is the party id, the y axis the class, the colour the number of samples; each
    cell shows its count when the grid has at most :data:`ANNOTATE_MAX_CELLS` cells.
    """
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"counts must be a [clients, classes] matrix, got shape {counts.shape}")
    num_clients, num_classes = counts.shape
    if classes is not None and len(classes) != num_classes:
        raise ValueError(f"{len(classes)} class names for {num_classes} classes")
    grid = counts.T  # rows: classes, columns: parties

    fig = Figure(figsize=(min(3 + 0.55 * num_clients, 24), min(1.5 + 0.45 * num_classes, 24)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="YlGnBu", aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="number of samples")
    ax.set_xlabel("party ID")
    ax.set_ylabel("class")
    if num_clients <= 50:
        ax.set_xticks(range(num_clients))
    if num_classes <= 50:
        ax.set_yticks(range(num_classes), labels=list(classes) if classes is not None else None)
    if title:
        ax.set_title(title)
    if grid.size <= ANNOTATE_MAX_CELLS:
        threshold = (grid.max() + grid.min()) / 2
        for (row, col), value in np.ndenumerate(grid):
            colour = "white" if value > threshold else "black"
            ax.text(col, row, f"{value:g}", ha="center", va="center", fontsize=8, color=colour)
    fig.tight_layout()
    path = path if hasattr(path, "write") else Path(path)
    fig.savefig(path, format="png", dpi=120)
    return path
