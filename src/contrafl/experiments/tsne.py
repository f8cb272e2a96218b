"""t-SNE of a run's test representations, coloured by class: ``contrafl plot-repr``.

MOON's Figure 2 and FedCRL's representation figure: one panel for the encoder of the global
model of the run's last checkpoint and one for the local model of each chosen client, all
embedding the same class-stratified random subset of the test set (the official test set,
or the clients' test splits pooled when the run pooled it into them, as ``contrafl
eval-repr`` takes it). Representations are the encoder's features ``h`` of un-augmented
inputs (the run's evaluation transform): what the kNN monitor and the linear probe read.

Local models are those of ``contrafl eval-repr --protocol spectrum``: the model each client
trains in one more round of local training from the checkpoint and its stored state, with
the parts it keeps to itself (a local body or head), trained without writing to the run
directory (:func:`~contrafl.experiments.probe._local_encoders`). Where a client trains two models
(Ditto, pFedMe) this is the one it sends, not its personal model. A global encoder that is
still its initialisation (FedProto, SOLO, FedGH, LG-FedAvg) gets no panel.

Each panel gets two numbers of how well the classes separate: the silhouette of the 2-D
embedding by class (scikit-learn's ``silhouette_score``; about 0 for random labels, 1 for
tight, distant clusters) and the leave-one-out :data:`KNN_K`-nearest-neighbour accuracy
in feature space (cosine similarity, majority vote; chance is about ``1 / classes``),
which does not depend on t-SNE.

Written next to each other (default ``RUN_DIR/representation/``): ``tsne.png`` and
``tsne.json`` (:func:`plot_run` gives its schema).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch.nn import functional as F

from ..engine.run_dir import to_json
from ..errors import ContraflError
from .probe import _load, _local_encoders, client_ids, global_encoder_trained
from ..metrics.knn import extract_features
from .representation import select_labeled

FIGURE = Path("representation") / "tsne.png"
"""The figure's path in a run directory by default; ``tsne.json`` is beside it."""
DEFAULT_CLIENTS = 2
"""Clients plotted when none are chosen: the first ones, at most this many."""
MIN_PER_CLASS = 2
"""The subset needs at least this many samples per class present in the test set."""
KNN_K = 10
"""Neighbours of the leave-one-out kNN accuracy in feature space."""
LEGEND_MAX_CLASSES = 20
"""Class names are listed in a legend up to this many classes."""
COLUMNS = 4
"""Panels per row of the figure."""
LEGEND_WIDTH = 1.1
"""Inches on the right of the figure for the legend."""


def plot_run(
    run_dir: Path,
    *,
    clients: str | Sequence[int] | None = None,
    local: bool = True,
    samples: int = 2000,
    perplexity: float = 30.0,
    seed: int = 0,
    device: str = "auto",
    out: Path | None = None,
) -> dict[str, Any]:
    """Embed the test representations of the models of ``run_dir`` with t-SNE, plot them
    and return the record also written as JSON next to the PNG ``out`` (default
    ``run_dir/representation/tsne.png``, the JSON ``tsne.json`` beside it).

    ``clients`` are ids as :func:`~contrafl.experiments.probe.client_ids` reads them (``"0,3"``,
    ``"all"``), by default the first :data:`DEFAULT_CLIENTS`; ``local=False`` plots the
    global model only. ``samples`` test samples (all when there are fewer) are drawn
    class-stratified with ``seed`` (:func:`~contrafl.experiments.representation.select_labeled`),
    the same for every panel; t-SNE (scikit-learn, PCA initialisation, ``random_state=seed``)
    runs with ``perplexity``, clipped to ``samples - 1``.

    The record (strict JSON)::

        run_dir, algorithm, dataset, round: the checkpoint evaluated
        global_trained: false when the global encoder is still its initialisation (no panel)
        note: why there is no global panel (only then)
        local_from_round: the round the local models were trained in (only with clients)
        samples, seed, perplexity (as used), knn_k
        classes: class names; labels: class id of each point; indices: its row in the test samples
            (the official test set, or the clients' test splits in client order when the run pooled it)
        png: file name of the figure, in the JSON's folder
        panels: one per plot, in order, each
            model: "global" or "local"; client: the client id (null for global); title
            silhouette, knn_acc: how well the classes separate (module docstring)
            coordinates: [samples][2] t-SNE coordinates, rounded to 4 decimals
    """
    from sklearn.manifold import TSNE  # imported here: slow to import
    from sklearn.metrics import silhouette_score

    run_dir = Path(run_dir)
    if not perplexity > 0:
        raise ContraflError(f"--perplexity {perplexity} must be positive, e.g. 30 (t-SNE's usual 5 to 50)")
    run = _load(run_dir, device)
    cfg, data = run.setup.config, run.setup.data
    cids = _chosen_clients(clients, local, cfg.num_clients)
    trained = global_encoder_trained(run)
    note = None if trained else f"the global encoder is still its initialisation ({cfg.algorithm.name} trains no global encoder)"
    if not trained and not cids:
        raise ContraflError(f"--no-local leaves nothing to plot: {note} in {run_dir}; plot the clients' local models without it")

    rows = _test_subset(run.y_test.cpu(), samples, data.num_classes, seed, run_dir)
    x, labels = run.x_test[rows.to(run.x_test.device)], run.y_test.cpu()[rows]
    n = len(rows)
    perplexity = min(float(perplexity), n - 1.0)

    models: list[tuple[str, int | None, str, Callable[[torch.Tensor], torch.Tensor]]] = []
    if trained:
        models.append(("global", None, "global model", lambda b: run.net(run.state, b, train=False).h))
    if cids:
        encoders = _local_encoders(run, run_dir, cids)
        models += [("local", cid, f"client {cid}, local model", encoders[cid]) for cid in cids]

    panels = []
    for model, cid, title, encode in models:
        features = extract_features(encode, x, run.setup.eval_transform, cfg.eval_batch_size).cpu()
        coords = TSNE(perplexity=perplexity, random_state=seed).fit_transform(features.numpy())
        panels.append({
            "model": model, "client": cid, "title": title,
            "silhouette": float(silhouette_score(coords, labels.numpy())),
            "knn_acc": loo_knn_accuracy(features, labels, KNN_K),
            "coordinates": np.round(coords, 4).tolist(),
        })

    path = Path(out) if out is not None else run_dir / FIGURE
    path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "run_dir": str(run_dir), "algorithm": cfg.algorithm.name, "dataset": data.name, "round": run.round,
        "global_trained": trained, **({"note": note} if note else {}), **({"local_from_round": run.round} if cids else {}),
        "samples": n, "seed": seed, "perplexity": perplexity, "knn_k": KNN_K,
        "classes": list(data.classes), "labels": labels.tolist(), "indices": rows.tolist(), "png": path.name,
        "panels": panels,
    }
    title = f"{cfg.algorithm.name} on {data.name}, round {run.round}: t-SNE of {n} test representations"
    untrained = f"\nno global panel: {cfg.algorithm.name} trains no global encoder"
    _plot(panels, labels.numpy(), list(data.classes), path, title + ("" if trained else untrained))
    path.with_suffix(".json").write_text(to_json(record, indent=1) + "\n")
    return record


def _test_subset(labels: torch.Tensor, samples: int, num_classes: int, seed: int, run_dir: Path) -> torch.Tensor:
    """Rows (ascending) of a class-stratified random subset of ``samples`` of the test
    samples whose classes are ``labels``, all of them when there are fewer; at least
    :data:`MIN_PER_CLASS` per class present."""
    present = int(torch.unique(labels).numel())
    if present < 2:
        raise ContraflError(
            f"the test samples of {run_dir} hold {present} class(es): a plot coloured by class needs labelled test data of "
            "at least 2 classes (give the run a test set: pool=false, or test_fraction > 0)"
        )
    minimum = MIN_PER_CLASS * present
    if len(labels) < minimum:
        raise ContraflError(
            f"the test set of {run_dir} has {len(labels)} samples, too few for its {present} classes "
            f"(at least {minimum}); raise test_fraction or use the official test set (pool=false)"
        )
    if samples < minimum:
        raise ContraflError(f"--samples {samples} is too few: give at least {minimum} ({MIN_PER_CLASS} per class of the test set)")
    # floor((samples + 0.5) / N * N) == samples exactly, whatever the rounding of the division
    fraction = min(1.0, (samples + 0.5) / len(labels))
    return select_labeled(labels, fraction, num_classes, torch.Generator().manual_seed(seed))


def _chosen_clients(clients: str | Sequence[int] | None, local: bool, num_clients: int) -> list[int]:
    """The clients whose local models are plotted: none without ``local``, the first
    :data:`DEFAULT_CLIENTS` when ``clients`` is None, else :func:`client_ids`."""
    if not local:
        if clients is not None:
            raise ContraflError(f"--clients {clients!r} and --no-local exclude each other: give one of them")
        return []
    if clients is None:
        return list(range(min(DEFAULT_CLIENTS, num_clients)))
    return client_ids(clients, num_clients)


def loo_knn_accuracy(features: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Leave-one-out accuracy of the ``k``-nearest-neighbour majority vote among the
    samples themselves (cosine similarity of the features; each sample's neighbours are
    the others, ``k`` clipped to ``N - 1``; ties go to the lowest class id)."""
    f = F.normalize(features.float(), dim=1)
    similarity = f @ f.T
    similarity.fill_diagonal_(-math.inf)
    neighbours = similarity.topk(min(k, len(f) - 1), dim=1).indices
    votes = F.one_hot(labels[neighbours], int(labels.max()) + 1).sum(dim=1)
    return float((votes.argmax(dim=1) == labels).double().mean())


def _colours(num_classes: int) -> np.ndarray:
    """``[C, 4]`` RGBA colours, one per class: tab10 or tab20, turbo beyond 20 classes."""
    import matplotlib

    if num_classes <= 20:
        table = matplotlib.colormaps["tab10" if num_classes <= 10 else "tab20"].colors
        return np.array([(*table[c], 1.0) for c in range(num_classes)])
    return matplotlib.colormaps["turbo"](np.linspace(0, 1, num_classes))


def _plot(panels: list[dict[str, Any]], labels: np.ndarray, classes: list[str], path: Path, title: str) -> None:
    """A grid of scatter plots, one per panel, the same colour for a class everywhere; the
    class names in a legend on the right (up to :data:`LEGEND_MAX_CLASSES` classes)."""
    from matplotlib.lines import Line2D

    colours = _colours(len(classes))
    legend = len(classes) <= LEGEND_MAX_CLASSES
    columns = min(len(panels), COLUMNS)
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(max(3.6 * columns, 5) + (LEGEND_WIDTH if legend else 0), 3.6 * rows + 0.6))
    FigureCanvasAgg(fig)
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, columns, i + 1)
        xy = np.asarray(panel["coordinates"])
        ax.scatter(xy[:, 0], xy[:, 1], c=colours[labels], s=5, linewidths=0)
        ax.set_title(f"{panel['title']}\nsilhouette {panel['silhouette']:.2f}, {KNN_K}-NN acc {panel['knn_acc']:.2f}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=10)
    right = 1.0
    if legend:
        handles = [Line2D([], [], marker="o", linestyle="", color=colours[c]) for c in range(len(classes))]
        fig.legend(handles, classes, loc="center right", fontsize="small", title="class", frameon=False)
        right = 1 - LEGEND_WIDTH / fig.get_figwidth()
    fig.tight_layout(rect=(0, 0, right, 1))
    fig.savefig(path, format="png", dpi=120)
