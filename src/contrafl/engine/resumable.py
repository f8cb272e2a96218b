"""Checkpoint and resume: what a run writes to continue exactly, and reads back.

Every ``checkpoint_every`` rounds (and after the last) the run directory gets a
checkpoint with everything needed to continue exactly: the server's state and
optimiser, every client's state (:class:`~contrafl.engine.client_store.ClientStore`),
the metrics so far, the communication totals and a robust aggregator's state (centered
clipping's previous aggregates). Every random stream is derived from
(seed, round, client) (:mod:`contrafl.rng`), so :meth:`Resumable.restore` followed by
:meth:`~contrafl.engine.simulation.Simulation.run` continues with the same numbers as a
run that was never stopped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..algorithms.base import ServerState
from .checkpoint import CHECKPOINT_FORMAT, check_checkpoint, check_client_state, history_rows, is_whole, pack_history, save_atomic


class Resumable:
    """The checkpoint part of :class:`~contrafl.engine.simulation.Simulation`."""

    def save_checkpoint(self, seconds: float) -> None:
        """Write the checkpoint of the rounds done so far (atomically, client states
        first) and the summary that goes with it."""
        assert self.run_dir is not None
        start = time.perf_counter()
        manifest = self.store.checkpoint()
        save_atomic(
            {
                "format": CHECKPOINT_FORMAT,
                "round": self.rounds_done,
                "fingerprint": self.fingerprint,
                "config": self.cfg.to_dict(),
                "server": {"model": self.server.model, "extras": self.server.extras},
                "server_optimizer": self.server_opt.state_dict(),
                "clients": manifest,
                "history": pack_history(self.history),
                "comm_total": self.comm_total,
                "privacy": self.privacy.state_dict() if self.privacy is not None else {},
                **({"aggregator": self.robust.state_dict()} if self.robust is not None else {}),
                "wall_time_s": self.wall_time_before + seconds,
                **({"extensions": self.extensions} if self.extensions else {}),
                **({"placement": self.placement} if self.placement else {}),
            },
            self.run_dir.checkpoint_path,
        )
        self.store.commit(manifest)
        self.checkpointed = self.rounds_done
        self.checkpoint_seconds += time.perf_counter() - start
        self.run_dir.write_json("summary.json", self.summary("running", seconds))

    def restore(self, checkpoint: Any, path: Path) -> None:
        """Continue from ``checkpoint``, read from ``path`` (:func:`load_checkpoint`), once
        :func:`~contrafl.engine.checkpoint.check_checkpoint` has found it one of this
        configuration and initial server model: server, clients, metrics; the run
        directory's metrics and timing files are cut back to it. Tensors go to this
        simulation's device (a run may resume on another one). A checkpoint of this
        configuration with fewer rounds extends the run (:attr:`extensions`)."""
        check_checkpoint(checkpoint, path, self.cfg, self.server.model)
        on_device = pytree.tree_map_only(torch.Tensor, lambda t: t.to(self.device), checkpoint)
        self.server = ServerState(on_device["server"]["model"], on_device["server"]["extras"])
        self.server_opt.load_state_dict(on_device["server_optimizer"])
        self.store.restore(checkpoint["clients"], check_client_state)
        self.history = list(history_rows(checkpoint))
        self.comm_total = checkpoint["comm_total"]
        self.rounds_done = self.checkpointed = int(checkpoint["round"])
        if self.privacy is not None:  # the rows metrics.jsonl published after the checkpoint count too
            later = [r for r in self.run_dir.rows("metrics.jsonl") if is_whole(r.get("round")) and r["round"] > self.rounds_done] if self.run_dir else []
            self.privacy.load_state_dict(checkpoint.get("privacy", {}), self.history + later, f"checkpoint {path}")
        if self.robust is not None:
            self.robust.load_state_dict(on_device.get("aggregator", {}))
        self.extensions = [dict(e) for e in checkpoint.get("extensions", [])]
        self.placement = dict(checkpoint.get("placement", {}))
        before = checkpoint["config"].get("rounds")
        if is_whole(before) and before < self.cfg.rounds:  # check_checkpoint let only the rounds grow
            self.extensions.append({"from": before, "to": self.cfg.rounds, "after": self.rounds_done})
        self.wall_time_before = float(checkpoint["wall_time_s"])
        if self.run_dir is not None:
            self.run_dir.truncate(self.rounds_done, self.history)
        if self.progress is not None:
            self.progress.resume_at(self.rounds_done)
