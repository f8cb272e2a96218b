"""Seconds per round of MOON on a local Flower deployment vs the simulator, same config.

The same run (MOON, the real CIFAR-10 subset of ``--data-dir`` or synthetic CIFAR-shaped
images, its simple CNN, Dirichlet(0.5)) goes through, in this order:

- **simulator, sequential**: ``contrafl run`` with the clients one after another in one
  process (what each SuperNode runs for its own client);
- **simulator, auto**: ``contrafl run`` with the executor ``auto`` picks (parallel on a
  multi-core CPU);
- **Flower**: ``contrafl deploy``, a SuperLink and one SuperNode per client on this
  machine, all sharing its cores.

Each prints the seconds of every round from the run's ``timing.jsonl``: the first round
of a deployment includes the partition queries, the app's installation and the start of
the SuperNodes' workers, so the steady state is the median of the other rounds. The
deployment's overhead per round is what Flower adds: the messages' way through the
SuperLink and the SuperNodes (``contrafl-supernode``: polls of at most 0.2 s, the
ClientApps in one process per SuperNode, :mod:`contrafl.flower.supernode`), and the
ClientApp's hand-over to the SuperNode's worker, which keeps torch, the data and the
model loaded. ``contrafl deploy`` gives each client's torch ``cores // clients``
threads; the deployment's metrics equal, bit for bit, those of the simulator mode that
trains each client with as many threads (on 2 cores and 3 clients: one thread, the
parallel executor of ``auto``); the script says which ones are identical.
``--supernode-poll 3`` gives the SuperNodes flwr's own 3 s wait. ``--secure-aggregation``
adds a fourth run, ``contrafl deploy --secure-aggregation`` (SecAgg+ on the same
deployment's settings), whose rounds are compared with the plain deployment's (its
metrics differ from the others' by SecAgg+'s quantisation, so they are not compared).

    python benchmarks/flower_overhead.py --data-dir ../shared/data/cifar-10-batches-py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fake_cifar10, machine  # noqa: E402


def rounds(path: Path) -> list[float]:
    return [json.loads(line)["seconds"] for line in (path / "timing.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", help="CIFAR-10 python batches (default: synthetic images)")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--out", default="runs/bench-flower", help="folder for the three run directories")
    ap.add_argument("--supernode-poll", type=float, default=0.2, help="contrafl deploy --supernode-poll (3: flwr's wait)")
    ap.add_argument("--secure-aggregation", action="store_true", help="also deploy with SecAgg+")
    args = ap.parse_args()

    from contrafl.cli import main as contrafl

    data_dir = args.data_dir or str(fake_cifar10(5000))
    settings = [
        "algorithm=moon", "dataset=cifar10", f"data_dir={data_dir}", "allow_subset=true", "model=moon_cnn",
        f"num_clients={args.clients}", "partition=dirichlet", "partition.beta=0.5", f"local_epochs={args.local_epochs}",
        "batch_size=64", f"rounds={args.rounds}", "eval_personal=false",
    ]
    out = Path(args.out)
    print(f"machine: {machine()}")
    print(f"MOON, {args.clients} clients, {args.rounds} rounds of {args.local_epochs} local epoch(s), data {data_dir}\n")
    results = {}
    deploy = ["deploy", "--supernode-poll", str(args.supernode_poll)]
    modes = [
        ("simulator, sequential", "sequential", ["run", "--quiet", "executor=sequential"]),
        ("simulator, auto", "auto", ["run", "--quiet"]),
        ("Flower deployment", "flower", deploy),
    ]
    if args.secure_aggregation:
        modes.append(("Flower, SecAgg+", "flower-secure", [*deploy, "--secure-aggregation"]))
    for name, folder, command in modes:
        began = time.perf_counter()
        assert contrafl([command[0], "--out", str(out / folder), *command[1:], *settings]) == 0
        wall = time.perf_counter() - began
        results[name] = (rounds(out / folder), wall, (out / folder / "metrics.jsonl").read_text())
    base = statistics.median(results["simulator, sequential"][0][1:])
    print(f"\n{'mode':<24}{'round 1 s':>10}{'median s/round (2..)':>22}{'vs sequential':>15}{'wall s':>9}")
    for name, (seconds, wall, _) in results.items():
        steady = statistics.median(seconds[1:])
        print(f"{name:<24}{seconds[0]:>10.2f}{steady:>22.2f}{steady / base:>14.2f}x{wall:>9.1f}")
    print()
    for name in ("simulator, sequential", "simulator, auto"):
        print(f"metrics.jsonl of the deployment identical to {name}: {results['Flower deployment'][2] == results[name][2]}")
    if args.secure_aggregation:
        plain, secure = (statistics.median(results[n][0][1:]) for n in ("Flower deployment", "Flower, SecAgg+"))
        print(f"SecAgg+ adds {secure - plain:.2f} s per round to the plain deployment's {plain:.2f} s")


if __name__ == "__main__":
    main()
