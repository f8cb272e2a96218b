"""FedProx: FedAvg with a proximal term on the local objective."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from .base import Batch, ClientContext, LocalTask, Network, TaskView
from .fedavg import FedAvg
from .registry import ALGORITHMS


@dataclass(frozen=True)
class FedProxParams:
    mu: float = P.param(0.01, P.Interval(0, None), "weight of the proximal term (MOON's best: 0.01 CIFAR-10, 0.001 CIFAR-100/Tiny-ImageNet)")


def proximal_term(params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``sum_p ||w_p - w_glob_p||^2`` over the entries of ``params`` (``anchor`` is ``w_glob``)."""
    return sum(((w - anchor[name]) ** 2).sum() for name, w in params.items())


@ALGORITHMS.register("fedprox")
class FedProx(FedAvg):
    """FedProx (Li et al., MLSys 2020), as in MOON's code (``train_net_fedprox``).

    Each sampled client starts from the global model ``w^t`` and minimises, per batch::

        l = CE(F_w(x), y) + (mu / 2) * sum_p ||w_p - w^t_p||^2

    over all trainable parameters ``p`` (BatchNorm statistics excluded), with ``w^t`` a
    fixed copy of the broadcast model. The server averages as FedAvg.

    A client may stop before its planned steps (``stragglers=partial``): FedProx accepts
    such gamma-inexact solutions of the local problem, where FedAvg drops stragglers.
    """

    name = "fedprox"
    partial_work = True
    summary = "FedProx: CE + (mu/2) * ||w - w_glob||^2 on the local objective"
    paper = "Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, Federated Optimization in Heterogeneous Networks, MLSys 2020"
    Params = FedProxParams

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        task = super().client_begin(message, state, ctx)
        task.consts["global"] = {name: message["model"][name] for name in task.params["model"]}
        return task

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        out = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True)
        ce = F.cross_entropy(out.logits, batch.y)
        prox = proximal_term(task.params["model"], task.consts["global"])
        loss = ce + self.params.mu / 2 * prox
        return loss, {"loss": loss.detach(), "ce": ce.detach(), "prox": prox.detach()}
