"""Seconds per round of MOON's default CIFAR-10 setting, and the time for 100 rounds.

MOON's Table 1 setting: 10 clients, Dirichlet(0.5), 10 local epochs, batch 64, the simple
CNN, about 5000 samples per client (50 000 in all), evaluation of the global model on the
10 000 test images after every round. MOON's paper reports 330 s (FedAvg) and 337 s
(MOON) per round on a V100 (its Table 11). With ``--data-dir`` the real CIFAR-10 is used,
otherwise synthetic CIFAR-shaped images of the same size.

    python benchmarks/round_time.py                          # CPU, auto executor
    python benchmarks/round_time.py --device cuda --precision bf16
    python benchmarks/round_time.py --device cuda --no-cuda-graphs   # every step launched eagerly
    python benchmarks/round_time.py --device cuda --pad-finished-clients   # one graph per phase
    python benchmarks/round_time.py --scaling                # 10 vs 100 clients, equal total samples
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import fake_cifar10, machine, run_isolated  # noqa: E402


def measure(p: dict) -> dict:
    from contrafl.config import load_config
    from contrafl.engine.setup import prepare
    from contrafl.engine.simulation import Simulation

    data_dir = p["data_dir"] or str(fake_cifar10(50000))
    overrides = [
        "dataset=cifar10", f"data_dir={data_dir}", "allow_subset=true", "model=moon_cnn",
        f"num_clients={p['clients']}", "partition=dirichlet", "partition.beta=0.5", "local_epochs=10",
        "batch_size=64", "rounds=100", f"algorithm={p['algorithm']}", f"executor={p['executor']}",
        f"device={p['device']}", f"precision={p['precision']}", f"cuda_graphs={p['cuda_graphs']}",
        f"pad_finished_clients={p['pad_finished_clients']}",
    ]
    if p["algorithm"] == "moon":
        overrides.append("algorithm.mu=5")
    sim = Simulation(prepare(load_config(None, overrides)), None, None)
    times, steps = [], []
    for t in range(p["rounds"]):
        start = time.perf_counter()
        row = sim.run_round(t)
        if sim.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        steps.append(row["local_steps"])
    from contrafl.execution.cuda_graphs import StepGraphs

    graphs = "off" if not (p["cuda_graphs"] and sim.device.type == "cuda" and sim.executor_name == "vectorized") \
        else f"failed ({StepGraphs.failed})" if StepGraphs.failed else "on"
    return {"seconds": times, "steps": steps, "executor": sim.executor_name, "device": str(sim.device),
            "train_samples": len(sim.train), "test_acc": row.get("test_acc"), "cuda_graphs": graphs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help="folder of the official CIFAR-10 files (default: synthetic data)")
    parser.add_argument("--algorithm", default="moon")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="rounds to measure (round 0 has no MOON term)")
    parser.add_argument("--executor", default="auto", choices=["auto", "sequential", "parallel", "vectorized"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="replay the vectorized executor's steps as CUDA graphs on a GPU (the run's cuda_graphs)")
    parser.add_argument("--pad-finished-clients", action="store_true",
                        help="vectorized: finished clients keep computing, masked (one CUDA graph per phase)")
    parser.add_argument("--scaling", action="store_true", help="compare 10 and 100 clients at equal total samples")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return
    print(f"machine: {machine()}")
    print(f"data: {'CIFAR-10 from ' + args.data_dir if args.data_dir else 'synthetic CIFAR-shaped images, 50000 train / 10000 test'}")
    client_counts = [10, 100] if args.scaling else [args.clients]
    results = []
    for n in client_counts:
        p = {"data_dir": args.data_dir, "algorithm": args.algorithm, "clients": n, "rounds": args.rounds,
             "executor": args.executor, "device": args.device, "precision": args.precision,
             "cuda_graphs": args.cuda_graphs, "pad_finished_clients": args.pad_finished_clients}
        r = run_isolated(Path(__file__), p)
        per_round = r["seconds"][-1]
        total_100 = r["seconds"][0] + 99 * per_round
        print(f"{args.algorithm}, {n} clients x 10 local epochs ({r['train_samples']} samples), executor {r['executor']}, "
              f"device {r['device']}, {args.precision}, CUDA graphs {r['cuda_graphs']}"
              f"{', finished clients padded' if args.pad_finished_clients else ''}:")
        for t, (s, k) in enumerate(zip(r["seconds"], r["steps"])):
            print(f"  round {t}: {s:.2f} s ({k} local steps, {k * 64 / s:.0f} samples/s)")
        print(f"  => {per_round:.2f} s per round; 100 rounds ~ {total_100:.0f} s ({total_100 / 60:.1f} min); "
              f"MOON's paper: 337 s per round on a V100")
        results.append({**p, **r, "seconds_per_round": per_round, "seconds_100_rounds": total_100})
    if args.scaling:
        ratio = results[1]["seconds_per_round"] / results[0]["seconds_per_round"]
        print(f"scaling: 100 clients take {ratio:.2f}x the time per round of 10 clients at equal total samples "
              f"(linear growth in the number of clients would be 10x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
