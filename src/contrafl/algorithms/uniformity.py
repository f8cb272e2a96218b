"""FedU2's flexible uniformity regularizer (FUR), as pure tensor functions.

Two versions of the client-side uniformity term ``l_u`` of FedU2 (Liao et al., CVPR 2024):

* the **paper** version (eqs 3-6): an unbalanced-OT divergence between the l2-normalised
  representations ``Z`` of a batch and as many fresh unit-normalised Gaussian samples ``S``
  (:func:`uot_uniformity`, solver :func:`uot_plan`);
* the **official code** version (``RepresentationTagentCollapse``): a sliced Wasserstein-2
  distance between ``Z`` and ``S`` after the log-map of both onto the tangent spaces of the
  unit sphere at random points (:func:`tangent_sliced_wasserstein`).

Everything works on ``[..., n, d]`` batches and under ``torch.func.vmap`` / ``torch.func.grad``.

Randomness. :func:`sphere_samples` (and the default tangent points / projections of
:func:`tangent_sliced_wasserstein`) draw with ``torch.randn``, from ``generator`` when one is
given. Inside ``vmap(..., randomness="different")`` every vmapped element gets its own draw, and
a draw from a ``generator`` is then the same as drawing the whole batched tensor
``[K, *shape]`` from that generator outside vmap (``randomness="same"`` gives every element the
same draw, the default ``"error"`` refuses). A Python loop of K draws of ``shape`` is in general
*not* the same stream as one batched draw (CPU normal sampling depends on the tensor size), so
where a sequential run must equal a vectorized one, draw the samples once outside, ``[K, n, d]``,
and pass them in.

Regime of the paper's FUR (a measured fact, see ``uot_uniformity``): with probability marginals
``a = 1/n``, ``b = 1/m`` and ``tau_a = tau_b = 0.8`` the optimal plan is exactly zero for
unit-norm data unless some ``||z_i - s_j||^2 < (tau_a + tau_b)/B`` (0.0125 at B = 128, i.e. a
fresh random sample within cosine 0.994 of a representation: practically impossible in
d >= 128); ``l_u`` is then the constant ``(tau_a ||a||^2 + tau_b ||b||^2)/2`` with zero gradient.
``point_mass`` scales the marginals into the regime where mass moves.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

UOT_SOLVERS = ("interior_point", "steepest_descent")
"""The plan solvers of :func:`uot_uniformity`: :func:`uot_plan` (the default) and the paper's
eq 6, :func:`uot_plan_steepest_descent`."""

UOT_ITERATIONS = {"interior_point": 25, "steepest_descent": 50}
"""Default iterations of each solver. ``interior_point``: a cap; a problem stops moving once it
meets :data:`UOT_GAP_TOLERANCE` (measured on 180 problems, B = 32-128, d = 128-512, per-point
masses 1-4 and 1/B, random, clustered and near-collapsed representations, and on the 27 of
:func:`uot_plan`: after at most 23 iterations). ``steepest_descent``: [infer] (the paper gives none); its
plan is far from converged after 50 steps (see :func:`uot_plan_steepest_descent`)."""

UOT_GAP_TOLERANCE = 1e-9
"""Stopping rule of :func:`uot_plan`, relative to the size of the problem: duality gap
``<pi, lambda> <= 1e-9 Omega`` (``Omega = tau_a ||a||^2/2 + tau_b ||b||^2/2``, the objective at
``pi = 0``) and dual residual ``max |r| <= 1e-9 max |w|``."""

_LOGMAP_EPS = {torch.float64: 1e-7}
"""geoopt's ``Sphere`` EPS (1e-4 for every dtype but float64)."""


def sphere_samples(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh samples ``s ~ N(0, I)`` normalised to ``||s|| = 1`` (paper's prior ``S_B``), with the
    shape, dtype and device of ``like`` (e.g. the batch ``z`` ``[..., n, d]``: one sample per row).
    ``generator`` must live on ``like``'s device. See the module docstring for how the draws
    behave under ``vmap``."""
    s = torch.randn(like.shape, generator=generator, dtype=like.dtype, device=like.device)
    return F.normalize(s, dim=-1)


def _largest_step(v: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """``max {t : v + t dv >= 0}`` for ``v > 0``, over the last two dims (``inf`` if ``dv >= 0``)."""
    return (v / dv.neg().clamp_min(0.0)).amin((-2, -1), keepdim=True)


class _NewtonSystem:
    """``(D + Q) dpi = h`` for a diagonal ``D = 1 / W`` (``W >= 0``, ``[..., n, m]``; ``W = 0``
    fixes an entry) and ``Q pi = tau_a (pi 1) 1^T + tau_b 1 (pi^T 1)^T``. ``Q`` only sees row and
    column sums, so by Woodbury the system reduces to the ``n + m`` nodes::

        dpi = W o (h - u_r 1^T - 1 u_c^T),
        [[diag(W 1) + 1/tau_a, W], [W^T, diag(W^T 1) + 1/tau_b]] [u_r; u_c] = [(W o h) 1; (W o h)^T 1]

    solved through the Cholesky factor ``L`` of the ``m x m`` Schur complement of the first block
    (factored once, ``failed`` where Cholesky failed) by two triangular solves. Not
    ``torch.cholesky_solve``: on a GPU its batched form is MAGMA's, which cannot be captured
    in a CUDA graph (it allocates), and a step that solves a UOT plan would run eagerly."""

    def __init__(self, W: torch.Tensor, tau_a: float, tau_b: float) -> None:
        self.W = W
        self.row = W.sum(-1, keepdim=True) + 1.0 / tau_a                                       # [..., n, 1]
        schur = torch.diag_embed(W.sum(-2) + 1.0 / tau_b) - W.mT @ (W / self.row)            # [..., m, m]
        self.factor, info = torch.linalg.cholesky_ex(schur)
        self.failed = (info != 0)[..., None, None]

    def solve(self, h: torch.Tensor) -> torch.Tensor:
        """``dpi`` ``[..., n, m]`` for the right-hand side ``h``."""
        W, row = self.W, self.row
        v = W * h
        v_r, v_c = v.sum(-1, keepdim=True), v.sum(-2, keepdim=True)
        rhs = v_c.mT - W.mT @ (v_r / row)                                                     # [..., m, 1]
        half = torch.linalg.solve_triangular(self.factor, rhs, upper=False)                    # L y = rhs
        u_c = torch.linalg.solve_triangular(self.factor.mT, half, upper=True).mT               # L^T u_c = y
        u_r = (v_r - W @ u_c.mT) / row                                                         # [..., n, 1]
        return W * (h - u_r - u_c)


def uot_plan(
    cost: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    tau_a: float,
    tau_b: float,
    iterations: int = UOT_ITERATIONS["interior_point"],
) -> torch.Tensor:
    """Plan ``pi`` ``[..., n, m]`` of the unbalanced OT problem with quadratic marginal penalties
    (paper eqs 4-5)::

        min_{pi >= 0}  <C, pi> + tau_a/2 ||pi 1 - a||^2 + tau_b/2 ||pi^T 1 - b||^2

    i.e. ``min_{pi >= 0} 1/2 pi^T Q pi + w^T pi`` (eq 5, ``pi`` as a vector) with
    ``Q pi = tau_a (pi 1) 1^T + tau_b 1 (pi^T 1)^T`` and ``w = C - tau_a a 1^T - tau_b 1 b^T``.

    1. A primal-dual interior-point method (Mehrotra's predictor-corrector) on the KKT
       conditions ``lambda = Q pi + w``, ``pi o lambda = 0``, ``pi, lambda >= 0`` (``lambda``: the
       gradient of eq 4, the multiplier of ``pi >= 0``). With the residual
       ``r = Q pi + w - lambda`` and ``mu = <pi, lambda> / nm``, an iteration solves
       ``(lambda / pi + Q) dpi = h``, ``dlambda = Q dpi + r`` (:class:`_NewtonSystem`,
       ``W = pi / lambda``) for the predictor ``h = -lambda - r`` and the corrector
       ``h = -lambda - r + (sigma mu - dpi' o dlambda') / pi`` (``sigma = (mu' / mu)^3``, ``mu'``
       the complementarity after the predictor's largest step), and moves both by
       ``min(1, 0.995 t)``, ``t`` the largest step that keeps ``pi, lambda >= 0``. Start:
       ``pi = a b^T / sqrt(1^T a 1^T b)``, ``lambda = mean |w|``. A problem stops moving (each
       one of a batch on its own) once it meets :data:`UOT_GAP_TOLERANCE`, or where rounding
       breaks the step (Cholesky fails or the step is not finite: seen only at relative gaps
       of 1e-9 to 2e-8). Then the entries with ``pi <= lambda`` are set to 0 (complementarity:
       they approximate zeros).
    2. Two Newton steps of the QP restricted to the support ``S`` of ``pi`` (its other entries
       held at 0): ``(Q_SS + 1e-8 min(tau_a, tau_b) I) dpi_S = -(Q pi + w)_S``, each kept only if
       it leaves ``pi >= 0`` (then the objective does not increase). When ``S`` is the optimal
       support this lands on the optimum to rounding.

    Measured on 27 problems at B = 128, d = 512 (per-point masses 1.5, 2, 4; random, clustered
    and near-collapsed unit representations), against exact plans certified by their KKT
    conditions (<= 1e-12): step 1 ends after 13-23 iterations with the z-gradient at most
    1.4e-4 (l2, relative; median 5e-6) off; step 2 then reaches the optimum (KKT residual
    <= 2e-15, gradient within 2e-13 in float64, 3e-5 from float32 costs) on 24 of them; on the
    other 3 (near-collapsed) ``S`` holds a few spurious entries and step 1's plan stays (KKT
    residual <= 2e-5, gradient within 3e-5). With the paper's marginals (``1/B``) the plan is
    exactly zero (module docstring).

    Computed in float64 (returned in ``cost``'s dtype), a fixed number of iterations and no
    branching on values: runs under ``vmap`` (a batch agrees with a loop over its problems to
    the solver's accuracy, not to the last bit: rounding differs and the late iterations
    amplify it). No gradient flows through the solver (inputs are detached). ``a`` ``[..., n]``,
    ``b`` ``[..., m]``; a wide problem (``m > n``) is solved transposed.
    """
    if cost.shape[-1] > cost.shape[-2]:
        return uot_plan(cost.mT, b, a, tau_b, tau_a, iterations).mT
    f64 = torch.float64
    a, b = a.detach().to(f64).unsqueeze(-1), b.detach().to(f64).unsqueeze(-2)
    w = cost.detach().to(f64) - tau_a * a - tau_b * b
    size = w.shape[-2] * w.shape[-1]
    omega = 0.5 * (tau_a * a.square().sum((-2, -1), keepdim=True) + tau_b * b.square().sum((-2, -1), keepdim=True))
    w_max = w.abs().amax((-2, -1), keepdim=True)
    pi = a * b / (a.sum((-2, -1), keepdim=True) * b.sum((-2, -1), keepdim=True)).sqrt()
    lam = w.abs().mean((-2, -1), keepdim=True).expand_as(w)
    done = torch.zeros_like(omega, dtype=torch.bool)
    for _ in range(iterations):
        r = tau_a * pi.sum(-1, keepdim=True) + tau_b * pi.sum(-2, keepdim=True) + w - lam
        gap = (pi * lam).sum((-2, -1), keepdim=True)
        residual = r.abs().amax((-2, -1), keepdim=True)
        done = done | ((gap <= UOT_GAP_TOLERANCE * omega) & (residual <= UOT_GAP_TOLERANCE * w_max))
        system = _NewtonSystem(pi / lam, tau_a, tau_b)
        dpi = system.solve(-lam - r)
        dlam = tau_a * dpi.sum(-1, keepdim=True) + tau_b * dpi.sum(-2, keepdim=True) + r
        step = torch.minimum(_largest_step(pi, dpi), _largest_step(lam, dlam)).clamp_max(1.0)
        mu = gap / size
        mu_affine = ((pi + step * dpi) * (lam + step * dlam)).sum((-2, -1), keepdim=True) / size
        dpi = system.solve(-lam - r + ((mu_affine / mu) ** 3 * mu - dpi * dlam) / pi)
        dlam = tau_a * dpi.sum(-1, keepdim=True) + tau_b * dpi.sum(-2, keepdim=True) + r
        step = (0.995 * torch.minimum(_largest_step(pi, dpi), _largest_step(lam, dlam))).clamp_max(1.0)
        done = done | system.failed | ~torch.isfinite(step)
        pi = torch.where(done, pi, pi + step * dpi)
        lam = torch.where(done, lam, lam + step * dlam)
    pi = torch.where(pi > lam, pi, 0.0)
    face = _NewtonSystem((pi > 0).to(f64) * (1e8 / min(tau_a, tau_b)), tau_a, tau_b)
    for _ in range(2):
        polished = pi + face.solve(-(tau_a * pi.sum(-1, keepdim=True) + tau_b * pi.sum(-2, keepdim=True) + w))
        pi = torch.where((polished >= 0).all(-1, keepdim=True).all(-2, keepdim=True) & ~face.failed, polished, pi)
    return pi.to(cost.dtype)


def uot_plan_steepest_descent(
    cost: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    tau_a: float,
    tau_b: float,
    iterations: int = UOT_ITERATIONS["steepest_descent"],
) -> torch.Tensor:
    """Plan ``pi`` ``[..., n, m]`` of the unbalanced OT problem of :func:`uot_plan` (paper eqs 4-5)::

        min_{pi >= 0}  <C, pi> + tau_a/2 ||pi 1 - a||^2 + tau_b/2 ||pi^T 1 - b||^2

    by projected steepest descent with the exact step (eq 6), in matrix form, from ``pi = a b^T``::

        G   = C + tau_a (pi 1 - a) 1^T + tau_b 1 (pi^T 1 - b)^T        # = Q vec(pi) + w
        G  <- 0 where pi = 0 and G > 0                                   # projected gradient
        eta = ||G||_F^2 / (tau_a ||G 1||^2 + tau_b ||G^T 1||^2)          # = g^T g / g^T Q g
        pi <- max(0, pi - eta G)

    The paper's ``eta*`` uses the full gradient; we use the projected one (the same when no entry
    sits at zero): the entries it drops cannot move anyway (they are clamped back to 0), but they
    spoil the step of the others. Measured at B = 128 (d = 128, 512, per-point masses 1.5-4):
    after 200 steps the full-gradient step leaves an objective gap 1-700x (median ~100x) larger,
    and its plan stalls (z-gradient 39-66 % off, against 7-66 %). On small problems (5x7) this
    solver reaches the KKT point to machine precision in ~1000 steps.

    It converges slowly in the plan: ``Q`` is zero along the mass moved around cycles of the
    bipartite graph (which changes ``<C, pi>`` only), where a step moves by about
    ``(cost difference) / (tau_a m + tau_b n)``. Measured on the 27 problems of :func:`uot_plan`:
    after 50 steps (its default) the z-gradient is 26-98 % (median 66 %) off the optimal plan's
    and the KKT residual 8e-3 to 0.16; after 5000 steps still 6-10 % off (two of them); some
    need more than 20000 steps to reach a KKT residual of 1e-10. The objective converges much
    sooner (within 0.2-7 % of its transport part after 50 steps).

    A fixed number of steps, no branching on values, a zero step when ``G^T Q G = 0`` (zero
    gradient, or a measure-zero zero-curvature direction): runs under ``vmap``. No gradient flows
    through the solver (inputs are detached). ``a`` ``[..., n]``, ``b`` ``[..., m]``.
    """
    cost, a, b = cost.detach(), a.detach().unsqueeze(-1), b.detach().unsqueeze(-2)
    pi = a * b
    tiny = torch.finfo(cost.dtype).tiny
    for _ in range(iterations):
        grad = cost + tau_a * (pi.sum(-1, keepdim=True) - a) + tau_b * (pi.sum(-2, keepdim=True) - b)
        grad = torch.where((pi <= 0) & (grad > 0), 0.0, grad)
        num = grad.square().sum((-2, -1), keepdim=True)
        den = (tau_a * grad.sum(-1, keepdim=True).square().sum(-2, keepdim=True)
               + tau_b * grad.sum(-2, keepdim=True).square().sum(-1, keepdim=True))
        eta = torch.where(den > 0, num / den.clamp_min(tiny), 0.0)
        pi = (pi - eta * grad).clamp_min(0.0)
    return pi


def uot_objective(
    cost: torch.Tensor, pi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tau_a: float, tau_b: float
) -> torch.Tensor:
    """``<C, pi> + tau_a/2 ||pi 1 - a||^2 + tau_b/2 ||pi^T 1 - b||^2`` (eq 4), over the last two dims."""
    return ((cost * pi).sum((-2, -1))
            + 0.5 * tau_a * (pi.sum(-1) - a).square().sum(-1)
            + 0.5 * tau_b * (pi.sum(-2) - b).square().sum(-1))


def uot_uniformity(
    z: torch.Tensor,
    samples: torch.Tensor,
    tau_a: float = 0.8,
    tau_b: float = 0.8,
    iterations: int | None = None,
    point_mass: float | None = None,
    solver: str = "interior_point",
) -> torch.Tensor:
    """The paper's uniformity term ``l_u(Z) = Div(Z, S)`` (eqs 3-6), ``[...]`` for ``z`` ``[..., n, d]``.

    ``Z`` = rows of ``z`` l2-normalised, ``S`` = ``samples`` ``[..., m, d]`` (unit rows, see
    :func:`sphere_samples`), ``C_ij = ||Z_i - S_j||^2``, ``pi* = uot_plan(C.detach(), a, b)`` and::

        l_u = <C(Z), pi*> + tau_a/2 ||pi* 1 - a||^2 + tau_b/2 ||pi*^T 1 - b||^2

    with ``pi*`` held fixed, so the gradient flows through ``C(Z)`` only (the penalties are
    constants): at an optimal plan this is the gradient of ``l_u(Z) = min_pi`` eq 4 (the envelope
    theorem, where the optimal plan is unique), hence a converged solver. ``solver``:
    ``"interior_point"`` (:func:`uot_plan`) or ``"steepest_descent"`` (the paper's eq 6,
    :func:`uot_plan_steepest_descent`, not converged at its default steps); ``iterations``:
    None for the solver's default (:data:`UOT_ITERATIONS`). Marginals: ``a = 1/n``, ``b = 1/m``
    (probability vectors, [infer]: the paper says "the marginal constraints a, b") when
    ``point_mass`` is None, else every point carries ``point_mass``.

    KKT at ``pi = 0``: the plan is exactly zero iff ``C_ij >= tau_a a_i + tau_b b_j`` for all
    i, j; with unit vectors (``C_ij = 2 - 2 cos``) and the default marginals this is
    ``cos(Z_i, S_j) <= 1 - (tau_a + tau_b)/(2B)``, true for every pair of a realistic batch,
    so ``l_u`` is constant with zero gradient. Mass starts to move for ``point_mass`` around
    1-1.5 (threshold ``1.6 * point_mass`` vs. ``C`` ~ 2 +- 0.1 in d = 512).
    """
    z = F.normalize(z, dim=-1)
    cost = (z.square().sum(-1, keepdim=True) + samples.square().sum(-1).unsqueeze(-2)
            - 2.0 * z @ samples.transpose(-2, -1)).clamp_min(0.0)
    n, m = cost.shape[-2], cost.shape[-1]
    a = cost.new_full(cost.shape[:-1], 1.0 / n if point_mass is None else point_mass)
    b = cost.new_full(cost.shape[:-2] + (m,), 1.0 / m if point_mass is None else point_mass)
    plan = uot_plan if solver == "interior_point" else uot_plan_steepest_descent
    pi = plan(cost, a, b, tau_a, tau_b, UOT_ITERATIONS[solver] if iterations is None else iterations)
    return uot_objective(cost, pi, a, b, tau_a, tau_b)


def sphere_logmap_projections(x: torch.Tensor, y: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """``<log_x(y_i), theta_l>`` ``[..., T, n, L]`` for tangent points ``x`` ``[..., T, d]``, points
    ``y`` ``[..., n, d]`` and directions ``theta`` ``[..., T, L, d]`` (one set per tangent point).

    ``log_x(y)`` is geoopt's ``Sphere.logmap`` (geoopt/manifolds/sphere.py, v0.5)::

        u = (y - x) - <x, y - x> x
        log_x(y) = u * acos(clamp(<x, y>, -1 + eps, 1 - eps)) / max(||u||, eps)

    (eps = 1e-7 in float64, 1e-4 otherwise; geoopt's ``where(dist > eps, ..., u)`` always takes
    this branch since ``dist >= acos(1 - eps) > eps``). ``y`` is not normalised, as in the
    official code. Expanded with ``c = 1 + <x, y> - <x, x>``, ``u = y - c x``, so that only
    ``[T, n]`` and ``[T, n, L]`` arrays are formed (no ``[T, n, d]``): ``<u, theta> = <y, theta> -
    c <x, theta>``, ``||u||^2 = ||y||^2 - 2 c <x, y> + c^2 ||x||^2``. This differs from geoopt's
    direct ``||u||`` only by rounding, which matters only for points within ~1e-3 of a tangent
    point in float32 (checked against geoopt 0.5.1: equal values in float32 and float64).
    """
    eps = _LOGMAP_EPS.get(y.dtype, 1e-4)
    xy = x @ y.transpose(-2, -1)                                   # [T, n]
    xx = x.square().sum(-1, keepdim=True)                          # [T, 1]
    c = 1.0 + xy - xx
    u_norm = (y.square().sum(-1).unsqueeze(-2) - 2.0 * c * xy + c.square() * xx).clamp_min(0.0).sqrt()
    scale = torch.acos(xy.clamp(-1.0 + eps, 1.0 - eps)) / u_norm.clamp_min(eps)
    y_theta = y.unsqueeze(-3) @ theta.transpose(-2, -1)            # [T, n, L]
    x_theta = (x.unsqueeze(-2) * theta).sum(-1).unsqueeze(-2)      # [T, 1, L]
    return scale.unsqueeze(-1) * (y_theta - c.unsqueeze(-1) * x_theta)


def tangent_sliced_wasserstein(
    z: torch.Tensor,
    samples: torch.Tensor,
    projections: int | torch.Tensor = 6,
    tangent_points: torch.Tensor | None = None,
    num_tangent_space: float = 6.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The official code's uniformity term (``RepresentationTagentCollapse.forward``,
    XeniaLLL/FedU2 src/my/loss/sw_loss.py lines 441-456, with ``sliced_wasserstein_distance``
    lines 514-548), ``[...]`` for ``z`` ``[..., B, d]``::

        value = (1/num_tangent_space) * sum_{t=1..T} (1/(L B)) sum_{l, i}
                    ( sort_i <log_{x_t}(s_i), theta_tl> - sort_i <log_{x_t}(z_i), theta_tl> )^2

    i.e. for every tangent point ``x_t`` the sliced Wasserstein-2 (squared, averaged over the
    ``L`` projections) between the log-maps of ``samples`` and of ``z``
    (:func:`sphere_logmap_projections`), summed over the tangent points and divided by
    ``num_tangent_space``. The official client builds it with ``num_tangent_space=6`` but draws
    ``T = B`` tangent points (``F.normalize(torch.randn(z.shape))``, line 448), so it sums B terms
    and divides by 6; its projection directions are ``torch.randn(L, d)``, not normalised, fresh
    for every tangent point (line 531); ``z`` is used as given (SimCLR feeds normalised projector
    outputs, BYOL/SimSiam un-normalised ones), ``samples`` are unit Gaussian rows (line 449).
    The official loss weight is 0.01 per view.

    ``projections``: an int ``L`` draws ``theta`` ``[..., T, L, d] ~ N(0, I)``; a tensor is used
    as ``theta`` (``[..., T, L, d]``, or ``[..., L, d]`` shared by all tangent points).
    ``tangent_points`` ``[..., T, d]`` (unit rows): drawn like the code when None. Draw order
    from ``generator``: tangent points, then directions. Needs as many samples as rows of ``z``.
    """
    if samples.shape[-2] != z.shape[-2]:
        raise ValueError(f"need as many samples as representations, got {samples.shape[-2]} and {z.shape[-2]}")
    if tangent_points is None:
        tangent_points = sphere_samples(z, generator)
    if isinstance(projections, int):
        shape = tangent_points.shape[:-1] + (projections, z.shape[-1])
        theta = torch.randn(shape, generator=generator, dtype=z.dtype, device=z.device)
    else:
        theta = projections if projections.dim() == tangent_points.dim() + 1 else projections.unsqueeze(-3)
    proj_s = sphere_logmap_projections(tangent_points, samples, theta).sort(dim=-2).values
    proj_z = sphere_logmap_projections(tangent_points, z, theta).sort(dim=-2).values
    return (proj_s - proj_z).square().mean((-2, -1)).sum(-1) / num_tangent_space
