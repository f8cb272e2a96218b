"""Where the time of one local step goes: torch.profiler over contrafl's MOON CNN.

Runs the local steps of the ``torch-loop`` mode of ``throughput.py`` (contrafl's model
and FedAvg's or MOON's loss in a plain PyTorch loop over batches of 64 already in
memory) in one thread and prints the milliseconds per step and the share of the step
spent in each group of PyTorch kernels: how much of a step is convolution arithmetic,
which no executor can remove.

    python benchmarks/step_profile.py
    python benchmarks/step_profile.py --algorithm fedavg --steps 100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from _common import machine  # noqa: E402
from throughput import torch_loop  # noqa: E402

GROUPS = {  # kernel name -> group (anything else is "other")
    "aten::mkldnn_convolution": "convolution forward",
    "aten::convolution_backward": "convolution backward",
    "aten::addmm": "linear layers (matmul)",
    "aten::mm": "linear layers (matmul)",
    "aten::maximum": "max-pooling",
    "aten::sign": "max-pooling",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="moon", choices=["moon", "fedavg"])
    parser.add_argument("--steps", type=int, default=200, help="profiled steps (after 20 warm-up steps)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = torch_loop(args.algorithm)
    work(20)
    start = time.perf_counter()
    work(args.steps)
    per_step = (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work(args.steps)
    shares: dict[str, float] = {}
    for event in prof.key_averages():
        group = GROUPS.get(event.key, "other")
        shares[group] = shares.get(group, 0.0) + event.self_cpu_time_total
    total = sum(shares.values())
    print(f"machine: {machine()}")
    print(f"{args.algorithm}: {per_step * 1e3:.2f} ms per step of 64 images in one thread "
          f"({64 / per_step:,.0f} images/s per core)")
    for group, t in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {group:<24} {100 * t / total:5.1f}%")


if __name__ == "__main__":
    main()
