"""Per-client persistent state with a memory budget.

Algorithms keep state on their clients between rounds (MOON's previous local models,
SCAFFOLD's control variates, personal layers, optimiser state). With 100 clients and a
ResNet-18 that is several GB per kind of state, so the store keeps the most recently used
clients in memory up to ``memory_bytes`` and spills the others to ``spill_dir``.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch


def state_bytes(obj: Any, _seen: set[int] | None = None) -> int:
    """Bytes held by the tensors in a nested structure (shared storages counted once)."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(state_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v, seen) for v in obj)
    return 0


class ClientStore:
    """LRU store of client states; states beyond the memory budget live on disk."""

    def __init__(self, memory_bytes: float, spill_dir: Path) -> None:
        self.memory_bytes = memory_bytes
        self.spill_dir = Path(spill_dir)
        self._memory: OrderedDict[int, tuple[dict[str, Any], int]] = OrderedDict()
        self._on_disk: set[int] = set()
        self._used = 0

    def __contains__(self, cid: int) -> bool:
        return cid in self._memory or cid in self._on_disk

    def get(self, cid: int) -> dict[str, Any] | None:
        """The state of ``cid``, or ``None`` if it has none yet."""
        if cid in self._memory:
            self._memory.move_to_end(cid)
            return self._memory[cid][0]
        if cid in self._on_disk:
            state = torch.load(self._path(cid), weights_only=False)
            self._on_disk.discard(cid)
            self._path(cid).unlink()
            self.put(cid, state)
            return state
        return None

    def put(self, cid: int, state: dict[str, Any]) -> None:
        if cid in self._memory:
            self._used -= self._memory.pop(cid)[1]
        size = state_bytes(state)
        self._memory[cid] = (state, size)
        self._used += size
        while self._used > self.memory_bytes and len(self._memory) > 1:
            old, (old_state, old_size) = self._memory.popitem(last=False)
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            torch.save(old_state, self._path(old))
            self._on_disk.add(old)
            self._used -= old_size

    @property
    def spilled(self) -> int:
        """Number of client states currently on disk."""
        return len(self._on_disk)

    def close(self) -> None:
        """Remove the spill files."""
        if self.spill_dir.exists():
            shutil.rmtree(self.spill_dir, ignore_errors=True)

    def _path(self, cid: int) -> Path:
        return self.spill_dir / f"client-{cid}.pt"
