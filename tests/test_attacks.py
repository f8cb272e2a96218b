"""The update-crafting attacks: against ByzFL's attacks on the same float64 inputs where
ByzFL has them, against hand-computed values where it does not, and their effect on the
robust aggregators on small fixed cases, as their papers report."""

import math

import numpy as np
import pytest
import torch

from contrafl.algorithms import attacks, robust
from contrafl.engine.attacking import SPREAD_ATTACKS
from conftest import BYZFL_MISSING, load_byzfl

TOL = {"rtol": 1e-12, "atol": 1e-12}
TAU = 1e-5


byzfl = load_byzfl("attacks")
needs_byzfl = pytest.mark.skipif(byzfl is None, reason=BYZFL_MISSING)


def honest(n: int, seed: int, d: int = 6, centre: float = 2.0) -> torch.Tensor:
    """``n`` float64 honest updates: unit noise around a common point of scale ``centre``."""
    g = torch.Generator().manual_seed(seed)
    centres = centre * torch.randn(d, generator=g, dtype=torch.float64)
    return centres + torch.randn(n, d, generator=g, dtype=torch.float64)


def with_attackers(x: torch.Tensor, x_m: torch.Tensor, f: int) -> torch.Tensor:
    """The round's ``n + f`` updates: the honest ones, then ``f`` copies of ``x_m``."""
    return torch.cat([x, x_m.expand(f, -1)])


def gamma_of(x_m: torch.Tensor, x: torch.Tensor, p: torch.Tensor) -> float:
    """``gamma`` in ``x_m = mu + gamma p``."""
    return float((x_m - x.mean(dim=0)) @ p / (p @ p))


SEEDS = [0, 1, 2]


# ByzFL's attacks on the same inputs


@pytest.mark.parametrize("seed", SEEDS)
@needs_byzfl
def test_sign_flipping_is_byzfl(seed):
    x = honest(7, seed)
    torch.testing.assert_close(attacks.sign_flipping(x), torch.from_numpy(byzfl.SignFlipping()(x.numpy())), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("epsilon", [0.1, 2.0, 100.0])
@needs_byzfl
def test_inner_product_manipulation_is_byzfl(seed, epsilon):
    x = honest(7, seed)
    expected = byzfl.InnerProductManipulation(tau=epsilon)(x.numpy())
    torch.testing.assert_close(attacks.inner_product_manipulation(x, epsilon), torch.from_numpy(expected), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n,f", [(8, 2), (20, 5), (50, 12)])
@needs_byzfl
def test_alie_is_byzfl_with_tau_minus_z_max(seed, n, f):
    x = honest(n, seed)
    expected = byzfl.ALittleIsEnough(tau=-attacks.alie_z_max(n + f, f))(x.numpy())
    torch.testing.assert_close(attacks.alie(x, f), torch.from_numpy(expected), **TOL)
    expected = byzfl.ALittleIsEnough(tau=1.5)(x.numpy())
    torch.testing.assert_close(attacks.alie(x, f, z=-1.5), torch.from_numpy(expected), **TOL)


@pytest.mark.parametrize("mu,sigma", [(0.0, 1.0), (-2.0, 200.0)])
@needs_byzfl
def test_gaussian_is_byzfl_with_the_same_seed(mu, sigma):
    x = honest(5, 0, d=40).float()
    with torch.random.fork_rng():
        torch.manual_seed(3)
        expected = byzfl.Gaussian(mu=mu, sigma=sigma)(x)
    got = attacks.gaussian(x, mu, sigma, torch.Generator().manual_seed(3))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# hand-computed values


def test_alie_z_max_is_the_normal_quantile_of_baruch_et_al():
    """n = 50, f = 12 (Baruch et al.'s 24 %): s = floor(26) - 12 = 14, Phi(z_max) = 36/50."""
    def quantile(p: float) -> float:
        return torch.special.ndtri(torch.tensor(p, dtype=torch.float64)).item()

    assert attacks.alie_z_max(50, 12) == pytest.approx(quantile(0.72), abs=1e-12)
    for n, f in [(8, 2), (25, 5), (51, 1)]:
        s = math.floor(n / 2 + 1) - f
        assert attacks.alie_z_max(n, f) == pytest.approx(quantile((n - s) / n), abs=1e-12)
    with pytest.raises(ValueError, match="floor"):
        attacks.alie_z_max(10, 6)


def test_alie_stays_within_the_honest_range():
    x = honest(8, 0)
    x_m = attacks.alie(x, 2)
    assert ((x.amin(dim=0) <= x_m) & (x_m <= x.amax(dim=0))).all()


def test_gaussian_draws_reproducibly_in_the_honest_dtype():
    x = honest(4, 0, d=5000)
    a = attacks.gaussian(x, 1.0, 3.0, torch.Generator().manual_seed(7))
    assert a.shape == (5000,) and a.dtype == torch.float64
    torch.testing.assert_close(a, attacks.gaussian(x, 1.0, 3.0, torch.Generator().manual_seed(7)), rtol=0, atol=0)
    assert abs(a.mean().item() - 1.0) < 0.2 and abs(a.std().item() - 3.0) < 0.2
    with pytest.raises(ValueError, match="sigma"):
        attacks.gaussian(x, sigma=-1.0)


@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_model_replacement_makes_fedavg_return_the_attackers_model(eta):
    """Bagdasaryan et al.: with gamma = n / eta, ``G + eta (mean_i L_i - G) = X`` once the
    other n - 1 updates cancel; in general it is ``X + eta/n sum_{i != m} (L_i - G)``."""
    n, g = 6, torch.Generator().manual_seed(0)
    G, X = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    delta = torch.randn(n - 1, 8, generator=g, dtype=torch.float64)
    for others in (delta - delta.mean(dim=0), delta):
        L = torch.cat([G + others, attacks.model_replacement(X, G, n / eta)[None]])
        G_next = G + eta * (robust.mean(L).aggregate - G)
        torch.testing.assert_close(G_next, X + eta / n * others.sum(dim=0), **TOL)
    zero = torch.zeros(8, dtype=torch.float64)
    torch.testing.assert_close(attacks.model_replacement(X - G, zero, n), n * (X - G), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("perturbation", ["unit_vec", "std", "sign"])
def test_min_max_gamma_is_the_largest_within_the_max_distance(seed, perturbation):
    """The largest feasible gamma in closed form: the smallest positive root over i of
    ``||mu - x_i + gamma p||^2 = max_{j,k} ||x_j - x_k||^2``; the search ends within 2 tau
    below it, and the bound holds at its gamma and fails at gamma + 2 tau."""
    x = honest(8, seed)
    p = attacks._perturbation(x, perturbation)
    x_m = attacks.min_max(x, perturbation, tau=TAU)
    bound = robust._squared_distances(x).max()
    r = x.mean(dim=0) - x
    a, b, c = p @ p, r @ p, (r * r).sum(dim=1) - bound
    gamma_max = ((-b + (b * b - a * c).sqrt()) / a).min().item()
    gamma = gamma_of(x_m, x, p)
    assert gamma_max - 2 * TAU <= gamma <= gamma_max
    torch.testing.assert_close(x_m, x.mean(dim=0) + gamma * p, **TOL)
    assert ((x - x_m) ** 2).sum(dim=1).max() <= bound
    assert ((x - (x_m + 2 * TAU * p)) ** 2).sum(dim=1).max() > bound


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("perturbation", ["unit_vec", "std", "sign"])
def test_min_sum_gamma_is_the_largest_within_the_max_sum(seed, perturbation):
    """``sum_i ||mu + gamma p - x_i||^2 = sum_i ||mu - x_i||^2 + n gamma^2 ||p||^2`` (the
    cross term sums to 0), so the largest feasible gamma is
    ``sqrt((max_i sum_j ||x_i - x_j||^2 - sum_i ||mu - x_i||^2) / (n ||p||^2))``."""
    x = honest(8, seed)
    p = attacks._perturbation(x, perturbation)
    x_m = attacks.min_sum(x, perturbation, tau=TAU)
    bound = robust._squared_distances(x).sum(dim=1).max()
    gamma_max = math.sqrt((bound - ((x - x.mean(dim=0)) ** 2).sum()) / (len(x) * (p @ p)))
    gamma = gamma_of(x_m, x, p)
    assert gamma_max - 2 * TAU <= gamma <= gamma_max
    assert ((x - x_m) ** 2).sum() <= bound
    assert ((x - (x_m + 2 * TAU * p)) ** 2).sum() > bound


def test_perturbations_are_the_inverse_unit_vector_std_and_sign():
    x = honest(8, 0)
    mu = x.mean(dim=0)
    torch.testing.assert_close(attacks._perturbation(x, "unit_vec"), -mu / mu.norm(), **TOL)
    std = torch.from_numpy(np.std(x.numpy(), axis=0, ddof=1))
    torch.testing.assert_close(attacks._perturbation(x, "std"), -std, **TOL)
    torch.testing.assert_close(attacks._perturbation(x, "sign"), -mu.sign(), **TOL)
    with pytest.raises(ValueError, match="perturbation"):
        attacks.min_max(x, "inverse")


def test_min_max_and_min_sum_send_the_mean_when_no_gamma_fits():
    """Identical honest updates bound every distance by 0: the search keeps gamma = 0."""
    x = honest(1, 0).expand(5, -1)
    torch.testing.assert_close(attacks.min_max(x), x[0], rtol=0, atol=0)
    torch.testing.assert_close(attacks.min_sum(x, "sign"), x[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", SPREAD_ATTACKS)
def test_an_attack_that_hides_in_the_spread_sends_a_lone_update_as_it_is(name):
    """ALIE, min-max and min-sum need the spread of several updates: from one honest
    update they send that update (an attack with no spread to hide in), from two they
    depart from it."""
    from contrafl.config import Component
    from contrafl.engine.attacking import Attack

    attack = Attack(Component(name, {"clients": [0]}), num_clients=4, seed=0, server_lr=1.0)
    one = torch.randn(1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(attack.vector(one, f=1, n=2), one[0])
    two = torch.cat([one, one + 1])
    assert not torch.equal(attack.vector(two, f=1, n=3), two.mean(dim=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attacks_keep_the_dtype(dtype):
    x = honest(8, 0).to(dtype)
    for x_m in (attacks.sign_flipping(x), attacks.inner_product_manipulation(x, 0.5), attacks.alie(x, 2),
                attacks.gaussian(x), attacks.min_max(x), attacks.min_sum(x, "std")):
        assert x_m.shape == (6,) and x_m.dtype == dtype


# effects on the aggregators


@pytest.mark.parametrize("epsilon", [0.5, 3.0, 5.0])
def test_sign_flipping_and_ipm_against_the_mean(epsilon):
    """Mean of n honest and f copies of ``-epsilon mu``: ``(n - f epsilon) / (n + f) mu``,
    against the honest mean once ``epsilon > n / f`` (Xie et al.); sign flipping is
    ``epsilon = 1``."""
    n, f = 8, 2
    x = honest(n, 0)
    mu = x.mean(dim=0)
    for e, x_m in ((epsilon, attacks.inner_product_manipulation(x, epsilon)), (1.0, attacks.sign_flipping(x))):
        aggregate = robust.mean(with_attackers(x, x_m, f)).aggregate
        torch.testing.assert_close(aggregate, (n - f * e) / (n + f) * mu, **TOL)
        assert (aggregate @ mu < 0) == (e > n / f)


@pytest.mark.parametrize("seed", SEEDS)
def test_krum_adopts_alie_but_rejects_sign_flipping(seed):
    """Baruch et al.: ALIE's copies, within the honest spread, are what Krum selects, so
    it moves the aggregate by ``-z_max sigma``; sign flipping's, far from the honest
    updates, are never selected by Krum or kept by Multi-Krum."""
    n, f = 8, 2
    x = honest(n, seed)
    x_alie = attacks.alie(x, f)
    alie_round = with_attackers(x, x_alie, f)
    assert robust.krum(alie_round, f).kept[n:].any()
    torch.testing.assert_close(robust.krum(alie_round, f).aggregate, x_alie, rtol=0, atol=0)
    assert robust.multi_krum(alie_round, f).kept[n:].all()
    sign_round = with_attackers(x, attacks.sign_flipping(x), f)
    assert not robust.krum(sign_round, f).kept[n:].any()
    assert not robust.multi_krum(sign_round, f).kept[n:].any()


@pytest.mark.parametrize("seed", SEEDS)
def test_krum_adopts_small_ipm_against_the_honest_mean(seed):
    """Xie et al.: with a small epsilon and honest updates whose mean is small against
    their spread (stochastic gradients), Krum selects ``-epsilon mu``, whose inner product
    with the honest mean is negative."""
    n, f = 8, 2
    x = honest(n, seed, centre=0.3)
    x_m = attacks.inner_product_manipulation(x, 0.1)
    aggregate = robust.krum(with_attackers(x, x_m, f), f).aggregate
    torch.testing.assert_close(aggregate, x_m, rtol=0, atol=0)
    assert aggregate @ x.mean(dim=0) < 0


@pytest.mark.parametrize("seed", SEEDS)
def test_multi_krum_keeps_min_sum_but_drops_sign_flipping(seed):
    """Shejwalkar and Houmansadr: min-sum's copies, no farther in sum of squared
    distances than the farthest honest update, are kept by Multi-Krum, which drops
    sign flipping's."""
    n, f = 8, 2
    x = honest(n, seed)
    assert robust.multi_krum(with_attackers(x, attacks.min_sum(x), f), f).kept[n:].all()
    assert not robust.multi_krum(with_attackers(x, attacks.sign_flipping(x), f), f).kept[n:].any()
