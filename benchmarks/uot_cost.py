"""Cost of FedU2's UOT uniformity regulariser per local step: the old default solver (the
paper's projected steepest descent, 50 steps) against the new one (interior point, to
convergence), timed in the same run.

One step's regulariser is ``lam_u (l_u(Z1) + l_u(Z2))`` on the two views' projections
``[B, d]`` (float32, as in training), forward and backward, with fresh unit-Gaussian samples
(``point_mass=2``, ``tau_a = tau_b = 0.8``: the ``fedu2`` defaults). ``--clients K`` times K
clients at once under ``torch.func.vmap`` (the vectorized executor's path). The two solvers
alternate, ``--repeats`` rounds of ``--steps`` steps each; the medians are printed.

    python benchmarks/uot_cost.py
    python benchmarks/uot_cost.py --threads 2 --clients 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.func import grad, vmap  # noqa: E402

from _common import machine  # noqa: E402
from contrafl.algorithms.uniformity import UOT_ITERATIONS, sphere_samples, uot_uniformity  # noqa: E402

SOLVERS = {"old default: steepest_descent": "steepest_descent", "new default: interior_point": "interior_point"}


def step_time(solver: str, z: torch.Tensor, samples: torch.Tensor, steps: int) -> float:
    """Seconds per step of ``0.1 (l_u(Z1) + l_u(Z2))`` and its gradient (``z``: ``[..., 2, B, d]``)."""

    def regulariser(views: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return 0.1 * uot_uniformity(views, s, point_mass=2.0, solver=solver).sum()

    run = vmap(grad(regulariser)) if z.dim() == 4 else grad(regulariser)
    start = time.perf_counter()
    for _ in range(steps):
        run(z, samples)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--clients", type=int, default=1, help="clients at once under vmap (1: no vmap)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    shape = ((args.clients,) if args.clients > 1 else ()) + (2, args.batch, args.dim)
    z = torch.randn(shape, generator=g)
    samples = sphere_samples(z, g)
    times: dict[str, list[float]] = {name: [] for name in SOLVERS}
    for name, solver in SOLVERS.items():  # warm-up
        step_time(solver, z, samples, 1)
    for _ in range(args.repeats):
        for name, solver in SOLVERS.items():
            times[name].append(step_time(solver, z, samples, args.steps))
    print(machine())
    print(f"B = {args.batch}, d = {args.dim}, {args.clients} client(s), two views per step, forward + backward; "
          f"iterations {UOT_ITERATIONS}; median of {args.repeats} x {args.steps} steps")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        print(f"{name:32s} {1e3 * seconds:8.1f} ms/step")
    old, new = medians.values()
    print(f"{'ratio new / old':32s} {new / old:8.2f}x")


if __name__ == "__main__":
    main()
