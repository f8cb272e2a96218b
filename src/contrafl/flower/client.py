"""The client side of a contrafl run on Flower: one partition's local training.

A SuperNode serves the client whose id is its node config's ``partition-id``. For each
train message it runs what the simulator runs for that client in the same round
(:meth:`contrafl.engine.simulation.Simulation.train_locally` with the sequential
executor: ``client_begin``, the local steps with the same plans and seeds,
``client_end``), on the run's config and partition read from the run directory, and
keeps the client's state (its algorithm state and optimiser state) in a file of its own,
so that it survives a restart of the SuperNode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import load_config
from ..engine.checkpoint import load_safe, save_atomic
from ..engine.setup import prepare
from ..engine.simulation import Simulation, check_partition
from ..errors import ContraflError

STATE_DIR = "flower-clients"


class FlowerClient:
    """Client ``cid`` of the run in ``run_dir`` (its ``config.yaml`` and ``partition.json``).

    The client's data are the rows of its partition; its state lives in
    ``state_dir/client-<cid>.pt`` (default ``run_dir/flower-clients``)."""

    def __init__(self, run_dir: Path, cid: int, state_dir: Path | None = None) -> None:
        self.run_dir = Path(run_dir)
        cfg = load_config(self.run_dir / "config.yaml", ["executor=sequential"])
        setup = prepare(cfg)
        check_partition(setup, self.run_dir, "start the SuperNodes with the data the run was started with")
        if not 0 <= cid < cfg.num_clients:
            raise ContraflError(f"partition-id={cid} is not a client of the run (0..{cfg.num_clients - 1}); set the SuperNode's --node-config partition-id")
        self.cid = cid
        self.sim = Simulation(setup)
        self.state_path = Path(state_dir or self.run_dir / STATE_DIR) / f"client-{cid}.pt"

    def train(self, round: int, message: dict[str, Any]) -> dict[str, Any]:
        """Round ``round``'s local training on ``message``: the reply as a tree
        (``payload``, ``num_samples``, ``loss``, ``steps``); the client's next state is
        saved before the reply leaves."""
        sim, cid = self.sim, self.cid
        if self.state_path.is_file():
            sim.store.put(cid, load_safe(self.state_path, f"client {cid}'s state", sim.device))
        phases = sim.algorithm.phases(round)
        outcome = next(iter(sim.train_locally(round, [cid], lambda _: message, phases)))
        entry = sim.store.get(cid)
        if entry is not None:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            save_atomic(entry, self.state_path)
        reply = outcome.reply
        return {
            "payload": reply.payload,
            "num_samples": reply.num_samples,
            "loss": outcome.loss,
            "steps": outcome.steps,
        }

