"""FedSSC: MOON plus a supervised contrastive loss against shared class representations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from ..rng import generator
from .base import (
    Batch,
    ClientContext,
    LocalTask,
    Network,
    Reply,
    ServerState,
    TaskView,
    TensorSpec,
    TrainResult,
    model_state,
)
from .moon import Moon
from .registry import ALGORITHMS


@dataclass(frozen=True)
class FedSSCParams:
    mu_moon: float = P.param(5.0, P.Interval(0, None), "weight of MOON's model-contrastive term L_moon (paper: 5)")
    mu_glob_start: float = P.param(1.0, P.Interval(0, None), "mu_glob at round 0: weight of the class-wise contrastive term L_glob [infer]")
    mu_glob_end: float = P.param(0.1, P.Interval(0, None), "mu_glob after warmup_rounds (schedule=linear) [infer]")
    warmup_rounds: int = P.param(100, P.Interval(1, None), "rounds over which mu_glob moves linearly from start to end (paper: 100)")
    schedule: str = P.param("linear", P.OneOf(("linear", "constant")), "mu_glob schedule: linear start->end, or constant mu_glob_start")
    temperature: float = P.param(0.5, P.Interval(0, None, "neither"), "tau of L_moon and L_glob (MOON's) [infer]")
    k: int = P.param(5, P.Interval(1, None), "client representations the server samples and averages per class [infer]")
    min_class_samples: int = P.param(10, P.Interval(1, None), "a client shares class c only if it holds at least this many samples of c")
    missing_class: str = P.param("keep", P.OneOf(("keep", "drop")), "class nobody shared this round: keep its last representation, or drop it")
    prev_models: int = P.param(1, P.Interval(1, None), "previous local models used as negatives in L_moon (MOON's k)")


def class_contrastive_loss(
    z: torch.Tensor, y: torch.Tensor, reps: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """FedSSC's eq. (3), averaged over the samples whose label has a shared representation::

        L_glob = mean_i -log( exp(cos(z_i, zs^{y_i})/tau) / sum_{k in K} exp(cos(z_i, zs^k)/tau) )

    Args:
        z: projected features ``[B, d]``.
        y: labels ``[B]``.
        reps: the shared representations ``zs^k`` of the classes ``K = {k : mask[k]}``,
            one row per class in increasing class order, ``[|K|, d]`` (``|K| >= 1``).
        mask: ``[C]`` bool, which classes have a shared representation.
        temperature: ``tau``.

    Samples with ``mask[y_i]`` false have no positive and are left out; the loss is 0 when
    no sample is left.
    """
    logits = F.normalize(z, dim=1) @ F.normalize(reps, dim=1).T / temperature
    row = mask.long().cumsum(0) - 1  # row[c]: the row of class c in reps, where mask[c]
    valid = mask[y]
    nll = F.cross_entropy(logits, torch.where(valid, row[y], 0), reduction="none")
    return (nll * valid).sum() / valid.sum().clamp(min=1)


def client_class_reps(z: torch.Tensor, y: torch.Tensor, num_classes: int, min_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean features ``zs^c = (1/n^c) sum_{j: y_j = c} z_j`` (FedSSC's eq. 4).

    Returns ``(reps [C, d], mask [C])`` with ``mask[c] = n^c >= min_samples``; rows of
    classes that are not shared are zero.
    """
    counts = torch.bincount(y, minlength=num_classes)
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, y, z)
    mask = counts >= min_samples
    reps = torch.where(mask[:, None], sums / counts.clamp(min=1)[:, None], 0)
    return reps, mask


def sample_class_reps(
    shared: Sequence[tuple[torch.Tensor, torch.Tensor]], num_classes: int, k: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's class representations from the clients' ``(reps [m_i, d], mask [C])``.

    For each class ``c``, ``k`` of the clients that shared ``c`` are drawn uniformly without
    replacement (all of them if fewer than ``k``) and their representations averaged
    without weights. Returns ``(reps [C, d], mask [C])``; classes nobody shared have
    ``mask`` false and a zero row.
    """
    first = shared[0][0]
    out = torch.zeros(num_classes, first.shape[1], dtype=first.dtype, device=first.device)
    available = torch.zeros(num_classes, dtype=torch.bool, device=first.device)
    for c in range(num_classes):
        owners = [reps[int(mask[:c].sum())] for reps, mask in shared if mask[c]]
        if not owners:
            continue
        picked = torch.randperm(len(owners), generator=generator)[:k].sort().values
        out[c] = torch.stack([owners[int(i)] for i in picked]).mean(0)
        available[c] = True
    return out, available


@ALGORITHMS.register("fedssc")
class FedSSC(Moon):
    """FedSSC (Hu, Feng, Yang, Chen, 2023): MOON plus shared class representations.

    Local objective of client ``i`` in round ``t`` for a batch (eq. 5), with ``z`` the
    projection-head output of the model being trained::

        L = CE(F_w(x), y) + mu_moon * L_moon(z, z_glob, z_prev) + mu_glob(t) * L_glob(z, ZS^t)

    ``L_moon`` is MOON's model-contrastive loss with its previous-model pool
    (``prev_models`` = MOON's ``k``; no ``L_moon`` in round 0). ``L_glob`` (eq. 3, :func:`class_contrastive_loss`)
    pulls ``z_i`` towards the shared representation of its class and away from the other
    classes' ones. ``mu_glob(t) = mu^1 + (mu^e - mu^1) * min(t / warmup_rounds, 1)``
    (``schedule=linear``) or ``mu^1`` (``schedule=constant``).

    After local training the client computes the mean projected feature of each class with
    its final weights (eval mode, no augmentation; eq. 4) and sends it, with the model, for
    the classes it holds at least ``min_class_samples`` samples of. The server averages the
    models as FedAvg; for each class it averages the representations of ``k`` clients drawn
    at random among those that sent the class (:func:`sample_class_reps`), and keeps the
    previous round's representation of a class nobody sent (``missing_class=keep``). Round 0
    has no shared representations, hence no ``L_glob``.
    """

    name = "fedssc"
    summary = "FedSSC: MOON + mu_glob * contrastive loss to server-averaged class representations"
    paper = "Hu, Feng, Yang, Chen, FedSSC: shared supervised-contrastive federated learning, Harvard University report, 2023"
    Params = FedSSCParams

    @property
    def moon_weight(self) -> float:
        return self.params.mu_moon

    @property
    def moon_negatives(self) -> int:
        return self.params.prev_models

    @property
    def moon_loss(self) -> str:
        return "contrastive"

    def mu_glob(self, round: int) -> float:
        """The weight of ``L_glob`` in round ``round`` (0-based)."""
        p = self.params
        if p.schedule == "constant":
            return p.mu_glob_start
        return p.mu_glob_start + (p.mu_glob_end - p.mu_glob_start) * min(round / p.warmup_rounds, 1.0)

    # -- server ------------------------------------------------------------------------
    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        message = super().broadcast(server, round)
        if "class_mask" in server.extras:
            mask = server.extras["class_mask"]
            message["class_reps"] = {"reps": server.extras["class_reps"][mask], "mask": mask}
        return message

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        """The model, and the representations of the ``m`` classes in ``mask``:
        ``reps`` ``[m, d]`` and ``mask`` ``bool[num_classes]``."""
        dtype = next(v.dtype for v in message["model"].values() if v.is_floating_point())
        reps = {"reps": TensorSpec((None, None), dtype), "mask": TensorSpec((self.federation.num_classes,), torch.bool)}
        return {**super().reply_spec(message), "class_reps": reps}

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return "FedSSC's server samples class representations from single clients' uploads"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        models = super().aggregate(server, replies, round).model
        shared = [(r.payload["class_reps"]["reps"], r.payload["class_reps"]["mask"]) for r in replies]
        g = generator(self.federation.seed, "fedssc", round)
        reps, mask = sample_class_reps(shared, self.federation.num_classes, self.params.k, g)
        if self.params.missing_class == "keep" and "class_mask" in server.extras:
            kept = server.extras["class_mask"] & ~mask
            reps = torch.where(kept[:, None], server.extras["class_reps"], reps)
            mask = mask | kept
        return ServerState(models, {**server.extras, "class_reps": reps, "class_mask": mask})

    # -- client ------------------------------------------------------------------------
    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        task = super().client_begin(message, state, ctx)
        weight = self.mu_glob(ctx.round)
        shared = message.get("class_reps")
        if shared is not None and weight > 0 and len(shared["reps"]) > 0:
            task.consts.update(class_reps=shared["reps"], class_mask=shared["mask"], mu_glob=weight)
        return task

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        out = net({**task.params["model"], **task.buffers["model"]}, batch.x, train=True)
        ce = F.cross_entropy(out.logits, batch.y)
        loss, stats = ce, {"ce": ce.detach()}
        con = self.moon_term(task, batch, net, out.z)
        if con is not None:
            loss = loss + self.moon_weight * con
            stats["con"] = con.detach()
        if "class_reps" in task.consts:
            c = task.consts
            glob = class_contrastive_loss(out.z, batch.y, c["class_reps"], c["class_mask"], self.params.temperature)
            loss = loss + c["mu_glob"] * glob
            stats["glob"] = glob.detach()
        stats["loss"] = loss.detach()
        return loss, stats

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        reply, state = super().client_end(task, result, state, ctx)
        out, labels = ctx.predict(model_state(result))
        reps, mask = client_class_reps(out.z, labels, self.federation.num_classes, self.params.min_class_samples)
        reply.payload["class_reps"] = {"reps": reps[mask], "mask": mask}
        return reply, state
