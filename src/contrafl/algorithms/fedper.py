"""FedPer: federated learning with a shared body and personal classifier heads."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from .aggregation import sample_weights, weighted_average
from .base import (
    Algorithm,
    Batch,
    ClientContext,
    LocalTask,
    Network,
    PersonalModel,
    Reply,
    ServerState,
    StateDict,
    TaskView,
    TrainResult,
    spec_of,
)
from .registry import ALGORITHMS
from .split import split_head


def split_ce(task: TaskView, batch: Batch, net: Network) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``CE(h(phi(x)), y)`` of the model made of the ``body`` and ``head`` roles."""
    state = {**task.params["body"], **task.params["head"], **task.buffers["body"], **task.buffers["head"]}
    out = net(state, batch.x, train=True)
    loss = F.cross_entropy(out.logits, batch.y)
    return loss, {"loss": loss.detach()}


def role_state(result: TrainResult, role: str) -> StateDict:
    """The trained ``role`` (parameters and buffers) as one partial state dict."""
    return {**result.params[role], **result.buffers[role]}


@ALGORITHMS.register("fedper")
class FedPer(Algorithm):
    """FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, arXiv 1912.00818, 2019).

    The model is split into a body ``phi`` (everything but the classifier, shared) and a
    head ``h`` (the classifier ``l3``, personal; :mod:`~contrafl.algorithms.split`).
    Round ``t``, client ``i``:

    1. ``phi_i <- phi^t`` (the received body); ``h_i`` is the client's own head, starting
       from the client's own initialisation.
    2. Local training of ``(phi_i, h_i)`` jointly on ``CE(h_i(phi_i(x)), y)`` with the
       run's optimiser and ``local_epochs``.
    3. Reply: ``phi_i`` only (parameters and buffers); ``h_i`` stays on the client.

    Server: ``phi^{t+1} = sum_{i in S_t} n_i / (sum_{j in S_t} n_j) * phi_i`` over every body
    entry (BatchNorm statistics included, as FedAvg here); the server's head entries keep
    their initial values and are never sent. Evaluation (PFLlib, start of a round): the
    received ``phi^{t+1}`` with the client's own head ``h_i``.
    """

    name = "fedper"
    summary = "FedPer: share and average the body; each client keeps its own classifier head"
    paper = "Arivazhagan, Aggarwal, Singh, Choudhary, Federated Learning with Personalization Layers, arXiv 1912.00818, 2019"
    Params = P.NoOptions
    evaluates_global = False
    personalized = True

    # -- server ------------------------------------------------------------------------
    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        return {"body": split_head(server.model)[0]}

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"body": spec_of(message["body"])}

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        body = weighted_average([r.payload["body"] for r in replies], sample_weights(replies))
        return ServerState({**server.model, **body}, server.extras)

    # -- client ------------------------------------------------------------------------
    def init_client(self, ctx: ClientContext) -> dict[str, Any]:
        return {"head": split_head(ctx.initial_state())[1]}

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        body_params, body_buffers = self.federation.split(message["body"])
        head_params, head_buffers = self.federation.split(state["head"])
        return LocalTask(
            params={"body": body_params, "head": head_params},
            buffers={"body": body_buffers, "head": head_buffers},
        )

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        return split_ce(task, batch, net)

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        body, head = role_state(result, "body"), role_state(result, "head")
        return Reply(ctx.cid, ctx.num_samples, {"body": body}), {"head": head}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        return PersonalModel({**message["body"], **state["head"]})
