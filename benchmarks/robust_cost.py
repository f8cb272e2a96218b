"""Cost of the Byzantine-robust aggregation rules per round, against the mean.

Each rule of :mod:`contrafl.algorithms.robust` aggregates ``n`` random float32 updates
``[n, d]`` (unit Gaussian; ``d`` defaults to the parameter count of MOON's CIFAR-10 CNN,
``build_model("moon_cnn", (3, 32, 32), 10)``), for n = 10, 100 and 1,000, with
``f = n // 5`` (20%) except Bulyan, which needs n >= 4f + 3 and gets ``f = (n - 3) // 4``.
MDA enumerates all C(n, f) subsets and is timed only for n <= 10. Per rule and n: a
warm-up call, then the median of ``--repeats`` calls (``--repeats-large`` for n >= 1,000);
a call that takes over ``--once-above`` seconds is timed once, with no warm-up. Printed:
seconds per call and the ratio to the mean's time, measured in the same run.

Krum, Multi-Krum and Bulyan compute all n^2 pairwise distances (O(n^2 d)); at n = 1,000
and the default d each of them takes a minute or more on a 2-core machine, so the default
run skips the two Bulyan variants at n = 1,000 (``--all`` includes them).

    python benchmarks/robust_cost.py
    python benchmarks/robust_cost.py --all
    python benchmarks/robust_cost.py --clients 10 100 --dim 10000 --skip mda
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import machine  # noqa: E402
from contrafl.algorithms import robust as R  # noqa: E402

MDA_MAX_N = 10
SKIPPED_BY_DEFAULT = {"bulyan (recursive)": 1000, "bulyan (multi_krum)": 1000}


def moon_cnn_dim() -> int:
    from contrafl.models.build import build_model

    return sum(p.numel() for p in build_model("moon_cnn", (3, 32, 32), 10).parameters())


def f_for(rule: str, n: int) -> int:
    """20% of ``n``, or the most Bulyan tolerates; checked by :func:`check_f`."""
    f = (n - 3) // 4 if rule == "bulyan" else n // 5
    R.check_f(rule, n, f)
    return f


def rules(n: int) -> dict[str, tuple[Callable[[torch.Tensor], R.Robust], str]]:
    """Name -> (the rule as a call on the updates ``[n, d]``, its settings as text)."""
    f, fb = n // 5, (n - 3) // 4
    table = {
        "mean": (R.mean, ""),
        "median": (R.median, ""),
        "trimmed_mean": (lambda x: R.trimmed_mean(x, f=f_for("trimmed_mean", n)), f"f={f}"),
        "krum": (lambda x: R.krum(x, f_for("krum", n)), f"f={f}"),
        "multi_krum": (lambda x: R.multi_krum(x, f_for("multi_krum", n)), f"f={f}, m=n-f"),
        "bulyan (recursive)": (lambda x: R.bulyan(x, f_for("bulyan", n), "recursive"), f"f={fb}"),
        "bulyan (multi_krum)": (lambda x: R.bulyan(x, f_for("bulyan", n), "multi_krum"), f"f={fb}"),
        "geometric_median": (R.geometric_median, "T=3"),
        # a fresh rule each call: the first call's work (from v = 0), not a state carried over
        "centered_clipping": (lambda x: R.CenteredClipping(tau=100.0, L=1)(x), "L=1"),
        "norm_bound": (lambda x: R.norm_bound(x, tau=100.0), ""),
    }
    if n <= MDA_MAX_N:
        table["mda"] = (lambda x: R.mda(x, f_for("mda", n)), f"f={f}, C({n},{f})={math.comb(n, f)}")
    return table


def seconds_per_call(call: Callable[[torch.Tensor], R.Robust], x: torch.Tensor, repeats: int,
                     once_above: float) -> tuple[float, int]:
    """Median seconds of ``repeats`` calls after a warm-up; one call when it is slow."""
    start = time.perf_counter()
    call(x)
    first = time.perf_counter() - start
    if first > once_above:
        return first, 1
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times), repeats


def ratio_text(r: float) -> str:
    return f"{r:.2g}" if r < 10 else f"{r:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000], help="values of n")
    parser.add_argument("--dim", type=int, default=None, help="d (default: MOON's CIFAR-10 CNN's parameter count)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per rule after a warm-up")
    parser.add_argument("--repeats-large", type=int, default=2, help="timed calls per rule for n >= 1000")
    parser.add_argument("--once-above", type=float, default=2.0,
                        help="a rule whose warm-up call takes longer (s) is timed by that call alone")
    parser.add_argument("--skip", nargs="*", default=[], metavar="RULE[@N]",
                        help="rules to leave out, everywhere or at one n (e.g. krum@1000, 'bulyan (recursive)')")
    parser.add_argument("--all", action="store_true", help="do not skip the Bulyan variants at n = 1000")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    d = args.dim or moon_cnn_dim()
    skip = set(args.skip)
    if not args.all:
        skip |= {f"{rule}@{n}" for rule, n in SKIPPED_BY_DEFAULT.items()}
    print(machine())
    print(f"d = {d:,} float32 parameters ({'MOON CIFAR-10 CNN' if args.dim is None else '--dim'}), "
          f"f = n // 5 (Bulyan: (n - 3) // 4), median of {args.repeats} calls "
          f"({args.repeats_large} for n >= 1000) after a warm-up, one call above {args.once_above:g} s")
    g = torch.Generator().manual_seed(0)
    results: dict[str, dict[int, tuple[float, int] | None]] = {}
    notes: dict[str, dict[int, str]] = {}
    for n in args.clients:
        x = torch.randn(n, d, generator=g)
        repeats = args.repeats_large if n >= 1000 else args.repeats
        for name, (call, note) in rules(n).items():
            results.setdefault(name, {})
            notes.setdefault(name, {})[n] = note
            if name in skip or f"{name}@{n}" in skip:
                results[name][n] = None
                continue
            results[name][n] = seconds_per_call(call, x, repeats, args.once_above)
            s, k = results[name][n]
            print(f"  n={n:5d} {name:20s} {s:10.4f} s ({k} call{'s' if k > 1 else ''}) {note}", file=sys.stderr, flush=True)
        del x
    if "mda" in results:
        for n in args.clients:
            results["mda"].setdefault(n, None)
    print()
    header = "| rule | " + " | ".join(f"n = {n:,}: s/call (x mean)" for n in args.clients) + " |"
    print(header)
    print("|---|" + "---|" * len(args.clients))
    for name, per_n in results.items():
        cells = []
        for n in args.clients:
            timed, mean_timed = per_n.get(n), results["mean"].get(n)
            if timed is None:
                cells.append("skipped" if name != "mda" or n <= MDA_MAX_N else "not run (C(n, f) subsets)")
                continue
            s, k = timed
            ratio = ratio_text(s / mean_timed[0]) if mean_timed else "?"
            cells.append(f"{s:.3g}{'*' if k == 1 else ''} (x{ratio})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n* one call (over --once-above s). f: n // 5; Bulyan (n - 3) // 4; MDA only for n <= "
          f"{MDA_MAX_N}. Skipped: {', '.join(sorted(skip)) or 'none'}.")


if __name__ == "__main__":
    main()
