"""Client sample-steps per second of local training: reference loop vs contrafl's executors.

For FedAvg and MOON on MOON's simple CNN, with 10, 50 and 100 clients sharing the same
data (IID split, so every configuration processes the same samples), this measures

  (a) reference: a reference-style loop as in MOON's official code (per-sample
      transforms in a DataLoader, one client after another; see reference_loop.py),
  (b) reference-arith: the reference's local steps (its model and loss) over batches
      already in memory, with no data pipeline, one single-threaded process per core,
  (c) torch-loop: contrafl's model (MOON's CNN with contrafl's max-pooling) and loss in
      a plain PyTorch loop (nn.Module, loss.backward(), torch.optim.SGD) over batches
      already in memory, one single-threaded process per core: local training with no
      data pipeline and no engine,
  (d) sequential: contrafl's sequential executor,
  (e) parallel: contrafl's sequential executor in one worker process per core,
  (f) vectorized: contrafl's vectorized executor (all clients of a chunk in one vmap),

and prints each figure and its ratio to (a) measured in the same run, plus the peak
memory of each measurement (every measurement runs in a fresh process). The time covers
local training of one round (MOON: the second round, which has the contrastive term).

    python benchmarks/throughput.py                       # all, CPU
    python benchmarks/throughput.py --clients 10 --algorithms moon --device cuda
    python benchmarks/throughput.py --modes sequential,vectorized --device cuda --precision bf16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _common import cifar_dir, machine, peak_rss_mb, run_isolated  # noqa: E402


IN_MEMORY = ("reference-arith", "torch-loop")  # modes that train in forked processes on batches in memory


def measure(p: dict) -> dict:
    torch.manual_seed(0)
    data_dir, _ = cifar_dir(p["rows"])
    algo, n, mode, epochs = p["algorithm"], p["clients"], p["mode"], p["epochs"]
    if mode in IN_MEMORY:
        # as many steps as the reference takes (its parties drop their last incomplete batch)
        steps = epochs * sum(len(part) // 64 for part in np.array_split(np.arange(p["rows"]), n))
        work = reference_arith(algo) if mode == "reference-arith" else torch_loop(algo)
        work(1)  # warm-up (oneDNN kernel generation, ~1 s in a fresh process), inherited by the forks
        seconds = in_processes(work, steps)
        processed = steps * 64
    elif mode == "reference":
        import reference_loop as ref
        from contrafl.data.registry import DATASETS, LoadRequest

        data = DATASETS.get("cifar10").load(LoadRequest(data_dir=data_dir, allow_subset=True))
        images = data.train.x.permute(0, 2, 3, 1).contiguous().numpy()
        labels = data.train.y.numpy()
        parts = np.array_split(np.random.default_rng(0).permutation(len(labels)), n)
        global_state = ref.ModelFedCon().state_dict()
        prev = [ref.ModelFedCon().state_dict() for _ in range(n)]
        ref.arithmetic_only(algo, 1, global_state, prev[0])  # warm-up, as the other modes have
        start = time.perf_counter()
        processed = ref.train_clients(algo, images, labels, parts, epochs, global_state, prev)
        seconds = time.perf_counter() - start
    else:
        from contrafl.config import load_config
        from contrafl.engine.setup import prepare
        from contrafl.engine.simulation import Simulation

        overrides = [
            "dataset=cifar10", f"data_dir={data_dir}", "allow_subset=true", "model=moon_cnn",
            f"num_clients={n}", "partition=iid", f"local_epochs={epochs}", "batch_size=64",
            "rounds=3", "eval_every=1000", f"algorithm={algo}", f"executor={mode}", f"device={p['device']}",
            f"precision={p['precision']}",
        ]
        if algo == "moon":
            overrides.append("algorithm.mu=5")
        sim = Simulation(prepare(load_config(None, overrides)), None, None)
        sim.run_round(0)  # warm-up; MOON's round 0 has no contrastive term
        if sim.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        row = sim.run_round(1)
        if sim.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        processed = row["local_steps"] * 64
    out = {"samples": processed, "seconds": seconds, "samples_per_s": processed / seconds,
           "peak_rss_mb": peak_rss_mb(children=mode in IN_MEMORY)}
    if torch.cuda.is_available():
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def reference_arith(algo: str):
    """``work(k)``: k local steps of the reference loop's model and loss on batches in memory."""
    import reference_loop as ref

    global_state, prev_state = ref.ModelFedCon().state_dict(), ref.ModelFedCon().state_dict()
    return lambda k: ref.arithmetic_only(algo, k, global_state, prev_state)


def plain_step(algo: str, model_name: str = "moon_cnn", bf16: bool = False):
    """``step(x, y)``: one local step of contrafl's ``model_name`` with FedAvg's or
    MOON's loss (mu=5, temperature 0.5, one previous model), plain autograd and
    ``torch.optim.SGD`` (MOON's lr 0.01, momentum 0.9, weight decay 1e-5); ``bf16``:
    the forward passes and the loss under CPU bfloat16 autocast."""
    from torch.nn import functional as F

    from contrafl.algorithms.moon import model_contrastive_loss
    from contrafl.models.build import build_model

    def build(frozen: bool):
        model = build_model(model_name, (3, 32, 32), 10).train(not frozen)
        return model.requires_grad_(not frozen)

    net, global_net, prev_net = build(False), build(True), build(True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = net(x)
            loss = F.cross_entropy(out.logits, y)
            if algo == "moon":
                with torch.no_grad():
                    z_glob, z_prev = global_net(x).z, prev_net(x).z
                loss = loss + 5.0 * model_contrastive_loss(out.z, z_glob, [z_prev], 0.5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def torch_loop(algo: str):
    """``work(k)``: k :func:`plain_step` s of contrafl's MOON CNN on batches in memory."""
    import reference_loop as ref

    def work(k: int) -> None:
        pool = ref.batch_pool()
        step = plain_step(algo)
        for i in range(k):
            step(*pool[i % len(pool)])

    return work


def in_processes(work, steps: int) -> float:
    """Seconds to run ``work(k)`` in one forked single-threaded process per core, the
    ``steps`` split evenly between them."""
    cores = os.cpu_count() or 1
    shares = [steps // cores + (i < steps % cores) for i in range(cores)]

    def child(k: int) -> None:
        torch.set_num_threads(1)
        work(k)

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=child, args=(k,)) for k in shares if k]
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    seconds = time.perf_counter() - start
    if any(proc.exitcode for proc in procs):
        raise RuntimeError("a worker process of the in-memory loop failed")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--algorithms", default="fedavg,moon")
    parser.add_argument("--clients", default="10,50,100")
    parser.add_argument("--modes", default="reference,reference-arith,torch-loop,sequential,parallel,vectorized")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per client")
    parser.add_argument("--rows", type=int, default=20000, help="synthetic CIFAR-shaped training images shared by the clients")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "auto"],
                        help="precision of contrafl's executors (the reference modes run in fp32)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure every mode this many times, round-robin, and report the fastest")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return
    _, data = cifar_dir(args.rows)
    modes = args.modes.split(",")
    print(f"machine: {machine()}")
    print(f"data: {data}; {args.epochs} local epoch(s), batch 64, MOON's simple CNN, contrafl in {args.precision}"
          + (f"; fastest of {args.repeat} measurements (range in brackets)" if args.repeat > 1 else ""))
    print(f"{'algorithm':<9} {'clients':>7} {'mode':<15} {'samples/s':>10} {'vs ref':>7} {'seconds':>8} {'peak RSS MB':>11}")
    results = []
    for algo in args.algorithms.split(","):
        for n in [int(c) for c in args.clients.split(",")]:
            runs: dict[str, list[dict]] = {mode: [] for mode in modes}
            for _ in range(args.repeat):  # round-robin, so that slow spells of the machine hit every mode
                for mode in modes:
                    p = {"algorithm": algo, "clients": n, "mode": mode, "epochs": args.epochs,
                         "rows": args.rows, "device": args.device, "precision": args.precision}
                    runs[mode].append({**p, **run_isolated(Path(__file__), p)})
            best = {mode: max(rs, key=lambda r: r["samples_per_s"]) for mode, rs in runs.items()}
            base = best["reference"]["samples_per_s"] if "reference" in best else None
            for mode, r in best.items():
                ratio = f"{r['samples_per_s'] / base:.2f}x" if base else "-"
                rates = [x["samples_per_s"] for x in runs[mode]]
                spread = f" [{min(rates):.0f}-{max(rates):.0f}]" if len(rates) > 1 else ""
                gpu = f" (GPU {r['peak_gpu_mb']:.0f} MB)" if "peak_gpu_mb" in r else ""
                print(f"{algo:<9} {n:>7} {mode:<15} {r['samples_per_s']:>10.0f} {ratio:>7} {r['seconds']:>8.2f} "
                      f"{r['peak_rss_mb']:>11.0f}{gpu}{spread}", flush=True)
                results.append({**r, "all_samples_per_s": rates, "ratio_vs_reference": r["samples_per_s"] / base if base else None})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
