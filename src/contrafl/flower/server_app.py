"""contrafl's Flower ServerApp: ``flwr run`` with run config ``run-dir`` (a run directory
prepared by ``contrafl deploy``: its ``config.yaml`` and ``partition.json``).

The run continues from the directory's last checkpoint (from round 0 when it has none),
so a ServerApp started again after a crash or a kill resumes the run.
"""

from __future__ import annotations

from pathlib import Path

from .codec import require_flwr

require_flwr()

from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from ..config import load_config  # noqa: E402
from ..engine.run_dir import RunDir  # noqa: E402
from ..engine.setup import prepare  # noqa: E402
from ..engine.simulation import resume  # noqa: E402
from .server import GridTransport  # noqa: E402

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run (or resume) the run in ``run-dir`` with its clients on the grid's SuperNodes."""
    rc = context.run_config
    run_dir = RunDir(Path(str(rc["run-dir"])), resume=True)
    setup = prepare(load_config(run_dir.path / "config.yaml"))
    sim = resume(setup, run_dir)
    sim.transport = GridTransport(grid, float(rc["round-timeout"]), int(rc["min-replies"]), float(rc["wait-nodes"]))
    summary = sim.run()
    print(f"contrafl: {summary['status']} after {summary['rounds_completed']} rounds; results in {run_dir.path}")
