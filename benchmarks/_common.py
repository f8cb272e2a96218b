"""Shared helpers of the benchmark scripts: data, subprocess isolation, machine facts."""

from __future__ import annotations

import json
import os
import pickle
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ROOT.parent / "shared" / "data" / "cifar-10-batches-py"


def fake_cifar10(rows: int, seed: int = 0) -> Path:
    """A CIFAR-10-shaped dataset of random images in the official pickle format.

    Written once per (rows, seed) to the temp directory and loaded through the real
    ``cifar10`` loader with ``allow_subset=true``.
    """
    folder = Path(tempfile.gettempdir()) / f"contrafl-fake-cifar10-{rows}-{seed}"
    if (folder / "test_batch").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per = [rows // 5 + (1 if i < rows % 5 else 0) for i in range(5)]
    batches = [(f"data_batch_{i + 1}", n) for i, n in enumerate(per)] + [("test_batch", max(rows // 5, 1))]
    for name, n in batches:
        labels = rng.integers(0, 10, n)
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": labels.tolist(), "data": data,
                         "filenames": [f"img_{i}.png" for i in range(n)]}, f)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names, "num_cases_per_batch": per[0], "num_vis": 3072}, f)
    return folder


def cifar_dir(rows: int | None) -> tuple[Path, str]:
    """The real CIFAR-10 subset when it is there and large enough, else fake data."""
    if rows is None and SUBSET.exists():
        return SUBSET, "real CIFAR-10 subset (../shared/data)"
    rows = rows or 5000
    return fake_cifar10(rows), f"synthetic CIFAR-10-shaped data ({rows} images)"


def peak_rss_mb(children: bool = False) -> float:
    """Peak resident memory of this process, or of it and its finished child processes
    (whichever was larger), in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if children:
        peak = max(peak, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return peak / 1024


def run_isolated(script: Path, payload: dict) -> dict:
    """Run one measurement in a fresh interpreter (so peak memory is its own)."""
    proc = subprocess.run(
        [sys.executable, str(script), "--worker", json.dumps(payload)],
        capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed for {payload}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"]
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name(0)}")
    return "; ".join(parts)
