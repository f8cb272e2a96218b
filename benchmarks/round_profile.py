"""Where a round of a peer benchmark's shape goes, on the CPU or a GPU: torch.profiler over
a few rounds of contrafl's run, after warm-up rounds.

Prints the milliseconds a round (wall), the part spent launching or running the training
steps (``StepGraphs.run``: on a GPU a replayed graph returns once launched, so this is
host time there), the GPU's busy time a round (the sum of its kernels and copies), the
waits for the GPU (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, blocking copies)
and the operations and kernels that take the most time. Outside the steps the round is the
engine's: the clients' jobs and plans, stacking and unstacking their state, the replies'
checks, the aggregation and the evaluation.

    python benchmarks/round_profile.py --data-dir ../shared/data/cifar-10-batches-py
    python benchmarks/round_profile.py --data-dir DIR --device cuda --shape device --rounds 5
    python benchmarks/round_profile.py --data-dir DIR --device cuda executor=distributed workers=2   # any setting
    python benchmarks/round_profile.py --data-dir DIR --device cuda --cudnn-benchmark   # cuDNN's timed choice
    python benchmarks/round_profile.py --data-dir DIR --device cuda --unfold-conv   # convolutions as batched matmuls
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from _common import machine  # noqa: E402
from peers._common import SHAPES, contrafl_overrides  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpy")


def unfold_conv(conv: torch.nn.Conv2d, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``conv``'s convolution of ``x`` as ``weight [O, C*kh*kw] @ unfold(x) [N, C*kh*kw, L]``
    (numeric padding, one group; else as PyTorch computes it). Under ``vmap`` over clients
    with their own weights this is a batched matrix product, where PyTorch's batching rule
    for the convolution is a grouped convolution with one group per client."""
    if isinstance(conv.padding, str) or conv.groups != 1 or conv.padding_mode != "zeros":
        return CONV_FORWARD(conv, x, weight, bias)
    (kh, kw), (ph, pw), (sh, sw), (dh, dw) = weight.shape[-2:], conv.padding, conv.stride, conv.dilation
    oh = (x.shape[-2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (x.shape[-1] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    columns = F.unfold(x, (kh, kw), dilation=conv.dilation, padding=conv.padding, stride=conv.stride)
    out = (weight.flatten(1) @ columns).unflatten(-1, (oh, ow))
    return out if bias is None else out + bias[:, None, None]


CONV_FORWARD = torch.nn.Conv2d._conv_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="a cifar-10-batches-py folder (the subset in ../shared/data works)")
    parser.add_argument("--shape", default="device", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before the profiled ones (graphs captured, caches warm)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds profiled")
    parser.add_argument("--top", type=int, default=15, help="rows of each table")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its algorithms for each convolution's shape and keep the fastest "
                             "(torch.backends.cudnn.benchmark; contrafl leaves cuDNN's own choice)")
    parser.add_argument("--unfold-conv", action="store_true",
                        help="compute each convolution as unfold + matrix product (under vmap: one batched matrix "
                             "product over the clients instead of cuDNN's grouped convolution); a probe, not a setting")
    parser.add_argument("settings", nargs="*", help="more KEY=VALUE settings of contrafl's run")
    a = parser.parse_args()
    print(machine())
    torch.backends.cudnn.benchmark = a.cudnn_benchmark
    if a.unfold_conv:
        torch.nn.Conv2d._conv_forward = unfold_conv

    from contrafl.config import load_config
    from contrafl.execution import cuda_graphs
    from contrafl.engine.setup import prepare
    from contrafl.engine.simulation import Simulation

    shape = SHAPES[a.shape]
    total = a.warmup + a.rounds
    overrides = [*contrafl_overrides(shape, str(Path(a.data_dir).resolve()), 0, total), f"device={a.device}", *a.settings]
    sim = Simulation(prepare(load_config(None, overrides)), None, None)
    print(f"{a.shape} shape, {sim.cfg.executor} executor on {sim.device}: {a.warmup} rounds of warm-up, {a.rounds} profiled"
          + (", cuDNN benchmark mode" if a.cudnn_benchmark else "") + (", convolutions as unfold + matmul" if a.unfold_conv else ""))
    cuda = sim.device.type == "cuda"

    inside = [0.0]
    run = cuda_graphs.StepGraphs.run

    def timed(self, key, remaining, step):
        start = time.perf_counter()
        try:
            return run(self, key, remaining, step)
        finally:
            inside[0] += time.perf_counter() - start

    cuda_graphs.StepGraphs.run = timed
    for t in range(a.warmup):
        sim.run_round(t)
    if cuda:
        torch.cuda.synchronize()
    inside[0] = 0.0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for t in range(a.warmup, total):
            sim.run_round(t)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / a.rounds
    events = prof.key_averages()
    print(f"\n{1000 * wall:.1f} ms a round under the profiler; {1000 * inside[0] / a.rounds:.1f} ms of it in "
          f"StepGraphs.run (the steps{', launched' if cuda else ''})")
    if cuda:
        busy = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1000 / a.rounds
        waits = [e for e in events if e.key.startswith(WAITS)]
        print(f"GPU busy {busy:.1f} ms a round (kernels and copies); waits for the GPU a round: "
              + (", ".join(f"{e.key} {e.count / a.rounds:.0f}x {e.cpu_time_total / 1000 / a.rounds:.1f} ms" for e in waits) or "none"))
        print("\nkernels by GPU time (ms a round):")
        for e in sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)[: a.top]:
            print(f"  {e.self_device_time_total / 1000 / a.rounds:8.2f}  {e.count / a.rounds:7.0f}x  {e.key[:90]}")
    print("\noperations by host time (self, ms a round):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: a.top]:
        print(f"  {e.self_cpu_time_total / 1000 / a.rounds:8.2f}  {e.count / a.rounds:7.0f}x  {e.key[:90]}")
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / a.rounds
    print(f"\n{ops:.0f} ATen operations a round (those inside replayed graphs are not dispatched)")


if __name__ == "__main__":
    main()
