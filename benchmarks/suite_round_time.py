"""Seconds per round of methods of an experiment suite, and their local-training samples/s
against a plain per-client PyTorch loop measured in the same run.

For each method, in a fresh process: the suite's configuration of that method in one
setting (seed 0) runs ``--rounds`` rounds; the script prints each round's wall time (local
training of every sampled client, aggregation and the round's evaluation), the part spent
evaluating, and the local training's samples per second. The baseline is the same model
trained with plain PyTorch (``nn.Module``, ``loss.backward()``, ``torch.optim.SGD``, the
suite's learning rate and batch size, cross-entropy only) on batches already in memory,
one single-threaded process per core, for as many local steps as the method's last
round: local training with no data pipeline, no engine and no algorithm. For a model
without a classifier (self-supervised methods) the loop trains a linear classifier on
the encoder's representation: one forward and backward per image, where a
self-supervised step has one per view (two or three per sample).

    python benchmarks/suite_round_time.py experiments/reduced/fedcrl_cifar10_subset.yaml \\
        --setting practical --methods FedAvg,FedCRL
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import machine, run_isolated  # noqa: E402
from throughput import in_processes  # noqa: E402


def _config(p: dict):
    from contrafl.experiments.suite import load_suite, resolved_configs

    suite = load_suite(p["suite"])
    configs = resolved_configs(suite, [f"executor={p['executor']}", f"device={p['device']}"])
    name = f"{p['setting']} / {p['method']}" if p["setting"] else p["method"]
    if (name, 0) not in configs:
        raise SystemExit(f"no method {name!r} in {p['suite']}; methods: {sorted({m for m, _ in configs})}")
    return configs[(name, 0)]


def measure(p: dict) -> dict:
    from contrafl.engine.setup import prepare
    from contrafl.engine.simulation import Simulation

    if p["mode"] == "torch-loop":
        return torch_loop(p)
    sim = Simulation(prepare(_config(p)), None, None)
    rounds = []
    for t in range(p["rounds"]):
        start = time.perf_counter()
        row = sim.run_round(t)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        sim.evaluate(t + 1)  # the evaluation the round just did, timed on its own
        if sim.cfg.knn_every:
            sim.evaluate_knn()
        rounds.append({"seconds": seconds, "eval_seconds": time.perf_counter() - start, "steps": row["local_steps"]})
    return {"rounds": rounds, "executor": sim.executor_name, "batch_size": sim.cfg.batch_size}


def torch_loop(p: dict) -> dict:
    """``steps`` SGD steps of the suite's model on cross-entropy, plain PyTorch."""
    from torch.nn import functional as F

    from contrafl.engine.setup import prepare

    setup = prepare(_config(p))
    cfg, data = setup.config, setup.data
    x = setup.eval_transform(data.train.x[: 64 * cfg.batch_size])
    y = data.train.y[: 64 * cfg.batch_size]
    batches = [(x[i : i + cfg.batch_size], y[i : i + cfg.batch_size]) for i in range(0, len(y), cfg.batch_size)]

    def work(k: int) -> None:
        model = setup.model_factory(0).train()
        # a model without a classifier (self-supervised) gets a linear one on h
        head = torch.nn.Linear(model.feature_dim, data.num_classes) if model.l3 is None else None
        params = list(model.parameters()) + (list(head.parameters()) if head is not None else [])
        optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        for step in range(k):
            xb, yb = batches[step % len(batches)]
            out = model(xb)
            loss = F.cross_entropy(out.logits if head is None else head(out.h), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    work(1)  # warm-up, inherited by the forks
    seconds = in_processes(work, p["steps"])
    return {"seconds": seconds, "samples_per_s": p["steps"] * cfg.batch_size / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("suite", nargs="?", help="an experiment suite (YAML)")
    parser.add_argument("--setting", default="", help="the setting of a suite with settings")
    parser.add_argument("--methods", default="FedAvg", help="comma-separated method names of the suite")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per method (the last is reported)")
    parser.add_argument("--executor", default="auto", choices=["auto", "sequential", "parallel", "vectorized"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return
    if not args.suite:
        parser.error("give the suite's YAML file")
    print(f"machine: {machine()}")
    base = {"suite": args.suite, "setting": args.setting, "executor": args.executor, "device": args.device}
    results = {}
    for method in args.methods.split(","):
        r = run_isolated(Path(__file__), {**base, "method": method, "mode": "run", "rounds": args.rounds})
        last = r["rounds"][-1]
        train = last["seconds"] - last["eval_seconds"]
        r["samples_per_s"] = last["steps"] * r["batch_size"] / train
        results[method] = r
        print(f"{method} ({args.setting or 'suite'}), executor {r['executor']}:")
        for t, row in enumerate(r["rounds"]):
            print(f"  round {t + 1}: {row['seconds']:.2f} s, of which evaluation {row['eval_seconds']:.2f} s ({row['steps']} local steps)")
        print(f"  => {last['seconds']:.2f} s per round; local training {r['samples_per_s']:.0f} samples/s")
    steps = max(r["rounds"][-1]["steps"] for r in results.values())
    loop = run_isolated(Path(__file__), {**base, "method": args.methods.split(",")[0], "mode": "torch-loop", "steps": steps})
    print(f"plain PyTorch loop (CE, SGD, {steps} steps, one single-threaded process per core): "
          f"{loop['samples_per_s']:.0f} samples/s")
    for method, r in results.items():
        print(f"  {method}: {r['samples_per_s'] / loop['samples_per_s']:.2f}x the plain loop's samples/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"methods": results, "torch_loop": loop}, indent=2) + "\n")


if __name__ == "__main__":
    main()
