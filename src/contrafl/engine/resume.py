"""Simulations of existing run directories: a run resumed from its last checkpoint, or
opened read-only for an analysis."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..execution.context import Setup
from .checkpoint import check_checkpoint, check_client_state, client_files, load_safe
from .progress import Progress
from .run_dir import CHECKPOINT, RunDir
from .simulation import Simulation


def check_partition(setup: Setup, path: Path, advice: str) -> None:
    """Stop with a :class:`CheckpointError` when the data give another partition than the
    run directory ``path`` recorded."""
    partition = path / "partition.json"
    if partition.is_file() and partition.read_text() != json.dumps(setup.partition.to_json()):
        raise CheckpointError(f"the data gives another partition than {partition} (different dataset files?); {advice}")


def resume(setup: Setup, run_dir: RunDir, progress: Progress | None = None) -> Simulation:
    """A simulation that continues the run in ``run_dir`` from its last checkpoint, or
    from round 0 when it has none yet (its per-round files are then emptied). The data
    must give the partition the run started with."""
    check_partition(setup, run_dir.path, "resume with the data the run started with")
    sim = Simulation(setup, run_dir, progress)
    checkpoint = load_checkpoint(run_dir.path)
    if checkpoint is not None:
        sim.restore(checkpoint, run_dir.checkpoint_path)
    else:
        if sim.privacy is not None:
            sim.privacy.load_state_dict({}, run_dir.rows("metrics.jsonl"), f"{run_dir.path / 'metrics.jsonl'}")
        run_dir.truncate(0, [])
    return sim


def read_only(setup: Setup, path: Path, checkpoint: dict[str, Any], clients: Iterable[int] | None = None) -> Simulation:
    """A simulation in the state of ``checkpoint``, the last checkpoint of the run in
    ``path`` (:func:`load_checkpoint`), that writes nothing there, for analyses of the
    run (``contrafl eval-repr``): it has no run directory, its client store spills to a
    private temporary directory (removed by ``sim.store.close()``), and it loads the
    client states the checkpoint names from the run's ``client-state/``
    (:attr:`RunDir.client_dir`) into that store: only those of ``clients`` when given,
    the other clients then look as if they had no state yet. The data must give the
    run's partition."""
    path = Path(path)
    check_partition(setup, path, "analyse the run with the data it was trained on")
    sim = Simulation(setup)
    where = path / CHECKPOINT
    check_checkpoint(checkpoint, where, setup.config, sim.server.model)  # with the manifest restore is not given
    files = client_files(checkpoint["clients"], f"checkpoint {where}")
    sim.restore({**checkpoint, "clients": {"files": {}, "serial": checkpoint["clients"]["serial"]}}, where)
    for cid in files if clients is None else [c for c in clients if c in files]:
        state = load_safe(path / "client-state" / files[cid], f"client {cid}'s state", sim.device)
        check_client_state(state, path / "client-state" / files[cid], cid)
        sim.store.put(cid, state)
    return sim


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The checkpoint of a run directory (loaded safely), or None if it has none yet."""
    path = Path(run_dir) / CHECKPOINT
    return load_safe(path, "checkpoint", map_location="cpu") if path.is_file() else None

