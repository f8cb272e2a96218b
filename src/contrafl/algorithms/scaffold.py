"""SCAFFOLD: stochastic controlled averaging with control variates (option II)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import params as P
from .aggregation import sample_weights, weighted_average
from .base import (
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
    spec_of,
)
from .fedavg import FedAvg, supervised_loss
from .registry import ALGORITHMS


@dataclass(frozen=True)
class ScaffoldParams:
    correction: str = P.param(
        "post_step",
        P.OneOf(("post_step", "gradient")),
        "where c - c_i enters: after each optimiser step (NIID-Bench code) or added to the gradient (paper)",
    )


def client_control_update(
    c_i: Mapping[str, torch.Tensor],
    c: Mapping[str, torch.Tensor],
    w_glob: Mapping[str, torch.Tensor],
    w_i: Mapping[str, torch.Tensor],
    steps: int,
    lr: float,
) -> StateDict:
    """SCAFFOLD's option II: ``c_i+ = c_i - c + (w_glob - w_i) / (K * lr)`` with ``K = steps``."""
    scale = 1.0 / (steps * lr)
    return {k: c_i[k] - c[k] + (w_glob[k] - w_i[k]) * scale for k in c}


def server_control_update(c: Mapping[str, torch.Tensor], deltas: list[StateDict], num_clients: int) -> StateDict:
    """``c <- c + (1/N) * sum_{i in S} delta_c_i`` with ``N`` the total number of clients."""
    return {k: c[k] + sum(d[k] for d in deltas) / num_clients for k in c}


@ALGORITHMS.register("scaffold")
class Scaffold(FedAvg):
    """SCAFFOLD (Karimireddy et al., ICML 2020), option II, as in NIID-Bench
    (``train_net_scaffold``, by MOON's authors).

    The server keeps a control variate ``c`` and every client ``i`` its own ``c_i``, both
    shaped like the model's trainable parameters and zero at the start (NIID-Bench starts
    from a random net copied to all of them; only differences matter). A sampled client
    starts from ``w^t``, minimises ``CE(F_w(x), y)`` and corrects every local step by
    ``c - c_i``:

    * ``correction=post_step`` (default, NIID-Bench): after each optimiser step
      ``w <- w - lr (c - c_i)``, outside momentum and weight decay;
    * ``correction=gradient`` (the paper's ``g - c_i + c``): the loss gets the linear
      term ``sum_p <w_p, c_p - c_i_p>``, whose gradient ``c - c_i`` then passes through
      momentum and weight decay.

    The two coincide for plain SGD (no momentum, no weight decay). After ``K`` local steps
    with learning rate ``lr`` the client updates
    ``c_i+ = c_i - c + (w^t - w_i) / (K lr)`` and sends ``w_i`` and
    ``delta_c_i = c_i+ - c_i`` (a client that took no step keeps ``c_i``). The server
    averages the models as FedAvg and sets ``c <- c + (1/N) sum_{i in S} delta_c_i`` with
    ``N`` the total number of clients. The logged loss is the cross-entropy in both modes.
    """

    name = "scaffold"
    summary = "SCAFFOLD: control variates correct the client drift (option II)"
    paper = "Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020"
    Params = ScaffoldParams

    @classmethod
    def beyond_weighted_mean(cls, params: Any) -> str | None:
        return "SCAFFOLD's server sums the clients' control-variate changes unweighted, and SecAgg+ weighs every array by the client's sample count"

    # -- server ------------------------------------------------------------------------
    def init_server(self, model: StateDict) -> ServerState:
        params, _ = self.federation.split(model)
        return ServerState(model, {"c": {k: torch.zeros_like(v) for k, v in params.items()}})

    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        return {"model": server.model, "c": server.extras["c"]}

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        return {**super().reply_spec(message), "delta_c": spec_of(message["c"])}

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        model = weighted_average([r.payload["model"] for r in replies], sample_weights(replies))
        deltas = [r.payload["delta_c"] for r in replies]
        c = server_control_update(server.extras["c"], deltas, self.federation.num_clients)
        return ServerState(model, {**server.extras, "c": c})

    # -- client ------------------------------------------------------------------------
    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        task = super().client_begin(message, state, ctx)
        c = message["c"]
        c_i = state["c_i"] if "c_i" in state else {k: torch.zeros_like(v) for k, v in c.items()}
        task.consts.update(c=c, c_i=c_i)
        return task

    def stages(self, round: int) -> list[Stage]:
        if self.params.correction == "gradient":
            return [Stage(self.local_loss)]
        return [Stage(self.local_loss, post_step=self.post_step)]

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        ce = supervised_loss(task, batch, net)
        if self.params.correction == "post_step":
            return ce, {"loss": ce.detach()}
        c, c_i = task.consts["c"], task.consts["c_i"]
        linear = sum((w * (c[k] - c_i[k])).sum() for k, w in task.params["model"].items())
        return ce + linear, {"loss": ce.detach()}

    def post_step(self, task: TaskView, batch: Batch, net: Network) -> dict[str, StateDict]:
        """NIID-Bench's update after each optimiser step: ``w <- w + correction``."""
        return {"model": {k: w + d for (k, w), d in zip(task.params["model"].items(), self.correction(task).values())}}

    def correction(self, task: TaskView) -> StateDict:
        """``-lr (c - c_i)`` for every parameter."""
        c, c_i, lr = task.consts["c"], task.consts["c_i"], self.federation.lr
        return {k: (c[k] - c_i[k]) * -lr for k in task.params["model"]}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        c, c_i = task.consts["c"], task.consts["c_i"]
        if result.steps == 0:
            delta_c = {k: torch.zeros_like(v) for k, v in c.items()}
            new_state = state
        else:
            c_plus = client_control_update(c_i, c, task.params["model"], result.params["model"], result.steps, self.federation.lr)
            delta_c = {k: c_plus[k] - c_i[k] for k in c}
            new_state = {**state, "c_i": c_plus}
        return Reply(ctx.cid, ctx.num_samples, {"model": model_state(result), "delta_c": delta_c}), new_state
