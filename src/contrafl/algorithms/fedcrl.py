"""FedCRL: personalised FL with shared label-wise representations and contrastive learning."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
    model_state,
    spec_of,
)
from .prototypes import (
    MISSING_LABEL,
    LabelMeans,
    MISSING_LABEL_DOC,
    aggregate_prototypes,
    contrastive_loss,
    label_sums,
    local_prototypes,
    previous_for,
    prototype_message,
)
from .prototypes import reply_spec as prototype_spec
from .registry import ALGORITHMS
from .split import body_head_forward, body_head_task, mix, split_head

ALPHA_RULES = ("exp", "power", "exp_inverse")


@dataclass(frozen=True)
class FedCRLParams:
    lam: float = P.param(1.0, P.Interval(0, None), "weight lambda of the contrastive term (Table I: 1)")
    temperature: float = P.param(0.1, P.Interval(0, None, "neither"), "temperature tau of the contrastive logits (Table I: 0.1)")
    s: float = P.param(0.8, P.Interval(0, None, "neither"), "scaling s of the loss-wise adaptive aggregation (Table I: 0.8)")
    alpha_rule: str = P.param(
        "exp",
        P.OneOf(ALPHA_RULES),
        "alpha from the previous contrastive loss L: exp = exp(-s L) (reconstructed eq. 8), power = s^L, exp_inverse = exp(-L/s)",
    )
    weighting: str = P.param("counts", P.OneOf(("counts", "uniform")), "global label representations: label-volume weighted (eq. 6) or uniform mean")
    missing_label: str = P.param("keep", MISSING_LABEL, MISSING_LABEL_DOC + " [infer]")


def adaptive_alpha(loss: float, s: float, rule: str = "exp") -> float:
    """FedCRL's loss-wise local aggregation weight ``alpha_i^t`` in ``(0, 1]`` from the
    client's mean contrastive loss ``L`` of its previous local training (eqs. 7-9, as
    reconstructed: the higher the loss, the more of the global model is taken)::

        exp:         alpha = exp(-s L)
        power:       alpha = s^L            (s < 1)
        exp_inverse: alpha = exp(-L / s)
    """
    if rule == "exp":
        return math.exp(-s * loss)
    if rule == "power":
        return s**loss
    if rule == "exp_inverse":
        return math.exp(-loss / s)
    raise ValueError(f"alpha_rule={rule!r}; expected one of {ALPHA_RULES}")


@ALGORITHMS.register("fedcrl")
class FedCRL(LabelMeans, Algorithm):
    """FedCRL (Huang, Chen, Zhang, Wang, arXiv 2404.17916), a.k.a. FedCoSR.

    The model is split into representation layers ``phi`` (the body) and a projection
    layer ``psi`` (the classifier head, never shared). Round ``t``, client ``i``:

    1. Loss-wise local adaptive aggregation (eqs. 7-9, reconstructed):
       ``alpha = exp(-s * L_i^{t-1})`` with ``L_i^{t-1}`` the client's mean contrastive
       loss of its last local training, ``phi_i <- alpha phi_i + (1 - alpha) phi^t``;
       a client without such a loss (first participation, or trained before any global
       representation existed) takes ``phi^t``.
    2. Local training of ``phi_i, psi_i`` on ``CE(psi(phi(x)), y) + lambda * L_CRL``, with
       ``L_CRL`` the InfoNCE of ``z = phi(x)`` against the global label representations
       (positive: own label; negatives: the other labels; tau = 0.1;
       :func:`~contrafl.algorithms.prototypes.contrastive_loss`); none before the first
       aggregation.
    3. Reply: ``phi_i``, the label-wise mean representations ``r_i^c`` of the samples it
       trained on and their counts ``|D_i^c|``.

    Server: ``phi^{t+1} = sum_i |D_i| / sum_j |D_j| * phi_i`` (eq. 5) and
    ``r^c = sum_{i in N_c} |D_i^c| r_i^c / sum_{j in N_c} |D_j^c|`` (eq. 6).
    Evaluation uses the client's step-1 model. The head starts from the client's own
    initialisation. Optimiser settings (Adam, lr 0.003, batch 16, one epoch, state kept
    across rounds) are run settings: ``experiments/fedcrl/``.
    """

    name = "fedcrl"
    summary = "FedCRL: share body + label-wise reps; CE + lambda * InfoNCE to global reps; loss-wise local mixing"
    paper = "Huang, Chen, Zhang, Wang, Personalized Federated Learning via Contrastive Representation Learning (FedCRL/FedCoSR), arXiv 2404.17916"
    Params = FedCRLParams
    evaluates_global = False
    personalized = True

    # -- server ------------------------------------------------------------------------
    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        body, _ = split_head(server.model)
        return {"body": body, **prototype_message(server.extras)}

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        dtype = next(v.dtype for v in message["body"].values() if v.is_floating_point())
        return {"body": spec_of(message["body"]), "prototypes": prototype_spec(self.federation.num_classes, dtype)}

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return "FedCRL's server averages each label's representation over the clients that hold the label (their counts weigh it)"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        body = weighted_average([r.payload["body"] for r in replies], sample_weights(replies))
        previous = previous_for(server.extras, self.params.missing_label)
        prototypes = aggregate_prototypes([r.payload["prototypes"] for r in replies], self.params.weighting, previous)
        return ServerState({**server.model, **body}, {**server.extras, "prototypes": prototypes})

    # -- client ------------------------------------------------------------------------
    def local_body(self, state: dict[str, Any], global_body: StateDict) -> StateDict:
        """Step 1: ``alpha phi_i + (1 - alpha) phi^t``, or ``phi^t`` without a previous loss."""
        if "crl_loss" not in state:
            return global_body
        alpha = adaptive_alpha(float(state["crl_loss"]), self.params.s, self.params.alpha_rule)
        return mix(state["body"], global_body, alpha)

    def head(self, state: dict[str, Any], ctx: ClientContext) -> StateDict:
        return state["head"] if "head" in state else split_head(ctx.initial_state())[1]

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        task = body_head_task(self.federation, self.local_body(state, message["body"]), self.head(state, ctx))
        if "prototypes" in message:
            task.consts["prototypes"] = message["prototypes"]
        return task

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        out = body_head_forward(task, batch, net)
        ce = F.cross_entropy(out.logits, batch.y)
        stats = label_sums(out.z, batch.y, self.federation.num_classes)
        if "prototypes" not in task.consts:
            return ce, {"loss": ce.detach(), "ce": ce.detach(), **stats}
        protos = task.consts["prototypes"]
        crl = contrastive_loss(out.z, batch.y, protos["reps"], protos["mask"], self.params.temperature)
        loss = ce + self.params.lam * crl
        return loss, {"loss": loss.detach(), "ce": ce.detach(), "crl": crl.detach(), **stats}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        body, head = model_state(result, "body"), model_state(result, "head")
        prototypes = local_prototypes(result.stats, self.federation.num_classes, self.federation.rep_dim)
        new_state: dict[str, Any] = {"body": body, "head": head}
        if "crl" in result.stats and result.steps:
            new_state["crl_loss"] = result.stats["crl"] / result.steps
        return Reply(ctx.cid, ctx.num_samples, {"body": body, "prototypes": prototypes}), new_state

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        return PersonalModel({**self.local_body(state, message["body"]), **self.head(state, ctx)})
