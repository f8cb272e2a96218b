"""Per-client persistent state with a memory budget and crash-safe checkpoints.

Algorithms keep state on their clients between rounds (MOON's previous local models,
SCAFFOLD's control variates, personal layers, optimiser state). With 100 clients and a
ResNet-18 that is several GB per kind of state, so the store keeps the most recently used
clients in memory up to ``memory_bytes`` and spills the others to ``directory``.

The same directory holds the client states of the run's checkpoints. Every write creates
a new file ``client-<cid>-<serial>.pt`` and never overwrites one, so the files named by
the last committed checkpoint stay intact whatever happens after it (a crash in the
middle of a round or of the next checkpoint): :meth:`checkpoint` writes the states that
changed since the last one and returns the manifest that the run's checkpoint file
records, :meth:`commit` removes the files no manifest needs any more once that file is
safely on disk, and :meth:`restore` goes back to a manifest.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .checkpoint import client_files, load_safe, save_atomic
from ..execution.executor import state_bytes
from ..files import fsync_dir


class ClientStore:
    """LRU store of client states; states beyond the memory budget live on disk.

    Args:
        memory_bytes: budget for the states kept in memory.
        directory: where spilled and checkpointed states are written.
        map_location: device that states loaded from disk are put on.
        keep: keep the directory on :meth:`close` (a run directory's checkpoint needs it).
    """

    def __init__(self, memory_bytes: float, directory: Path, map_location: Any = None, keep: bool = False) -> None:
        self.memory_bytes = memory_bytes
        self.directory = Path(directory)
        self.map_location = map_location
        self.keep = keep
        self._memory: OrderedDict[int, tuple[dict[str, Any], int, bool]] = OrderedDict()  # state, bytes, dirty
        self._files: dict[int, str] = {}  # latest file of each client on disk
        self._committed: set[str] = set()  # files named by the last committed checkpoint
        self._serial = 0
        self._used = 0
        self._check: Callable[[Any, Path, int], None] | None = None  # of states read back (restore)

    def __contains__(self, cid: int) -> bool:
        return cid in self._memory or cid in self._files

    def get(self, cid: int) -> dict[str, Any] | None:
        """The state of ``cid``, or ``None`` if it has none yet."""
        if cid in self._memory:
            self._memory.move_to_end(cid)
            return self._memory[cid][0]
        if cid in self._files:
            path = self.directory / self._files[cid]
            state = load_safe(path, f"client {cid}'s state", self.map_location)
            if self._check is not None:
                self._check(state, path, cid)
            self._keep_in_memory(cid, state, dirty=False)
            return state
        return None

    def put(self, cid: int, state: dict[str, Any]) -> None:
        """Set the state of ``cid`` (kept in memory until evicted or checkpointed)."""
        self._keep_in_memory(cid, state, dirty=True)

    def _keep_in_memory(self, cid: int, state: dict[str, Any], dirty: bool) -> None:
        if cid in self._memory:
            self._used -= self._memory.pop(cid)[1]
        size = state_bytes(state)
        self._memory[cid] = (state, size, dirty)
        self._used += size
        while self._used > self.memory_bytes and len(self._memory) > 1:
            old, (old_state, old_size, old_dirty) = self._memory.popitem(last=False)
            if old_dirty:
                self._write(old, old_state)
            self._used -= old_size

    def _write(self, cid: int, state: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._serial += 1
        name = f"client-{cid}-{self._serial}.pt"
        save_atomic(state, self.directory / name)
        previous = self._files.get(cid)
        if previous is not None and previous not in self._committed:
            (self.directory / previous).unlink(missing_ok=True)
        self._files[cid] = name

    # -- checkpoints ------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        """Write every state changed since the last checkpoint; the manifest to record."""
        for cid, (state, size, dirty) in list(self._memory.items()):
            if dirty:
                self._write(cid, state)
                self._memory[cid] = (state, size, False)
        fsync_dir(self.directory)
        return {"files": dict(self._files), "serial": self._serial}

    def commit(self, manifest: dict[str, Any]) -> None:
        """``manifest`` is now the checkpoint on disk: remove the files of the previous
        checkpoint that it does not name (the states written since; without listing the
        directory, whose size grows with the clients that have a state)."""
        committed = set(manifest["files"].values())
        for name in self._committed - committed - set(self._files.values()):
            (self.directory / name).unlink(missing_ok=True)
        self._committed = committed

    def restore(self, manifest: dict[str, Any], check: Callable[[Any, Path, int], None] | None = None) -> None:
        """Go back to the states of a committed checkpoint (forgetting memory); ``check``
        (e.g. :func:`~contrafl.engine.checkpoint.check_client_state`) is then applied to
        every state read back from disk. A manifest that names a file this store cannot
        have written (:func:`~contrafl.engine.checkpoint.client_files`) or a missing one
        is a :class:`CheckpointError` that changes nothing, here or on disk."""
        files = client_files(manifest, f"the client-state manifest of {self.directory}")
        missing = [n for n in files.values() if not (self.directory / n).is_file()]
        if missing:
            raise CheckpointError(
                f"client state {self.directory / missing[0]} named by the checkpoint is missing; "
                "the run directory is incomplete and cannot be resumed"
            )
        self._memory.clear()
        self._used = 0
        self._files = files
        self._serial = manifest["serial"]
        self._committed = set(files.values())
        self._check = check
        self._remove_unused()

    def clear(self) -> None:
        """Forget every state, as a new store (the directory's files go too)."""
        self.restore({"files": {}, "serial": 0})

    def _remove_unused(self) -> None:
        """Remove every file in the directory that neither the checkpoint nor the current
        states name (those of a crash: states and temporary files written after it)."""
        needed = self._committed | set(self._files.values())
        if self.directory.is_dir():
            for path in [*self.directory.glob("client-*.pt"), *self.directory.glob(".*.tmp")]:
                if path.name not in needed:
                    path.unlink(missing_ok=True)

    @property
    def spilled(self) -> int:
        """Number of client states that are on disk only."""
        return len(set(self._files) - set(self._memory))

    def close(self) -> None:
        """Remove the directory unless it is kept for a checkpoint (states still in
        memory stay readable)."""
        if not self.keep and self.directory.exists():
            shutil.rmtree(self.directory, ignore_errors=True)
