"""FedPer: federated learning with a shared body and personal classifier heads."""

from __future__ import annotations

from typing import Any, ClassVar

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
from .registry import ALGORITHMS
from .split import body_head_task, split_ce, split_head


class SharedPart(Algorithm):
    """Personalisation by layers: one part of the model (``shared``: ``"body"`` or
    ``"head"``) is sent, trained jointly with the client's own other part, returned and
    averaged by ``n_i``; the other part never leaves the client and starts from the
    client's own initialisation. Evaluation: the received shared part with the
    client's own part. FedPer shares the body, LG-FedAvg the head."""

    shared: ClassVar[str]
    Params = P.NoOptions
    evaluates_global = False
    personalized = True

    @property
    def kept(self) -> str:
        """The part that stays on the client."""
        return "head" if self.shared == "body" else "body"

    @staticmethod
    def parts(state: StateDict) -> dict[str, StateDict]:
        body, head = split_head(state)
        return {"body": body, "head": head}

    # -- server ------------------------------------------------------------------------
    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        return {self.shared: self.parts(server.model)[self.shared]}

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        return {self.shared: spec_of(message[self.shared])}

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        part = weighted_average([r.payload[self.shared] for r in replies], sample_weights(replies))
        return ServerState({**server.model, **part}, server.extras)

    # -- client ------------------------------------------------------------------------
    def init_client(self, ctx: ClientContext) -> dict[str, Any]:
        return {self.kept: self.parts(ctx.initial_state())[self.kept]}

    def model_parts(self, message: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        return {self.shared: message[self.shared], self.kept: state[self.kept]}

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        parts = self.model_parts(message, state)
        return body_head_task(self.federation, parts["body"], parts["head"])

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        return split_ce(task, batch, net)

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        reply = Reply(ctx.cid, ctx.num_samples, {self.shared: model_state(result, self.shared)})
        return reply, {self.kept: model_state(result, self.kept)}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        parts = self.model_parts(message, state)
        return PersonalModel({**parts["body"], **parts["head"]})


@ALGORITHMS.register("fedper")
class FedPer(SharedPart):
    """FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, arXiv 1912.00818, 2019).

    The model is split into a body ``phi`` (everything but the classifier, shared) and a
    head ``h`` (the classifier ``l3``, personal; :mod:`~contrafl.algorithms.split`).
    Round ``t``, client ``i``:

    1. ``phi_i <- phi^t`` (the received body); ``h_i`` is the client's own head, starting
       from the client's own initialisation.
    2. Local training of ``(phi_i, h_i)`` jointly on ``CE(h_i(phi_i(x)), y)`` with the
       run's optimiser and ``local_epochs``.
    3. Reply: ``phi_i`` only (parameters and buffers); ``h_i`` stays on the client.

    Server: ``phi^{t+1} = sum_{i in S_t} n_i / (sum_{j in S_t} n_j) * phi_i`` over every body
    entry (BatchNorm statistics included, as FedAvg here); the server's head entries keep
    their initial values and are never sent. Evaluation (PFLlib, start of a round): the
    received ``phi^{t+1}`` with the client's own head ``h_i``.
    """

    name = "fedper"
    summary = "FedPer: share and average the body; each client keeps its own classifier head"
    paper = "Arivazhagan, Aggarwal, Singh, Choudhary, Federated Learning with Personalization Layers, arXiv 1912.00818, 2019"
    shared = "body"
