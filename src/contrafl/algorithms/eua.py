"""FedU2's enhanced uniform aggregation (EUA): the server's math on flattened parameter vectors.

Paper (Liao et al., CVPR 2024, eqs 7-12). With ``u_k = ||theta_g - theta_k||^2`` the server looks
for the direction ``d`` that maximises the worst rate of change of ``log u_k`` (eq 8); its dual
(eq 10) is the quadratic program over the simplex::

    p* = argmin_{p in simplex} (eta_g^2 / 2 phi) p^T G p,   G_kl = <g_k, g_l>,
    g_k = grad_{theta_g} log u_k = 2 (theta_g - theta_k) / ||theta_g - theta_k||^2

and ``d* = (eta_g / phi) sum_k p_k g_k`` (after eq 9); the model that was sent this round moves
to ``theta_g - eta d*``. The paper solves the QP by the method of multipliers on its augmented
Lagrangian (eqs 11-12); minimised over ``p >= 0``, that method's p-step is already a multiple of
``p*``, which :func:`simplex_weights_active_set` computes exactly (``eua=paper``). The printed
closed-form p-step (:func:`simplex_weights_admm`, ``eua=paper_closed_form``) is not ``p*`` when
the optimum is on the boundary of the simplex, and can diverge.

Official code (XeniaLLL/FedU2 src/my/algo/commons/mtl.py lines 84-85 and 139-146): the same QP
on the unit directions scaled by 2, ``d_k = 2 (theta_g - theta_k) / ||theta_g - theta_k||``,
solved by MGDA's ``MinNormSolver.find_min_norm_element`` (:func:`simplex_weights_min_norm`)
from the sharpened sample-size weights (:func:`sharpen`), and ``d = sum_k p_k d_k``
(applied with a fresh SGD, lr ``gmodel_lr`` = 8 in main.py).

Degenerate clients. A client whose vector equals the global one (``u_k = 0``: e.g. it took no
step) has no direction (``g_k`` is infinite, ``d_k`` is 0/0). Its scale in :func:`direction_gram`
is zero, and :func:`eua_direction` leaves it out of the QP and gives it weight 0; if every client
is degenerate the direction is zero (the global model stays) and all weights are 0.

All computations are in float64. Every direction is a multiple of its client's update,
``g_k = c_k delta_k``, so the ``[K, P]`` direction matrix (``8 K P`` bytes: 2.4 GB for ten
clients of FedU2's ResNet-18 with its target network) is never formed: its Gram matrix
and the combination ``sum_k a_k delta_k`` are accumulated over slices of :data:`CHUNK`
parameters (:func:`direction_gram`, :func:`combine`), and the vectors may be given as the
list of tensors whose flattened concatenation they are, so that nothing is concatenated.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

import torch

DirectionKind = Literal["log_distance", "normalized"]

EUAVariant = Literal["paper", "paper_closed_form", "official"]

EUAStep = Literal["fixed", "convex"]

Vector = torch.Tensor | Sequence[torch.Tensor]
"""A parameter vector: flat, or the tensors whose flattened concatenation it is."""

CHUNK = 1 << 18
"""Parameters per slice of the streamed computations (``K x 2 MiB`` of float64 deltas)."""

MIN_NORM_STOP = 1e-5
"""The official solver's ``STOP_CRIT``: stop when ``sum_k |p_k^new - p_k| < 1e-5``."""

MIN_NORM_MAX_ITERATIONS = 1000
"""Our cap on the official solver's loop (its ``iter_count`` is never incremented, so its
``MAX_ITER = 20`` never applies and it can loop forever); it only ends runs that the official
stopping rule would not end (measured on K = 3-20: the rule stops after 2-21 steps)."""


def _slices(v: Vector, chunk: int) -> Iterator[torch.Tensor]:
    """``v``'s entries in order, as 1-D slices of at most ``chunk`` entries (vectors of
    equal shapes give equal slices)."""
    for t in [v] if isinstance(v, torch.Tensor) else v:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), chunk):
            yield flat[start : start + chunk]


def _deltas(global_vec: Vector, client_vecs: Sequence[Vector], chunk: int) -> Iterator[torch.Tensor]:
    """``delta_k = theta_g - theta_k`` of every client, slice by slice: ``[K, n]`` float64."""
    for g, *clients in zip(_slices(global_vec, chunk), *(_slices(v, chunk) for v in client_vecs)):
        g = g.to(torch.float64)
        d = g.new_empty(len(clients), g.numel())
        for row, v in zip(d, clients):
            torch.sub(g, v, out=row)
        yield d


def direction_gram(
    global_vec: Vector, client_vecs: Sequence[Vector], kind: DirectionKind, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gram matrix ``G_kl = <g_k, g_l>`` ``[K, K]`` of the per-client directions and
    their scales ``c`` ``[K]`` (float64), ``g_k = c_k delta_k`` with
    ``delta_k = theta_g - theta_k``:

    * ``"log_distance"`` (paper, eq 7): ``g_k = grad log ||delta_k||^2 = 2 delta_k / ||delta_k||^2``;
    * ``"normalized"`` (official mtl.py line 85, ``2*grads/grads.norm(p=2, dim=0)``, i.e. each
      client's column divided by its own norm): ``d_k = 2 delta_k / ||delta_k||``.

    ``G = diag(c) (sum over slices of Delta Delta^T) diag(c)``. A client with
    ``delta_k = 0`` has ``c_k = 0`` (a zero direction; see the module docstring).
    """
    gram: torch.Tensor | None = None
    for d in _deltas(global_vec, client_vecs, chunk):
        gram = d @ d.T if gram is None else gram.addmm_(d, d.T)
    if gram is None:
        raise ValueError("EUA needs parameters to aggregate: the vectors are empty")
    sq = gram.diagonal().clone()
    norm = {"log_distance": sq, "normalized": sq.sqrt()}[kind]
    scale = torch.where(sq > 0, 2.0 / torch.where(sq > 0, norm, 1.0), 0.0)
    return gram * scale.unsqueeze(1) * scale.unsqueeze(0), scale


def combine(global_vec: Vector, client_vecs: Sequence[Vector], a: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """``sum_k a_k delta_k`` ``[P]`` (float64), slice by slice."""
    pieces = [global_vec] if isinstance(global_vec, torch.Tensor) else global_vec
    out = torch.empty(sum(t.numel() for t in pieces), dtype=torch.float64, device=pieces[0].device)
    a = a.to(torch.float64)
    offset = 0
    for d in _deltas(global_vec, client_vecs, chunk):
        torch.mv(d.T, a, out=out[offset : offset + d.shape[1]])
        offset += d.shape[1]
    return out


def _nonnegative_quadratic_minimum(H: torch.Tensor) -> torch.Tensor:
    """``x = argmin_{x >= 0} 1/2 x^T H x - 1^T x`` for a positive semi-definite ``H`` ``[K, K]``
    (float64, CPU) by Lawson and Hanson's active-set method for non-negative least squares,
    in its normal-equation form (Bro and de Jong's FNNLS)::

        P = {}, x = 0
        while some j not in P has w_j = (1 - H x)_j > tol:     # the KKT condition it violates
            add the j of largest w_j to P
            loop: s = H_PP^{-1} 1 on P, 0 elsewhere
                  if s_P > 0: break
                  x <- x + alpha (s - x), alpha the largest step keeping x >= 0; the entry of
                  P that reaches 0 (and any other <= 0) leaves P
            x = s

    At the end ``x >= 0`` and ``1 - H x`` is 0 on ``P`` and ``<= tol`` elsewhere: the KKT
    conditions, so ``x`` is optimal. Finite in exact arithmetic (the objective decreases at
    every addition and no set ``P`` repeats); ``tol = 10 K eps max_j sum_i |H_ij|`` as scipy's
    ``nnls``. Raises if it makes more than ``3 K`` additions (scipy's cap: cycling through
    rounding; not seen in the tests)."""
    K = H.shape[0]
    tol = 10 * K * torch.finfo(H.dtype).eps * H.abs().sum(0).max().item()
    ones = torch.ones(K, dtype=H.dtype)
    passive = torch.zeros(K, dtype=torch.bool)
    x = torch.zeros(K, dtype=H.dtype)
    for _ in range(3 * K):
        w = ones - H @ x
        candidates = ~passive & (w > tol)
        if not candidates.any():
            return x
        passive[torch.where(candidates, w, -torch.inf).argmax()] = True
        while True:
            s = torch.zeros_like(x)
            s[passive] = torch.linalg.solve(H[passive][:, passive], ones[passive])
            if (s[passive] > 0).all():
                break
            blocking = passive & (s <= 0)  # x - s >= 0 there; 0 only if x = s = 0 (then ratio 0)
            ratios = torch.where(blocking, x / (x - s).clamp_min(torch.finfo(x.dtype).tiny), torch.inf)
            leaving = ratios.argmin()
            x = x + ratios[leaving] * (s - x)
            x[leaving] = 0.0
            passive &= x > 0
        x = s
    raise RuntimeError(f"the active-set method made more than {3 * K} additions (K = {K})")


def simplex_weights_active_set(G: torch.Tensor) -> torch.Tensor:
    """The exact weights ``p* = argmin_{p in simplex} p^T G p`` ``[K]`` (eq 10; the factor
    ``eta_g^2 / 2 phi`` does not move the minimiser) for a Gram matrix ``G`` ``[K, K]``.

    The paper's method of multipliers (eqs 11-12) alternates a p-step on the augmented
    Lagrangian ``(eta_g^2 / 2 phi) p^T G p + mu (1^T p - 1) + rho/2 (1^T p - 1)^2`` over
    ``p >= 0`` and ``mu <- mu + rho (1^T p - 1)``. Writing ``p = s q`` (``s = 1^T p``, ``q`` in the
    simplex), the p-step's objective is ``(eta_g^2 / 2 phi) s^2 q^T G q`` plus terms in ``s``
    alone, so for ``mu < rho`` its minimiser over ``p >= 0`` is ``s* p*``: every renormalised
    iterate is ``p*``, and one p-step at ``mu = 0`` suffices. With ``G`` scaled by its largest
    diagonal entry ``g`` (which does not move ``p*``) that p-step is::

        x = argmin_{x >= 0} 1/2 x^T (G / g + 1 1^T) x - 1^T x,     p* = x / 1^T x

    solved exactly by an active-set method (:func:`_nonnegative_quadratic_minimum`; the
    matrix is ``A^T A`` for the columns ``A_k = (v_k / sqrt(g), 1)``, so this is Wolfe's
    nearest-point problem as non-negative least squares). The printed p-step instead clips the
    unconstrained minimiser (:func:`simplex_weights_admm`), which is not ``p*`` when the
    optimum is on the boundary.

    Identical clients (equal rows of ``G``, the same direction) are one point of the convex
    hull, solved once; their weight is split equally between them (every split is optimal).
    Computed in float64 on the CPU, returned on ``G``'s device.
    """
    device, G = G.device, G.detach().to(torch.float64).cpu()
    K = G.shape[0]
    groups, group, counts = torch.unique(G, dim=0, return_inverse=True, return_counts=True)
    first = torch.full((len(groups),), K).scatter_reduce(0, group, torch.arange(K), "amin")
    Gu = G[first][:, first]
    x = _nonnegative_quadratic_minimum(Gu / Gu.diagonal().max().clamp_min(torch.finfo(G.dtype).tiny) + 1.0)
    return ((x / x.sum())[group] / counts[group]).to(device)


def simplex_weights_admm(
    G: torch.Tensor, eta_g: float = 1.0, phi: float = 0.1, rho: float = 1.0, iterations: int = 100
) -> torch.Tensor:
    """Weights ``p`` ``[K]`` by the paper's printed closed-form iteration for
    ``min_{p in simplex} (eta_g^2 / 2 phi) p^T G p`` (eqs 11-12, ``eua=paper_closed_form``), with
    the corrected matrix (the printed ``(... + rho I)^{-1}(rho I - mu I)`` is not the minimiser of
    eq 11 over ``R^K``)::

        p  <- max(0, ((eta_g^2/phi) G + rho 1 1^T)^+ (rho - mu) 1)
        mu <- mu + rho (1^T p - 1)

    from ``mu = 0`` (``iterations`` p-steps), then ``p <- p / 1^T p``. ``^+`` is the
    pseudo-inverse (``G`` is singular when directions are linearly dependent, e.g. two identical
    clients; it then splits weight equally between them). Not the minimiser of the QP in
    general: the exact weights are :func:`simplex_weights_active_set`.

    What this computes: the p-step clips the minimiser over ``R^K`` instead of minimising over
    ``p >= 0``. The matrix never changes, so every iterate is ``max(0, (rho - mu) x)`` with
    ``x = H^+ 1``; with ``c = 1^T max(0, x)``, ``rho - mu`` follows ``r <- r (1 - rho c) + rho``.

    * ``rho c < 2``: it converges to ``1/c`` and the result is ``max(0, x) / c``. For invertible
      ``G``, ``x`` is proportional to ``G^{-1} 1``, the minimiser over the affine hull
      ``1^T p = 1``, negative entries clipped: the optimum when it is interior (all ``p_k > 0``),
      above it otherwise (measured against the exact weights on boundary optima, see the tests
      and docs/algorithms.md).
    * ``rho c > 2`` (possible only when clipping removes large negative entries): it oscillates
      with growing amplitude, ``rho - mu`` turns negative, the iterates become
      ``|rho - mu| max(0, -x)`` and the result is ``max(0, -x) / 1^T max(0, -x)``: all the weight
      on the clients that the affine minimiser rejects (e.g. two nearly parallel directions of
      unequal norms: ``[0, 1]`` where the optimum is ``[1, 0]``).

    ``eta_g``, ``phi``, ``rho`` enter only through ``x`` and ``rho c``.
    """
    K = G.shape[0]
    ones = torch.ones(K, dtype=torch.float64, device=G.device)
    H = (eta_g**2 / phi) * G.to(torch.float64) + rho * torch.outer(ones, ones)
    x = torch.linalg.pinv(H, hermitian=True) @ ones
    mu = 0.0
    p = (rho * x).clamp_min(0.0)
    for _ in range(iterations - 1):
        mu = mu + rho * (p.sum().item() - 1.0)
        p = ((rho - mu) * x).clamp_min(0.0)
    return p / p.sum()


def _line_min(v1v1: float, v1v2: float, v2v2: float) -> float:
    """``argmin_{c in [0, 1]} ||c x1 + (1 - c) x2||^2`` from the inner products, as the official
    ``_min_norm_element_from2`` (min_norm_solvers.py lines 8-29), including its clamps to
    0.999 / 0.001 instead of 1 / 0."""
    if v1v2 >= v1v1:
        return 0.999
    if v1v2 >= v2v2:
        return 0.001
    return -(v1v2 - v2v2) / (v1v1 + v2v2 - 2.0 * v1v2)


def _projection_to_simplex(y: torch.Tensor) -> torch.Tensor:
    """Euclidean projection onto the simplex (official ``_projection2simplex``, lines 55-69)."""
    m = y.shape[0]
    sorted_y = y.sort(descending=True).values.tolist()
    tmax_f = (y.sum().item() - 1.0) / m
    tmpsum = 0.0
    for i in range(m - 1):
        tmpsum += sorted_y[i]
        tmax = (tmpsum - 1.0) / (i + 1.0)
        if tmax > sorted_y[i + 1]:
            tmax_f = tmax
            break
    return (y - tmax_f).clamp_min(0.0)


def _next_point(cur: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The official ``_next_point`` (lines 71-85): a step along the descent direction ``grad``
    centred to sum 0, as long as the first coordinate to reach 0 or 1 allows (1 if none, and
    not capped at 1 by the coordinates that reach 0), projected onto the simplex."""
    proj_grad = grad - grad.sum() / grad.shape[0]
    neg, pos = proj_grad < 0, proj_grad > 0
    tm1 = -cur[neg] / proj_grad[neg]
    tm2 = (1.0 - cur[pos]) / proj_grad[pos]
    t = 1.0
    if (tm1 > 1e-7).any():
        t = tm1[tm1 > 1e-7].min().item()
    if (tm2 > 1e-7).any():
        t = min(t, tm2[tm2 > 1e-7].min().item())
    return _projection_to_simplex(cur + t * proj_grad)


def simplex_weights_min_norm(
    G: torch.Tensor, init: torch.Tensor, max_iterations: int = MIN_NORM_MAX_ITERATIONS
) -> torch.Tensor:
    """Weights ``p`` ``[K]`` for ``min_{p in simplex} p^T G p`` (the min-norm element of the
    convex hull of vectors with Gram matrix ``G``) by the official
    ``MinNormSolver.find_min_norm_element`` (min_norm_solvers.py lines 87-133) from ``init``::

        repeat:  q = _next_point(p, -G p)                      # projected-gradient point
                 c = argmin_{c} ||c p + (1 - c) q||_G^2          # exact line search (_line_min)
                 if sum |c p + (1 - c) q - p| < 1e-5: return p   # the *previous* iterate
                 p = c p + (1 - c) q

    Differences from the official code: the loop stops after ``max_iterations`` (returning the
    last iterate; the official loop has no working cap), and there is no shortcut for K < 3
    (the official one returns ``init`` unchanged when K = 2 and sample weights are given).
    Accuracy: on interior optima it stops within ~5e-6 of the exact weights. On boundary optima
    it often stalls: the line-search clamp leaves ``0.001 p_k`` on a coordinate heading to 0,
    ``_next_point``'s step is then limited by that tiny coordinate, the change drops below 1e-5
    and it stops, usually after 2-20 steps. Measured from the uniform start against exact
    solutions: K = 3 random boundary problems, 78 % end more than 0.1 % above the optimal
    objective (worst 120 %, weights off by up to 0.46); K = 10 "normalized" directions, up to
    4 % (weights off by up to 0.09).
    """
    G = G.to(torch.float64)
    p = init.to(torch.float64)
    for _ in range(max_iterations):
        q = _next_point(p, -(G @ p))
        c = _line_min((p @ G @ p).item(), (p @ G @ q).item(), (q @ G @ q).item())
        new_p = c * p + (1.0 - c) * q
        if (new_p - p).abs().sum().item() < MIN_NORM_STOP:
            return p
        p = new_p
    return p


def sharpen(weights: torch.Tensor, temperature: float) -> torch.Tensor:
    """``w^(1/T) / sum w^(1/T)`` (official fedU2/functional.py ``sharpen``; the server applies it
    to the sample-size weights ``n_k / sum n`` with ``T = sharpen_ratio`` = 1 in main.py)."""
    sharp = weights.to(torch.float64) ** (1.0 / temperature)
    return sharp / sharp.sum()


def eua_direction(
    global_vec: Vector,
    client_vecs: Sequence[Vector],
    variant: EUAVariant,
    *,
    eta_g: float = 1.0,
    phi: float = 0.1,
    rho: float = 1.0,
    iterations: int = 100,
    init: torch.Tensor | None = None,
    step: EUAStep = "fixed",
) -> tuple[torch.Tensor, torch.Tensor]:
    """EUA's update direction ``[P]`` and client weights ``[K]`` (float64).

    * ``"paper"``: ``g_k`` of :func:`direction_gram` ``"log_distance"``, ``p`` =
      :func:`simplex_weights_active_set` (the exact minimiser), ``d* = (eta_g / phi) sum_k p_k g_k``;
    * ``"paper_closed_form"``: the same with ``p`` = :func:`simplex_weights_admm` (``eta_g``,
      ``phi``, ``rho``, ``iterations``: the printed iteration, not the minimiser in general);
    * ``"official"``: ``d_k`` of :func:`direction_gram` ``"normalized"``, ``p`` =
      :func:`simplex_weights_min_norm` from ``init`` (default uniform; official: the
      :func:`sharpen`-ed sample-size weights), renormalised over the non-degenerate clients,
      ``d = sum_k p_k d_k``.

    Every direction is ``d = sum_k a_k delta_k`` with ``a_k >= 0``. ``step="fixed"`` returns it
    as it is; ``step="convex"`` returns ``sum_k (a_k / sum_j a_j) delta_k``, the same direction
    scaled so that ``theta_g - d`` is the convex combination ``sum_k q_k theta_k``,
    ``q_k = a_k / sum_j a_j``, of the clients' models.

    The caller moves the global model by ``theta_g - lr * d``. Degenerate clients (zero distance)
    are left out with weight 0 (module docstring). Memory: the deltas of :data:`CHUNK`
    parameters at a time, and the direction.
    """
    kind: DirectionKind = "normalized" if variant == "official" else "log_distance"
    G, c = direction_gram(global_vec, client_vecs, kind)
    active = c > 0
    weights = torch.zeros(G.shape[0], dtype=torch.float64, device=G.device)
    if not active.any():  # the direction is zero: the global model stays
        return combine(global_vec, client_vecs, weights), weights
    Ga = G[active][:, active]
    if variant == "paper":
        weights[active] = simplex_weights_active_set(Ga)
        scale = eta_g / phi
    elif variant == "paper_closed_form":
        weights[active] = simplex_weights_admm(Ga, eta_g, phi, rho, iterations)
        scale = eta_g / phi
    else:
        start = torch.ones_like(weights) if init is None else init.to(weights)
        weights[active] = simplex_weights_min_norm(Ga, start[active] / start[active].sum())
        scale = 1.0
    a = scale * weights * c
    return combine(global_vec, client_vecs, a / a.sum() if step == "convex" else a), weights
