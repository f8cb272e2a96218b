"""FedU2: flexible uniformity regularizer (FUR) on the clients and enhanced uniform
aggregation (EUA) on the server (Liao et al., CVPR 2024)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from ..models.base import ModelOutput
from .aggregation import weighted_average
from .base import Batch, Reply, ServerState, StateDict
from .eua import eua_direction
from .registry import ALGORITHMS
from .ssl import METHODS, ROTATION_HEADS, SelfSupervised, SSLParams
from .uniformity import UOT_ITERATIONS, UOT_SOLVERS, tangent_sliced_wasserstein, uot_uniformity


@dataclass(frozen=True)
class FedU2Params(SSLParams):
    method: str = P.param("byol", P.OneOf(METHODS), "the self-supervised backbone method (the paper's main one: BYOL)")
    share_target: bool = P.param(True, None, "BYOL: send and aggregate the target network with the model (FedU2's code)")
    rotation_head: str = P.param("fedu2", P.OneOf(ROTATION_HEADS), "with rotation > 0: fedu2 = FedU2's code (BYOL's optimiser leaves the head at its initialisation, SimCLR's and SimSiam's train it), train, or fixed")
    lam_u: float = P.param(0.1, P.Interval(0, None), "lambda_U, weight of FUR on each view (eq. 2; code: 0.01)")
    uniformity: str = P.param("uot", P.OneOf(("uot", "tangent_sw", "none")), "FUR: the paper's UOT to sphere samples, the code's tangent sliced Wasserstein, or none (the -FUR ablation)")
    tau_a: float = P.param(0.8, P.Interval(0, None, "neither"), "UOT penalty on the representations' marginal")
    tau_b: float = P.param(0.8, P.Interval(0, None, "neither"), "UOT penalty on the samples' marginal")
    point_mass: float | None = P.param(2.0, P.Interval(0, None, "neither"), "UOT marginals: mass of every point ([infer]; none = 1/B, which leaves the plan at zero, see docs)")
    uot_scale: str = P.param("mass", P.OneOf(("mass", "sum")), "UOT: l_u divided by the marginals' total mass (B point_mass): the paper's probability marginals with penalties tau B point_mass, a mean over the batch like l_a ([infer], docs/algorithms.md); sum = undivided (B point_mass times larger)")
    uot_solver: str = P.param("interior_point", P.OneOf(UOT_SOLVERS), "UOT plan: an interior-point method to convergence, or the paper's projected steepest descent (eq. 6) for uot_iterations steps")
    uot_iterations: int | None = P.param(None, P.Interval(1, None), f"iterations of the UOT solver (none: {UOT_ITERATIONS['interior_point']} for interior_point, a cap; {UOT_ITERATIONS['steepest_descent']} for steepest_descent)")
    projections: int = P.param(6, P.Interval(1, None), "tangent_sw: random projections per tangent point")
    aggregation: str = P.param("eua", P.OneOf(("eua", "fedavg")), "server: EUA, or weighted averaging (the -EUA ablation)")
    eua: str = P.param("paper", P.OneOf(("paper", "paper_closed_form", "official")), "EUA: log-distance directions with the exact simplex weights of eq. 10 (paper), the same with the paper's printed closed-form ADMM step (not the minimiser on boundary optima), or unit directions + MGDA min-norm (code)")
    step: str = P.param("convex", P.OneOf(("convex", "fixed")), "server step along d*: convex = the length that lands the model on the clients' convex hull (theta_g <- sum_k q_k theta_k, q_k proportional to p_k g_k's scale; [infer], docs/algorithms.md), fixed = eta d* (the literal eq.; code: eua=official eta=8)")
    eta: float = P.param(1.0, P.Interval(0, None, "neither"), "server step: theta_g <- theta_g - eta d* ([infer]; code: 8 with eua=official)")
    eta_g: float = P.param(1.0, P.Interval(0, None, "neither"), "eta_g of the dual problem (d* = eta_g / phi sum p_k g_k)")
    phi: float = P.param(0.1, P.Interval(0, None, "neither"), "phi of the dual problem")
    rho: float = P.param(1.0, P.Interval(0, None, "neither"), "ADMM penalty rho (eua=paper_closed_form; the exact weights of eua=paper do not depend on it)")
    admm_iterations: int = P.param(100, P.Interval(1, None), "ADMM iterations (eua=paper_closed_form)")


@ALGORITHMS.register("fedu2")
class FedU2(SelfSupervised):
    """FedU2 (Liao, Gao, Ren, Liu, Sun, Wang, CVPR 2024).

    Client (eq. 2): the self-supervised loss of ``method`` (:class:`SelfSupervised`) plus
    FUR on the projections of both views::

        L = l_a(Z1, Z2) + lambda_U (l_u(Z1) + l_u(Z2))

    ``uniformity=uot`` (eqs. 3-6): ``l_u(Z) = <C, pi*> + tau_a/2 ||pi* 1 - a||^2 +
    tau_b/2 ||pi*^T 1 - b||^2`` with ``C_ij = ||Z_i - S_j||^2`` to fresh unit-normalised
    Gaussian samples ``S``, ``pi*`` the optimal unbalanced plan (an interior-point method to
    convergence; ``uot_solver=steepest_descent``: the paper's eq. 6 for ``uot_iterations``
    steps), held fixed: the gradient flows through ``C(Z)`` (the envelope theorem);
    ``uot_scale=mass`` divides it by the marginals' total mass ``B point_mass``;
    ``uniformity=tangent_sw`` is the official code's sliced Wasserstein-2 distance in the
    tangent spaces of the sphere at random points.

    Server (EUA, eqs. 7-12): with ``theta_g`` the model sent this round and ``theta_k``
    the returned ones (all parameters, BYOL's target included),
    ``g_k = grad log ||theta_g - theta_k||^2``; ``p = argmin_{p in simplex} p^T G p``
    with ``G_kl = g_k . g_l`` (exact; ``eua=paper_closed_form``: the paper's printed ADMM
    step); ``d* = (eta_g / phi) sum_k p_k g_k``. ``eua=official``:
    ``d_k = 2 (theta_g - theta_k) / ||theta_g - theta_k||``, MGDA's min-norm solver started
    at the aggregation weights, ``d* = sum_k p_k d_k``. Either is ``sum_k a_k (theta_g -
    theta_k)``, ``a_k >= 0``; ``step=convex`` moves the model along it to the clients'
    convex hull, ``theta_g <- theta_g - eta sum_k (a_k / sum_j a_j) (theta_g - theta_k)``,
    ``step=fixed`` by ``theta_g <- theta_g - eta d*``. BatchNorm statistics are the
    weighted average of the clients'. The weights ``p`` are kept in
    ``extras["eua_weights"]`` by client.

    With ``rotation > 0`` (the code's ``use_deg``, set by its ``main.py:54``) the rotation
    loss trains the encoder and projector; ``rotation_head=fedu2`` (default) does what
    the code's client of the method does with the head itself: BYOL's optimiser does not
    hold it, so it stays at its random initialisation
    (``src/my/algo/fedU2/fedbyol_client.py:125-130``), SimCLR's and SimSiam's train it
    (``fedsimclr_client.py:106-109``, ``fedsimsiam_client.py:105-108``).
    """

    name = "fedu2"
    min_batch_size = 64
    """FUR compares a batch with as many fresh samples of the sphere; below 64 they are noise
    that pulls the two views apart (digits at 16: BYOL's alignment loss 0.08 -> 2.07 in 20
    rounds, docs/algorithms.md). The paper's 128 would leave several clients of the default
    splits (digits, the CIFAR subset) without a step."""
    summary = "FedU2: SSL + flexible uniformity regularizer (FUR); enhanced uniform aggregation (EUA)"
    paper = "Liao, Gao, Ren, Liu, Sun, Wang, Rethinking the Representation in Federated Unsupervised Learning with Non-IID Data, CVPR 2024"
    Params = FedU2Params

    # -- client ------------------------------------------------------------------------
    def noise_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        B, d = self.federation.batch_size, self.federation.rep_dim
        shapes = list(super().noise_shapes())
        for view in (1, 2):
            if self.params.uniformity != "none":
                shapes.append((f"samples{view}", (B, d)))
            if self.params.uniformity == "tangent_sw":
                shapes += [(f"tangent{view}", (B, d)), (f"theta{view}", (B, self.params.projections, d))]
        return tuple(shapes)

    def regularizer(self, o1: ModelOutput, o2: ModelOutput, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``lambda_U (l_u(Z1) + l_u(Z2))``."""
        if self.params.uniformity == "none":
            return torch.zeros((), device=o1.z.device), {}
        u = self.uniformity(o1.z, batch, 1) + self.uniformity(o2.z, batch, 2)
        return self.params.lam_u * u, {"uniformity": u.detach()}

    def uniformity(self, z: torch.Tensor, batch: Batch, view: int) -> torch.Tensor:
        p, noise = self.params, batch.noise
        samples = F.normalize(noise[f"samples{view}"], dim=-1)
        if p.uniformity == "uot":
            value = uot_uniformity(z, samples, p.tau_a, p.tau_b, p.uot_iterations, p.point_mass, p.uot_solver)
            mass = 1.0 if p.point_mass is None else z.shape[-2] * p.point_mass
            return value / mass if p.uot_scale == "mass" else value
        if self.method_of(p) == "simclr":  # the code feeds SimCLR's normalised projections
            z = F.normalize(z, dim=-1)
        tangent = F.normalize(noise[f"tangent{view}"], dim=-1)
        return tangent_sliced_wasserstein(z, samples, noise[f"theta{view}"], tangent)

    # -- server ------------------------------------------------------------------------
    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return None if params.aggregation == "fedavg" else "FedU2's EUA solves for weights from every client's update (algorithm.aggregation=fedavg averages instead)"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        if self.params.aggregation == "fedavg":
            return super().aggregate(server, replies, round)
        weights = self.weights(replies)
        names = set(self.federation.param_names)
        parts = ["model"] + (["target"] if "target" in server.extras else [])
        sent = {part: server.model if part == "model" else server.extras["target"] for part in parts}
        new: dict[str, StateDict] = {}
        for part in parts:  # buffers: the weighted average
            buffers = [{k: v for k, v in r.payload[part].items() if k not in names} for r in replies]
            new[part] = weighted_average(buffers, weights) if buffers[0] else {}
        keys = [(part, k) for part in parts for k in sent[part] if k in names]
        p = self.params
        d, eua_weights = eua_direction(  # the tensors as they are: EUA streams over them
            [sent[part][k] for part, k in keys],
            [[r.payload[part][k] for part, k in keys] for r in replies],
            p.eua, eta_g=p.eta_g, phi=p.phi, rho=p.rho,
            iterations=p.admm_iterations, init=torch.tensor(weights, dtype=torch.float64), step=p.step,
        )
        offset = 0
        for part, k in keys:  # theta_g - eta d, tensor by tensor
            ref = sent[part][k]
            step = d[offset : offset + ref.numel()].mul(-p.eta).add_(ref.detach().flatten())
            new[part][k] = step.view_as(ref).to(ref.dtype)
            offset += ref.numel()
        extras: dict[str, Any] = {**server.extras, "eua_weights": {r.cid: float(w) for r, w in zip(replies, eua_weights)}}
        if "target" in extras:
            extras["target"] = {k: new["target"][k] for k in sent["target"]}
        return ServerState({k: new["model"][k] for k in sent["model"]}, extras)
