"""A fixed run writes the same metrics, checkpoint and client states as the stored digest.

The digest (tests/run_digest.json) was taken before the executors moved below the round
loop and ``Simulation`` was split by concern; it guards every later refactor of the round
loop or the executors: a change that alters a single bit of what a run computes fails
here. The runs are pinned to one core and to the CPU's portable code paths (ATen's
default kernels, MKL's compatible mode, oneDNN's SSE4.1), so that the bits do not
depend on the machine: another thread count or vector width sums in another order.

To record a new digest after a deliberate change of the numbers:
``CONTRAFL_UPDATE_DIGEST=1 python -m pytest tests/test_same_bytes.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from contrafl.engine.checkpoint import history_rows

DIGEST = Path(__file__).with_name("run_digest.json")
RUN = ["dataset=digits", "algorithm=moon", "rounds=3", "num_clients=4", "sample_fraction=0.75",
       "local_epochs=1", "checkpoint_every=1", "seed=3"]
EXECUTORS = {"sequential": ["executor=sequential"], "distributed": ["executor=distributed", "workers=2"]}
PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
NOT_COMPUTED = {"wall_time_s", "format"}  # the entries of a checkpoint that the run does not compute


def feed(h: "hashlib._Hash", value: Any) -> None:
    """Hash ``value`` canonically: dict keys in order, tensors by dtype, shape and bytes."""
    if isinstance(value, dict):
        h.update(b"{")
        for key in sorted(value, key=repr):
            if key in NOT_COMPUTED:
                continue
            h.update(repr(key).encode())
            feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            feed(h, item)
        h.update(b"]")
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(value).encode())


def digest(out: Path) -> dict[str, str]:
    """sha256 of what the run computed: metrics.jsonl's bytes, the checkpoint's contents
    but its wall time and format (its metrics rows unpacked), every client state file's
    bytes."""
    found = {"metrics.jsonl": hashlib.sha256((out / "metrics.jsonl").read_bytes()).hexdigest()}
    h = hashlib.sha256()
    checkpoint = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    feed(h, {**checkpoint, "history": history_rows(checkpoint)})
    found["checkpoint.pt"] = h.hexdigest()
    for path in sorted((out / "client-state").iterdir()):
        found[f"client-state/{path.name}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins the run to one core (Linux)")
@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_fixed_run_writes_the_stored_bytes(tmp_path, executor):
    out = tmp_path / "run"
    env = {**os.environ, **PORTABLE}
    proc = subprocess.run(
        [sys.executable, "-m", "contrafl", "run", *RUN, *EXECUTORS[executor], "--out", str(out), "--quiet"],
        env=env, capture_output=True, text=True, preexec_fn=one_core, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    found = digest(out)
    stored = json.loads(DIGEST.read_text()) if DIGEST.is_file() else {}
    if os.environ.get("CONTRAFL_UPDATE_DIGEST"):
        DIGEST.write_text(json.dumps({**stored, executor: found}, indent=2, sort_keys=True) + "\n")
        pytest.skip("digest recorded")
    assert found == stored[executor]
