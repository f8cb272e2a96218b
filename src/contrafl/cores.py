"""The CPU cores this process may use, without importing torch (the Flower launcher
needs it as well as the engine)."""

from __future__ import annotations

import os


def cpu_cores() -> int:
    """The cores in this process's affinity mask (all the machine's where it has none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cores_each(processes: int) -> int:
    """Threads for each of ``processes`` processes sharing this process's cores:
    ``max(1, cores // processes)``."""
    return max(1, cpu_cores() // processes)
