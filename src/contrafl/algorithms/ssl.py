"""Self-supervised objectives (SimCLR, BYOL, SimSiam) and their plain federated
versions, FedSimCLR, FedBYOL and FedSimSiam: FedAvg over the self-supervised local
objective.

The model is the run's encoder with a projector (``model.projection_hidden``,
``model.projection_bn``: FedU2's ``Linear(512, 2048) - BN - ReLU - Linear(2048, 512)``),
no classifier, and for BYOL and SimSiam a predictor of the same shape. Labels never
reach the loss. Each sample comes as two augmented views (``augment=simclr``); with
``rotation > 0`` a third, independently augmented view is turned by a random multiple
of 90 degrees and a linear head on its projection predicts the turn (the auxiliary loss
of FedU2's code, ``use_deg``); ``rotation_head`` says whether the optimiser trains that
head (FedU2's BYOL client leaves it at its initialisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.nn import functional as F

from .. import params as P
from ..models.base import Heads, ModelOutput
from .aggregation import sample_weights, weighted_average
from .base import (
    Algorithm,
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
from .registry import ALGORITHMS

METHODS = ("simclr", "byol", "simsiam")
HEADLESS = ("predictor.", "heads.", "l3.")  # not part of BYOL's target network
ROTATION_HEAD = "heads.rotation."  # the rotation classifier's parameters
ROTATION_HEADS = ("train", "fixed", "fedu2")
"""``rotation_head``: the optimiser trains the rotation head, leaves it at its
initialisation, or does what FedU2's client of the method does (fixed for BYOL, trained
for SimCLR and SimSiam)."""


# -- objectives ---------------------------------------------------------------------------
def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float, self_similarity: str = "mask") -> torch.Tensor:
    """SimCLR's NT-Xent loss of two views ``z1, z2 [B, d]``.

    With ``u = normalize([z1; z2])`` (``2B`` rows) and ``s_ij = u_i . u_j / temperature``,
    the loss averages over all ``2B`` rows::

        l_i = -log( exp(s_{i,i'}) / sum_{j != i} exp(s_ij) ),   i' = the other view of i

    ``self_similarity="zero"`` reproduces FedU2's code, which multiplies the diagonal by 0
    instead of masking it, so every denominator also holds ``exp(0) = 1``.
    """
    n = z1.shape[0]
    u = F.normalize(torch.cat([z1, z2]), dim=1)
    s = u @ u.T / temperature
    eye = torch.eye(2 * n, dtype=torch.bool, device=s.device)
    s = s.masked_fill(eye, float("-inf") if self_similarity == "mask" else 0.0)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(s.device)
    return F.cross_entropy(s, targets)


def byol_loss(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """BYOL's regression loss ``mean_i (2 - 2 cos(p_i, t_i))`` of online predictions ``p``
    against target projections ``t`` (no gradient reaches ``t``)."""
    return (2 - 2 * F.cosine_similarity(p, t.detach(), dim=-1)).mean()


def negative_cosine(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """SimSiam's ``D(p, stopgrad(z)) = -cos(p, z)``, averaged over the batch."""
    return -F.cosine_similarity(p, z.detach(), dim=-1).mean()


def simsiam_loss(p1: torch.Tensor, p2: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """SimSiam's symmetric loss ``1/2 D(p1, sg(z2)) + 1/2 D(p2, sg(z1))``."""
    return 0.5 * negative_cosine(p1, z2) + 0.5 * negative_cosine(p2, z1)


def quadrant(noise: torch.Tensor) -> torch.Tensor:
    """Standard-normal draws mapped to turns uniform on ``{0, 1, 2, 3}`` through the
    normal CDF: ``a = min(floor(4 Phi(n)), 3)``."""
    u = 0.5 * (1 + torch.erf(noise / math.sqrt(2)))
    return (4 * u).floor().clamp(max=3).long()


def rotate_quarters(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Images ``x [B, C, H, W]`` (square) turned counter-clockwise by ``90 * turns[i]``
    degrees each, as ``torch.rot90(x[i], turns[i], dims=(-2, -1))``."""
    out = x
    for k in (1, 2, 3):
        out = torch.where((turns == k)[:, None, None, None], torch.rot90(x, k, dims=(-2, -1)), out)
    return out


def rotation_loss(task: TaskView, batch: Batch, net: Network, fixed_head: bool = False) -> torch.Tensor:
    """FedU2's auxiliary loss: ``CE(rot(proj(enc(rot_a(x3)))), a)`` on the third view with
    turns ``a`` uniform on ``{0..3}``.

    The head reads the projection, not the predictor (XeniaLLL/FedU2
    ``src/my/model/contrastive_model.py:32, 57, 95``: ``deg_layer(projector(encoder(x3)))``).
    The model computes every head, so the predictor also runs on the rotated view here,
    on a copy of its BatchNorm statistics: its running statistics see the two views only,
    as in the code (the encoder's and projector's see the third view too, as there).

    ``fixed_head``: the head's parameters enter detached, so no gradient reaches them and
    the optimiser leaves them at their values (no weight decay, no momentum: a parameter
    without a gradient is skipped, as ``torch.optim`` skips it), as FedU2's BYOL client,
    whose optimiser holds the online encoder, projector and predictor but not
    ``deg_layer`` (``src/my/algo/fedU2/fedbyol_client.py:125-130``); the loss still trains
    the encoder and projector through the head's fixed weights."""
    turns = quadrant(batch.noise["rotation"])
    params = task.params["model"]
    if fixed_head:
        params = {k: v.detach() if k.startswith(ROTATION_HEAD) else v for k, v in params.items()}
    buffers = {k: v.clone() if k.startswith("predictor.") else v for k, v in task.buffers["model"].items()}
    out = net({**params, **buffers}, rotate_quarters(batch.x[2], turns), train=True)
    return F.cross_entropy(out.extra["rotation"], turns)


# -- the algorithm family -----------------------------------------------------------------
@dataclass(frozen=True)
class SSLParams:
    temperature: float = P.param(0.07, P.Interval(0, None, "neither"), "SimCLR's NT-Xent temperature (FedU2's code)")
    self_similarity: str = P.param("mask", P.OneOf(("mask", "zero")), "NT-Xent's own-sample logit: masked (SimCLR) or zeroed (FedU2's code)")
    ema: float = P.param(0.99, P.Interval(0, 1), "BYOL's target update xi <- ema xi + (1 - ema) theta after every step")
    predictor_hidden: int = P.param(2048, P.Interval(1, None), "hidden width of the BYOL/SimSiam predictor")
    rotation: float = P.param(0.0, P.Interval(0, None), "weight of the rotation-prediction loss on a third view (FedU2's code: 1)")
    weighting: str = P.param("samples", P.OneOf(("samples", "batches")), "aggregation weights: n_k, or the number of batches ceil(n_k / B) (FedU2's code)")
    even_steps: bool = P.param(False, None, "FedU2's EvenClient: client k runs min(max_steps // batches_k, 10) epochs, max_steps = (max_j n_j // B + 1) E")
    share_target: bool = P.param(False, None, "BYOL: send and average the target network (FedU2) instead of keeping it on the client (FedBYOL)")
    rotation_head: str = P.param("train", P.OneOf(ROTATION_HEADS), "with rotation > 0: train the rotation head (FedU2's baseline clients), keep it fixed at its initialisation (FedU2's BYOL client), or fedu2: as FedU2's client of the method (fixed for BYOL, trained for SimCLR/SimSiam)")


METHOD_OPTIONS: dict[str, tuple[str, ...]] = {
    "temperature": ("simclr",),
    "self_similarity": ("simclr",),
    "ema": ("byol",),
    "share_target": ("byol",),
    "predictor_hidden": ("byol", "simsiam"),
}
"""The options of :class:`SSLParams` that only some methods use, with those methods."""


class SelfSupervised(Algorithm):
    """FedAvg over a self-supervised local objective.

    Every sampled client starts from the global model and minimises, on two augmented
    views ``x1, x2`` of each sample (``z = proj(enc(x))``, ``p = pred(z)``)::

        SimCLR:   L = NT-Xent(z1, z2; temperature)
        BYOL:     L = (2 - 2 cos(p1, t2)) + (2 - 2 cos(p2, t1)),   t = target proj(enc(x))
        SimSiam:  L = 1/2 D(p1, sg z2) + 1/2 D(p2, sg z1),          D = -cos

    plus :meth:`regularizer` (FedDecorr's decorrelation, FedU2's uniformity) and, with
    ``rotation > 0``, ``rotation * CE(rot(z3'), a)`` on a third view turned by ``90 a``
    degrees (:func:`rotation_loss`; the head trained or, ``rotation_head=fixed``, left at
    its initialisation). BYOL's target network ``xi`` has no gradient: after every optimiser step
    ``xi <- ema xi + (1 - ema) theta`` over the encoder's and projector's parameters
    (its BatchNorm statistics follow its own train-mode forwards). It starts as a copy
    of the online network the first time a client trains and stays on the client
    (``share_target=false``, FedBYOL) or is averaged with the model (FedU2's code).

    The server averages the returned models weighted by ``n_k`` (or by the number of
    batches, FedU2's code), BatchNorm statistics included.
    """

    Params: ClassVar[type] = SSLParams
    method: ClassVar[str] = "simclr"
    supervised = False

    def __init__(self, params: Any, federation: Any) -> None:
        super().__init__(params, federation)
        self.views = 3 if params.rotation > 0 else 2

    @classmethod
    def heads(cls, params: Any) -> Heads:
        return Heads(
            predictor_hidden=params.predictor_hidden if cls.method_of(params) != "simclr" else None,
            classifier=False,
            extra=(("rotation", 4),) if params.rotation > 0 else (),
        )

    @classmethod
    def beyond_weighted_mean(cls, params: Any) -> str | None:
        why = cls.individual_updates(params)
        if why is None and params.weighting == "batches":
            return f"{cls.name} with algorithm.weighting=batches weighs replies by their batches, and SecAgg+ by their samples"
        return why

    @classmethod
    def inapplicable(cls, params: Any) -> dict[str, str]:
        """The options of :class:`SSLParams` that the method does not use
        (:data:`METHOD_OPTIONS`), and ``rotation_head`` without the rotation loss;
        algorithms with options of their own (Orchestra, FedX) use all of theirs."""
        if not isinstance(params, SSLParams):
            return {}
        method = cls.method_of(params)
        out = {option: "method=" + "|".join(methods) for option, methods in METHOD_OPTIONS.items() if method not in methods}
        if params.rotation == 0:
            out["rotation_head"] = "rotation=1"
        return out

    @classmethod
    def needs_all_clients_data(cls, params: Any) -> str | None:
        if getattr(params, "even_steps", False):  # Orchestra's and FedX's options have none
            return "algorithm.even_steps=true sets each client's epochs from the largest client's sample count; set algorithm.even_steps=false"
        return None

    @classmethod
    def input_problem(cls, params: Any, input_shape: tuple[int, ...]) -> str | None:
        if getattr(params, "rotation", 0) > 0 and (len(input_shape) != 3 or input_shape[1] != input_shape[2]):
            return (
                f"algorithm.rotation={params.rotation} predicts quarter turns of square images [C, H, W], but the "
                f"dataset's samples have shape {list(input_shape)}; set algorithm.rotation=0 or use an image dataset"
            )
        return None

    @classmethod
    def method_of(cls, params: Any) -> str:
        return getattr(params, "method", cls.method)

    @property
    def byol(self) -> bool:
        return self.method_of(self.params) == "byol"

    @property
    def rotation_head_fixed(self) -> bool:
        """Whether the optimiser leaves the rotation head at its initialisation:
        ``rotation_head=fixed``, or ``fedu2`` with BYOL (FedU2's ``ByolEvenClient``,
        ``fedbyol_client.py:125-130``; its SimCLR and SimSiam clients optimise
        ``self.model.parameters()``, head included: ``fedsimclr_client.py:106-109``,
        ``fedsimsiam_client.py:105-108``)."""
        mode = getattr(self.params, "rotation_head", "train")
        return mode == "fixed" or (mode == "fedu2" and self.byol)

    # -- server ------------------------------------------------------------------------
    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        if self.byol and self.params.share_target:
            return {"model": server.model, "target": server.extras["target"]}
        return {"model": server.model}

    def init_server(self, model: StateDict) -> ServerState:
        if self.byol and self.params.share_target:
            return ServerState(model, {"target": target_part(model)})
        return ServerState(model)

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        return {k: spec_of(v) for k, v in message.items()}

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        weights = self.weights(replies)
        extras = dict(server.extras)
        if "target" in extras:
            extras["target"] = weighted_average([r.payload["target"] for r in replies], weights)
        return ServerState(weighted_average([r.payload["model"] for r in replies], weights), extras)

    def weights(self, replies: list[Reply]) -> list[float]:
        """``n_k / sum n_j`` or, with ``weighting=batches``, ``b_k / sum b_j`` with
        ``b_k = ceil(n_k / B)``."""
        if self.params.weighting == "samples":
            return sample_weights(replies)
        sizes = [math.ceil(r.num_samples / self.federation.batch_size) for r in replies]
        total = sum(sizes)
        return [s / total for s in sizes] if total else [1.0 / len(replies)] * len(replies)

    # -- client ------------------------------------------------------------------------
    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        params, buffers = self.federation.split(message["model"])
        task = LocalTask(params={"model": params}, buffers={"model": buffers})
        if self.byol:
            target = message.get("target") or state.get("target") or target_part(message["model"])
            t_params, t_buffers = self.federation.split({**message["model"], **target})
            task.params["target"], task.buffers["target"] = t_params, t_buffers
        if self.params.even_steps:
            task.epochs = (self.even_epochs(ctx.num_samples),)
        return task

    def even_epochs(self, n: int) -> int:
        """FedU2's EvenClient epochs ``min(max_steps // ceil(n / B), 10)`` with
        ``max_steps = (max_j n_j // B + 1) E``: smaller clients run more epochs (at least
        one), so every client takes about as many steps as the largest."""
        B = self.federation.batch_size
        max_steps = (max(self.federation.client_sizes) // B + 1) * self.federation.local_epochs
        return max(1, min(max_steps // max(math.ceil(n / B), 1), 10))

    def stages(self, round: int) -> list[Stage]:
        noise = self.noise_shapes()
        if self.byol:
            return [Stage(self.local_loss, trains=("model",), post_step=self.ema_step, noise=noise)]
        return [Stage(self.local_loss, noise=noise)]

    def noise_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The standard-normal draws the loss needs at every step."""
        return (("rotation", (self.federation.batch_size,)),) if self.params.rotation > 0 else ()

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        model = {**task.params["model"], **task.buffers["model"]}
        o1, o2 = net(model, batch.x[0], train=True), net(model, batch.x[1], train=True)
        align = self.alignment(task, batch, net, o1, o2)
        reg, stats = self.regularizer(o1, o2, batch)
        loss = align + reg
        stats = {"align": align.detach(), **stats}
        if self.params.rotation > 0:
            rot = rotation_loss(task, batch, net, self.rotation_head_fixed)
            loss = loss + self.params.rotation * rot
            stats["rotation"] = rot.detach()
        return loss, {"loss": loss.detach(), **stats}

    def alignment(self, task: TaskView, batch: Batch, net: Network, o1: ModelOutput, o2: ModelOutput) -> torch.Tensor:
        """The self-supervised loss of the two views."""
        method = self.method_of(self.params)
        if method == "simclr":
            return nt_xent(o1.z, o2.z, self.params.temperature, self.params.self_similarity)
        if method == "simsiam":
            return simsiam_loss(o1.p, o2.p, o1.z, o2.z)
        target = {**task.params["target"], **task.buffers["target"]}
        with torch.no_grad():  # train mode: the target's BatchNorm statistics follow its forwards
            t1, t2 = net(target, batch.x[0], train=True).z, net(target, batch.x[1], train=True).z
        return byol_loss(o1.p, t2) + byol_loss(o2.p, t1)

    def regularizer(self, o1: ModelOutput, o2: ModelOutput, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """An extra term of the local loss and its statistics: none here."""
        return torch.zeros((), device=o1.z.device), {}

    def ema_step(self, task: TaskView, batch: Batch, net: Network) -> dict[str, StateDict]:
        """BYOL's target update ``xi <- xi + (1 - ema)(theta - xi)``."""
        return {"target": ema_update(task.params["target"], task.params["model"], self.params.ema)}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        payload: dict[str, Any] = {"model": model_state(result)}
        if self.byol:
            target = target_part(model_state(result, "target"))
            if self.params.share_target:
                payload["target"] = target
            else:
                state = {**state, "target": target}
        return Reply(ctx.cid, ctx.num_samples, payload), state


def ema_update(target: StateDict, online: StateDict, ema: float) -> StateDict:
    """``xi + (1 - ema)(theta - xi)`` for every parameter ``xi`` of the target network
    (encoder and projector)."""
    rate = 1 - ema
    return {k: xi + rate * (online[k] - xi) for k, xi in target.items() if not k.startswith(HEADLESS)}


def target_part(state: StateDict) -> StateDict:
    """The entries of BYOL's target network: the encoder and the projector."""
    return {k: v.detach().clone() for k, v in state.items() if not k.startswith(HEADLESS)}


@ALGORITHMS.register("fedsimclr")
class FedSimCLR(SelfSupervised):
    """FedSimCLR: FedAvg over SimCLR (Chen et al., ICML 2020), as in FedU2's baselines."""

    name = "fedsimclr"
    summary = "FedSimCLR: FedAvg over SimCLR's NT-Xent (self-supervised)"
    paper = "Chen, Kornblith, Norouzi, Hinton, A Simple Framework for Contrastive Learning of Visual Representations, ICML 2020"
    method = "simclr"


@ALGORITHMS.register("fedbyol")
class FedBYOL(SelfSupervised):
    """FedBYOL: FedAvg over BYOL (Grill et al., NeurIPS 2020); the target network stays
    on the client (FedU2's baseline code)."""

    name = "fedbyol"
    summary = "FedBYOL: FedAvg over BYOL, target network kept on each client (self-supervised)"
    paper = "Grill et al., Bootstrap Your Own Latent, NeurIPS 2020"
    method = "byol"


@ALGORITHMS.register("fedsimsiam")
class FedSimSiam(SelfSupervised):
    """FedSimSiam: FedAvg over SimSiam (Chen and He, CVPR 2021)."""

    name = "fedsimsiam"
    summary = "FedSimSiam: FedAvg over SimSiam (self-supervised)"
    paper = "Chen, He, Exploring Simple Siamese Representation Learning, CVPR 2021"
    method = "simsiam"
