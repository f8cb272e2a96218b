"""FedU2's math: the UOT uniformity regularizer (optimality of both plan solvers, POT, vmap,
collapse), the official tangent sliced-Wasserstein variant (hand-checked values), and EUA's
aggregation weights (simplex, symmetry, active set vs. ADMM vs. min-norm vs. exact solutions).
Convergence at the paper's sizes and exactness on boundary optima: test_fedu2_solvers.py."""

import itertools
import math

import numpy as np
import ot
import pytest
import torch
from torch.func import grad, vmap
from torch.nn import functional as F

from contrafl.algorithms.eua import (
    _line_min,
    combine,
    direction_gram,
    eua_direction,
    sharpen,
    simplex_weights_active_set,
    simplex_weights_admm,
    simplex_weights_min_norm,
)
from contrafl.algorithms.uniformity import (
    sphere_samples,
    tangent_sliced_wasserstein,
    uot_objective,
    uot_plan,
    uot_plan_steepest_descent,
    uot_uniformity,
)

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def small_uot_problem(seed: int, n: int = 5, m: int = 7):
    """A random cost in [0, 1) with random marginals (masses 0.2-1.2 per point, so that
    some entries of the optimal plan carry mass and others do not) and random penalties."""
    g = torch.Generator().manual_seed(seed)
    cost = torch.rand(n, m, generator=g, dtype=F64)
    a = torch.rand(n, generator=g, dtype=F64) + 0.2
    b = torch.rand(m, generator=g, dtype=F64) + 0.2
    tau_a, tau_b = 0.5 + 2.0 * torch.rand((), generator=g, dtype=F64).item(), 0.8
    return cost, a, b, tau_a, tau_b


def uot_gradient(cost, pi, a, b, tau_a, tau_b):
    """Gradient of the UOT objective (eq 4) w.r.t. the plan."""
    return cost + tau_a * (pi.sum(-1) - a)[..., :, None] + tau_b * (pi.sum(-2) - b)[..., None, :]


# ---------------------------------------------------------------------------------------------
# UOT (paper FUR)


SOLVERS = {  # solver at the iterations the tests use, and its KKT tolerance on small problems
    "interior_point": (uot_plan, 25, 1e-12),  # the defaults; measured <= 5e-16
    # measured <= 2e-10 after 400 steps; with the paper's full-gradient step size instead of
    # the projected one: up to 1e-4
    "steepest_descent": (uot_plan_steepest_descent, 400, 1e-8),
}


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@pytest.mark.parametrize("seed", range(6))
def test_uot_plan_satisfies_kkt(seed, solver):
    """KKT of min_{pi >= 0}: pi >= 0, gradient >= 0 where pi = 0 and = 0 where pi > 0."""
    plan, iterations, tol = SOLVERS[solver]
    cost, a, b, tau_a, tau_b = small_uot_problem(seed)
    pi = plan(cost, a, b, tau_a, tau_b, iterations)
    G = uot_gradient(cost, pi, a, b, tau_a, tau_b)
    assert (pi >= 0).all()
    assert (pi > 0).any() and (pi == 0).any()  # a problem with both active and inactive entries
    assert G[pi == 0].min() >= -tol
    assert G[pi > 0].abs().max() <= tol


def test_first_step_is_eq6_with_the_kronecker_form_of_eq5():
    """From pi = a b^T (all entries positive, so the projected gradient is the full one) one
    step is vec(pi) <- max(0, vec(pi) - eta* (Q vec(pi) + w)), eta* = g^T g / g^T Q g, with
    Q = tau_a Phi_r^T Phi_r + tau_b Phi_c^T Phi_c, w = vec(C) - tau_a Phi_r^T a - tau_b Phi_c^T b,
    Phi_r = I_n (x) 1_m^T (row sums of the row-major vec), Phi_c = 1_n^T (x) I_m (column sums)."""
    cost, a, b, tau_a, tau_b = small_uot_problem(7, n=4, m=3)
    phi_r = torch.kron(torch.eye(4, dtype=F64), torch.ones(1, 3, dtype=F64))
    phi_c = torch.kron(torch.ones(1, 4, dtype=F64), torch.eye(3, dtype=F64))
    Q = tau_a * phi_r.T @ phi_r + tau_b * phi_c.T @ phi_c
    w = cost.reshape(-1) - tau_a * phi_r.T @ a - tau_b * phi_c.T @ b
    vec = torch.outer(a, b).reshape(-1)
    g = Q @ vec + w
    expected = (vec - (g @ g) / (g @ Q @ g) * g).clamp_min(0).reshape(4, 3)
    torch.testing.assert_close(uot_plan_steepest_descent(cost, a, b, tau_a, tau_b, 1), expected, rtol=1e-12, atol=1e-14)
    # eq 5 is eq 4 up to the constant Omega = (tau_a a^T a + tau_b b^T b)/2
    pi = torch.rand(4, 3, dtype=F64)
    quadratic = 0.5 * pi.reshape(-1) @ Q @ pi.reshape(-1) + w @ pi.reshape(-1) + 0.5 * (tau_a * a @ a + tau_b * b @ b)
    assert uot_objective(cost, pi, a, b, tau_a, tau_b).item() == pytest.approx(quadratic.item(), rel=1e-12)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # scipy's L-BFGS-B 'disp', passed by POT
@pytest.mark.parametrize("solver", sorted(SOLVERS))
@pytest.mark.parametrize("seed", range(6))
def test_uot_plan_matches_pot(seed, solver):
    """POT solves the same problem: its div='l2' is the *half* squared l2 divergence, so
    reg_m = (tau_a, tau_b) gives exactly tau/2 ||.||^2 (eq 4). mm_unbalanced (reg=0) agrees to
    1e-9 (measured ~1e-12 for both solvers; steepest descent after 2000 steps),
    lbfgsb_unbalanced (regm_div='l2') to 1e-6 (measured ~1e-7)."""
    plan, iterations, _ = SOLVERS[solver]
    cost, a, b, tau_a, tau_b = small_uot_problem(seed)
    pi = plan(cost, a, b, tau_a, tau_b, max(iterations, 2000) if solver == "steepest_descent" else iterations).numpy()
    args = (a.numpy(), b.numpy(), cost.numpy())
    mm = ot.unbalanced.mm_unbalanced(*args, reg_m=(tau_a, tau_b), div="l2", numItermax=100_000, stopThr=1e-15)
    lbfgs = ot.unbalanced.lbfgsb_unbalanced(*args, reg=0, reg_m=(tau_a, tau_b), regm_div="l2",
                                            numItermax=100_000, stopThr=1e-15)
    assert np.abs(pi - mm).max() <= 1e-9
    assert np.abs(pi - lbfgs).max() <= 1e-6
    ours = uot_objective(cost, torch.from_numpy(pi), a, b, tau_a, tau_b).item()
    theirs = uot_objective(cost, torch.from_numpy(mm), a, b, tau_a, tau_b).item()
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_uot_plan_batched_vmap_and_loop_agree(solver):
    """Steepest descent agrees to rounding; the interior-point method too here, where its
    final Newton steps land every problem on its optimum (where they do not, a batch and a
    loop agree only to the solver's accuracy: rounding differs and its late iterations
    amplify it)."""
    plan, iterations, _ = SOLVERS[solver]
    problems = [small_uot_problem(seed) for seed in range(4)]
    cost = torch.stack([p[0] for p in problems])
    a = torch.stack([p[1] for p in problems])
    b = torch.stack([p[2] for p in problems])
    tau_a, tau_b = problems[0][3], problems[0][4]
    loop = torch.stack([plan(cost[k], a[k], b[k], tau_a, tau_b, iterations) for k in range(4)])
    batched = plan(cost, a, b, tau_a, tau_b, iterations)
    vmapped = vmap(lambda c, a_, b_: plan(c, a_, b_, tau_a, tau_b, iterations))(cost, a, b)
    torch.testing.assert_close(batched, loop, rtol=0, atol=1e-14)
    torch.testing.assert_close(vmapped, loop, rtol=0, atol=1e-14)


@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_uot_uniformity_value_and_gradient_under_vmap_equal_the_loop(solver):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 16, 8, generator=g, dtype=F64)
    s = sphere_samples(z, g)

    def loss(z_, s_):
        return uot_uniformity(z_, s_, point_mass=2.0, solver=solver)

    values = vmap(loss)(z, s)
    grads = vmap(grad(loss))(z, s)
    for k in range(3):
        zk = z[k].clone().requires_grad_()
        value = loss(zk, s[k])
        (gk,) = torch.autograd.grad(value, zk)
        torch.testing.assert_close(values[k], value.detach(), rtol=0, atol=1e-13)
        torch.testing.assert_close(grads[k], gk, rtol=0, atol=1e-13)
    assert grads.abs().max() > 1e-3


@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_uot_uniformity_is_the_objective_at_the_plan_and_differentiates_through_the_cost_only(solver):
    plan, iterations, _ = SOLVERS[solver]
    g = torch.Generator().manual_seed(1)
    z = torch.randn(12, 6, generator=g, dtype=F64, requires_grad=True)
    s = sphere_samples(z.detach(), g)
    value = uot_uniformity(z, s, tau_a=0.8, tau_b=0.8, iterations=iterations, point_mass=1.5, solver=solver)
    (gz,) = torch.autograd.grad(value, z)

    zn = F.normalize(z, dim=-1)
    cost = ((zn[:, None, :] - s[None, :, :]) ** 2).sum(-1)
    mass = torch.full((12,), 1.5, dtype=F64)
    pi = plan(cost, mass, mass, 0.8, 0.8, iterations)
    assert (pi > 0).any()
    assert value.item() == pytest.approx(uot_objective(cost, pi, mass, mass, 0.8, 0.8).item(), rel=1e-12)
    (expected,) = torch.autograd.grad((cost * pi).sum(), z)  # envelope: pi held fixed
    torch.testing.assert_close(gz, expected, rtol=1e-10, atol=1e-12)


def test_paper_marginals_give_the_zero_plan_on_realistic_batches():
    """With a = b = 1/B and tau = 0.8 the plan is zero iff every C_ij >= (tau_a + tau_b)/B
    (KKT at pi = 0): true for unit vectors in d = 512, so l_u is the constant
    (tau_a ||a||^2 + tau_b ||b||^2)/2 with zero gradient, collapsed or not."""
    g = torch.Generator().manual_seed(2)
    for z in (torch.randn(128, 512, generator=g), torch.randn(1, 512, generator=g).repeat(128, 1)):
        z.requires_grad_()
        value = uot_uniformity(z, sphere_samples(z.detach(), g))
        (gz,) = torch.autograd.grad(value, z)
        assert value.item() == pytest.approx(0.8 / 128, rel=1e-6)
        assert gz.abs().max() == 0


def wang_isola(z: torch.Tensor) -> float:
    """log mean_{i != j} exp(-2 ||z_i - z_j||^2) of the normalised rows (lower = more uniform)."""
    z = F.normalize(z, dim=-1)
    sq = torch.cdist(z, z).square()
    off = ~torch.eye(len(z), dtype=torch.bool)
    return (torch.logsumexp(-2 * sq[off], 0) - math.log(off.sum().item())).item()


@pytest.mark.parametrize(
    "regularizer",
    [lambda z, g: uot_uniformity(z, sphere_samples(z.detach(), g), point_mass=2.0),
     lambda z, g: tangent_sliced_wasserstein(z, sphere_samples(z.detach(), g), generator=g)],
    ids=["uot", "tangent_sw"],
)
def test_regularizer_pushes_collapsed_representations_apart(regularizer):
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(1, 8, generator=g, dtype=F64)
    collapsed = z0.repeat(16, 1).requires_grad_()
    (gz,) = torch.autograd.grad(regularizer(collapsed, g), collapsed)
    assert gz.norm() > 1e-3

    z = (z0 + 1e-2 * torch.randn(16, 8, generator=g, dtype=F64)).requires_grad_()
    before = wang_isola(z.detach())
    opt = torch.optim.SGD([z], lr=0.5)
    for _ in range(30):
        opt.zero_grad()
        regularizer(z, g).backward()
        opt.step()
    assert wang_isola(z.detach()) < before - 0.5  # measured: ~0 -> -2.7 (uot), -> -2.8 (tangent_sw)


def test_sphere_samples_are_unit_and_vmap_draws_equal_one_batched_draw():
    like = torch.zeros(4, 5, 3)
    draws = vmap(lambda t: sphere_samples(t, torch.Generator().manual_seed(0)), randomness="different")
    # a fresh generator per call inside vmap: the vmapped draw is one batched draw
    vmapped = draws(like)
    batched = sphere_samples(like, torch.Generator().manual_seed(0))
    torch.testing.assert_close(vmapped, batched, rtol=0, atol=0)
    torch.testing.assert_close(batched.norm(dim=-1), torch.ones(4, 5))
    assert not torch.equal(batched[0], batched[1])


# ---------------------------------------------------------------------------------------------
# Tangent sliced Wasserstein (official FUR)


def on_circle(*angles: float, radius: float = 1.0) -> torch.Tensor:
    return radius * torch.tensor([[math.cos(t), math.sin(t)] for t in angles], dtype=F64)


def test_tangent_sw_hand_case():
    """On the unit circle, the log-map at (1, 0) of the point at angle t is (0, t) and at (-1, 0)
    it is (0, pi - t) (0 < t < pi); projected on theta = (0, 1) these are t and pi - t.
    Samples at {0.1, 0.5}, z at {0.3, 0.2}: sorted pairs (0.1, 0.2), (0.5, 0.3) at (1, 0) and
    (pi-0.5, pi-0.3), (pi-0.1, pi-0.2) at (-1, 0); each tangent point gives
    (0.1^2 + 0.2^2)/2 = 0.025."""
    samples, z = on_circle(0.1, 0.5), on_circle(0.3, 0.2)
    theta = torch.tensor([[0.0, 1.0]], dtype=F64)
    tangent = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=F64)
    value = tangent_sliced_wasserstein(z, samples, theta, tangent, num_tangent_space=1.0)
    assert value.item() == pytest.approx(0.05, rel=1e-12)
    # the official divisor 6, and unnormalised directions (the code's randn): |theta|^2 scaling
    value = tangent_sliced_wasserstein(z, samples, 2 * theta, tangent)
    assert value.item() == pytest.approx(4 * 0.05 / 6, rel=1e-12)


def test_tangent_sw_uses_z_unnormalised_like_geoopt():
    """For y = r (cos t, sin t) geoopt's log-map at (1, 0) is (0, acos(r cos t)) (sin t > 0):
    z is not normalised. Here r = 0.5, t = pi/3 gives acos(0.25) instead of pi/3."""
    samples, z = on_circle(0.1, 0.5), torch.cat([on_circle(math.pi / 3, radius=0.5), on_circle(0.2)])
    theta = torch.tensor([[0.0, 1.0]], dtype=F64)
    tangent = torch.tensor([[1.0, 0.0]], dtype=F64)
    value = tangent_sliced_wasserstein(z, samples, theta, tangent, num_tangent_space=1.0)
    expected = ((0.1 - 0.2) ** 2 + (0.5 - math.acos(0.25)) ** 2) / 2
    assert value.item() == pytest.approx(expected, rel=1e-12)


def direct_logmap(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """geoopt's Sphere.logmap, term by term, materialising u."""
    eps = 1e-7 if x.dtype == F64 else 1e-4
    u = (y - x) - ((y - x) * x).sum(-1, keepdim=True) * x
    dist = torch.acos((x * y).sum(-1, keepdim=True).clamp(-1 + eps, 1 - eps))
    return torch.where(dist > eps, u * dist / u.norm(dim=-1, keepdim=True).clamp_min(eps), u)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_tangent_sw_matches_a_direct_loop_over_tangent_points(dtype, rtol):
    g = torch.Generator().manual_seed(3)
    z = (1.7 * torch.randn(24, 10, generator=g)).to(dtype)  # un-normalised, as BYOL's projector output
    samples = sphere_samples(z, g)
    tangent = sphere_samples(z, g)
    theta = torch.randn(24, 6, 10, generator=g).to(dtype)
    expected = 0.0
    for t in range(24):
        log_s = direct_logmap(tangent[t], samples) @ theta[t].T
        log_z = direct_logmap(tangent[t], z) @ theta[t].T
        expected += (log_s.sort(0).values - log_z.sort(0).values).square().mean()
    value = tangent_sliced_wasserstein(z, samples, theta, tangent)
    assert value.item() == pytest.approx(expected.item() / 6, rel=rtol)


def test_tangent_sw_default_draws_under_vmap_equal_the_batched_call():
    """Defaults draw B tangent points then [B, L, d] directions from the generator; inside
    vmap(randomness="different") the same generator state gives the batched call's draws."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(3, 8, 5, generator=g, dtype=F64)
    s = sphere_samples(z, g)
    batched = tangent_sliced_wasserstein(z, s, generator=torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(9)
    vmapped = vmap(lambda z_, s_: tangent_sliced_wasserstein(z_, s_, generator=gen), randomness="different")(z, s)
    torch.testing.assert_close(vmapped, batched, rtol=1e-12, atol=0)
    assert batched.shape == (3,)
    with pytest.raises(ValueError):
        tangent_sliced_wasserstein(z[0], s[0, :5])


# ---------------------------------------------------------------------------------------------
# EUA


def exact_simplex_qp(G: np.ndarray) -> tuple[float, np.ndarray]:
    """Brute force: argmin_{p in simplex} p^T G p by trying every support (equality-constrained
    QP on the face, kept if feasible); exact for small K and non-singular G."""
    K = len(G)
    best = (math.inf, None)
    for r in range(1, K + 1):
        for S in itertools.combinations(range(K), r):
            idx = list(S)
            kkt = np.zeros((r + 1, r + 1))
            kkt[:r, :r], kkt[:r, r], kkt[r, :r] = G[np.ix_(idx, idx)], 1.0, 1.0
            rhs = np.zeros(r + 1)
            rhs[r] = 1.0
            p = np.zeros(K)
            p[idx] = np.linalg.solve(kkt, rhs)[:r]
            if (p >= -1e-12).all() and p @ G @ p < best[0]:
                best = (p @ G @ p, p.clip(0))
    return best


def random_clients(seed: int, K: int, P: int = 40, shared: float = 0.5):
    """A global vector and K client vectors whose updates share a component (correlated
    directions with different lengths)."""
    g = torch.Generator().manual_seed(seed)
    global_vec = torch.randn(P, generator=g, dtype=F64)
    common = torch.randn(P, generator=g, dtype=F64)
    clients = []
    for _ in range(K):
        length = 0.2 + torch.rand(1, generator=g, dtype=F64)
        clients.append(global_vec - (shared * common + torch.randn(P, generator=g, dtype=F64)) * length)
    return global_vec, clients


def directions(global_vec: torch.Tensor, clients: list[torch.Tensor], kind: str) -> torch.Tensor:
    """The ``[K, P]`` direction matrix as eq 7 (``log_distance``: ``2 delta / |delta|^2``) and
    the official mtl.py line 85 (``normalized``: ``2 delta / |delta|``) write it, a zero row
    for ``delta = 0``; the library only ever forms its Gram matrix and combinations."""
    delta = torch.stack([global_vec - v for v in clients]).to(F64)
    sq = delta.square().sum(1, keepdim=True)
    norm = sq if kind == "log_distance" else sq.sqrt()
    return torch.where(sq > 0, 2 * delta / torch.where(sq > 0, norm, 1.0), 0.0)


@pytest.mark.parametrize("kind", ["log_distance", "normalized"])
def test_the_streamed_gram_and_combination_equal_the_direction_matrix(kind):
    """Slices of 7 entries over tensors of 3, 20 and 1 (pieces of unequal sizes, a slice
    boundary inside a tensor) give D D^T and sum_k a_k delta_k of the whole matrix, also
    with a degenerate client (scale 0), to float64 rounding."""
    global_vec, clients = random_clients(3, K=5, shared=1.0, P=24)
    clients.append(global_vec.clone())
    D = directions(global_vec, clients, kind)
    pieces = lambda v: [v[:3].view(3, 1), v[3:23].view(4, 5), v[23:]]
    for g, cs, chunk in [(global_vec, clients, 1 << 20), (pieces(global_vec), [pieces(v) for v in clients], 7)]:
        G, c = direction_gram(g, cs, kind, chunk)
        torch.testing.assert_close(G, D @ D.T, rtol=1e-13, atol=0)
        assert c[-1] == 0 and (c[:-1] > 0).all()
        a = torch.arange(6, dtype=F64)
        delta = torch.stack([global_vec - v for v in clients])
        torch.testing.assert_close(combine(g, cs, a, chunk), a @ delta, rtol=1e-13, atol=1e-15)


def test_directions_hand_case_and_degenerate_client():
    global_vec = torch.tensor([1.0, 1.0])
    clients = [torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0])]  # delta = (0, -2); identical
    G, c = direction_gram(global_vec, clients, "log_distance")  # g = 2 delta / |delta|^2 = (0, -1)
    torch.testing.assert_close(G, torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=F64))
    torch.testing.assert_close(c, torch.tensor([0.5, 0.0], dtype=F64))
    G, c = direction_gram(global_vec, clients, "normalized")  # d = 2 delta / |delta| = (0, -2)
    torch.testing.assert_close(G, torch.tensor([[4.0, 0.0], [0.0, 0.0]], dtype=F64))
    torch.testing.assert_close(c, torch.tensor([1.0, 0.0], dtype=F64))


@pytest.mark.parametrize("seed", range(5))
def test_weights_lie_on_the_simplex(seed):
    global_vec, clients = random_clients(seed, K=7, shared=float(seed))
    for kind in ("log_distance", "normalized"):
        D = directions(global_vec, clients, kind)
        G = D @ D.T
        start = sharpen(torch.rand(7, dtype=F64) + 0.1, 0.5)
        for p in (simplex_weights_active_set(G), simplex_weights_admm(G), simplex_weights_min_norm(G, start)):
            assert (p >= 0).all()
            assert p.sum().item() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("variant", ["paper", "paper_closed_form", "official"])
def test_symmetric_clients_get_equal_weights(variant):
    """Swapping the first two coordinates swaps clients 1 and 2 (equal distance to the global
    model) and fixes client 3, so p_1 = p_2."""
    global_vec = torch.zeros(3, dtype=F64)
    clients = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.0, 1.0, 1.0]), torch.tensor([-1.5, -1.5, 0.3])]
    _, p = eua_direction(global_vec, clients, variant)
    assert p[0].item() == pytest.approx(p[1].item(), abs=1e-9)
    assert (p > 0.05).all()
    # two identical clients: G is singular; the active set solves for their common point once
    # and splits its weight (paper), the pseudo-inverse splits equally (closed form), min-norm too
    _, p = eua_direction(global_vec, [clients[0], clients[0], clients[2]], variant)
    assert p[0].item() == pytest.approx(p[1].item(), abs=1e-9)


def interior_problems():
    """Gram matrices of 'normalized' directions whose exact simplex optimum is interior."""
    found = []
    for seed in range(100):
        global_vec, clients = random_clients(seed, K=3 + seed % 4, shared=0.3)
        D = directions(global_vec, clients, "normalized")
        G = (D @ D.T).numpy()
        f, p = exact_simplex_qp(G)
        if (p > 1e-3).all():
            found.append((G, f, p))
        if len(found) == 6:
            return found
    raise AssertionError("no interior problems")


def test_active_set_admm_and_min_norm_agree_with_the_exact_solution_on_interior_problems():
    """Tolerance 1e-5 on the weights (measured: active set and ADMM ~1e-15, min-norm <= 5e-6,
    bounded by its stopping rule sum |change| < 1e-5); the active set to 1e-12. Boundary
    optima: test_fedu2_solvers.py."""
    for G, f, p in interior_problems():
        G = torch.from_numpy(G)
        K = len(G)
        np.testing.assert_allclose(simplex_weights_active_set(G).numpy(), p, atol=1e-12)
        p_admm = simplex_weights_admm(G, eta_g=1.0, phi=0.1, rho=1.0, iterations=100)
        p_min_norm = simplex_weights_min_norm(G, torch.full((K,), 1.0 / K, dtype=F64))
        np.testing.assert_allclose(p_admm.numpy(), p, atol=1e-5)
        np.testing.assert_allclose(p_min_norm.numpy(), p, atol=1e-5)
        np.testing.assert_allclose(p_admm.numpy(), p_min_norm.numpy(), atol=1e-5)
        assert (p_min_norm @ G @ p_min_norm).item() == pytest.approx(f, rel=1e-9)


def test_min_norm_reproduces_the_official_line_search_clamps():
    """Boundary optimum p* = (1/2, 1/2, 0) for the vectors (1, 0), (0, 1), (2, 2). From the
    uniform start the official steps reach the edge through the line search clamp c = 0.001
    (not 0) twice, leaving (1/3) 0.001^2 on the third client, then stop."""
    V = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]], dtype=F64)
    p = simplex_weights_min_norm(V @ V.T, torch.full((3,), 1 / 3, dtype=F64))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.5, 0.0], dtype=F64), rtol=0, atol=1e-6)
    assert p[2].item() == pytest.approx(1e-6 / 3, rel=1e-6)
    assert simplex_weights_min_norm(V @ V.T, torch.full((3,), 1 / 3, dtype=F64), max_iterations=0)[2] == 1 / 3


def test_line_search_branches_are_the_official_ones():
    """argmin_c ||c x1 + (1-c) x2||^2 from <x1,x1>, <x1,x2>, <x2,x2>, clamped to 0.999 / 0.001."""
    assert _line_min(1.0, 1.0, 3.0) == 0.999  # <x1,x2> >= <x1,x1>: x1 is the minimum
    assert _line_min(3.0, 1.0, 1.0) == 0.001  # <x1,x2> >= <x2,x2>: x2 is the minimum
    assert _line_min(1.0, 0.0, 1.0) == 0.5
    assert _line_min(4.0, 1.0, 2.0) == pytest.approx(0.25)  # (2 - 1) / (4 + 2 - 2)


def test_admm_is_the_clipped_affine_minimiser():
    """Eq 12's p-step keeps its matrix, so the result is max(0, x)/sum with x = H^+ 1,
    H = (eta_g^2/phi) G + rho 1 1^T, while rho 1^T max(0, x) < 2 (the other regime:
    test_fedu2_solvers.py): for boundary optima this is not the simplex optimum."""
    global_vec, clients = random_clients(11, K=8, shared=2.0)
    D = directions(global_vec, clients, "log_distance")
    G = D @ D.T
    H = 10.0 * G + torch.ones(8, 8, dtype=F64)
    x = torch.linalg.pinv(H, hermitian=True) @ torch.ones(8, dtype=F64)
    assert (x < 0).any() and x.clamp_min(0).sum() < 2  # a boundary problem: the clipping matters
    torch.testing.assert_close(simplex_weights_admm(G, 1.0, 0.1, 1.0, 100), x.clamp_min(0) / x.clamp_min(0).sum())


def test_eua_direction_formulas_and_degenerate_clients():
    global_vec, clients = random_clients(5, K=4, shared=1.0)
    clients.append(global_vec.clone())  # took no step: zero distance
    for variant, kind in (("paper", "log_distance"), ("paper_closed_form", "log_distance"), ("official", "normalized")):
        d, p = eua_direction(global_vec, clients, variant, eta_g=0.5, phi=0.1)
        assert torch.isfinite(d).all() and torch.isfinite(p).all()
        assert p[4] == 0 and p.sum().item() == pytest.approx(1.0, abs=1e-12)
        D = directions(global_vec, clients, kind)
        scale = 1.0 if variant == "official" else 0.5 / 0.1
        torch.testing.assert_close(d, scale * (p @ D))
    d, p = eua_direction(global_vec, [global_vec.clone()] * 3, "paper")
    assert (d == 0).all() and (p == 0).all()


def test_sharpen():
    w = torch.tensor([1.0, 3.0])
    torch.testing.assert_close(sharpen(w, 1.0), torch.tensor([0.25, 0.75], dtype=F64))
    torch.testing.assert_close(sharpen(w, 0.5), torch.tensor([0.1, 0.9], dtype=F64))
