"""MOON: model-contrastive federated learning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from .base import Batch, ClientContext, LocalTask, Network, Reply, StateDict, TaskView, TrainResult, model_state
from .fedavg import FedAvg
from .registry import ALGORITHMS


@dataclass(frozen=True)
class MoonParams:
    mu: float = P.param(1.0, P.Interval(0, None), "weight of the model-contrastive term (paper: 5 CIFAR-10, 1 CIFAR-100/Tiny-ImageNet)")
    temperature: float = P.param(0.5, P.Interval(0, None, "neither"), "temperature tau of the contrastive logits")
    k: int = P.param(1, P.Interval(1, None), "previous local models used as negatives (App. G, model_buffer_size)")
    loss: str = P.param("contrastive", P.OneOf(("contrastive", "l2")), "second term: model-contrastive (eq. 3) or mu*||z - z_glob||_2 (eq. 6, Table 5)")


def model_contrastive_loss(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: list[torch.Tensor], temperature: float
) -> torch.Tensor:
    """MOON's eq. (3)/(7), averaged over the batch::

        l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + sum_i exp(sim(z, z_prev_i)/tau)) )

    with ``sim`` the cosine similarity; computed as cross-entropy of the logits
    ``[sim(z, z_glob), sim(z, z_prev_1), ...] / tau`` with target 0, as MOON's code does.
    """
    sims = [F.cosine_similarity(z, z_glob, dim=-1)] + [F.cosine_similarity(z, zp, dim=-1) for zp in z_prev]
    logits = torch.stack(sims, dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def model_at(history: list[tuple[int, StateDict]], round: int, ctx: ClientContext) -> StateDict:
    """The client's latest local model as of the end of ``round``: the newest entry of
    ``history`` trained at or before ``round``, else the client's own initialisation."""
    for trained_at, state in reversed(history):
        if trained_at <= round:
            return state
    return ctx.initial_state()


@ALGORITHMS.register("moon")
class Moon(FedAvg):
    """MOON (Li, He, Song, CVPR 2021).

    Local objective for a batch, with ``z = R_w(x)`` the projection-head output of the
    model being trained, ``z_glob`` that of the global model ``w^t`` and ``z_prev^i``
    that of the client's local model as of round ``t - i`` (i = 1..min(t, k))::

        l = CE(F_w(x), y) + mu * l_con(z, z_glob, z_prev)

    The global and previous models run in eval mode and are frozen. In round 0 there is
    no previous model and hence no contrastive term (MOON's code and App. G). A client
    that was not sampled keeps its latest local model; one never sampled holds its own
    random initialisation, as every party's net in MOON's code. The server averages as
    FedAvg. ``loss=l2`` replaces ``l_con`` by ``||z - z_glob||_2`` (MOON eq. 6).
    """

    name = "moon"
    summary = "MOON: CE + mu * model-contrastive loss (z to global, away from previous local)"
    paper = "Li, He, Song, Model-Contrastive Federated Learning, CVPR 2021"
    Params = MoonParams

    # MOON's three settings, read through properties so that FedSSC, which adds to MOON's
    # objective, can name them as its paper does.
    @property
    def moon_weight(self) -> float:
        return self.params.mu

    @property
    def moon_negatives(self) -> int:
        return self.params.k

    @property
    def moon_loss(self) -> str:
        return self.params.loss

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        task = super().client_begin(message, state, ctx)
        if self.moon_weight == 0:
            return task
        if self.moon_loss == "l2":
            task.frozen["global"] = message["model"]
            return task
        negatives = min(ctx.round, self.moon_negatives)
        if negatives:
            history = state.get("history", [])
            task.frozen["global"] = message["model"]
            for i in range(1, negatives + 1):
                task.frozen[f"prev{i}"] = model_at(history, ctx.round - i, ctx)
        return task

    def moon_term(self, task: TaskView, batch: Batch, net: Network, z: torch.Tensor) -> torch.Tensor | None:
        """``l_con`` for the projections ``z`` of the trained model (``||z - z_glob||_2``
        with ``loss=l2``), or None when the task has no global model (round 0, mu = 0)."""
        if "global" not in task.frozen:
            return None
        with torch.no_grad():
            z_glob = net(task.frozen["global"], batch.x, train=False).z
            z_prev = [
                net(task.frozen[f"prev{i}"], batch.x, train=False).z
                for i in range(1, self.moon_negatives + 1)
                if f"prev{i}" in task.frozen
            ]
        if self.moon_loss == "l2":
            return (z - z_glob).norm(dim=1).mean()
        return model_contrastive_loss(z, z_glob, z_prev, self.params.temperature)

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        out = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True)
        ce = F.cross_entropy(out.logits, batch.y)
        con = self.moon_term(task, batch, net, out.z)
        if con is None:
            return ce, {"loss": ce.detach(), "ce": ce.detach()}
        loss = ce + self.moon_weight * con
        return loss, {"loss": loss.detach(), "ce": ce.detach(), "con": con.detach()}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        model = model_state(result)
        history = (state.get("history", []) + [(ctx.round, model)])[-self.moon_negatives :]
        return Reply(ctx.cid, ctx.num_samples, {"model": model}), {"history": history}
