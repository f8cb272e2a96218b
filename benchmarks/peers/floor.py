"""The arithmetic floor of the peer benchmarks' shapes on this CPU: how long any program
takes for their local steps when it does nothing but a plain PyTorch training loop.

    python benchmarks/peers/floor.py [--shape silo|device|both] [--processes 2] [--seed 0]
                                     [--data-dir DIR] [--full-batches-only]
    python benchmarks/peers/pfl_research.py --shape both --floor   # alternated with the programs

A shape's local training is its batches through MOON's CNN with its head
(``_common.moon_cnn``, the model both programs train), cross-entropy, plain SGD, forward
and backward, eager PyTorch. The batches are those of the shape's run for ``--seed``:
contrafl's partition of the CIFAR-10 data in ``--data-dir`` and its sampled clients of
every round (``_common.make_spec``, what the peer benchmarks check both programs against),
each sampled client's epochs cut into batches with the last partial one kept, as both
programs train them. Here ``processes`` processes of one thread each (as pfl under
``torchrun`` and contrafl's ranks run) each train every ``processes``-th batch, in NCHW
(pfl's layout) and channels-last (contrafl's on the CPU), on random data held in memory:
no data loading, no aggregation, no evaluation, no start-up. The wall time of the
slowest process is the floor: a program that runs the same steps one client at a time
with PyTorch's CPU kernels cannot finish its training faster (stacked clients can:
contrafl's on the device shape, docs/performance.md). ``--full-batches-only`` leaves the partial
batches out (the floor as issues #36 and #57 first measured it; for seed 0 the partial
batches are 4,226 of the device shape's 29,226 steps and 500 of the silo shape's 4,300).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHAPES, make_spec, moon_cnn  # noqa: E402


def batches(shape: str, data_dir: str, seed: int) -> list[int]:
    """The batch sizes of ``shape``'s local steps in its run for ``seed``, in order."""
    import tempfile

    with tempfile.TemporaryDirectory() as work:  # the spec's files (its initial weights), not needed here
        spec = make_spec(SHAPES[shape], data_dir, seed, SHAPES[shape].rounds, Path(work))
    return [b for steps in round_batches(spec) for b in steps]


def round_batches(spec: dict) -> list[list[int]]:
    """Each round's batch sizes in the run of a peer benchmark's spec (``_common.make_spec``):
    the round's sampled clients, each client's epochs of ``ceil(n / batch)`` batches, the
    last one partial."""
    b, out = spec["batch_size"], []
    for sampled in spec["schedule"]:
        sizes = []
        for cid in sampled:
            n = len(spec["clients"][cid])
            sizes += ([b] * (n // b) + ([n % b] if n % b else [])) * spec["local_epochs"]
        out.append(sizes)
    assert [len(r) for r in out] == spec["local_steps"]
    return out


def train(sizes: list[int], channels_last: bool, out: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = moon_cnn()
    x, y = torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,))
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for batch in sorted(set(sizes)) * 5:  # warm-up: every batch shape
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:batch]), y[:batch]).backward()
        opt.step()
    start = time.perf_counter()
    j = 0
    for batch in sizes:
        j = j + batch if j + 2 * batch <= len(x) else 0
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[j : j + batch]), y[j : j + batch]).backward()
        opt.step()
    out.put(time.perf_counter() - start)


def floor(sizes: list[int], processes: int, channels_last: bool) -> float:
    """The slowest of ``processes`` processes, each training every ``processes``-th batch."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=train, args=(sizes[i::processes], channels_last, out)) for i in range(processes)]
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
    p.add_argument("--seed", type=int, default=0, help="the run whose partition and sampled clients give the batches")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2].parent / "shared/data/cifar-10-batches-py"),
                   help="the cifar-10-batches-py folder (default: ../shared/data/cifar-10-batches-py beside the repository)")
    p.add_argument("--full-batches-only", action="store_true", help="leave out the clients' partial last batches")
    p.add_argument("--spec", type=Path, help="the batches of a peer benchmark's spec instead (its --floor), channels-last")
    p.add_argument("--out", type=Path, help="with --spec: where to write record.json")
    a = p.parse_args()
    if a.spec is not None:
        if a.out is None:
            p.error("--spec needs --out DIR (where record.json goes)")
        spec = json.loads(a.spec.read_text())
        rounds = round_batches(spec)
        seconds = floor([b for steps in rounds for b in steps], a.processes, True)
        a.out.mkdir(parents=True, exist_ok=True)
        record = {"floor": True, "clients": spec["schedule"], "local_steps": [len(r) for r in rounds], "test_acc": {}, "rounds_s": seconds}
        (a.out / "record.json").write_text(json.dumps(record))
        return
    for shape in ["silo", "device"] if a.shape == "both" else [a.shape]:
        sizes = batches(shape, a.data_dir, a.seed)
        if a.full_batches_only:
            sizes = [b for b in sizes if b == SHAPES[shape].batch_size]
        for name, cl in (("NCHW", False), ("channels-last", True)):
            seconds = floor(sizes, a.processes, cl)
            print(f"{shape}: {sum(sizes):,} images in {len(sizes):,} batches (of {SHAPES[shape].batch_size} and "
                  f"{sum(b < SHAPES[shape].batch_size for b in sizes):,} partial) on {a.processes} processes, {name}: "
                  f"{seconds:.1f} s ({seconds / (sum(sizes) / a.processes) * 1e6:.0f} us an image)")


if __name__ == "__main__":
    main()
