"""FedProto: federated prototype learning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from .base import (
    Algorithm,
    Batch,
    ClientContext,
    LocalTask,
    Network,
    PersonalModel,
    Reply,
    ServerState,
    TaskView,
    TrainResult,
    model_state,
)
from .prototypes import (
    MISSING_LABEL,
    LabelMeans,
    MISSING_LABEL_DOC,
    aggregate_prototypes,
    label_sums,
    local_prototypes,
    nearest_prototype_scores,
    previous_for,
    prototype_message,
    reply_spec as prototype_spec,
    squared_distance_loss,
)
from .registry import ALGORITHMS


@dataclass(frozen=True)
class FedProtoParams:
    lam: float = P.param(1.0, P.Interval(0, None), "weight lambda of the prototype regulariser (PFLlib: 1)")
    weighting: str = P.param(
        "uniform", P.OneOf(("uniform", "counts")), "global prototypes: unweighted mean over clients (PFLlib) or weighted by label counts (paper eq. 6)"
    )
    missing_label: str = P.param("drop", MISSING_LABEL, MISSING_LABEL_DOC)


@ALGORITHMS.register("fedproto")
class FedProto(LabelMeans, Algorithm):
    """FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, AAAI 2022), as in PFLlib.

    No model parameters are exchanged: every client trains its own model (from its own
    initialisation) and the clients share per-label prototypes. Client ``i``, each
    round, minimises for a batch, with ``z = phi_i(x)`` the representation::

        L = CE(psi_i(z), y) + lam * MSE(z, C^y)

    where ``C^y`` is the global prototype of label ``y`` (the MSE averages over the
    ``B x d`` elements; a label without a global prototype contributes nothing; no term
    before the first aggregation). Its local prototypes are the per-label means of the
    detached ``z`` of the samples it trained on. The server averages them per label over
    the clients holding the label: uniformly (PFLlib, default) or weighted by the label
    counts (the paper); a label no client of the round holds has no global prototype that
    round (PFLlib, ``missing_label=drop``) or keeps its previous one (``keep``). A client
    predicts the label of the nearest global prototype, ``argmin_c ||phi_i(x) - C^c||^2``;
    before any prototype exists, its classifier.
    """

    name = "fedproto"
    summary = "FedProto: share label prototypes only; CE + lam * MSE to global prototypes; nearest-prototype prediction"
    paper = "Tan et al., FedProto: Federated Prototype Learning across Heterogeneous Clients, AAAI 2022"
    Params = FedProtoParams
    evaluates_global = False
    personalized = True

    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        return prototype_message(server.extras)

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"prototypes": prototype_spec(self.federation.num_classes, torch.float32)}

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return "FedProto's server averages each label's prototype over the clients that hold the label"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        previous = previous_for(server.extras, self.params.missing_label)
        protos = aggregate_prototypes([r.payload["prototypes"] for r in replies], self.params.weighting, previous)
        return ServerState(server.model, {**server.extras, "prototypes": protos})

    def init_client(self, ctx: ClientContext) -> dict[str, Any]:
        return {"model": ctx.initial_state()}

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        params, buffers = self.federation.split(state["model"])
        task = LocalTask(params={"model": params}, buffers={"model": buffers})
        if "prototypes" in message:
            task.consts["prototypes"] = message["prototypes"]
        return task

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        out = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True)
        ce = F.cross_entropy(out.logits, batch.y)
        stats = label_sums(out.z, batch.y, self.federation.num_classes)
        if "prototypes" not in task.consts:
            return ce, {"loss": ce.detach(), "ce": ce.detach(), **stats}
        protos = task.consts["prototypes"]
        reg = squared_distance_loss(out.z, batch.y, protos["reps"], protos["mask"])
        loss = ce + self.params.lam * reg
        return loss, {"loss": loss.detach(), "ce": ce.detach(), "proto": reg.detach(), **stats}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        prototypes = local_prototypes(result.stats, self.federation.num_classes, self.federation.rep_dim)
        return Reply(ctx.cid, ctx.num_samples, {"prototypes": prototypes}), {"model": model_state(result)}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        if "prototypes" not in message:
            return PersonalModel(state["model"])
        protos = message["prototypes"]
        return PersonalModel(state["model"], lambda out: nearest_prototype_scores(out.z, protos["reps"], protos["mask"]))
