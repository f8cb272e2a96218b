"""Cost of differential privacy's accounting and noise per round, against a round.

Issue #33's case: ``contrafl run dp=central num_clients=100 sample_fraction=0.1
sampling=secret rounds=30`` on digits (here with results.md's small MLP, which the
noise does not make diverge). Each round's epsilon composes a
sampled-without-replacement Gaussian, whose RDP is the costly part (0.15 s on a 2-core
EPYC; issue #33 measured runs 3x slower with DP than without on its machine).
The old accountant rebuilt dp-accounting's ``RdpAccountant`` every round and composed the
event ``t`` times (recomputing its RDP); :class:`contrafl.engine.privacy.Accountant`
computes it once and converts ``t`` times it. Printed, in the same process:

- the epsilon of every round both ways (equal) and their times per round;
- whole runs with and without DP (each a ``contrafl run`` subprocess, alternating,
  ``--repeats`` pairs), and the DP run's time over the plain run's; the DP run also
  draws secret noise (``os.urandom``) of the model's size every round.

    python benchmarks/dp_cost.py
    python benchmarks/dp_cost.py --rounds 100 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine  # noqa: E402
from contrafl.engine.privacy import Accountant, secret_normal  # noqa: E402


def rebuilt_epsilon(event, rounds: int, delta: float) -> float:
    """The old way: a new accountant composing the event ``rounds`` times."""
    from dp_accounting import privacy_accountant
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant(neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE)
    accountant.compose(event, rounds)
    return accountant.get_epsilon(delta)


def run_seconds(settings: list[str]) -> tuple[float, dict]:
    """Wall-clock seconds of a ``contrafl run`` subprocess, and its summary."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "contrafl", "run", "--quiet", "--out", f"{out}/run", *settings], check=True)
        seconds = time.perf_counter() - start
        return seconds, json.loads(Path(out, "run", "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--sampled", type=int, default=10)
    parser.add_argument("--z", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of whole runs (0: accounting only)")
    args = parser.parse_args()
    print(machine())
    sampled = Accountant.of("central", "secret", args.z, 1e-5, args.clients, args.sampled).events[0]
    accountant = Accountant((sampled,), "replace_one", 1e-5)  # the sampled event alone, as the old way
    old_times, new_times = [], []
    for t in range(1, args.rounds + 1):
        start = time.perf_counter()
        old = rebuilt_epsilon(sampled, t, 1e-5)
        old_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        new = accountant.epsilon(t)
        new_times.append(time.perf_counter() - start)
        if abs(old - new) > 1e-9 * old:
            raise SystemExit(f"round {t}: epsilon {new} differs from the rebuilt accountant's {old}")
    print(f"accounting of SampledWithoutReplacement({args.clients}, {args.sampled}, Gaussian({args.z / 2:g})), {args.rounds} rounds, "
          f"epsilon after the last {new:.4g} both ways:")
    print(f"  rebuilt every round: {statistics.mean(old_times):.3f} s a round (round 1 {old_times[0]:.3f} s, round {args.rounds} {old_times[-1]:.3f} s)")
    print(f"  computed once:       {statistics.mean(new_times) * 1e3:.2f} ms a round (round 1, the RDP: {new_times[0]:.3f} s; "
          f"later rounds {statistics.mean(new_times[1:]) * 1e3:.2f} ms)")
    start = time.perf_counter()
    secret_normal(1_000_000)
    print(f"secret noise: {time.perf_counter() - start:.3f} s per million draws (os.urandom and Box-Muller)")
    if args.repeats:
        base = [  # results.md's central-DP sweep: digits, 10 of 100 clients a round, a small MLP
            "dataset=digits", "partition=iid", "drop_last=false", "batch_size=8", "lr=0.1", "model=mlp", "model.hidden=32",
            "model.projection=false", f"num_clients={args.clients}", f"sample_fraction={args.sampled / args.clients}", f"rounds={args.rounds}",
        ]
        dp = [*base, "sampling=secret", "dp=central", "dp.clip=0.5", f"dp.noise_multiplier={args.z}"]
        plain_s, dp_s = [], []
        for _ in range(args.repeats):
            plain_s.append(run_seconds(base)[0])
            seconds, summary = run_seconds(dp)
            dp_s.append(seconds)
        print(f"contrafl run, {args.rounds} rounds ({' '.join(dp)}):")
        print(f"  without DP {statistics.median(plain_s):.1f} s, with DP {statistics.median(dp_s):.1f} s "
              f"(x{statistics.median(dp_s) / statistics.median(plain_s):.2f}); epsilon {summary['dp']['epsilon']:.4g}")


if __name__ == "__main__":
    main()
