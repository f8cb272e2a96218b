"""Seed derivation: every random stream of a run is a pure function of the run seed.

Streams are keyed by names and numbers (``derive_seed(seed, "plan", round, cid)``), so the
randomness a client sees does not depend on which other clients ran before it, on the
executor, or on the number of worker processes.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed derived from ``seed`` and ``keys`` (stable across processes)."""
    text = repr((int(seed),) + tuple(keys)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def generator(seed: int, *keys: object) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``derive_seed(seed, *keys)``."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, *keys))
    return g


def seed_global(seed: int, device: torch.device) -> None:
    """Seed the global random stream that dropout draws from on ``device``.

    Only the generators of the CPU and, on CUDA, of the current device are seeded:
    ``torch.manual_seed`` also queues a seeding call (with a stack trace) for every lazy
    accelerator backend, which costs half a millisecond per client on a CPU-only machine.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
