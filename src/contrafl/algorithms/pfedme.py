"""pFedMe: personalized federated learning with Moreau envelopes."""

from __future__ import annotations

from dataclasses import dataclass
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
    Phase,
    PersonalModel,
    Reply,
    ServerState,
    Stage,
    TaskView,
    TrainResult,
)
from .registry import ALGORITHMS


@dataclass(frozen=True)
class PFedMeParams:
    lam: float = P.param(1.0, P.Interval(0, None), "weight lambda of the Moreau-envelope proximal term (PFLlib -lam 1.0; pFedMe's own code 15)")
    k: int = P.param(5, P.Interval(1, None), "K inner steps on the personal model per batch (PFLlib and pFedMe: 5)")
    personal_lr: float = P.param(0.01, P.Interval(0, None, "neither"), "personal learning rate of the K inner steps (PFLlib -lrp 0.01)")
    beta: float = P.param(1.0, P.Interval(0, None), "server mixing w_g <- (1 - beta) w_g + beta avg(w_i) (pFedMe's code 1.0; PFLlib's 0 freezes the global model)")
    inner_l2: float = P.param(0.001, P.Interval(0, None), "L2 weight mu of the inner steps, gradient mu * theta (pFedMeOptimizer's hard-coded 0.001)")


def _sq_dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
    """``||a - b||^2`` summed over the entries of two parameter dicts."""
    return sum(((a[k] - b[k]) ** 2).sum() for k in a)  # type: ignore[return-value]


@ALGORITHMS.register("pfedme")
class PFedMe(Algorithm):
    """pFedMe (T. Dinh, Tran, Nguyen, NeurIPS 2020).

    Each client keeps two models in a round: the personalised ``theta`` and its local
    copy ``w`` of the global model; both start from the received global model ``w_g``
    (PFLlib's ``set_parameters``). For every batch ``(x, y)`` of the local epochs:

    1. ``K`` gradient steps on the same batch, warm-started from the current ``theta``,
       on the Moreau-envelope problem (lr ``eta_p`` = ``personal_lr``)::

           theta <- theta - eta_p * grad_theta[ CE(f_theta(x), y) + lam/2 ||theta - w||^2 + mu/2 ||theta||^2 ]
                  = theta - eta_p * ( grad CE + lam (theta - w) + mu theta )

       (``mu`` = ``inner_l2`` = 0.001, PFLlib's pFedMeOptimizer);
    2. the local update ``w <- w - eta * lam * (w - theta)`` with ``eta`` the run's lr.

    The client uploads ``w``; the server averages ``w_avg = sum_i n_i w_i / sum_j n_j``
    and mixes ``w_g <- (1 - beta) w_g + beta * w_avg``. The client keeps ``theta`` (its
    value after the last batch) and is evaluated with it, the pFedMe paper's personalised
    model; a client that never trained is evaluated with the global model it receives.

    Both steps run in one phase of two stages with plain SGD of lr ``eta_p`` (no
    momentum, no weight decay, whatever the run's optimiser): step 2 is one SGD step on
    ``(eta / eta_p) * lam/2 ||w - sg(theta)||^2``, whose gradient is
    ``(eta / eta_p) lam (w - theta)``, so the step is ``w - eta lam (w - theta)``
    (exact up to float rounding).

    Differences from PFLlib (docs/developer/pfllib_reference.md, B.1): PFLlib's personalised
    evaluation evaluates the global model (its ``personalized_params`` alias the
    model's own parameters, overwritten by ``w`` and then ``w_g``); here ``theta_i`` is
    evaluated. PFLlib's default ``beta = 0`` never moves the global model; the default
    here is pFedMe's own code's ``beta = 1`` (plain averaging of the ``w_i``). The
    uploaded model carries the BatchNorm statistics of ``theta``'s forwards (the only
    forwards of a round; PFLlib's models have no buffers). The reported ``loss`` is the
    mean cross-entropy of the K inner steps.
    """

    name = "pfedme"
    summary = "pFedMe: K Moreau-envelope steps on personal theta per batch, w <- w - lr*lam*(w - theta); evaluate theta"
    paper = "T. Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau Envelopes, NeurIPS 2020"
    Params = PFedMeParams
    personalized = True

    # -- server ------------------------------------------------------------------------
    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        avg = weighted_average([r.payload["model"] for r in replies], sample_weights(replies))
        beta = self.params.beta
        mixed = {
            k: (1 - beta) * server.model[k] + beta * v if v.is_floating_point() else v
            for k, v in avg.items()
        }
        return ServerState(mixed, server.extras)

    # -- client ------------------------------------------------------------------------
    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        params, buffers = self.federation.split(message["model"])
        return LocalTask(params={"personal": dict(params), "model": dict(params)}, buffers={"personal": dict(buffers)})

    def phases(self, round: int) -> list[Phase]:
        p = self.params
        return [
            Phase(
                (Stage(self.inner_loss, trains=("personal",), repeat=p.k), Stage(self.outer_loss, trains=("model",))),
                optimizer={"name": "sgd", "lr": p.personal_lr, "momentum": 0.0, "weight_decay": 0.0},
            )
        ]

    def inner_loss(self, task: TaskView, batch: Batch, net: Network):
        """``CE(f_theta(x), y) + lam/2 ||theta - w||^2 + mu/2 ||theta||^2`` (``w`` constant)."""
        theta = task.params["personal"]
        w = {k: v.detach() for k, v in task.params["model"].items()}
        out = net({**theta, **task.buffers["personal"]}, batch.x, train=True)
        ce = F.cross_entropy(out.logits, batch.y)
        loss = ce + 0.5 * self.params.lam * _sq_dist(theta, w)
        if self.params.inner_l2:
            loss = loss + 0.5 * self.params.inner_l2 * sum((v**2).sum() for v in theta.values())
        return loss, {"loss": ce.detach() / self.params.k}

    def outer_loss(self, task: TaskView, batch: Batch, net: Network):
        """``(eta / eta_p) * lam/2 ||w - sg(theta)||^2``: one SGD step of lr ``eta_p`` on it
        is ``w <- w - eta * lam * (w - theta)``."""
        theta = {k: v.detach() for k, v in task.params["personal"].items()}
        w = task.params["model"]
        dist = _sq_dist(w, theta)
        scale = self.federation.lr / self.params.personal_lr
        return scale * 0.5 * self.params.lam * dist, {"prox_dist": dist.detach()}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        buffers = result.buffers["personal"]
        personal = {**result.params["personal"], **buffers}
        uploaded = {**result.params["model"], **{k: v.clone() for k, v in buffers.items()}}
        return Reply(ctx.cid, ctx.num_samples, {"model": uploaded}), {"personal": personal}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        return PersonalModel(state["personal"] if "personal" in state else message["model"])
