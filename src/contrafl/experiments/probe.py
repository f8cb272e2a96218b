"""Representation evaluation of a finished (or checkpointed) run: ``contrafl eval-repr``.

The global model of the run's last checkpoint is evaluated by one protocol on the run's
own data (its config.yaml): the training set is the union of the clients' training
samples, the test set the official one (or the clients' test splits when the run pooled
it into them). Inputs are un-augmented and normalised as in the run.

- ``knn``: weighted kNN on the encoder's features (the run's ``knn_k``,
  ``knn_temperature``);
- ``linear``: a linear classifier on the frozen features (Adam 3e-3, batch 512, 200
  epochs, the accuracy after the last epoch: FedU2's ``linear_eval.py``);
- ``finetune``: encoder and a linear head fine-tuned on a class-stratified fraction of
  the training labels (1% or 10%; SGD with momentum 0.9, lr 1e-3 for the encoder and 0.3
  for the head, batch 128, 200 epochs, augmentation ``finetune``, the best of the
  evaluations at epochs 100 and 200: FedU2's ``semi_eval.py``; vector data are not
  augmented);
- ``spectrum``: singular values of the covariance of the l2-normalised test
  representations (FedU2's Figure 3), of the global model and of the local models of
  some clients after one more round of local training, each with its effective rank
  (:func:`effective_rank`), saved with a plot of the log-values.

Each result is written to ``RUN_DIR/representation/<protocol>.json`` (``finetune-1%``,
``finetune-10%``) with the settings that produced it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data import augment
from ..engine.checkpoint import check_checkpoint
from ..engine.run_dir import CHECKPOINT, to_json
from ..errors import ContraflError
from ..metrics.knn import bank_and_queries, extract_features, knn_accuracy
from .representation import finetune, linear_probe, singular_spectrum

PROTOCOLS = ("knn", "linear", "finetune", "spectrum")
LOCAL_CLIENTS = 10  # local spectra by default: the first clients, at most this many


@dataclass
class _Loaded:
    setup: Any
    net: Any
    state: dict[str, torch.Tensor]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    round: int
    checkpoint: dict[str, Any]


def _load(run_dir: Path, device: str) -> _Loaded:
    from ..config import load_config
    from ..execution.executor import FunctionalNet
    from ..engine.setup import prepare
    from ..engine.resume import load_checkpoint

    if not (run_dir / "config.yaml").is_file():
        raise ContraflError(f"{run_dir} is not a run directory (no config.yaml); give the directory a `contrafl run` wrote")
    checkpoint = load_checkpoint(run_dir)
    if checkpoint is None:
        raise ContraflError(f"{run_dir} has no checkpoint yet; evaluate it after its first round")
    setup = prepare(load_config(run_dir / "config.yaml", [f"device={device}"]))
    check_checkpoint(checkpoint, run_dir / CHECKPOINT, setup.config, setup.model.state_dict())
    dev = setup.device
    data = [t.to(dev) for t in bank_and_queries(setup.data.train, setup.data.test, setup.partition)]
    state = {k: v.to(dev) for k, v in checkpoint["server"]["model"].items()}
    return _Loaded(setup, FunctionalNet(setup.model.to(dev)), state, *data, int(checkpoint["round"]), checkpoint)


def client_ids(clients: str | Sequence[int] | None, num_clients: int) -> list[int]:
    """The clients whose local spectra are computed, ascending: ``None`` the first
    :data:`LOCAL_CLIENTS` (all when there are no more), ``"all"``, or ids given as
    ``"0,3,5"`` or a sequence, each in ``0..num_clients - 1``."""
    if clients is None:
        return list(range(min(num_clients, LOCAL_CLIENTS)))
    if isinstance(clients, str) and clients.strip() == "all":
        return list(range(num_clients))
    try:
        ids = [int(c) for c in (clients.split(",") if isinstance(clients, str) else clients)]
    except (TypeError, ValueError):
        ids = []
    if not ids or not all(0 <= c < num_clients for c in ids):
        raise ContraflError(
            f"--clients {clients!r} is not valid: give comma-separated client ids in 0..{num_clients - 1}, or all"
        )
    return sorted(set(ids))


def evaluate_run(
    run_dir: Path,
    protocol: str,
    *,
    label_fraction: float = 0.01,
    epochs: int | None = None,
    seed: int = 0,
    device: str = "auto",
    clients: str | Sequence[int] | None = None,
    local: bool = True,
) -> dict[str, Any]:
    """Evaluate the global model of ``run_dir`` by ``protocol``; the result (also written
    to the run directory). ``spectrum`` adds the local models of ``clients``
    (:func:`client_ids`) unless ``local`` is false, and ``knn`` those of ``clients``
    when given.

    A global encoder that is still its initialisation (FedProto and SOLO share no model,
    FedGH and LG-FedAvg no encoder) is not evaluated: ``global_trained`` is false, ``knn``
    and ``spectrum`` evaluate the local models of ``clients`` (the first ones by
    default), and ``linear`` and ``finetune``, which train on the global encoder, stop
    with an error."""
    if protocol not in PROTOCOLS:
        raise ContraflError(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if protocol == "finetune" and not 0 < label_fraction <= 1:
        raise ContraflError(f"--label-fraction {label_fraction} must lie in (0, 1], e.g. 0.01 or 0.1")
    if protocol in ("linear", "finetune") and clients is not None:
        raise ContraflError(f"--clients selects local models for --protocol knn or spectrum; {protocol} evaluates the global encoder only")
    run = _load(Path(run_dir), device)
    cfg, tf = run.setup.config, run.setup.eval_transform
    trained = global_encoder_trained(run)
    if not trained and protocol in ("linear", "finetune"):
        raise ContraflError(
            f"the global encoder of {run_dir} is still its initialisation ({cfg.algorithm.name} trains no global encoder); "
            "evaluate the clients' own models with --protocol knn or spectrum and --clients"
        )
    wants_local = (protocol == "spectrum" and local) or (protocol == "knn" and clients is not None) or not trained
    cids = client_ids(clients, cfg.num_clients) if wants_local else []
    classes = run.setup.data.num_classes
    bs = cfg.eval_batch_size
    g = torch.Generator().manual_seed(seed)

    def encode(x: torch.Tensor) -> torch.Tensor:
        return run.net(run.state, x, train=False).h

    out: dict[str, Any] = {
        "protocol": protocol, "round": run.round, "train_samples": len(run.y_train), "test_samples": len(run.y_test),
        "global_trained": trained,
    }
    name = protocol
    encoders = {"global": encode} if trained else {}
    if cids:
        out["local_from_round"] = run.round
        encoders.update({str(cid): e for cid, e in _local_encoders(run, Path(run_dir), cids).items()})
    if protocol == "spectrum":
        for who, enc in encoders.items():
            with torch.no_grad():
                record = _spectrum_record(extract_features(enc, run.x_test, tf, bs))
            if who == "global":
                out.update(record)
            else:
                out.setdefault("local", {})[who] = record
    elif protocol == "knn":
        out.update(k=cfg.knn_k, temperature=cfg.knn_temperature)
        for who, enc in encoders.items():
            with torch.no_grad():
                train_f = extract_features(enc, run.x_train, tf, bs)
                test_f = extract_features(enc, run.x_test, tf, bs)
            acc = knn_accuracy(train_f, run.y_train, test_f, run.y_test, classes, cfg.knn_k, cfg.knn_temperature)
            if who == "global":
                out["acc"] = acc
            else:
                out.setdefault("local", {})[who] = {"acc": acc}
    elif protocol == "linear":
        with torch.no_grad():
            train_f = extract_features(encode, run.x_train, tf, bs)
            test_f = extract_features(encode, run.x_test, tf, bs)
        epochs = epochs or 200
        res = linear_probe(train_f, run.y_train, test_f, run.y_test, classes, epochs=epochs, generator=g)
        out.update(epochs=epochs, lr=3e-3, batch_size=512, acc=res.acc, best_acc=res.best_acc)
    elif protocol == "finetune":
        epochs = epochs or 200
        name = f"finetune-{100 * label_fraction:g}%"
        encoder = {k for k in run.state if k.startswith("features.")}
        names = {n for n, _ in run.setup.model.named_parameters()}
        params = {k: v for k, v in run.state.items() if k in encoder and k in names}
        rest = {k: v for k, v in run.state.items() if k not in params}
        buffers = {k: v for k, v in rest.items() if k not in names}
        frozen = {k: v for k, v in rest.items() if k in names}
        mean, std = run.setup.data.mean, run.setup.data.std
        images = len(run.setup.data.input_shape) == 3
        transform = augment.AUGMENTATIONS.get("finetune")(mean, std) if images else augment.eval_transform(mean, std)
        res = finetune(
            params, buffers, lambda s, x, train: run.net({**frozen, **s}, x, train=train).h,
            run.x_train, run.y_train, run.x_test, run.y_test, classes,
            transform=transform, test_transform=tf, generator=g, label_fraction=label_fraction,
            epochs=epochs, eval_every=max(1, math.ceil(epochs / 2)),
        )
        out.update(label_fraction=label_fraction, labeled=len(res.labeled), epochs=epochs, acc=res.acc, last_acc=res.last_acc)
    out["seed"] = seed
    folder = Path(run_dir) / "representation"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(to_json(out, indent=1) + "\n")
    if protocol == "spectrum":
        local_records = {f"client {cid}": r for cid, r in out.get("local", {}).items()}
        _plot_spectrum(out if trained else None, local_records, folder / "spectrum.png", f"{cfg.algorithm.name}, round {run.round}")
    return out


def global_encoder_trained(run: _Loaded) -> bool:
    """Whether the checkpoint's global encoder (the ``features.`` part of the server's
    model) differs from the run's initial global model, i.e. whether the run ever trained
    and aggregated an encoder."""
    initial = run.setup.model.state_dict()
    return any(not torch.equal(v, initial[k]) for k, v in run.state.items() if k.startswith("features."))


def effective_rank(singular_values: torch.Tensor) -> float:
    """The effective rank of a spectrum (Roy & Vetterli, 2007)::

        p_k = sigma_k / sum_j sigma_j        erank = exp(-sum_k p_k log p_k)    (0 log 0 = 0)

    between 1 (one direction carries all the variance: complete collapse) and D (equal
    singular values); a continuous count of the singular values that are not ~0, the
    number FedU2's Figure 3 argues with. 0 for an all-zero spectrum."""
    sigma = singular_values.to(torch.float64).clamp_min(0)
    total = sigma.sum()
    if total <= 0:
        return 0.0
    p = sigma / total
    return math.exp(-torch.special.xlogy(p, p).sum().item())


def _spectrum_record(features: torch.Tensor) -> dict[str, Any]:
    """The spectrum of ``features`` (:func:`singular_spectrum`), its effective rank, and
    the singular values that are numerically zero: those below ``tol = sigma_1 D eps``
    (numpy's ``matrix_rank`` tolerance, ``eps`` of the features' dtype, float32's for
    float32 features) are rounding noise of a rank-deficient covariance, however small
    their logarithm (-160 is common); ``numerical_rank`` counts the others."""
    spectrum = singular_spectrum(features)
    sigma = spectrum.singular_values
    tol = float(sigma.max()) * sigma.numel() * torch.finfo(features.dtype).eps
    return {
        "singular_values": sigma.tolist(),
        "log_singular_values": spectrum.log_singular_values.tolist(),
        "effective_rank": effective_rank(sigma),
        "numerical_rank": int((sigma > tol).sum()),
        "log_tolerance": math.log(tol) if tol > 0 else None,
    }


def _local_encoders(run: _Loaded, run_dir: Path, cids: list[int]) -> dict[int, Any]:
    """The encoders of the local models of clients ``cids``: from the checkpoint's
    server state and each client's stored state, one round of local training (the round
    after the checkpoint's, trained as the run trains it:
    :meth:`~contrafl.engine.simulation.Simulation.local_models`) without aggregating and
    without writing to ``run_dir`` (:func:`~contrafl.engine.resume.read_only`). Parts
    of the architecture a client does not train are the global model's."""
    from ..engine.resume import read_only

    sim = read_only(run.setup, run_dir, run.checkpoint, cids)
    try:
        models = sim.local_models(cids)
    finally:
        sim.store.close()

    def encoder(state: dict[str, torch.Tensor]) -> Any:
        return lambda x: run.net(state, x, train=False).h

    return {cid: encoder({**run.state, **models[cid]}) for cid in cids}


def _plot_spectrum(global_record: dict[str, Any] | None, local: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """The global curve (when the global encoder was evaluated) and, thinner and lighter,
    every local one; each curve stops at its numerical rank (:func:`_spectrum_record`),
    and a dashed line marks the largest tolerance, below which values are rounding
    noise."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    def significant(record: dict[str, Any]) -> list[float]:
        return record["log_singular_values"][: record["numerical_rank"]]

    fig, ax = plt.subplots(figsize=(5, 3.5))
    if global_record is not None:
        values = significant(global_record)
        ax.plot(range(1, len(values) + 1), values, color="black", linewidth=2, label="global", zorder=3)
    for label, record in local.items():
        values = significant(record)
        ax.plot(range(1, len(values) + 1), values, linewidth=0.8, alpha=0.5, label=label)
    records = ([global_record] if global_record is not None else []) + list(local.values())
    tolerances = [r["log_tolerance"] for r in records if r["log_tolerance"] is not None]
    if tolerances:
        ax.axhline(max(tolerances), color="grey", linestyle="--", linewidth=0.8, label="numerical zero")
    if local or tolerances:
        ax.legend(fontsize="x-small", ncol=2)
    ax.set_xlabel("singular value rank")
    ax.set_ylabel("log singular value")
    ax.set_title(f"representation spectrum: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
