"""FedLC: FedAvg whose clients calibrate their logits by their own label counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.nn import functional as F

from contrafl import params as P
from contrafl.algorithms.base import Batch, ClientContext, LocalTask, Network, TaskView
from contrafl.algorithms.fedavg import FedAvg


@dataclass(frozen=True)
class FedLCParams:
    tau: float = P.param(1.0, P.Interval(0, None), "strength of the calibration (0: FedAvg)")


class FedLC(FedAvg):
    """FedLC (Zhang et al., ICML 2022). Client ``k`` minimises the cross-entropy of
    calibrated logits::

        l = CE(F_w(x) - tau * n_k^(-1/4), y)

    with ``n_k[c]`` its number of training samples of class ``c`` (a class it lacks
    counts as one): locally rare classes are no longer pushed down. The server averages
    as FedAvg.
    """

    name = "fedlc"
    summary = "FedLC: CE of logits calibrated by the client's label counts, minus tau * n_c^(-1/4)"
    paper = "Zhang, Li, Li, Shao, Xu, Federated Learning with Label Distribution Skew via Logits Calibration, ICML 2022"
    Params = FedLCParams

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        task = super().client_begin(message, state, ctx)
        device = next(iter(task.params["model"].values())).device
        counts = ctx.label_counts.to(device).float().clamp(min=1)
        task.consts["shift"] = self.params.tau * counts.pow(-0.25)
        return task

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        out = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True)
        loss = F.cross_entropy(out.logits - task.consts["shift"], batch.y)
        return loss, {"loss": loss.detach()}
