"""Milliseconds per local step by image layout (NCHW, channels-last) and precision
(fp32, bfloat16 autocast) on this CPU, and each one's speed-up over NCHW fp32, measured
in the same run: what contrafl's channels-last CPU batches and ``precision=bf16`` (or
``auto``) buy.

A step is ``throughput.plain_step``: contrafl's model with FedAvg's or MOON's loss (mu=5,
temperature 0.5, one previous model) in a plain PyTorch loop on a batch of 64 random
CIFAR-shaped images already in memory, MOON's SGD, one intra-op thread (what each worker of the
parallel executor has). Each cell is the best of ``--repeats`` timings of ``--steps``
steps after 10 warm-up steps. contrafl's pooling follows the layout (its hand-written
kernel for NCHW, PyTorch's for channels-last: ``contrafl.models.layers``), so the NCHW
columns are contrafl's steps as they ran before it gave the CPU channels-last batches.
It prints the CPU's bf16 features (AMX, AVX512-BF16: without either, bf16 is emulated
and slower).

    python benchmarks/step_layout.py
    python benchmarks/step_layout.py --models moon_cnn fedavg_cnn resnet18 --steps 20
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import machine  # noqa: E402
from throughput import plain_step  # noqa: E402


def step_ms(model_name: str, algorithm: str, bf16: bool, channels_last: bool, steps: int) -> float:
    torch.manual_seed(0)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    step = plain_step(algorithm, model_name, bf16)
    for _ in range(10):
        step(x, y)
    began = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    return (time.perf_counter() - began) / steps * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["moon_cnn", "fedavg_cnn"])
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "moon"], choices=["fedavg", "moon"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from contrafl.engine.setup import CPU_BF16_FLAGS, cpu_flags

    torch.set_num_threads(1)
    print(f"machine: {machine()}")
    print(f"native bf16: {', '.join(f for f in CPU_BF16_FLAGS if f in cpu_flags()) or 'none (bf16 is emulated here)'}\n")
    layouts = ((False, False), (False, True), (True, False), (True, True))
    names = ("fp32", "fp32 CL", "bf16", "bf16 CL")
    print(f"{'model':<12}{'loss':<8}" + "".join(f"{n + ' ms':>11}" for n in names) + "".join(f"{'x ' + n:>10}" for n in names[1:]))
    for model in args.models:
        for algorithm in args.algorithms:
            ms = [min(step_ms(model, algorithm, b, cl, args.steps) for _ in range(args.repeats)) for b, cl in layouts]
            print(f"{model:<12}{algorithm:<8}" + "".join(f"{t:>11.2f}" for t in ms) + "".join(f"{ms[0] / t:>9.2f}x" for t in ms[1:]), flush=True)


if __name__ == "__main__":
    main()
