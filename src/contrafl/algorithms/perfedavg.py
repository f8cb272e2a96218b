"""Per-FedAvg: personalized federated learning with a MAML-type objective (first-order)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.func import grad
from torch.nn import functional as F

from .. import params as P
from ..rng import seed_global
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
    StateDict,
    TaskView,
    TrainResult,
    model_state,
)
from .registry import ALGORITHMS


@dataclass(frozen=True)
class PerFedAvgParams:
    alpha: float = P.param(0.0, P.Interval(0, None), "inner (adaptation) step size alpha; 0: the run's lr (PFLlib: lr)")
    beta: float = P.param(0.0, P.Interval(0, None), "outer (meta) step size beta; 0: the run's lr (PFLlib: self.beta = lr, -bt ignored)")


def _under_transform(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors are ``torch.func`` wrappers (the loss runs under the
    vectorized executor's ``vmap(grad(...))``)."""
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def adapt(
    net: Network, params: StateDict, buffers: StateDict, x: torch.Tensor, y: torch.Tensor, lr: float
) -> StateDict:
    """One SGD step ``params - lr * grad CE(f_params(x), y)`` with a train-mode forward;
    the gradient is a constant (first order), so the result's gradient in ``params`` is
    the identity.

    Under ``torch.func`` transforms (the vectorized executor) the gradient is taken with
    ``torch.func.grad``, the buffers being an input of the differentiated function so
    that BatchNorm may update them in place; otherwise with ordinary autograd on detached
    copies (``torch.func.grad`` refuses to run under the saved-tensor hooks with which
    the vectorized executor measures a step's memory)."""

    def ce(p: StateDict, b: StateDict) -> torch.Tensor:
        return F.cross_entropy(net({**p, **b}, x, train=True).logits, y)

    if _under_transform(list(params.values())):
        g = grad(ce)(params, buffers)
        return {k: v - lr * g[k].detach() for k, v in params.items()}
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    with torch.enable_grad():
        grads = torch.autograd.grad(ce(leaves, buffers), list(leaves.values()))
    return {k: v - lr * g for (k, v), g in zip(params.items(), grads)}


@ALGORITHMS.register("perfedavg")
class PerFedAvg(Algorithm):
    """Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020), first-order variant (FO).

    Each sampled client starts from the global model ``theta_g`` and cuts its data into
    batches of ``2B``; for every batch, with ``(x1, y1)`` its first and ``(x2, y2)`` its
    second half::

        theta' = theta - alpha * grad CE(f_theta(x1), y1)
        theta  <- theta - beta * grad_{theta'} CE(f_{theta'}(x2), y2)

    (first order: the Hessian term of the MAML gradient is dropped). PFLlib calls the
    client's ``train()`` twice per round, so a round is ``2 * local_epochs`` passes of
    ``2B``-batches (one phase with that many epochs and batch size ``2B``), with plain SGD
    (no momentum, no weight decay, whatever the run's optimiser). ``alpha = beta = lr`` by
    default (PFLlib: ``self.beta = self.learning_rate``). The server averages the
    ``theta_i`` weighted by data size.

    Evaluation (PFLlib's ``evaluate_one_step``): client ``i`` is evaluated with the global
    model it receives after one SGD step of lr ``alpha`` on ``B`` of its training samples
    drawn without replacement (PFLlib: the first batch of a freshly shuffled loader), in
    a train-mode forward (BatchNorm statistics of that batch are updated in the copy,
    dropout is seeded from the client's ``"eval"`` stream); the client's state is not
    changed. A client with fewer than ``B`` samples uses all of them (PFLlib's
    ``drop_last`` loader would be empty and crash).

    The inner gradient is taken inside the loss (:func:`adapt`: ``torch.func.grad`` under
    the vectorized executor's ``vmap``, ordinary autograd otherwise), so the objective is
    vectorizable. A batch of odd size (``drop_last=false``)
    is split at ``len // 2``; a batch of one sample takes no inner step; with BatchNorm
    a last batch of fewer than 4 samples is left out (each half needs two,
    :attr:`~contrafl.algorithms.base.Phase.parts`).
    """

    name = "perfedavg"
    summary = "Per-FedAvg (FO): 2B batches, theta' = theta - alpha*grad(half 1), theta -= beta*grad_theta'(half 2); eval global + 1 step"
    paper = "Fallah, Mokhtari, Ozdaglar, Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach, NeurIPS 2020"
    Params = PerFedAvgParams
    personalized = True

    @property
    def alpha(self) -> float:
        return self.params.alpha or self.federation.lr

    @property
    def beta(self) -> float:
        return self.params.beta or self.federation.lr

    # -- server ------------------------------------------------------------------------
    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        models = [r.payload["model"] for r in replies]
        return ServerState(weighted_average(models, sample_weights(replies)), server.extras)

    # -- client ------------------------------------------------------------------------
    def phases(self, round: int) -> list[Phase]:
        fed = self.federation
        return [
            Phase(
                (Stage(self.meta_loss),),
                epochs=2 * fed.local_epochs,
                batch_size=2 * fed.batch_size,
                optimizer={"name": "sgd", "lr": self.beta, "momentum": 0.0, "weight_decay": 0.0},
                parts=2,
            )
        ]

    def meta_loss(self, task: TaskView, batch: Batch, net: Network):
        """``CE(f_{theta'}(x2), y2)`` with ``theta' = theta - alpha * sg(grad CE(f_theta(x1), y1))``:
        its gradient in ``theta`` is the first-order meta-gradient ``grad_{theta'} CE``."""
        theta, buffers = task.params["model"], task.buffers["model"]
        half = len(batch.y) // 2
        x1, y1, x2, y2 = batch.x[:half], batch.y[:half], batch.x[half:], batch.y[half:]
        adapted = adapt(net, theta, buffers, x1, y1, self.alpha) if half else theta
        loss = F.cross_entropy(net({**adapted, **buffers}, x2, train=True).logits, y2)
        return loss, {"loss": loss.detach()}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        return Reply(ctx.cid, ctx.num_samples, {"model": model_state(result)}), state

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        """The received global model after one SGD step (lr ``alpha``) on ``B`` training
        samples drawn with ``ctx.generator("eval")``; ``state`` is not used or changed. A
        client with fewer training samples than a train-mode forward takes (none; one,
        with BatchNorm: ``ctx.smallest_batch``) is evaluated with the global model."""
        x, y = ctx.train_data()
        if len(y) < max(ctx.smallest_batch, 1):
            return PersonalModel(message["model"])
        g = ctx.generator("eval")
        rows = torch.randperm(len(y), generator=g)[: self.federation.batch_size].to(y.device)
        dropout_seed = int(torch.randint(0, 2**62, (1,), generator=g))
        params, buffers = self.federation.split(message["model"])
        buffers = {k: v.clone() for k, v in buffers.items()}
        params = {k: v.detach() for k, v in params.items()}
        device = y.device
        with torch.enable_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            seed_global(dropout_seed, device)
            stepped = adapt(ctx.net, params, buffers, x[rows], y[rows], self.alpha)
        return PersonalModel({**{k: v.detach() for k, v in stepped.items()}, **buffers})
