"""Shared helpers of the peer benchmarks: the machine, timed subprocesses, medians.

Nothing here imports contrafl or a peer: every timed program runs in its own process,
started the way its users start it, and is timed from before the process starts to
after it exits (interpreter start-up, imports, data loading and worker start-up count).
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def cpu_info() -> dict[str, object]:
    """CPU model, logical cores usable by this process, and the SIMD flags that decide
    the fp32 peak (avx2/fma/avx512f)."""
    model, flags, mhz = "unknown", set(), None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model == "unknown":
            model = value
        elif key == "flags" and not flags:
            flags = set(value.split())
        elif key == "cpu MHz" and mhz is None:
            try:
                mhz = float(value)
            except ValueError:
                pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": model,
        "cores": cores,
        "mhz": mhz,
        "avx2": "avx2" in flags,
        "fma": "fma" in flags,
        "avx512f": "avx512f" in flags,
        "python": platform.python_version(),
    }


def print_machine(python: str) -> dict[str, object]:
    info = cpu_info()
    torch_version = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__, torch.get_num_threads())"],
        capture_output=True, text=True,
    ).stdout.strip()
    print(f"machine: {info['model']}, {info['cores']} cores, cpu MHz {info['mhz']}, "
          f"avx2={info['avx2']} fma={info['fma']} avx512f={info['avx512f']}")
    print(f"python: {python} ({info['python']}); torch, intra-op threads: {torch_version}")
    print(f"load average at start: {load()}")
    return info


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def timed(cmd: list[str], cwd: str | Path | None, log: Path, env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Run ``cmd`` to completion; return (wall seconds from before the process starts
    to after it exits, exit status, its stdout+stderr). The output also goes to ``log``."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)
    wall = time.perf_counter() - start
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout)
    return wall, proc.returncode, proc.stdout


def show(cmd: list[str], cwd: str | Path | None = None) -> str:
    text = " ".join(shlex.quote(c) for c in cmd)
    return f"(cd {shlex.quote(str(cwd))} && {text})" if cwd else text


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def contrafl_command(python: str) -> list[str]:
    """The ``contrafl`` console script beside ``python`` (as a user types it), else
    ``python -m contrafl``."""
    script = Path(python).parent / "contrafl"
    return [str(script)] if script.exists() else [python, "-m", "contrafl"]


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)
