"""Orchestra: unsupervised federated learning by global clustering (Lubana, Tang, Kawsar,
Dick, Mathur, ICML 2022), in two variants: as FedU2's code runs it for its baseline
(``variant=fedu2``, XeniaLLL/FedU2 ``src/my/algo/fedorche``; facts in
docs/developer/fedu2_reference.md section 2.7) and as the official code does
(``variant=official``, akhilmathurs/orchestra at b6ae718: ``models.py``, ``client.py``,
``myfedavg.py``).

Where the official code differs from FedU2's re-implementation (files of the official
code unless named):

- the target network travels: with ``stateful_client=False`` (``config.py:25``, its
  default) ``set_parameters`` loads every entry of the global state but the memory,
  ``target_*`` included (``client.py:140-147``), ``get_parameters`` returns the whole
  state (``client.py:137-138``) and the server averages all of it
  (``myfedavg.py:97-103``); FedU2's client keeps its own target and receives the online
  networks only (``fedorche/client.py:55-56, 226-229``);
- the forward runs the online network on the first view, ``Z1`` (``models.py:657``),
  whose output nothing uses but whose train-mode BatchNorm statistics it updates, before
  the second view's (``models.py:658``); FedU2's code comments it out
  (``fedorche/client.py:184``);
- clients are weighted by ``len(trainloader)`` (``client.py:164``) of a ``drop_last=True``
  loader (``utils.py:357``), ``floor(n_k / B)``; FedU2's by the ``len`` of a loader
  without ``drop_last`` (``fedorche/server.py:55``, ``train_fedorche.py:66``),
  ``ceil(n_k / B)``;
- global clustering takes 500 SGD steps (``models.py:624``); FedU2's 50
  (``fedorche/server.py:98``);
- the round-0 memory fill restores the target's BatchNorm statistics (``models.py:551,
  573``); FedU2's restores the online encoder's, which it never runs, so the target keeps
  the fill's (``fedorche/client.py:112-114, 142``). Nothing reads them: the target runs
  in train mode only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from ..rng import generator
from ..errors import ConfigError
from ..models.base import Heads
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
    TensorSpec,
    TrainResult,
    model_state,
    spec_of,
)
from .registry import ALGORITHMS
from .ssl import SelfSupervised, rotation_loss, target_part


VARIANTS = ("fedu2", "official")
WEIGHTINGS = ("samples", "batches", "full_batches")
GLOBAL_STEPS = {"fedu2": 50, "official": 500}
"""Global clustering's SGD steps of each variant: FedU2's ``fedorche/server.py:98``, the
official ``models.py:624``."""
WEIGHTING = {"fedu2": "batches", "official": "full_batches"}
"""Aggregation weights of each variant: ``ceil(n_k / B)`` (FedU2's ``fedorche/server.py:55``)
or ``floor(n_k / B)`` (the official ``client.py:164`` with ``utils.py:357``)."""


@dataclass(frozen=True)
class OrchestraParams:
    variant: str = P.param("fedu2", P.OneOf(VARIANTS), "fedu2: FedU2's re-implementation (its baseline); official: akhilmathurs/orchestra (target sent and averaged, an unused online forward of x1, floor(n_k / B) weights, 500 clustering steps)")
    temperature: float = P.param(0.1, P.Interval(0, None, "neither"), "softmax temperature T of the cluster assignments")
    ema: float = P.param(0.996, P.Interval(0, 1), "target update xi <- ema xi + (1 - ema) theta before every step")
    global_clusters: int = P.param(128, P.Interval(1, None), "number of global centroids")
    local_clusters: int = P.param(16, P.Interval(1, None), "number of local centroids each client sends")
    memory: int = P.param(128, P.Interval(1, None), "size of each client's memory of target projections")
    rotation: float = P.param(1.0, P.Interval(0, None), "weight of the degeneracy regulariser (rotation prediction on a third view)")
    sinkhorn_lambda: float = P.param(25.0, P.Interval(0, None, "neither"), "Sinkhorn-Knopp's inverse entropic regularisation lambda")
    local_iterations: int = P.param(5, P.Interval(1, None), "iterations of the local (balanced k-means) clustering")
    local_sinkhorn_iters: int = P.param(10, P.Interval(1, None), "Sinkhorn-Knopp iterations of local clustering")
    global_steps: int | None = P.param(None, P.Interval(1, None), "SGD steps of global clustering per round (none: the variant's, 50 fedu2, 500 official)")
    global_sinkhorn_iters: int = P.param(100, P.Interval(1, None), "Sinkhorn-Knopp iterations of global clustering")
    global_lr: float = P.param(0.01, P.Interval(0, None, "neither"), "learning rate of global clustering")
    global_momentum: float = P.param(0.9, P.Interval(0, 1, "right"), "momentum of global clustering")
    global_weight_decay: float = P.param(1e-4, P.Interval(0, None), "weight decay of global clustering")
    weighting: str | None = P.param(None, P.OneOf(WEIGHTINGS), "aggregation weights: n_k, ceil(n_k / B) (batches, FedU2's code) or floor(n_k / B) (full_batches, the official code); none: the variant's")


@ALGORITHMS.register("orchestra")
class Orchestra(SelfSupervised):
    """Orchestra (Lubana et al., ICML 2022).

    The server keeps global centroids ``C [G, d]`` (unit rows). Client ``k`` keeps a
    target network ``xi`` (EMA of its online network ``theta``), a memory ``Mem [M, d]`` of
    its latest target projections and, between rounds, nothing else (the optimiser's
    momentum persists with ``persist_optimizer_state=true``, as in FedU2's code, whose
    client builds its optimiser once, ``fedorche/client.py:69``; the official client
    builds a fresh one every round, ``client.py:49``: ``persist_optimizer_state=false``). On views
    ``x1 ~ T1``, ``x2 ~ T2`` (``augment=orchestra``) and ``x3 = rot_a(T1(x))``, at every
    step::

        xi      <- ema xi + (1 - ema) theta                       (before the step)
        z2      = normalize(proj(enc(x2))),  t1 = normalize(proj_xi(enc_xi(x1)))
        L       = - mean_i sum_c softmax(t1 C^T / T)_ic log softmax(z2 C^T / T)_ic
                  + rotation CE(deg(proj(enc(x3))), a)
        Mem     <- the newest M rows of [Mem; t1]                 (after the step)

    After training the client clusters ``Mem`` into ``L`` local centroids
    (:func:`local_clustering`) and sends them with its online network. The server
    averages the networks (weights ``ceil(n_k / B)``, BatchNorm statistics included)
    and fits ``C`` to the union of the local centroids (:func:`global_clustering`, 50
    steps).
    Round 0 only clusters: every client fills its memory with the target projections of
    ``T1`` views of the first ``ceil(M / B)`` shuffled batches of its samples, cut to ``M``
    rows (tiled if it has fewer; :meth:`fill_memory`) and sends its local centroids; the
    server runs global clustering and keeps the model.

    ``variant=official`` (the module's docstring gives the lines): the server keeps the
    target network beside the model (a copy of the initial model), sends it, and
    averages the returned targets with the same weights, so the client keeps only its
    memory; the loss first runs the online network on ``x1`` in train mode (the output
    unused, its BatchNorm statistics updated; no gradient); weights ``floor(n_k / B)``;
    500 steps of global clustering; the memory fill leaves the target's BatchNorm
    statistics as they were. ``weighting`` and ``global_steps`` override the
    variant's.
    """

    name = "orchestra"
    summary = "Orchestra: clustering-based federated self-supervised learning; EMA target, memory, local and global Sinkhorn clustering"
    paper = "Lubana, Tang, Kawsar, Dick, Mathur, Orchestra: Unsupervised Federated Learning via Globally Consistent Clustering, ICML 2022"
    Params = OrchestraParams
    method = "orchestra"

    def __init__(self, params: Any, federation: Any) -> None:
        super().__init__(params, federation)
        if params.local_clusters > params.memory:
            raise ConfigError(
                f"algorithm.local_clusters={params.local_clusters} exceeds algorithm.memory={params.memory}: local "
                "clustering starts from distinct rows of the memory; set local_clusters <= memory"
            )

    @classmethod
    def heads(cls, params: Any) -> Heads:
        return Heads(classifier=False, extra=(("rotation", 4),) if params.rotation > 0 else ())

    @property
    def official(self) -> bool:
        return self.params.variant == "official"

    @property
    def global_steps(self) -> int:
        """``global_steps``, or the variant's (:data:`GLOBAL_STEPS`)."""
        return self.params.global_steps or GLOBAL_STEPS[self.params.variant]

    @property
    def weighting(self) -> str:
        """``weighting``, or the variant's (:data:`WEIGHTING`)."""
        return self.params.weighting or WEIGHTING[self.params.variant]

    # -- server ------------------------------------------------------------------------
    def init_server(self, model: StateDict) -> ServerState:
        """``C`` drawn like ``nn.Linear(d, G, bias=False)``'s weight: uniform in
        ``[-1/sqrt(d), 1/sqrt(d)]`` (normalised by the first global clustering); with
        ``variant=official`` also the target network, a copy of the initial model's
        encoder and projector (``models.py:524-535``)."""
        d, G = self.federation.rep_dim, self.params.global_clusters
        bound = 1 / math.sqrt(d)
        g = generator(self.federation.seed, "orchestra-centroids")
        C = (torch.rand(G, d, generator=g) * 2 - 1) * bound
        extras: dict[str, Any] = {"centroids": C.to(next(iter(model.values())).device)}
        if self.official:
            extras["target"] = target_part(model)
        return ServerState(model, extras)

    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        message = {"model": server.model, "centroids": server.extras["centroids"]}
        if self.official:
            message["target"] = server.extras["target"]
        return message

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        C = message["centroids"]
        spec = {"model": spec_of(message["model"]), "local_centroids": TensorSpec((self.params.local_clusters, C.shape[1]), C.dtype)}
        if "target" in message:
            spec["target"] = spec_of(message["target"])
        return spec

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return "Orchestra's server clusters every client's local centroids"

    def weights(self, replies: list[Reply]) -> list[float]:
        """``n_k``, ``ceil(n_k / B)`` (``batches``) or ``floor(n_k / B)``
        (``full_batches``: the official code's ``len`` of a ``drop_last`` loader, so a
        client with fewer than ``B`` samples weighs 0), normalised; equal weights when
        they are all 0."""
        if self.weighting == "samples":
            return sample_weights(replies)
        B = self.federation.batch_size
        sizes = [-(-r.num_samples // B) if self.weighting == "batches" else r.num_samples // B for r in replies]
        total = sum(sizes)
        return [s / total for s in sizes] if total else [1.0 / len(replies)] * len(replies)

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        p = self.params
        extras = dict(server.extras)
        model = server.model
        if round > 0:  # round 0 trains nothing: the model (and target) stay
            weights = self.weights(replies)
            model = weighted_average([r.payload["model"] for r in replies], weights)
            if "target" in extras:
                extras["target"] = weighted_average([r.payload["target"] for r in replies], weights)
        Z = torch.cat([r.payload["local_centroids"] for r in replies])
        extras["centroids"] = global_clustering(
            server.extras["centroids"], Z, p.temperature, self.global_steps, p.global_lr, p.global_momentum,
            p.global_weight_decay, p.sinkhorn_lambda, p.global_sinkhorn_iters,
        )
        return ServerState(model, extras)

    # -- client ------------------------------------------------------------------------
    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        params, buffers = self.federation.split(message["model"])
        if self.official:  # received every round (client.py:140-147)
            target = message["target"]
        else:  # kept on the client (fedorche/client.py:55-56)
            target = state.get("target") or target_part(message["model"])
        t_params, t_buffers = self.federation.split({**message["model"], **target})
        if "memory" in state:
            memory = state["memory"]
        else:
            memory, t_buffers = self.fill_memory(t_params, t_buffers, ctx)
        return LocalTask(
            params={"model": params, "target": t_params, "memory": {"bank": memory.clone()}},
            buffers={"model": buffers, "target": t_buffers},
            consts={"centroids": message["centroids"]},
            epochs=(0,) if ctx.round == 0 else None,
        )

    def fill_memory(
        self, t_params: StateDict, t_buffers: StateDict, ctx: ClientContext
    ) -> tuple[torch.Tensor, StateDict]:
        """The first memory and the target's buffers after it. The client's samples are
        shuffled (one permutation, a shuffled loader's first epoch) and cut into batches
        of ``B``; batch after batch, until at least ``M`` rows are collected, the target
        runs in train mode on the batch's ``T1`` views, a batch of one sample repeated 16
        times; the memory is the first ``M`` normalised projections, tiled when there
        are fewer::

            Mem = first M rows of [z_1; z_2; ...; z_b] repeated,  b = min(ceil(M / B), ceil(n / B))

        FedU2's ``reset_memory`` (``fedorche/client.py:117-136``, the 16 copies l.122-123)
        and the official one (``models.py:554-567``) on their shuffled loaders
        (``train_fedorche.py:66``; the official ``utils.py:357``): whole batches of ``B``
        cut to ``M`` rows, the last batch short only when the client's samples end
        there (``n < ceil(M / B) B``). There the official code, whose loader drops the
        short batch, fails (a memory of fewer than ``M`` rows does not fit its
        ``copy_``, l.570); the rule above is FedU2's, whose loader keeps it.

        BatchNorm statistics: with ``variant=fedu2`` the target keeps the statistics
        its forwards updated: FedU2's code saves and restores the *online* encoder's
        (``fedorche/client.py:112-114, 142``), which the fill never runs. With
        ``variant=official`` they are restored: the code saves and restores every
        ``bn`` entry of the model, the target's included (``models.py:551, 573``).
        The forwards run on a copy of ``t_buffers`` (which may be the broadcast
        model's)."""
        M, B = self.params.memory, self.federation.batch_size
        g = ctx.generator("orchestra-memory")
        x, _ = ctx.augmented_data(0, g)
        order = torch.randperm(len(x), generator=g).to(x.device)
        buffers = {k: v.clone() for k, v in t_buffers.items()}
        state = {**t_params, **buffers}
        z: list[torch.Tensor] = []
        rows = 0
        with torch.no_grad():
            for i in range(0, len(order), B):
                if rows >= M:
                    break
                xb = x[order[i : i + B]]
                if len(xb) == 1:
                    xb = xb.repeat_interleave(16, dim=0)
                z.append(F.normalize(ctx.net(state, xb, train=True).z, dim=1))
                rows += len(xb)
        bank = torch.cat(z)
        return bank.repeat(math.ceil(M / len(bank)), 1)[:M], t_buffers if self.official else buffers

    def stages(self, round: int) -> list[Stage]:
        return [
            Stage(self.local_loss, trains=("model",), pre_step=self.ema_step, post_step=self.remember, noise=self.noise_shapes())
        ]

    def local_loss(self, task: TaskView, batch: Batch, net: Network):
        T, C = self.params.temperature, task.consts["centroids"]
        model = {**task.params["model"], **task.buffers["model"]}
        if self.official:  # Z1 (models.py:657): unused, but its BatchNorm statistics are updated
            with torch.no_grad():
                net(model, batch.x[0], train=True)
        z2 = F.normalize(net(model, batch.x[1], train=True).z, dim=1)
        target = {**task.params["target"], **task.buffers["target"]}
        with torch.no_grad():  # train mode: the target's statistics follow its forwards
            t1 = F.normalize(net(target, batch.x[0], train=True).z, dim=1)
        cluster = -(F.softmax(t1 @ C.T / T, dim=1) * F.log_softmax(z2 @ C.T / T, dim=1)).sum(dim=1).mean()
        loss, stats = cluster, {"cluster": cluster.detach()}
        if self.params.rotation > 0:
            rot = rotation_loss(task, batch, net)
            loss = loss + self.params.rotation * rot
            stats["rotation"] = rot.detach()
        return loss, {"loss": loss.detach(), **stats}

    def remember(self, task: TaskView, batch: Batch, net: Network) -> dict[str, StateDict]:
        """``Mem <- the newest M rows of [Mem; t1]`` with this step's target projections
        ``t1`` (recomputed: the step changed no target parameter; the statistics are not
        updated twice)."""
        target = {**task.params["target"], **{k: v.clone() for k, v in task.buffers["target"].items()}}
        t1 = F.normalize(net(target, batch.x[0], train=True).z, dim=1)
        bank = task.params["memory"]["bank"]
        return {"memory": {"bank": torch.cat([bank, t1])[-bank.shape[0] :]}}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        p = self.params
        bank = result.params["memory"]["bank"].detach().clone()
        local = local_clustering(bank, p.local_clusters, p.local_iterations, p.sinkhorn_lambda, p.local_sinkhorn_iters, ctx.generator("orchestra-local"))
        payload = {"model": model_state(result), "local_centroids": local}
        target = target_part(model_state(result, "target"))
        if self.official:  # sent with the model (client.py:137-138)
            payload["target"] = target
            return Reply(ctx.cid, ctx.num_samples, payload), {"memory": bank}
        return Reply(ctx.cid, ctx.num_samples, payload), {"target": target, "memory": bank}


# -- clustering ---------------------------------------------------------------------------
def sinkhorn_knopp(scores: torch.Tensor, lam: float, iters: int) -> torch.Tensor:
    """Orchestra's balanced soft assignment of ``N`` samples to ``K`` clusters from scores
    ``S [N, K]``: ``P = softmax(lam S)^T`` (``[K, N]``), then alternately

        r = (1/K) / (P c),   c = (1/N) / (P^T r)

    from ``c = 1/N`` for at most ``iters`` iterations, stopping once
    ``sum |c / c_new - 1| < 1e-2`` (checked every 10th iteration, as the code does);
    returns ``N diag(c) P^T diag(r)`` (``[N, K]``, rows summing to about 1)."""
    N, K = scores.shape
    P = F.softmax(lam * scores, dim=1).T
    r = torch.full((K, 1), 1 / K, dtype=P.dtype, device=P.device)
    c = torch.full((N, 1), 1 / N, dtype=P.dtype, device=P.device)
    err = math.inf
    for it in range(iters):
        r = (1 / K) / (P @ c)
        c_new = (1 / N) / (r.T @ P).T
        if it % 10 == 0:
            err = float(torch.nansum((c / c_new - 1).abs()))
        c = c_new
        if err < 1e-2:
            break
    return (P * c.squeeze(1)).T * r.squeeze(1) * N


def local_clustering(
    Z: torch.Tensor, clusters: int, iterations: int, lam: float, sinkhorn_iters: int, g: torch.Generator
) -> torch.Tensor:
    """Balanced k-means of the memory ``Z [M, d]`` into ``clusters`` unit centroids:
    start from distinct random rows of ``Z``; ``iterations`` times assign every row to
    ``argmax_k sinkhorn_knopp(Z mu^T)`` and set ``mu_k = normalize(mean of its rows)`` (a
    random row of ``Z`` when it has none)."""
    mu = Z[torch.randperm(len(Z), generator=g)[:clusters].to(Z.device)].clone()
    for _ in range(iterations):
        assign = sinkhorn_knopp(Z @ mu.T, lam, sinkhorn_iters).argmax(dim=1)
        for k in range(clusters):
            members = Z[assign == k]
            if len(members) == 0:
                members = Z[torch.randint(len(Z), (1,), generator=g).to(Z.device)]
            mu[k] = F.normalize(members.mean(dim=0), dim=0)
    return mu


def global_clustering(
    C: torch.Tensor, Z: torch.Tensor, temperature: float, steps: int, lr: float, momentum: float,
    weight_decay: float, lam: float, sinkhorn_iters: int,
) -> torch.Tensor:
    """Orchestra's server clustering of the clients' local centroids ``Z [N, d]``:
    ``steps`` steps of SGD (momentum, weight decay, a fresh buffer each round) on

        L(C) = - mean_i cos( Q_i, softmax(normalize(Z) C^T / T)_i ),   Q = sinkhorn_knopp(Z C^T)

    (``Q`` without gradient), each followed by ``C <- normalize rows of C``."""
    C = C.detach().clone()
    buf = None
    for _ in range(steps):
        with torch.no_grad():
            Q = sinkhorn_knopp(Z @ C.T, lam, sinkhorn_iters)
        C.requires_grad_(True)
        probs = F.softmax(F.normalize(Z, dim=1) @ C.T / temperature, dim=1)
        loss = -F.cosine_similarity(Q, probs, dim=-1).mean()
        (grad,) = torch.autograd.grad(loss, C)
        with torch.no_grad():
            d = grad + weight_decay * C
            buf = d if buf is None else momentum * buf + d
            C = F.normalize(C - lr * buf, dim=1)
    return C.detach()
