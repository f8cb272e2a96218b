"""FedAvg and FedAvgM."""

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
    Reply,
    ServerState,
    TaskView,
    TrainResult,
    model_state,
)
from .registry import ALGORITHMS


def supervised_loss(task: TaskView, batch: Batch, net: Network) -> torch.Tensor:
    """Cross-entropy of the trained ``model`` on the batch: ``CE(F_w(x), y)``."""
    out = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True)
    return F.cross_entropy(out.logits, batch.y)


@ALGORITHMS.register("fedavg")
class FedAvg(Algorithm):
    """FedAvg (McMahan et al., AISTATS 2017).

    Each sampled client starts from the global model ``w^t`` and minimises
    ``CE(F_w(x), y)`` with SGD; the server averages the returned models weighted by data
    size: ``w^{t+1} = sum_{k in S_t} n_k / (sum_{j in S_t} n_j) * w_k^t`` over the full
    state dict, BatchNorm statistics included (MOON's reference code).
    """

    name = "fedavg"
    summary = "FedAvg: sample-size weighted model averaging"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
    Params = P.NoOptions

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        """Cross-entropy of the trained model on the batch, ``CE(F_w(x), y)``."""
        loss = supervised_loss(task, batch, net)
        return loss, {"loss": loss.detach()}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        """The trained model (parameters and buffers), weighted by the client's sample count."""
        return Reply(ctx.cid, ctx.num_samples, {"model": model_state(result)}), state

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        """The sample-weighted mean of the replied models, ``w^{t+1} = sum_k n_k w_k / sum_k n_k``."""
        models = [r.payload["model"] for r in replies]
        return ServerState(weighted_average(models, sample_weights(replies)), server.extras)


@ALGORITHMS.register("fedavgm")
class FedAvgM(FedAvg):
    """FedAvgM (Hsu et al., 2019): FedAvg with server momentum.

    The server treats ``w^t - w_avg`` as a pseudo-gradient and applies momentum
    (see :mod:`contrafl.algorithms.server_opt`); ``server_momentum`` defaults to 0.9 for
    this algorithm and can be combined with any other algorithm (MOON + FedAvgM is MOON's
    Table 10, which tunes beta in {0.1, 0.7, 0.9}).
    """

    name = "fedavgm"
    summary = "FedAvg with server momentum (server_momentum, default 0.9)"
    paper = "Hsu, Qi, Brown, Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification, 2019"
    default_server_momentum = 0.9
