"""contrafl's Flower ServerApp: ``flwr run`` with run config ``run-dir`` (a run directory
prepared by ``contrafl deploy``: its ``config.yaml`` and ``partition.json``); with
``secure-aggregation=true`` its training rounds run through SecAgg+
(:class:`~contrafl.flower.server.SecureTransport`).

The run continues from the directory's last checkpoint (from round 0 when it has none),
so a ServerApp started again after a crash or a kill resumes the run.
"""

from __future__ import annotations

from pathlib import Path

from . import codec  # noqa: F401  (first: a clear error when flwr is missing)
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..config import load_config
from ..engine.progress import Progress
from ..engine.run_dir import RunDir
from ..engine.setup import prepare
from ..engine.simulation import resume
from ..errors import ContraflError
from ..words import count
from .node import REPRODUCIBLE_WARNING, reproducible_noise
from .secagg import refusal
from .server import GridTransport, SecureTransport

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run (or resume) the run in ``run-dir`` with its clients on the grid's SuperNodes."""
    rc = context.run_config
    run_dir = RunDir(Path(str(rc["run-dir"])), resume=True)
    setup = prepare(load_config(run_dir.path / "config.yaml"))
    if reproducible_noise(setup.config):
        print(f"contrafl: warning: {REPRODUCIBLE_WARNING}", flush=True)
    secure = bool(rc.get("secure-aggregation", False))
    why = refusal(type(setup.algorithm), setup.algorithm.params, setup.config) if secure else None
    if secure and setup.config.node_data == "own":
        why = "the weights are quantised by the largest client's sample count, which the server of node_data=own does not know"
    if why is not None:  # a run config written by hand: contrafl deploy refuses it before
        raise ContraflError(f"secure aggregation shows the server only the mean of the updates, but {why}; run without secure-aggregation")
    sim = resume(setup, run_dir, Progress(setup.config.rounds))
    settings = (setup.config.num_clients, float(rc["round-timeout"]), int(rc["min-replies"]), float(rc["wait-nodes"]))
    if secure:
        largest = max(len(rows) for rows in setup.partition.train)
        sim.transport = SecureTransport(grid, context, setup.config.seed, largest, *settings, checkpointed=lambda: sim.checkpointed)
    else:
        sim.transport = GridTransport(grid, *settings, checkpointed=lambda: sim.checkpointed)
    summary = sim.run()
    print(f"contrafl: {summary['status']} after {count(summary['rounds_completed'], 'round')}; results in {run_dir.path}")
