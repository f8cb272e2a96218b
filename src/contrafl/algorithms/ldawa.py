"""L-DAWA: layer-wise divergence aware weight aggregation (Rehman et al., ICCV 2023),
over any of the self-supervised clients of :mod:`.ssl`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import params as P
from .aggregation import weighted_average
from .base import Reply, ServerState, StateDict
from .registry import ALGORITHMS
from .ssl import METHODS, SelfSupervised, SSLParams

GRANULARITIES = ("layer", "module", "model")

# state-dict prefixes of the model's blocks (models/base.py): FedU2's encoder, projector
# and predictor modules; each extra head (FedU2's deg_layer) is a block of its own
PROJECTOR = ("l1.", "l1_bn.", "l2.")


@dataclass(frozen=True)
class LDAWAParams(SSLParams):
    method: str = P.param("simclr", P.OneOf(METHODS), "the clients' self-supervised method (L-DAWA's code and FedU2's Table 1: SimCLR)")
    granularity: str = P.param("layer", P.OneOf(GRANULARITIES), "one cosine per tensor (L-DAWA's code), per block: encoder/projector/predictor/each head (FedU2's code), or for the whole model")
    renormalize: bool = P.param(False, None, "divide by sum_k c_k instead of K (FedU2's SimSiam variant); the code divides by K")
    buffers: str = P.param("ldawa", P.OneOf(("ldawa", "average")), "BatchNorm statistics: cosine-scaled like the parameters (both codes), or the weighted average")
    warmup_rounds: int = P.param(0, P.Interval(0, None), "rounds aggregated by FedAvg before L-DAWA starts (the code: while its simulation starts at round <= 2)")


def block_of(name: str) -> str:
    """The block of a state-dict entry: ``encoder`` (``features.``), ``projector``
    (``l1.``, ``l1_bn.``, ``l2.``), ``predictor``, ``heads.<name>`` for each extra head,
    else the name's first component (``l3`` for a classifier)."""
    if name.startswith("features."):
        return "encoder"
    if name.startswith(PROJECTOR):
        return "projector"
    if name.startswith("heads."):
        return ".".join(name.split(".")[:2])
    return name.split(".")[0]


def ldawa_groups(reference: Mapping[str, torch.Tensor], granularity: str, keys: Sequence[str] | None = None) -> dict[str, list[str]]:
    """The entries that share one cosine: ``layer``: every tensor alone, 0-dim tensors
    (BatchNorm's ``num_batches_tracked``) left out as L-DAWA's code does; ``module``:
    the entries of each :func:`block_of` together, 0-dim ones included (FedU2's code);
    ``model``: every entry together. ``keys`` restricts the groups to some entries."""
    keys = list(reference) if keys is None else list(keys)
    if granularity == "layer":
        return {k: [k] for k in keys if reference[k].dim() > 0}
    if granularity == "model":
        return {"model": keys} if keys else {}
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(block_of(k), []).append(k)
    return groups


def divergence_cosines(
    reference: Mapping[str, torch.Tensor], clients: Sequence[Mapping[str, torch.Tensor]], groups: Mapping[str, Sequence[str]]
) -> dict[str, list[float]]:
    """``c_k = min(cos(vec(G), vec(W_k)), 1)`` for every group, in float64, with ``vec``
    the concatenation of the group's entries of the reference (the global model sent this
    round) and of client ``k``'s model. A group with a zero vector on either side has no
    angle: ``c_k = 1`` (the client's tensor enters unscaled; L-DAWA's code skips a zero
    client tensor and divides by zero for a zero global one, e.g. BatchNorm's bias at
    initialisation)."""
    out: dict[str, list[float]] = {}
    for name, keys in groups.items():
        g = torch.cat([reference[k].detach().double().flatten() for k in keys])
        cos = []
        for client in clients:
            w = torch.cat([client[k].detach().double().flatten() for k in keys])
            norms = float(g.norm() * w.norm())
            cos.append(min(float(g @ w) / norms, 1.0) if norms > 0 else 1.0)
        out[name] = cos
    return out


def ldawa_average(
    reference: Mapping[str, torch.Tensor],
    clients: Sequence[Mapping[str, torch.Tensor]],
    groups: Mapping[str, Sequence[str]],
    renormalize: bool = False,
    keys: Sequence[str] | None = None,
) -> tuple[StateDict, dict[str, list[float]]]:
    """L-DAWA's rule for the entries ``keys`` (default: all of the reference)::

        W_new = sum_k c_k W_k / K          (renormalize: / sum_k c_k)

    with ``c_k`` the cosine of the entry's group (:func:`divergence_cosines`); an entry
    in no group (a 0-dim tensor at layer granularity) is the plain mean ``sum_k W_k / K``.
    Computed in float64 and cast back; integer entries are truncated, as loading the
    averaged state dict into an integer buffer does. Returns the new entries and the
    cosines by group."""
    cosines = divergence_cosines(reference, clients, groups)
    group_of = {k: name for name, ks in groups.items() for k in ks}
    K = len(clients)
    out: StateDict = {}
    for key in reference if keys is None else keys:
        ref = reference[key]
        c = cosines[group_of[key]] if key in group_of else [1.0] * K
        total = sum(c)
        denominator = total if renormalize and total != 0 else K
        value = sum((ck / denominator) * client[key].detach().double() for ck, client in zip(c, clients))
        out[key] = value.to(ref.dtype)
    return out, cosines


@ALGORITHMS.register("ldawa")
class LDAWA(SelfSupervised):
    """L-DAWA (Rehman, Gao, de Gusmao, Alibeigi, Shen, Lane, ICCV 2023).

    The clients run the self-supervised objective of ``method`` (:class:`SelfSupervised`:
    SimCLR, BYOL or SimSiam). The server scales every client's layer by its angular
    divergence from the global model and averages::

        c_k^l = min( <W_g^l, W_k^l> / (||W_g^l|| ||W_k^l||), 1 )
        W_g^l <- (1/K) sum_k c_k^l W_k^l

    with ``W_g`` the global model sent this round and ``K`` the number of replying
    clients (no sample weighting, no renormalisation: sum_k c_k / K <= 1 shrinks the
    layer). ``layer`` is one state-dict tensor, as L-DAWA's code; ``granularity=module``
    is FedU2's code, one cosine per block (encoder ``features.``, projector ``l1.``
    ``l1_bn.`` ``l2.``, predictor ``predictor.``, each extra head ``heads.<name>.``) over
    all its entries, and ``model`` one cosine over the whole state dict.
    ``renormalize=true`` divides by ``sum_k c_k`` (FedU2's SimSiam branch). BatchNorm
    statistics are scaled like the rest (both codes: running means and variances are
    layers of the state dict; ``num_batches_tracked`` is 0-dim, so averaged at layer
    granularity and inside its block's vector at module granularity);
    ``buffers=average`` gives them the weighted average instead. A shared BYOL target
    (``share_target=true``) is aggregated the same way against the global target. The
    first ``warmup_rounds`` rounds are plain FedAvg. ``extras["ldawa_cosine"]`` keeps the
    mean cosine of each client of the last round.
    """

    name = "ldawa"
    summary = "L-DAWA: SSL (method: simclr); server scales each layer by cos(global, client) and averages over K (self-supervised)"
    paper = "Rehman, Gao, de Gusmao, Alibeigi, Shen, Lane, L-DAWA: Layer-wise Divergence Aware Weight Aggregation in Federated Self-Supervised Visual Representation Learning, ICCV 2023"
    Params = LDAWAParams

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return "L-DAWA's server scales each client's layers by their cosine to the global model"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        if round < self.params.warmup_rounds:
            return super().aggregate(server, replies, round)
        extras = dict(server.extras)
        new: dict[str, StateDict] = {}
        cosines: list[list[float]] = [[] for _ in replies]
        parts = ["model"] + (["target"] if "target" in extras else [])
        for part in parts:
            sent = server.model if part == "model" else extras["target"]
            states = [r.payload[part] for r in replies]
            names = set(self.federation.param_names)
            scaled = list(sent) if self.params.buffers == "ldawa" else [k for k in sent if k in names]
            groups = ldawa_groups(sent, self.params.granularity, scaled)
            state, by_group = ldawa_average(sent, states, groups, self.params.renormalize, scaled)
            rest = [k for k in sent if k not in state]
            if rest:
                state.update(weighted_average([{k: s[k] for k in rest} for s in states], self.weights(replies)))
            new[part] = {k: state[k] for k in sent}
            for i in range(len(replies)):
                cosines[i] += [c[i] for c in by_group.values()]
        if "target" in extras:
            extras["target"] = new["target"]
        extras["ldawa_cosine"] = {r.cid: sum(c) / len(c) if c else 1.0 for r, c in zip(replies, cosines)}
        return ServerState(new["model"], extras)
