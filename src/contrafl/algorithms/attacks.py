"""Byzantine attacks that craft a malicious update, in plain tensor code.

Every attack but model replacement takes ``honest``, the round's honest updates as an
``[n, d]`` tensor (float32 or float64, one flattened update per row): the omniscient
attacker of the papers, which sees them all (Gaussian noise reads only ``d``). Each returns
one malicious update ``[d]`` in their dtype, which every Byzantine client sends (ByzFL's
``ByzantineClient`` likewise repeats one vector ``f`` times). ``f`` is the number of
Byzantine clients, so a round aggregates ``n + f`` updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Literal

import torch

from contrafl.algorithms.robust import _squared_distances


def sign_flipping(honest: torch.Tensor) -> torch.Tensor:
    """Sign flipping (Allen-Zhu et al., ICLR 2021): the opposite of the honest mean,
    ``x_m = -1/n sum_i x_i`` (ByzFL's SignFlipping). The non-omniscient variant, the
    opposite of the attacker's own update ``-x_a``, is ``sign_flipping(x_a[None])``."""
    return -honest.mean(dim=0)


def gaussian(honest: torch.Tensor, mu: float = 0.0, sigma: float = 1.0,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Gaussian noise (Blanchard et al., NeurIPS 2017): ``[x_m]_k ~ N(mu, sigma^2)``
    independently for ``k = 1..d``, drawn as ``sigma * randn(d) + mu`` from ``generator``
    (torch's global one when ``None``); only ``d`` is read from ``honest``. With the same
    seed, ByzFL's Gaussian(mu, sigma) on float32 tensors. Each call draws a fresh vector:
    call once per attacker for independent noise, once per round for ByzFL's shared one."""
    if sigma < 0:
        raise ValueError(f"attack=gaussian needs sigma >= 0, got sigma={sigma}")
    noise = torch.randn(honest.shape[1], generator=generator, dtype=honest.dtype, device=honest.device)
    return noise * sigma + mu


def model_replacement(x_attacker: torch.Tensor, global_model: torch.Tensor, gamma: float) -> torch.Tensor:
    """Scaling / model replacement (Bagdasaryan et al., AISTATS 2020): the attacker
    submits ``L = gamma (X - G) + G`` for its target model ``X`` and the global model ``G``.
    With ``gamma = n / eta`` for the server step ``G' = G + eta/n sum_i (L_i - G)`` over ``n``
    clients, ``G' = X`` once the other updates cancel, ``sum_{i != m} (L_i - G) = 0``.
    For updates sent as differences from ``G``, pass ``global_model = 0``: ``gamma (X - G)``."""
    return gamma * (x_attacker - global_model) + global_model


def inner_product_manipulation(honest: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Inner-product manipulation (Xie et al., UAI 2019): ``x_m = -epsilon / n sum_i x_i``,
    which turns the inner product of the aggregate and the honest mean negative (for the
    mean, once ``epsilon > n / f``). ByzFL's InnerProductManipulation(tau=epsilon)."""
    return -epsilon * honest.mean(dim=0)


def alie_z_max(n: int, f: int) -> float:
    """A Little Is Enough's ``z_max = Phi^{-1}((n - s) / n)`` (Baruch et al., NeurIPS 2019),
    ``Phi`` the standard normal CDF, ``s = floor(n/2 + 1) - f`` the honest supporters the
    ``f`` attackers need among ``n`` clients in all. Needs ``0 < s < n``."""
    s = math.floor(n / 2 + 1) - f
    if not 0 < s < n:
        raise ValueError(f"attack=alie with f={f} of n={n} clients needs 0 < s = floor(n/2 + 1) - f < n, got s={s}")
    return NormalDist().inv_cdf((n - s) / n)


def alie(honest: torch.Tensor, f: int, z: float | None = None) -> torch.Tensor:
    """A Little Is Enough (Baruch et al., NeurIPS 2019): ``x_m = mu - z sigma`` with ``mu``,
    ``sigma`` the coordinate-wise mean and sample standard deviation (``1/(n-1)``, as
    ByzFL) of the honest updates, and ``z`` by default :func:`alie_z_max` of the
    ``len(honest) + f`` clients. ByzFL's ALittleIsEnough(tau=-z)."""
    if z is None:
        z = alie_z_max(len(honest) + f, f)
    return honest.mean(dim=0) - z * honest.std(dim=0)


Perturbation = Literal["unit_vec", "std", "sign"]


def _perturbation(honest: torch.Tensor, perturbation: Perturbation) -> torch.Tensor:
    """Shejwalkar and Houmansadr's ``grad^p``: the inverse unit vector ``-mu / ||mu||``, the
    inverse standard deviation ``-sigma`` (sample, as their code) or the inverse sign
    ``-sign(mu)`` of the honest mean ``mu``."""
    mu = honest.mean(dim=0)
    if perturbation == "unit_vec":
        return -mu / mu.norm()
    if perturbation == "std":
        return -honest.std(dim=0)
    if perturbation == "sign":
        return -mu.sign()
    raise ValueError(f"the perturbation must be 'unit_vec', 'std' or 'sign', got {perturbation!r}")


def _largest_gamma(feasible: Callable[[float], bool], gamma_init: float, tau: float) -> float:
    """Algorithm 1's halving search (Shejwalkar and Houmansadr, NDSS 2021), as the authors'
    code runs it: from ``gamma = gamma_init``, ``step = gamma_init``, ``gamma_succ = 0``,
    while ``|gamma_succ - gamma| > tau``: on success ``gamma_succ = gamma`` and
    ``gamma += step/2``, else ``gamma -= step/2``; then ``step /= 2``. Returns
    ``gamma_succ`` in ``[0, 2 gamma_init)``."""
    gamma, step, gamma_succ = gamma_init, gamma_init, 0.0
    while abs(gamma_succ - gamma) > tau:
        if feasible(gamma):
            gamma_succ = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return gamma_succ


def _optimised(honest: torch.Tensor, perturbation: Perturbation, gamma_init: float, tau: float,
               feasible: Callable[[torch.Tensor], bool]) -> torch.Tensor:
    mu, p = honest.mean(dim=0), _perturbation(honest, perturbation)
    return mu + _largest_gamma(lambda gamma: feasible(mu + gamma * p), gamma_init, tau) * p


def min_max(honest: torch.Tensor, perturbation: Perturbation = "unit_vec", gamma_init: float = 10.0,
            tau: float = 1e-5) -> torch.Tensor:
    """Min-Max (Shejwalkar and Houmansadr, NDSS 2021): ``x_m = mu + gamma grad^p``,
    ``mu`` the honest mean, ``grad^p`` the perturbation (see :func:`_perturbation`), with
    the largest ``gamma`` Algorithm 1 finds (to within ``tau``) such that
    ``max_i ||x_m - x_i||^2 <= max_{i,j} ||x_i - x_j||^2``."""
    bound = _squared_distances(honest).max()
    return _optimised(honest, perturbation, gamma_init, tau,
                      lambda x_m: bool(((honest - x_m) ** 2).sum(dim=1).max() <= bound))


def min_sum(honest: torch.Tensor, perturbation: Perturbation = "unit_vec", gamma_init: float = 10.0,
            tau: float = 1e-5) -> torch.Tensor:
    """Min-Sum (Shejwalkar and Houmansadr, NDSS 2021): as :func:`min_max`, with the
    largest ``gamma`` such that ``sum_i ||x_m - x_i||^2 <= max_i sum_j ||x_i - x_j||^2``
    (the paper's bound; the authors' released code bounds by the minimum over ``i``)."""
    bound = _squared_distances(honest).sum(dim=1).max()
    return _optimised(honest, perturbation, gamma_init, tau,
                      lambda x_m: bool(((honest - x_m) ** 2).sum() <= bound))
