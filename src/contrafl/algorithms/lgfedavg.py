"""LG-FedAvg: local representations, a shared global classifier head."""

from __future__ import annotations

from typing import Any

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
    TaskView,
    TrainResult,
    spec_of,
)
from .fedper import role_state, split_ce
from .registry import ALGORITHMS
from .split import split_head


@ALGORITHMS.register("lg_fedavg")
class LGFedAvg(Algorithm):
    """LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency,
    arXiv 2001.01523, 2020), as PFLlib implements it.

    The model is split into a body ``phi`` (everything but the classifier ``l3``:
    *local*, PFLlib's "local representation") and a head ``h`` (the classifier ``l3``:
    *global*, shared). Round ``t``, client ``i``:

    1. ``h_i <- h^t`` (the received head); ``phi_i`` is the client's own body, starting
       from the client's own initialisation.
    2. Local training of ``(phi_i, h_i)`` jointly on ``CE(h_i(phi_i(x)), y)`` with the
       run's optimiser and ``local_epochs``.
    3. Reply: ``h_i`` only; ``phi_i`` stays on the client.

    Server: ``h^{t+1} = sum_{i in S_t} n_i / (sum_{j in S_t} n_j) * h_i``. The server's
    model stays a full state dict whose body entries keep their initial values (never
    sent, never used). Evaluation (PFLlib, start of a round): the client's own
    ``phi_i`` with the received ``h^{t+1}``.

    The paper's global part is "the top layers" (possibly several); PFLlib, and this
    implementation, share the last linear layer only.
    """

    name = "lg_fedavg"
    summary = "LG-FedAvg: each client keeps its own body; only the classifier head is shared and averaged"
    paper = (
        "Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, Think Locally, Act Globally: "
        "Federated Learning with Local and Global Representations, arXiv 2001.01523, 2020"
    )
    Params = P.NoOptions
    evaluates_global = False
    personalized = True

    # -- server ------------------------------------------------------------------------
    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        return {"head": split_head(server.model)[1]}

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"head": spec_of(message["head"])}

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        head = weighted_average([r.payload["head"] for r in replies], sample_weights(replies))
        return ServerState({**server.model, **head}, server.extras)

    # -- client ------------------------------------------------------------------------
    def init_client(self, ctx: ClientContext) -> dict[str, Any]:
        return {"body": split_head(ctx.initial_state())[0]}

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        body_params, body_buffers = self.federation.split(state["body"])
        head_params, head_buffers = self.federation.split(message["head"])
        return LocalTask(
            params={"body": body_params, "head": head_params},
            buffers={"body": body_buffers, "head": head_buffers},
        )

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        return split_ce(task, batch, net)

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        body, head = role_state(result, "body"), role_state(result, "head")
        return Reply(ctx.cid, ctx.num_samples, {"head": head}), {"body": body}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        return PersonalModel({**state["body"], **message["head"]})
