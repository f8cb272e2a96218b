"""Byzantine-robust aggregation rules over stacked client updates, in plain tensor code.

Every rule takes ``updates``, an ``[n, d]`` tensor (float32 or float64) with one client's
flattened update per row, and returns a :class:`Robust`: the aggregate ``[d]`` in the
updates' dtype and, where the rule selects or re-weights clients, which rows it kept and
the weight it gave each row. ``f`` is the number of Byzantine clients a rule tolerates;
:func:`check_f` rejects an ``n`` too small for it.

Sample counts: ``mean``, ``multi_krum``, ``norm_bound``, ``geometric_median`` and
``CenteredClipping`` take optional ``weights`` (normalised to sum 1, uniform when
omitted); median, trimmed mean, Krum, Bulyan and MDA ignore them, as Flower's FedMedian,
FedTrimmedAvg, Krum and Bulyan do.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class Robust:
    """What a rule returns.

    ``aggregate``: ``[d]``. ``kept``: bool ``[n]``, the rows a selecting rule (Krum,
    Multi-Krum, Bulyan, MDA, the finite rows of the geometric median) used, else ``None``.
    ``weights``: ``[n]``, the coefficient of each row in the aggregate (for centered
    clipping, in its last step), else ``None``.
    """

    aggregate: torch.Tensor
    kept: torch.Tensor | None = None
    weights: torch.Tensor | None = None


# rule: (a, b, text) for the requirement n > a f + b
_REQUIREMENTS = {
    "trimmed_mean": (2, 0, "n > 2f"),
    "krum": (2, 2, "n > 2f + 2"),
    "multi_krum": (2, 2, "n > 2f + 2"),
    "bulyan": (4, 2, "n >= 4f + 3"),
    "mda": (2, 0, "n > 2f"),
}


def check_f(rule: str, n: int, f: int) -> None:
    """Raise a one-line ``ValueError`` unless ``n`` clients suffice for ``rule`` to
    tolerate ``f`` Byzantine ones (trimmed mean and MDA n > 2f, Krum and Multi-Krum
    n > 2f + 2, Bulyan n >= 4f + 3)."""
    a, b, requirement = _REQUIREMENTS[rule]
    if f < 0:
        raise ValueError(f"aggregator={rule} needs aggregator.f >= 0, got f={f}")
    if n <= a * f + b:
        f_max = (n - b - 1) // a
        lower = f"set aggregator.f to at most {f_max} or " if f_max >= 0 else ""
        raise ValueError(f"aggregator={rule} with f={f} needs {requirement} clients, got n={n}: "
                         f"{lower}sample at least {a * f + b + 1} clients per round")


def _normalised(weights: torch.Tensor | None, updates: torch.Tensor) -> torch.Tensor:
    n = len(updates)
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=updates.dtype, device=updates.device)
    w = weights.to(updates)
    return w / w.sum()


def _mask(rows: torch.Tensor, n: int) -> torch.Tensor:
    kept = torch.zeros(n, dtype=torch.bool, device=rows.device)
    kept[rows] = True
    return kept


def mean(updates: torch.Tensor, weights: torch.Tensor | None = None) -> Robust:
    """FedAvg (McMahan et al., AISTATS 2017): ``sum_i w_i x_i`` with ``w = weights / sum``
    (``1/n`` without weights). Not robust: the reference the robust rules replace."""
    w = _normalised(weights, updates)
    return Robust(w @ updates, weights=w)


def _median(updates: torch.Tensor) -> torch.Tensor:
    n = len(updates)
    s = updates.sort(dim=0).values
    return (s[(n - 1) // 2] + s[n // 2]) / 2


def median(updates: torch.Tensor) -> Robust:
    """Coordinate-wise median (Yin et al., ICML 2018): ``[y]_k = median_i [x_i]_k``, the
    mean of the two middle values for even ``n`` (``numpy.median``; Flower's FedMedian,
    ByzFL's Median)."""
    return Robust(_median(updates))


def trimmed_mean(updates: torch.Tensor, f: int | None = None, beta: float | None = None) -> Robust:
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018):
    ``[y]_k = 1/(n - 2f) sum_{j=f+1}^{n-f} [x_(j)]_k`` over the sorted k-th coordinates,
    dropping the ``f`` smallest and ``f`` largest (ByzFL's TrMean(f)). Give either ``f`` or
    Flower's fraction ``beta`` in [0, 0.5), which means ``f = floor(beta n)`` (FedTrimmedAvg)."""
    n = len(updates)
    if (f is None) == (beta is None):
        raise ValueError("trimmed_mean takes exactly one of aggregator.f and aggregator.beta")
    if beta is not None:
        if not 0.0 <= beta < 0.5:
            raise ValueError(f"aggregator=trimmed_mean needs 0 <= aggregator.beta < 0.5, got beta={beta}")
        f = int(beta * n)
    check_f("trimmed_mean", n, f)
    return Robust(updates.sort(dim=0).values[f:n - f].mean(dim=0))


def _squared_distances(updates: torch.Tensor) -> torch.Tensor:
    """``||x_i - x_j||^2 = ||y_i||^2 + ||y_j||^2 - 2 y_i . y_j`` with ``y = x - mean(x)``:
    one matrix product (O(n^2 d) in BLAS), and centring first removes what the updates
    share, whose cancellation would swamp the distances of updates close to each other
    and far from 0. Symmetric, exact 0 on the diagonal, clamped at 0."""
    y = updates - updates.mean(dim=0)
    sq = (y * y).sum(dim=1)
    gram = y @ y.T
    gram = (gram + gram.T) / 2  # exactly symmetric: d(i, j) = d(j, i) ties as the difference form's do
    d = (sq[:, None] + sq[None, :] - 2 * gram).clamp_(min=0)
    return d.fill_diagonal_(0)


def _krum_scores(distances: torch.Tensor, neighbours: int) -> torch.Tensor:
    """``s(i) = sum of the `neighbours` smallest ||x_i - x_j||^2, j != i`` (``inf`` marks
    excluded pairs)."""
    d = distances.clone()
    d.fill_diagonal_(math.inf)
    return d.topk(neighbours, dim=1, largest=False).values.sum(dim=1)


def _krum_neighbours(n: int, f: int, variant: Literal["blanchard", "byzfl"]) -> int:
    if variant not in ("blanchard", "byzfl"):
        raise ValueError(f"Krum's variant must be 'blanchard' or 'byzfl', got {variant!r}")
    return n - f - 2 if variant == "blanchard" else n - f - 1


def krum(updates: torch.Tensor, f: int, variant: Literal["blanchard", "byzfl"] = "blanchard") -> Robust:
    """Krum (Blanchard et al., NeurIPS 2017): ``y = x_i*`` with
    ``i* = argmin_i s(i)``, ``s(i) = sum_{j in N_i} ||x_i - x_j||^2`` over ``N_i``, the
    ``n - f - 2`` nearest other updates (``variant="blanchard"``: the paper, Flower's Krum);
    ``variant="byzfl"`` takes the ``n - f - 1`` nearest (ByzFL's Krum). Needs n > 2f + 2."""
    n = len(updates)
    check_f("krum", n, f)
    best = _krum_scores(_squared_distances(updates), _krum_neighbours(n, f, variant)).argmin()
    return Robust(updates[best].clone(), kept=_mask(best, n))


def multi_krum(updates: torch.Tensor, f: int, m: int | None = None, weights: torch.Tensor | None = None,
               variant: Literal["blanchard", "byzfl"] = "blanchard") -> Robust:
    """Multi-Krum (Blanchard et al., NeurIPS 2017): the weighted mean of the ``m`` updates
    with the smallest Krum scores ``s(i)`` (see :func:`krum`), ``y = sum_{i in S} w_i x_i /
    sum_{i in S} w_i``. ``m`` defaults to ``n - f`` (ByzFL's MultiKrum, unweighted);
    Flower's MultiKrum is ``m=num_nodes_to_select`` weighted by sample counts."""
    n = len(updates)
    check_f("multi_krum", n, f)
    m = n - f if m is None else m
    if not 1 <= m <= n:
        raise ValueError(f"aggregator=multi_krum needs 1 <= aggregator.m <= n={n}, got m={m}")
    scores = _krum_scores(_squared_distances(updates), _krum_neighbours(n, f, variant))
    kept = _mask(scores.topk(m, largest=False).indices, n)
    w = _normalised(weights, updates) * kept
    w = w / w.sum()
    return Robust(w @ updates, kept=kept, weights=w)


def bulyan(updates: torch.Tensor, f: int, variant: Literal["recursive", "multi_krum"] = "recursive") -> Robust:
    """Bulyan (El Mhamdi et al., ICML 2018). Selection of ``theta = n - 2f`` updates, then
    for each coordinate the mean of the ``beta = theta - 2f`` selected values closest to
    their median: ``[y]_k = 1/beta sum_{i in B_k} [x_i]_k``, ``B_k = argmin_{|B|=beta}
    sum_{i in B} |[x_i]_k - median_{j in S} [x_j]_k|``. Needs n >= 4f + 3.

    ``variant="recursive"``: the paper's selection, Krum applied ``theta`` times, each time
    to the updates not yet selected (``max(1, r - f - 2)`` neighbours among the ``r`` left;
    Flower's ``aggregate_bulyan``). ``variant="multi_krum"``: the ``theta`` smallest Krum
    scores of one scoring of all ``n`` (Flower's ``serverapp`` Bulyan)."""
    n = len(updates)
    check_f("bulyan", n, f)
    theta, beta = n - 2 * f, n - 4 * f
    distances = _squared_distances(updates)
    if variant == "multi_krum":
        kept = _mask(_krum_scores(distances, n - f - 2).topk(theta, largest=False).indices, n)
    elif variant == "recursive":
        kept = torch.zeros(n, dtype=torch.bool, device=updates.device)
        for r in range(n, n - theta, -1):
            left = distances.masked_fill(kept[None, :], math.inf)
            scores = _krum_scores(left, min(r - 1, max(1, r - f - 2))).masked_fill(kept, math.inf)
            kept[scores.argmin()] = True
    else:
        raise ValueError(f"Bulyan's variant must be 'recursive' or 'multi_krum', got {variant!r}")
    selected = updates[kept]
    closest = (selected - _median(selected)).abs().topk(beta, dim=0, largest=False).indices
    return Robust(selected.gather(0, closest).mean(dim=0), kept=kept)


def geometric_median(updates: torch.Tensor, nu: float = 0.1, T: int = 3, weights: torch.Tensor | None = None,
                     init: torch.Tensor | None = None) -> Robust:
    """Geometric median ``argmin_z sum_i alpha_i ||z - x_i||`` by ``T`` steps of the smoothed
    Weiszfeld algorithm (Weiszfeld 1937; Pillutla et al., IEEE TSP 2022, RFA):
    ``z_{t+1} = sum_i b_i x_i / sum_i b_i``, ``b_i = alpha_i / max(nu, ||x_i - z_t||)``,
    from ``z_0 = init`` (0 by default), ``alpha = weights`` (uniform by default). Rows with
    a non-finite entry are left out. With the defaults, ByzFL's GeometricMedian(nu, T)."""
    finite = torch.isfinite(updates).all(dim=1)
    x, alpha = updates[finite], _normalised(weights, updates)[finite]
    z = torch.zeros_like(updates[0]) if init is None else init.to(updates)
    b = alpha
    for _ in range(T):
        b = alpha / (x - z).norm(dim=1).clamp(min=nu)
        z = b @ x / b.sum()
    w = torch.zeros_like(finite, dtype=updates.dtype)
    w[finite] = b / b.sum()
    return Robust(z, kept=finite, weights=w)


class CenteredClipping:
    """Centered clipping (Karimireddy et al., ICML 2021), ``L`` steps from the previous
    aggregate ``v_0`` (0 on the first call; ``v`` carries it between calls):
    ``v_{l+1} = v_l + sum_i w_i (x_i - v_l) min(1, tau / ||x_i - v_l||)``, ``w = 1/n`` or
    the normalised weights. With uniform weights, ByzFL's CenteredClipping(L=L, tau=tau)."""

    def __init__(self, tau: float = 100.0, L: int = 1, v: torch.Tensor | None = None) -> None:
        if tau < 0 or L < 0:
            raise ValueError(f"aggregator=centered_clipping needs tau >= 0 and L >= 0, got tau={tau}, L={L}")
        self.tau, self.L, self.v = tau, L, v

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor | None = None) -> Robust:
        v = torch.zeros_like(updates[0]) if self.v is None else self.v.to(updates)
        w = c = _normalised(weights, updates)
        for _ in range(self.L):
            differences = updates - v
            c = w * _clip_factors(differences, self.tau)
            v = v + c @ differences
        self.v = v
        return Robust(v, weights=c)


def _clip_factors(x: torch.Tensor, tau: float) -> torch.Tensor:
    """``min(1, tau / ||x_i||)`` per row (1 for a zero row)."""
    norms = x.norm(dim=1)
    return torch.where(norms > tau, tau / norms, torch.ones_like(norms))


def norm_bound(updates: torch.Tensor, tau: float, weights: torch.Tensor | None = None) -> Robust:
    """Norm bounding (Sun et al., "Can you really backdoor federated learning?", 2019):
    each update clipped to norm ``tau``, then averaged,
    ``y = sum_i w_i x_i min(1, tau / ||x_i||)`` (ByzFL's Clipping(c=tau) then Average)."""
    if tau < 0:
        raise ValueError(f"aggregator=norm_bound needs tau >= 0, got tau={tau}")
    w = _normalised(weights, updates) * _clip_factors(updates, tau)
    return Robust(w @ updates, weights=w)


def mda(updates: torch.Tensor, f: int) -> Robust:
    """Minimum-diameter averaging (El Mhamdi et al., PODC 2020): the mean of the subset
    ``S*`` of ``n - f`` updates with the smallest diameter ``max_{i,j in S} ||x_i - x_j||``
    (the first in lexicographic order on ties, as ByzFL's MDA). Enumerates all
    ``C(n, f)`` subsets: for small ``n``. Needs n > 2f."""
    n = len(updates)
    check_f("mda", n, f)
    subsets = torch.tensor(list(itertools.combinations(range(n), n - f)), device=updates.device)
    distances = torch.cdist(updates, updates, compute_mode="donot_use_mm_for_euclid_dist")
    diameters = distances[subsets[:, :, None], subsets[:, None, :]].flatten(1).amax(dim=1)
    kept = _mask(subsets[diameters.argmin()], n)
    return Robust(updates[kept].mean(dim=0), kept=kept)
