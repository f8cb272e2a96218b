"""FedSiam-DA: local and global model as the two branches of a Siamese network, and
dual (cosine-similarity weighted) aggregation on the server."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from ..models.base import Heads, ModelOutput
from .aggregation import sample_weights, weighted_average
from .base import (
    Algorithm,
    PersonalModel,
    Batch,
    ClientContext,
    LocalTask,
    Network,
    Reply,
    ServerState,
    Stage,
    StateDict,
    TaskView,
    TrainResult,
    model_state,
)
from .registry import ALGORITHMS
from .ssl import negative_cosine


@dataclass(frozen=True)
class FedSiamDAParams:
    mu: float = P.param(0.1, P.Interval(0, None), "weight of L_hist + L_stop (eq. 11; the paper's best on CIFAR-10/100)")
    predictor_hidden: int = P.param(256, P.Interval(1, None), "hidden width of the prediction MLP h (not stated; [infer] the projection width)")
    update: str = P.param("alternating", P.OneOf(("alternating", "joint")), "per batch: step the branch, then the local model (eqs. 8-9), or one joint step")
    history: str = P.param("epoch", P.OneOf(("epoch", "round")), "z_prev from the local model of the previous epoch (eq. 10) or round (eq. 5, MOON-like)")
    reset: bool = P.param(True, None, "start each round from the global model (false: from the client's last local model)")
    first_average: str = P.param("uniform", P.OneOf(("uniform", "samples")), "first aggregate w^f0: uniform (eq. 13) or data-size weighted (the prose)")
    aggregation: str = P.param("dual", P.OneOf(("dual", "fedavg")), "server: dual aggregation (eqs. 13-16) or data-size weighted averaging (ablation)")


def history_term(z_prev: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``L_hist = D(stopgrad(z_prev), z) = +cos(z_prev, z)`` (eq. 10 with Def. 1's
    positive sign), averaged over the batch. A zero ``z_prev`` gives 0 and no gradient."""
    return F.cosine_similarity(z_prev.detach(), z, dim=-1).mean()


def trained_forward(task: TaskView, role: str, net: Network, x: torch.Tensor) -> ModelOutput:
    """Train-mode forward of the ``role`` model being optimised (updates its BatchNorm
    running statistics)."""
    return net({**task.params[role], **task.buffers[role]}, x, train=True)


def target_forward(task: TaskView, role: str, net: Network, x: torch.Tensor) -> ModelOutput:
    """Forward of the ``role`` model on the stop-gradient side: no gradients, train mode
    (batch statistics, as the model sees the batch when it is trained) on a copy of its
    buffers, so that its running statistics are updated once per batch, by its own
    trained forward."""
    with torch.no_grad():
        buffers = {k: v.clone() for k, v in task.buffers[role].items()}
        return net({**task.params[role], **buffers}, x, train=True)


def history_forward(task: TaskView, net: Network, x: torch.Tensor) -> torch.Tensor:
    """``z_prev``: the frozen history model's projection, in eval mode, without gradients."""
    with torch.no_grad():
        return net(task.frozen["hist"], x, train=False).z


def similarity_weights(
    models: Sequence[StateDict], first_weights: Sequence[float], names: Sequence[str]
) -> torch.Tensor:
    """The weights ``xi`` of the second aggregation (eqs. 13-15), in float64::

        w^f0 = sum_k a_k w^k                     (eq. 13; a_k = first_weights)
        D_k  = cos(vec(w^k), vec(w^f0))          (eq. 14, over the parameters ``names``)
        xi_k = max(D_k, 0) / sum_j max(D_j, 0)   (eq. 15)

    Negative similarities are clipped at 0 (a guard the paper does not need: in practice
    ``D_k`` is close to 1); if every ``D_k`` is 0 the weights are uniform.
    """
    device = models[0][names[0]].device
    a = torch.tensor(first_weights, dtype=torch.float64, device=device)
    dots = torch.zeros(len(models), dtype=torch.float64, device=device)
    squares = torch.zeros_like(dots)
    reference_square = torch.zeros((), dtype=torch.float64, device=device)
    for name in names:
        w = torch.stack([m[name].detach().double().flatten() for m in models])
        w_f0 = a @ w
        dots += w @ w_f0
        squares += (w * w).sum(dim=1)
        reference_square += w_f0 @ w_f0
    cosines = dots / (squares * reference_square).sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    d = cosines.clamp_min(0)
    if d.sum() <= 0:
        return torch.full_like(d, 1.0 / len(d))
    return d / d.sum()


@ALGORITHMS.register("fedsiam_da")
class FedSiamDA(Algorithm):
    """FedSiam-DA (Yang, Wang, Wang, Zhang, Wu, Cheng).

    Every round, a client trains its local model ``w^k`` (started from the global model
    ``w^f_t``) together with a trainable copy ``w^f'`` of the global model (the
    ``"branch"``), both with a SimSiam prediction MLP ``h``. With ``z = R(x)`` the
    projection and ``p = h(z)`` the prediction of each, the objective of a batch is
    (eqs. 7, 10, 11)::

        L = CE(F_{w^k}(x), y) + mu * (L_hist + L_stop)
        L_hist = cos(sg(z_prev), z_k)
        L_stop = 1/2 D(p_g, sg(z_k)) + 1/2 D(p_k, sg(z_g)),    D(p, z) = -cos(p, z)

    where ``z_prev`` comes from the local model at the end of the previous local epoch
    (``w^k_{Mt+m-1}``; in the first epoch, the client's model uploaded at its previous
    participation; none for a client's first epoch ever). ``update=alternating`` takes
    the two steps of eqs. 8-9 per batch: first the branch on ``mu/2 D(p_g, sg(z_k))``,
    then the local model on the rest with ``z_g`` from the updated branch;
    ``update=joint`` takes one step of both (their gradients are disjoint). The side under
    stop-gradient runs in train mode (batch statistics) without updating its BatchNorm
    running statistics. Only the local model is uploaded; the branch is discarded; the
    client keeps its upload as its personal model.

    The server aggregates twice (eqs. 13-16): ``w^f0 = 1/K sum_k w^k``, then
    ``w^f = sum_k xi_k w^k`` with ``xi_k`` the normalised cosine similarities of
    ``vec(w^k)`` and ``vec(w^f0)`` (see :func:`similarity_weights`), applied to every
    float entry of the state dicts; the weights are kept in ``extras["xi"]`` by client.

    Alternative readings: ``history=round`` (eq. 5: ``z_prev`` from the previous round's
    upload only), ``reset=false`` (continuing local trajectories), ``first_average=samples``
    and ``aggregation=fedavg`` (the local objective with FedAvg's server, an ablation).
    """

    name = "fedsiam_da"
    summary = "FedSiam-DA: CE + mu(L_hist + SimSiam loss with a trainable global branch); cosine-weighted aggregation"
    paper = "Yang, Wang, Wang, Zhang, Wu, Cheng, FedSiam-DA: Dual-aggregated Federated Learning via Siamese Network under Non-IID Data"
    Params = FedSiamDAParams
    personalized = True

    @classmethod
    def heads(cls, params: FedSiamDAParams) -> Heads:
        return Heads(predictor_hidden=params.predictor_hidden)

    # -- client ------------------------------------------------------------------------
    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        """Local model and branch from ``w^f_t`` (the local model from the client's last
        one when ``reset=false``). A client without a previous model gets the all-zero
        state as history stand-in: its ``z_prev = 0`` makes ``L_hist = 0`` (and gives no
        gradient) until the first epoch-end snapshot replaces it, while every client of
        a round keeps the same task structure."""
        previous = state.get("model")
        start = previous if previous is not None and not self.params.reset else message["model"]
        params, buffers = self.federation.split(start)
        branch_params, branch_buffers = self.federation.split(message["model"])
        hist = previous if previous is not None else {k: torch.zeros_like(v) for k, v in message["model"].items()}
        return LocalTask(
            params={"model": params, "branch": branch_params},
            buffers={"model": buffers, "branch": branch_buffers},
            frozen={"hist": hist},
            snapshots={"hist": "model"} if self.params.history == "epoch" else {},
        )

    def stages(self, round: int) -> list[Stage]:
        if self.params.update == "joint":
            return [Stage(self.joint_loss)]
        return [Stage(self.branch_loss, trains=("branch",)), Stage(self.model_loss, trains=("model",))]

    def branch_loss(self, task: TaskView, batch: Batch, net: Network):
        """Eq. 8, the branch's step: ``mu * 1/2 * D(p_g, sg(z_k))``."""
        z_k = target_forward(task, "model", net, batch.x).z
        p_g = trained_forward(task, "branch", net, batch.x).p
        stop_g = negative_cosine(p_g, z_k)
        loss = self.params.mu * 0.5 * stop_g
        return loss, {"loss": loss.detach(), "stop_g": stop_g.detach()}

    def model_loss(self, task: TaskView, batch: Batch, net: Network):
        """Eq. 9, the local model's step: ``CE + mu * (L_hist + 1/2 D(p_k, sg(z_g)))``
        with ``z_g`` from the branch as it is now."""
        z_g = target_forward(task, "branch", net, batch.x).z
        z_prev = history_forward(task, net, batch.x)
        out = trained_forward(task, "model", net, batch.x)
        ce = F.cross_entropy(out.logits, batch.y)
        hist = history_term(z_prev, out.z)
        stop_k = negative_cosine(out.p, z_g)
        loss = ce + self.params.mu * (hist + 0.5 * stop_k)
        return loss, {"loss": loss.detach(), "ce": ce.detach(), "hist": hist.detach(), "stop_k": stop_k.detach()}

    def joint_loss(self, task: TaskView, batch: Batch, net: Network):
        """Eq. 11 minimised over both models at once:
        ``CE + mu * (L_hist + 1/2 D(p_g, sg(z_k)) + 1/2 D(p_k, sg(z_g)))``."""
        z_prev = history_forward(task, net, batch.x)
        out = trained_forward(task, "model", net, batch.x)
        out_g = trained_forward(task, "branch", net, batch.x)
        ce = F.cross_entropy(out.logits, batch.y)
        hist = history_term(z_prev, out.z)
        stop_g = negative_cosine(out_g.p, out.z)
        stop_k = negative_cosine(out.p, out_g.z)
        loss = ce + self.params.mu * (hist + 0.5 * stop_g + 0.5 * stop_k)
        stats = {"loss": loss, "ce": ce, "hist": hist, "stop_g": stop_g, "stop_k": stop_k}
        return loss, {k: v.detach() for k, v in stats.items()}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        model = model_state(result, "model")
        return Reply(ctx.cid, ctx.num_samples, {"model": model}), {"model": model}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel | None:
        """The client's last uploaded local model ("local accuracy" in the paper); none
        before the client first trains."""
        return PersonalModel(state["model"]) if "model" in state else None

    # -- server ------------------------------------------------------------------------
    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return None if params.aggregation == "fedavg" else "FedSiam-DA's server weighs each model by its cosine similarity to the others (algorithm.aggregation=fedavg averages instead)"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        models = [r.payload["model"] for r in replies]
        if self.params.aggregation == "fedavg":
            return ServerState(weighted_average(models, sample_weights(replies)), server.extras)
        first = sample_weights(replies) if self.params.first_average == "samples" else [1.0 / len(models)] * len(models)
        xi = similarity_weights(models, first, self.federation.param_names).tolist()
        extras = {**server.extras, "xi": {r.cid: x for r, x in zip(replies, xi)}}
        return ServerState(weighted_average(models, xi), extras)
