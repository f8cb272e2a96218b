"""``contrafl deploy``: a contrafl config on a local Flower deployment.

:func:`prepare_run` makes the run directory the ServerApp and the ClientApps read (the
resolved ``config.yaml`` and the ``partition.json`` every client takes its rows from);
:func:`deploy` starts a SuperLink and one SuperNode per client on this machine
(:class:`~contrafl.flower.launch.LocalDeployment`) and runs contrafl's Flower app on them,
which writes the same run directory as ``contrafl run``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..config import Config
from ..engine.run_dir import RunDir
from ..engine.setup import prepare
from .launch import LocalDeployment, RunResult

APP_DIR = Path(str(resources.files("contrafl.flower") / "app"))
"""contrafl's Flower app directory (the argument of ``flwr run``)."""


def prepare_run(cfg: Config, path: Path) -> Config:
    """Write the run directory ``path`` (new or empty) of ``cfg``: the resolved config and
    the partition. Returns the resolved config."""
    setup = prepare(cfg)
    run_dir = RunDir(path)
    run_dir.write_config(setup.config)
    run_dir.write_text("partition.json", json.dumps(setup.partition.to_json()))
    run_dir.close()
    return setup.config


def run_config(path: Path, round_timeout: float, min_replies: int, wait_nodes: float = 120.0) -> dict[str, str | float | int]:
    """The app's run config for the run directory ``path``."""
    return {"run-dir": str(Path(path).resolve()), "round-timeout": round_timeout, "min-replies": min_replies, "wait-nodes": wait_nodes}


def deploy(
    cfg: Config, path: Path, *, tls: bool = False, round_timeout: float = 600.0, min_replies: int | None = None,
    timeout: float | None = None,
) -> RunResult:
    """Run ``cfg`` on a SuperLink and ``num_clients`` SuperNodes on this machine, the
    Flower processes' homes and logs in ``path/flower``; the run directory is ``path``."""
    cfg = prepare_run(cfg, path)
    with LocalDeployment(Path(path) / "flower", cfg.num_clients, tls=tls) as deployment:
        rc = run_config(path, round_timeout, min_replies if min_replies is not None else 1)
        return deployment.run(APP_DIR, rc, timeout=timeout)
