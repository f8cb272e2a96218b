"""Ditto: a personal model regularised towards the FedAvg global model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.nn import functional as F

from .. import params as P
from .base import (
    Batch,
    ClientContext,
    LocalTask,
    Network,
    PersonalModel,
    Phase,
    Reply,
    Stage,
    TaskView,
    TrainResult,
    model_state,
)
from .fedavg import FedAvg, supervised_loss
from .fedprox import proximal_term
from .registry import ALGORITHMS


@dataclass(frozen=True)
class DittoParams:
    lam: float = P.param(
        1.0,
        P.Interval(0, None),
        "lambda of the personal objective CE(v) + lambda/2 ||v - w||^2 (PFLlib's mu, default 0 there: v is then "
        "trained locally only; Ditto's paper tunes lambda per device in {0.1, 1, 2} and fixes it to 1 where it cannot tune)",
    )
    personal_epochs: int = P.param(1, P.Interval(1, None), "local epochs of the personal model v per round (PFLlib's plocal_epochs: 1)")


@ALGORITHMS.register("ditto")
class Ditto(FedAvg):
    """Ditto (Li, Hu, Beirami, Smith, ICML 2021), as in PFLlib.

    Every client keeps a personal model ``v_i``; the global model ``w`` is trained by
    FedAvg. Round ``t``, sampled client ``i``, received global model ``w^t`` (fixed during
    the round):

    1. personal phase, ``personal_epochs`` epochs on ``v_i`` (``w`` untouched), per
       batch, minimising ``h_i(v; w^t) = CE(f_v(x), y) + (lambda / 2) ||v - w^t||^2``
       (trainable parameters only), i.e. with plain SGD::

           v_i <- v_i - eta * (grad CE(f_{v_i}(x), y) + lambda * (v_i - w^t))

    2. global phase, the run's ``local_epochs`` of plain ``CE(f_w(x), y)`` on
       ``w_i``, starting from ``w^t`` (``v_i`` untouched).
    3. Reply: ``w_i`` (the full state dict); ``v_i`` stays on the client.

    Server: FedAvg, ``w^{t+1} = sum_{i in S_t} n_i / (sum_{j in S_t} n_j) * w_i``.
    ``lambda = 0`` makes the personal model plain local training (from ``w^t`` at first);
    PFLlib's default ``mu`` is 0, so the default here is the Ditto paper's ``lambda = 1``
    (its fixed value where a device cannot tune lambda on validation data; otherwise it
    picks from {0.1, 1, 2} without attacks).

    A client that has no ``v_i`` yet (first participation) starts it from the global
    model it receives; PFLlib starts every ``v_i`` from the common initial model, which
    is the same thing for a client first sampled in round 0 (every client with PFLlib's
    join ratio 1). Evaluation: the personal model ``v_i`` (the received global model for
    a client without one). PFLlib also evaluates the global model and logs both in one
    accuracy list; here the personal accuracy is reported alone (the global model is
    still evaluated on the global test set as ``test_acc`` when there is one). The
    personal phase runs first, as in PFLlib (``ptrain`` then ``train``); the two phases
    draw their batches one after the other from the client's stream of the round.
    ``train_loss`` averages the objective of every local step of both phases.
    """

    name = "ditto"
    summary = "Ditto: FedAvg global model + personal model trained on CE + lambda/2 ||v - w_glob||^2"
    paper = "Li, Hu, Beirami, Smith, Ditto: Fair and Robust Federated Learning through Personalization, ICML 2021"
    Params = DittoParams
    personalized = True

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        global_params, global_buffers = self.federation.split(message["model"])
        personal_params, personal_buffers = self.federation.split(state.get("personal", message["model"]))
        task = LocalTask(
            params={"personal": personal_params, "model": global_params},
            buffers={"personal": personal_buffers, "model": global_buffers},
        )
        task.consts["global"] = global_params  # w^t: the same tensors for every client
        return task

    def phases(self, round: int) -> list[Phase]:
        return [
            Phase((Stage(self.personal_loss, trains=("personal",)),), epochs=self.params.personal_epochs, name="personal"),
            Phase((Stage(self.local_loss, trains=("model",)),), epochs=None, name="global"),
        ]

    def personal_loss(self, task: TaskView, batch: Batch, net: Network):
        """``CE(f_v(x), y) + (lambda / 2) * sum_p ||v_p - w^t_p||^2``."""
        out = net({**task.params["personal"], **task.buffers["personal"]}, batch.x, train=True)
        ce = F.cross_entropy(out.logits, batch.y)
        prox = proximal_term(task.params["personal"], task.consts["global"])
        loss = ce + self.params.lam / 2 * prox
        return loss, {"loss": loss.detach(), "personal_ce": ce.detach(), "prox": prox.detach()}

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        """The global track: ``CE(f_w(x), y)``."""
        loss = supervised_loss(task, batch, net)
        return loss, {"loss": loss.detach(), "ce": loss.detach()}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        reply = Reply(ctx.cid, ctx.num_samples, {"model": model_state(result, "model")})
        return reply, {"personal": model_state(result, "personal")}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        return PersonalModel(state.get("personal", message["model"]))
