"""FedAMP: personalised cross-silo FL by attentive message passing."""

from __future__ import annotations

from collections.abc import Mapping
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
    StateDict,
    TaskView,
    TrainResult,
    model_state,
    spec_of,
)
from .registry import ALGORITHMS


@dataclass(frozen=True)
class FedAMPParams:
    alpha_k: float = P.param(1.0, P.Interval(0, None, "neither"), "step alpha_K of the message passing: xi_ij = alpha_K e(||w_i - w_j||^2) (PFLlib -alk 1.0)")
    lam: float = P.param(1.0, P.Interval(0, None), "weight lambda of the proximal term lambda/(2 alpha_K) ||w - u_i||^2 (PFLlib -lam 1.0)")
    sigma: float = P.param(1.0, P.Interval(0, None, "neither"), "scale sigma of the attention A(x) = 1 - exp(-x/sigma), e = A' (PFLlib -sg 1.0)")
    start: str = P.param("own", P.OneOf(("own", "cloud")), "local training starts from the client's own model w_i (PFLlib) or from its cloud model u_i")
    init: str = P.param(
        "common",
        P.OneOf(("common", "own")),
        "a client's first model: the server's common initialisation, sent with its first message (PFLlib: every client starts from the same init), or its own random initialisation",
    )
    penalty: str = P.param(
        "squared",
        P.OneOf(("squared", "pfllib")),
        "proximal term: squared and differentiable (the paper), or PFLlib's detached 0.5 lambda/alpha_K ||w - u_i||_2 (no gradient: local training)",
    )


def attention(sq_distance: torch.Tensor, sigma: float) -> torch.Tensor:
    """``e(x) = A'(x) = exp(-x / sigma) / sigma``, the derivative of FedAMP's attention
    function ``A(x) = 1 - exp(-x / sigma)``."""
    return torch.exp(-sq_distance / sigma) / sigma


def squared_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``||a - b||^2`` over every entry of ``a`` (flattened and concatenated), summed in
    float64."""
    return sum(((a[k] - b[k]).double() ** 2).sum() for k in a)


def attention_weights(
    models: Mapping[int, Mapping[str, torch.Tensor]], cid: int, alpha_k: float, sigma: float
) -> tuple[list[int], torch.Tensor]:
    """FedAMP's message-passing weights of client ``cid`` over the stored ``models``
    (``cid`` must be one of them): ``(cids, xi)`` with ``cids`` sorted and ``xi`` float64::

        xi_ij = alpha_K * e(||w_i - w_j||^2)      (j != i)
        xi_ii = 1 - sum_{j != i} xi_ij

    The weights sum to 1; ``xi_ii`` is negative when ``alpha_K sum_j e(.)`` exceeds 1
    (nearby models with the default ``alpha_K = sigma = 1``): the cloud model is then an
    affine, not a convex, combination.
    """
    cids = sorted(models)
    own = models[cid]
    xi = torch.zeros(len(cids), dtype=torch.float64)
    for n, j in enumerate(cids):
        if j != cid:
            xi[n] = alpha_k * float(attention(squared_distance(own, models[j]), sigma))
    xi[cids.index(cid)] = 1.0 - (xi.sum() - xi[cids.index(cid)])
    return cids, xi


def cloud_model(models: Mapping[int, Mapping[str, torch.Tensor]], cids: list[int], xi: torch.Tensor) -> StateDict:
    """``u = sum_j xi_j w_j`` entry by entry (accumulated in float64, returned in each
    entry's dtype)."""
    first = models[cids[0]]
    out: StateDict = {}
    for key, ref in first.items():
        acc = sum(float(x) * models[j][key].double() for j, x in zip(cids, xi))
        out[key] = acc.to(ref.dtype)
    return out


@ALGORITHMS.register("fedamp")
class FedAMP(Algorithm):
    """FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, AAAI 2021).

    No global model. The server keeps the latest uploaded model ``w_j`` of every client
    that has uploaded; client ``i`` with a stored model receives its personalised cloud
    model (the paper's message-passing step ``U = W - alpha_K grad A(W)``)::

        u_i = xi_ii w_i + sum_{j != i} xi_ij w_j,
        xi_ij = alpha_K e(||w_i - w_j||^2),  xi_ii = 1 - sum_{j != i} xi_ij,
        e(x) = exp(-x / sigma) / sigma        (A(x) = 1 - exp(-x / sigma), e = A')

    over all trainable parameters flattened, ``j`` ranging over every client with a
    stored model. The client then trains its own persistent model on::

        CE(F_w(x), y) + lambda / (2 alpha_K) * ||w - u_i||^2

    (gradient ``lambda/alpha_K (w - u_i)``), starting from its own ``w_i`` (PFLlib;
    ``start=cloud`` starts from ``u_i``, the proximal point of the paper's step, which
    does not say where its local solver starts), uploads ``w_i`` (its trainable
    parameters) and is evaluated with ``w_i``. A client the server holds no model of
    gets no cloud model and trains plain CE.

    Differences from PFLlib (``docs/developer/pfllib_reference.md`` §B.7):

    * PFLlib's penalty ``0.5 lambda/alpha_K ||w - u||_2`` is built from detached tensors
      and has no gradient, so its FedAMP trains like Local; here the term is the paper's
      squared, differentiable one (``penalty=pfllib`` reproduces PFLlib's: reported in
      the loss, no gradient).
    * PFLlib mixes only the models uploaded in the previous round; here every client's
      latest upload takes part (the same under full participation).
    * PFLlib's clients share one initialisation by construction; here the server sends
      its initial model with a client's first message (``init=common``, counted as
      communication; ``init=own`` uses each client's own random initialisation, with
      which the distances are so large that every ``xi_ij`` is ~0).

    With ``sigma = 1`` and ``||w_i - w_j||^2 >> 1`` the weights ``xi_ij`` are ~0 and
    ``u_i ~ w_i``; with nearby models ``xi_ii`` can be negative (see
    :func:`attention_weights`). The server's ``model`` is never updated and is not a
    classifier (``evaluates_global = False``).
    """

    name = "fedamp"
    summary = "FedAMP: per-client attentive cloud model u_i; CE + lambda/(2 alpha_K) ||w - u_i||^2; own model evaluated"
    paper = "Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, Personalized Cross-Silo Federated Learning on Non-IID Data, AAAI 2021"
    Params = FedAMPParams
    evaluates_global = False
    personalized = True

    # -- server ------------------------------------------------------------------------
    def init_server(self, model: StateDict) -> ServerState:
        self._param_spec = spec_of(self.federation.split(model)[0])
        return ServerState(model, {"models": {}})

    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        return {}  # every client gets its own message

    def message_for(self, message: dict[str, Any], server: ServerState, cid: int, round: int) -> dict[str, Any]:
        models = server.extras.get("models", {})
        if cid in models:
            cids, xi = attention_weights(models, cid, self.params.alpha_k, self.params.sigma)
            return {"cloud": cloud_model(models, cids, xi)}
        if self.params.init == "common":
            return {"init": server.model}
        return {}

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        if "cloud" in message:
            return {"model": spec_of(message["cloud"])}
        if "init" in message:
            return {"model": spec_of(self.federation.split(message["init"])[0])}
        return {"model": self._param_spec}

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return "FedAMP's server keeps every client's model to build each one's attention-weighted cloud model"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        models = dict(server.extras.get("models", {}))
        for r in replies:
            models[r.cid] = r.payload["model"]
        return ServerState(server.model, {**server.extras, "models": models})

    # -- client ------------------------------------------------------------------------
    def own_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> StateDict:
        """The client's persistent model: its last trained one, else the server's common
        initialisation (``init=common``), else its own initialisation."""
        if "model" in state:
            return state["model"]
        if "init" in message:
            return message["init"]
        return ctx.initial_state()

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        params, buffers = self.federation.split(self.own_model(state, message, ctx))
        if "cloud" in message:
            cloud = message["cloud"]
            weight = self.params.lam / self.params.alpha_k
            if self.params.start == "cloud":
                params = {k: cloud[k] for k in params}
        else:  # no cloud model: the term is switched off by a zero weight (same task structure)
            cloud, weight = params, 0.0
        dtype = next(iter(params.values())).dtype
        consts = {"cloud": cloud, "prox_weight": torch.tensor(weight, dtype=dtype, device=next(iter(params.values())).device)}
        return LocalTask(params={"model": params}, buffers={"model": buffers}, consts=consts)

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        params = task.params["model"]
        out = net({**params, **task.buffers["model"]}, batch.x, train=True)
        ce = F.cross_entropy(out.logits, batch.y)
        cloud = task.consts["cloud"]
        sq = sum(((params[k] - cloud[k]) ** 2).sum() for k in params)
        if self.params.penalty == "squared":
            prox = 0.5 * task.consts["prox_weight"] * sq
        else:  # PFLlib: an unsquared norm of detached tensors, i.e. no gradient
            prox = (0.5 * task.consts["prox_weight"] * sq.detach().sqrt()).detach()
        loss = ce + prox
        return loss, {"loss": loss.detach(), "ce": ce.detach(), "prox": prox.detach()}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        model = model_state(result)
        return Reply(ctx.cid, ctx.num_samples, {"model": dict(result.params["model"])}), {"model": model}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        return PersonalModel(self.own_model(state, message, ctx))

