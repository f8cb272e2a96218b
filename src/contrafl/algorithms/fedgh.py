"""FedGH: a global classifier head trained by the server on the clients' class prototypes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from ..rng import generator
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
    model_state,
)
from .prototypes import predicted_prototypes
from .prototypes import reply_spec as prototype_spec
from .registry import ALGORITHMS
from .split import HEAD_PREFIX, body_head_task, head_logits, split_ce, split_head


@dataclass(frozen=True)
class FedGHParams:
    server_lr: float = P.param(
        1.0,
        P.Interval(0, None, "neither"),
        "SGD learning rate of the server's head training on the prototypes (PFLlib -slr 1.0; not the run's server_lr)",
    )
    server_epochs: int = P.param(1, P.Interval(1, None), "passes over the round's (prototype, label) pairs (PFLlib: 1)")


def prototype_pairs(prototypes: Sequence[Mapping[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``(r_i^c, c)`` of the labels each client holds (``counts > 0``), client
    by client in the given order, labels ascending: ``(reps [n, d], labels int64 [n])``."""
    reps, labels = [], []
    for p in prototypes:
        held = torch.nonzero(p["counts"] > 0).flatten()
        reps.append(p["reps"][held])
        labels.append(held.to(torch.long))
    return torch.cat(reps), torch.cat(labels)


def train_head(
    head: Mapping[str, torch.Tensor],
    reps: torch.Tensor,
    labels: torch.Tensor,
    lr: float,
    batch_size: int,
    epochs: int,
    g: torch.Generator,
) -> StateDict:
    """FedGH's server update of the linear head ``psi(r) = W r + b``: ``epochs`` shuffled
    passes (order drawn from ``g``; last batch kept) of plain SGD on the mean
    ``CE(psi(r), c)`` of each batch of ``batch_size`` pairs, starting from ``head`` (which
    is not modified)."""
    weight_key, bias_key = f"{HEAD_PREFIX}weight", f"{HEAD_PREFIX}bias"
    if set(head) - {weight_key, bias_key}:
        raise ValueError(f"FedGH trains a linear head ({weight_key}, {bias_key}); got {sorted(head)}")
    new = {k: v.detach().clone() for k, v in head.items()}
    reps = reps.to(new[weight_key].dtype)
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=g).to(reps.device)
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            with torch.enable_grad():
                leaves = {k: v.requires_grad_(True) for k, v in new.items()}
                logits = head_logits(reps[rows], leaves)
                loss = F.cross_entropy(logits, labels[rows])
                grads = torch.autograd.grad(loss, list(leaves.values()))
            new = {k: (v - lr * gr).detach() for (k, v), gr in zip(leaves.items(), grads)}
    return new


@ALGORITHMS.register("fedgh")
class FedGH(Algorithm):
    """FedGH (Yi, Wang, Liu, Shi, Yu, ACM MM 2023).

    Only the classifier head ``psi`` is global; every client's body ``phi_i`` is its own
    and never leaves it. Round ``t``, client ``i``:

    1. ``psi_i <- psi^t`` (the global head), then local training of ``phi_i`` and
       ``psi_i`` on ``CE(psi_i(phi_i(x)), y)`` with the run's optimiser;
    2. prototypes of the trained body in eval mode over its training data,
       ``r_i^c = (1/|D_i^c|) sum_{x in D_i^c} phi_i(x)``, uploaded with their counts
       (the trained head is discarded).

    Server: the head is trained on the pairs ``{(r_i^c, c)}`` of the round's replies,
    ``server_epochs`` shuffled passes of SGD (lr ``server_lr``, batches of the run's
    batch size, the order drawn from (seed, round)) on ``CE(psi(r_i^c), c)``, starting
    from ``psi^t``. A client is evaluated with ``phi_i`` and ``psi^{t+1}``.

    Differences from PFLlib (``docs/developer/pfllib_reference.md`` §B.10): PFLlib's server
    head is the very module of client 0's head, so its training starts from client 0's
    locally trained head; here it starts from the previous global head. PFLlib starts
    every body from one common initialisation; here each client's body starts from its
    own (bodies are never communicated: FedGH's setting is one of heterogeneous models),
    and the prototypes are means over all the client's training samples (PFLlib's loader
    drops the last incomplete batch). The server's body entries are never updated and
    are no classifier (``evaluates_global = False``).
    """

    name = "fedgh"
    summary = "FedGH: local bodies; the server trains the global head on the clients' class prototypes"
    paper = "Yi, Wang, Liu, Shi, Yu, FedGH: Heterogeneous Federated Learning with Generalized Global Header, ACM MM 2023"
    Params = FedGHParams
    evaluates_global = False
    personalized = True

    # -- server ------------------------------------------------------------------------
    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        return {"head": split_head(server.model)[1]}

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        dtype = next(v.dtype for v in message["head"].values() if v.is_floating_point())
        return {"prototypes": prototype_spec(self.federation.num_classes, dtype)}

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return "FedGH's server trains the global head on every client's class prototypes"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        reps, labels = prototype_pairs([r.payload["prototypes"] for r in replies])
        if not len(labels):
            return server
        _, head = split_head(server.model)
        g = generator(self.federation.seed, "fedgh-head", round)
        new = train_head(head, reps, labels, self.params.server_lr, self.federation.batch_size, self.params.server_epochs, g)
        return ServerState({**server.model, **new}, server.extras)

    # -- client ------------------------------------------------------------------------
    def body(self, state: dict[str, Any], ctx: ClientContext) -> StateDict:
        return state["body"] if "body" in state else split_head(ctx.initial_state())[0]

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        return body_head_task(self.federation, self.body(state, ctx), message["head"])

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        return split_ce(task, batch, net)

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        body = model_state(result, "body")
        prototypes = predicted_prototypes(ctx, {**body, **model_state(result, "head")}, self.federation.num_classes)
        return Reply(ctx.cid, ctx.num_samples, {"prototypes": prototypes}), {"body": body}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        return PersonalModel({**self.body(state, ctx), **message["head"]})
