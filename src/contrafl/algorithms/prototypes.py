"""Per-label representations ("prototypes"), shared by FedProto and FedCRL.

A client accumulates, during its local training, the detached representations of the
samples it trains on, per label (:func:`label_sums`, returned as loss statistics and so
summed over the local steps by the executor); their means are its local prototypes
``r_i^c = (1/|D_i^c|) sum_{x in D_i^c} phi_i(x)`` (FedCRL eq. 3, FedProto eq. 4). The
server averages them per label over the clients that hold the label
(:func:`aggregate_prototypes`), weighted by the label counts (FedCRL's label-volume
weighting, FedProto's paper) or uniformly (PFLlib's FedProto). A label that no replying
client holds has no global prototype that round (PFLlib's FedProto and FedPAC rebuild the
prototypes from the round's uploads), or keeps its previous one (``missing_label``).

Prototypes travel as fixed-shape tensors so that every client of a round has the same
task structure (needed to vectorize): ``reps`` ``[C, d]`` (zero rows for absent labels)
with ``mask`` ``bool[C]`` from the server, and ``reps`` with ``counts`` ``int64[C]`` from
a client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from .base import ClientContext, TensorSpec


def label_sums(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """``{"proto_sum": [C, d], "proto_count": [C]}``: per-label sums of the detached
    representations ``z`` ``[B, d]`` and per-label sample counts of a batch."""
    onehot = (y.unsqueeze(1) == torch.arange(num_classes, device=y.device)).to(z.dtype)  # vmap-safe one_hot
    return {"proto_sum": onehot.T @ z.detach(), "proto_count": onehot.sum(0)}


def local_prototypes(stats: Mapping[str, torch.Tensor], num_classes: int, dim: int) -> dict[str, torch.Tensor]:
    """A client's reply ``{"reps": [C, d], "counts": int64[C]}`` from the summed
    :func:`label_sums` of its local training (zeros when it took no step)."""
    if "proto_sum" not in stats:
        return {"reps": torch.zeros(num_classes, dim), "counts": torch.zeros(num_classes, dtype=torch.long)}
    counts = stats["proto_count"].round().long()
    reps = stats["proto_sum"] / counts.clamp(min=1).unsqueeze(1).to(stats["proto_sum"].dtype)
    return {"reps": reps, "counts": counts}


def predicted_prototypes(ctx: ClientContext, state: Mapping[str, torch.Tensor], num_classes: int) -> dict[str, torch.Tensor]:
    """Local prototypes of ``state`` over the client's whole training data in eval mode
    (FedGH's and FedPAC's ``collect_protos``), as a reply ``{"reps", "counts"}``."""
    out, y = ctx.predict(state)
    return local_prototypes(label_sums(out.z, y, num_classes), num_classes, out.z.shape[1])


def aggregate_prototypes(
    replies: Sequence[Mapping[str, torch.Tensor]], weighting: str, previous: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Global prototypes ``{"reps": [C, d], "mask": bool[C]}`` from the clients' local ones.

    For each label ``c`` held by some client (``N_c`` = those clients)::

        counts:  r^c = sum_{i in N_c} |D_i^c| r_i^c / sum_{j in N_c} |D_j^c|   (FedCRL eq. 6)
        uniform: r^c = (1/|N_c|) sum_{i in N_c} r_i^c                         (PFLlib's FedProto)

    A label no replying client holds has none (``mask`` False), or keeps its ``previous``
    global prototype when one is given.
    """
    counts = torch.stack([r["counts"] for r in replies]).to(torch.float64)  # [M, C]
    reps = torch.stack([r["reps"] for r in replies]).to(torch.float64)  # [M, C, d]
    if weighting == "counts":
        weights = counts
    elif weighting == "uniform":
        weights = (counts > 0).to(torch.float64)
    else:
        raise ValueError(f"weighting={weighting!r}; expected 'counts' or 'uniform'")
    total = weights.sum(0)  # [C]
    mask = total > 0
    out = (weights.unsqueeze(2) * reps).sum(0) / total.clamp(min=1e-300).unsqueeze(1)
    out = out.to(replies[0]["reps"].dtype)
    if previous is not None:
        out = torch.where(mask.unsqueeze(1), out, previous["reps"])
        mask = mask | previous["mask"]
    return {"reps": out, "mask": mask}


class LabelMeans:
    """For an algorithm whose server averages each label's rows with
    :func:`aggregate_prototypes` (weighted as its ``params.weighting`` says) and
    everything else by sample count: those means are what secure aggregation's weighted
    sums give (:meth:`~contrafl.algorithms.base.Algorithm.beyond_weighted_mean`)."""

    @classmethod
    def beyond_weighted_mean(cls, params: Any) -> str | None:
        return None

    @classmethod
    def label_weighting(cls, params: Any) -> str:
        return params.weighting


MISSING_LABEL = P.OneOf(("drop", "keep"))
MISSING_LABEL_DOC = (
    "a label no client of the round holds: no global prototype that round (PFLlib rebuilds them "
    "from the round's uploads) or keep its previous one"
)


def previous_for(extras: Mapping[str, Any], missing_label: str) -> Mapping[str, torch.Tensor] | None:
    """The global prototypes an aggregation falls back on for labels nobody reported:
    the server's current ones with ``missing_label="keep"``, none with ``"drop"``."""
    return extras.get("prototypes") if missing_label == "keep" else None


def prototype_message(extras: Mapping[str, Any]) -> dict[str, Any]:
    """``{"prototypes": ...}``, the server's global prototypes, once at least one label
    has one; ``{}`` before (round 0, or no client has reported a label yet)."""
    protos = extras.get("prototypes")
    return {"prototypes": protos} if protos is not None and bool(protos["mask"].any()) else {}


def reply_spec(num_classes: int, dtype: torch.dtype) -> dict[str, Any]:
    """Shapes of a client's prototype reply."""
    return {"reps": TensorSpec((num_classes, None), dtype), "counts": TensorSpec((num_classes,), torch.long)}


def contrastive_loss(
    z: torch.Tensor, y: torch.Tensor, reps: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """FedCRL's representation contrastive loss (eqs. 11-12, InfoNCE against the global
    label representations), averaged over the samples whose label has one::

        L = -(1/|V|) sum_{b in V} log( exp(cos(z_b, r^{y_b})/tau) / sum_{c: mask_c} exp(cos(z_b, r^c)/tau) )

    with ``V = {b : mask[y_b]}``: the positive is the sample's own label's global
    representation, the negatives every other label's. Zero when ``V`` is empty. Written
    without branching on values (it runs under ``vmap``).
    """
    sims = F.normalize(z, dim=1) @ F.normalize(reps, dim=1).T / temperature  # [B, C]
    log_den = sims.masked_fill(~mask, float("-inf")).logsumexp(dim=1)
    per_sample = log_den - sims.gather(1, y.unsqueeze(1)).squeeze(1)
    valid = mask[y].to(z.dtype)
    return (per_sample * valid).sum() / valid.sum().clamp(min=1)


def squared_distance_loss(z: torch.Tensor, y: torch.Tensor, reps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """FedProto's regulariser as PFLlib computes it: ``MSE(z, P)`` averaged over all
    ``B x d`` elements, where row ``b`` of ``P`` is the global prototype of ``y_b`` or,
    for a label without one, ``z_b`` itself (no contribution)."""
    valid = mask[y].unsqueeze(1).to(z.dtype)
    return ((z - reps[y]) ** 2 * valid).mean()


def nearest_prototype_scores(z: torch.Tensor, reps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Class scores ``-||z - r^c||^2 / d`` (minus FedProto's MSE), ``-inf`` for labels
    without a prototype: the argmax is the nearest prototype."""
    dist = torch.cdist(z.float(), reps.float()).pow(2) / z.shape[1]
    return (-dist).masked_fill(~mask, float("-inf"))
