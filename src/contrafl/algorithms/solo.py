"""SOLO: local training only."""

from __future__ import annotations

from typing import Any

from .base import Algorithm, ClientContext, LocalTask, PersonalModel, Reply, ServerState, TrainResult, model_state
from .. import params as P
from .fedavg import FedAvg
from .registry import ALGORITHMS


@ALGORITHMS.register("solo")
class Solo(Algorithm):
    """SOLO, the no-federation baseline of MOON's Table 1.

    Every client trains its own model (its own random initialisation) on its own data
    with ``CE(F_w(x), y)``; nothing is communicated and there is no global model, and
    every client trains every round whatever ``sample_fraction`` says (MOON's code trains
    all parties for SOLO). The
    result is the mean and standard deviation of the clients' test accuracies (MOON trains
    300 local epochs: ``rounds=1 local_epochs=300``, or the same in several rounds to
    follow the curve).
    """

    name = "solo"
    summary = "SOLO: each client trains alone; reports mean +- std of client accuracies"
    paper = "Li, He, Song, Model-Contrastive Federated Learning (SOLO baseline), CVPR 2021"
    Params = P.NoOptions
    evaluates_global = False
    personalized = True
    samples_clients = False
    local_loss = FedAvg.local_loss

    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        return {}

    def init_client(self, ctx: ClientContext) -> dict[str, Any]:
        return {"model": ctx.initial_state()}

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        params, buffers = self.federation.split(state["model"])
        return LocalTask(params={"model": params}, buffers={"model": buffers})

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        return Reply(ctx.cid, ctx.num_samples, {}), {"model": model_state(result)}

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return "SOLO's clients send nothing"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        return server

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        return {}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        return PersonalModel(state["model"])
