"""The arithmetic floor of the peer benchmarks' shapes on this CPU: how long any program
takes for their local steps when it does nothing but a plain PyTorch training loop.

    python benchmarks/peers/floor.py [--shape silo|device|both] [--processes 2]

A shape's local training is ``samples`` images in batches of ``batch`` through MOON's CNN
with its head (``_common.moon_cnn``, the model both programs train), cross-entropy, plain
SGD, forward and backward, eager PyTorch. Here ``processes`` processes of one thread each
(as pfl under ``torchrun`` and contrafl's ranks run) each train ``samples / processes``
images, in NCHW (pfl's layout) and channels-last (contrafl's on the CPU), on random
data held in memory: no data loading, no aggregation, no evaluation, no start-up. The
wall time of the slowest process is the floor: a program that runs the same steps with
PyTorch's CPU kernels cannot finish its training faster. The samples of each shape are
those of the issue's runs on the 10% CIFAR-10 subset (every sampled client's images,
every round, every epoch).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import moon_cnn  # noqa: E402

# images trained in each shape's run (clients x images x epochs x rounds), and the batch
SHAPES = {
    "silo": (5085 * 5 * 10, 64),  # every client of the subset's 5,085 images, 5 epochs, 10 rounds
    "device": (2542 * 100, 10),  # 50 of 100 clients of about 50.85 images, 1 epoch, 100 rounds
}


def train(samples: int, batch: int, channels_last: bool, out: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = moon_cnn()
    x, y = torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,))
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = -(-samples // batch)
    for i in range(20):  # warm-up
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:batch]), y[:batch]).backward()
        opt.step()
    start = time.perf_counter()
    for i in range(steps):
        j = i * batch % (len(x) - batch)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[j : j + batch]), y[j : j + batch]).backward()
        opt.step()
    out.put(time.perf_counter() - start)


def floor(samples: int, batch: int, processes: int, channels_last: bool) -> float:
    """The slowest of ``processes`` processes training their share of ``samples``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=train, args=(samples // processes, batch, channels_last, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    times = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return max(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["silo", "device", "both"], default="both")
    p.add_argument("--processes", type=int, default=2)
    a = p.parse_args()
    for shape in ["silo", "device"] if a.shape == "both" else [a.shape]:
        samples, batch = SHAPES[shape]
        for name, cl in (("NCHW", False), ("channels-last", True)):
            seconds = floor(samples, batch, a.processes, cl)
            print(f"{shape}: {samples:,} images in batches of {batch} on {a.processes} processes, {name}: {seconds:.1f} s "
                  f"({seconds / (samples / a.processes) * 1e6:.0f} us an image)")


if __name__ == "__main__":
    main()
