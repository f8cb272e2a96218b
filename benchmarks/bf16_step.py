"""Milliseconds per local step in fp32 and under bfloat16 autocast on this CPU, and the
ratio, measured in the same run: what ``precision=bf16`` (or ``auto``) buys.

A step is ``throughput.plain_step``: contrafl's model with FedAvg's or MOON's loss (mu=5,
temperature 0.5, one previous model) in a plain PyTorch loop on a batch of 64 random
CIFAR-shaped images already in memory, MOON's SGD, one intra-op thread (what each worker of the
parallel executor has). Each cell is the best of ``--repeats`` timings of ``--steps``
steps after 10 warm-up steps. The batch goes in as it comes (NCHW) and channels-last,
the layout contrafl gives the image batches under bf16 on a CPU. It prints the CPU's
bf16 features (AMX, AVX512-BF16: without either, bf16 is emulated and slower).

    python benchmarks/bf16_step.py
    python benchmarks/bf16_step.py --models moon_cnn fedavg_cnn resnet18 --steps 20
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
    print(f"{'model':<12}{'loss':<8}{'fp32 ms':>9}{'bf16 ms':>9}{'bf16 CL ms':>12}{'fp32/bf16':>11}{'fp32/bf16 CL':>14}")
    for model in args.models:
        for algorithm in args.algorithms:
            fp32, bf16, bf16_cl = (
                min(step_ms(model, algorithm, b, cl, args.steps) for _ in range(args.repeats))
                for b, cl in ((False, False), (True, False), (True, True))
            )
            print(f"{model:<12}{algorithm:<8}{fp32:>9.2f}{bf16:>9.2f}{bf16_cl:>12.2f}{fp32 / bf16:>10.2f}x{fp32 / bf16_cl:>13.2f}x", flush=True)


if __name__ == "__main__":
    main()
