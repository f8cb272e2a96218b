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
from typing import TextIO

from ..config import Config
from ..errors import ConfigError
from ..engine.run_dir import RunDir
from ..engine.setup import cpu_cores, prepare
from .launch import LocalDeployment, RunResult, toml_document

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
    cfg: Config, path: Path, *, resume: bool = False, tls: bool = False, round_timeout: float = 600.0,
    min_replies: int = 1, timeout: float | None = None, echo: TextIO | None = None,
) -> RunResult:
    """Run ``cfg`` on a SuperLink and ``num_clients`` SuperNodes on this machine, the
    Flower processes' homes and logs in ``path/flower``; the run directory is ``path``.
    ``resume``: the run is already in ``path`` (``cfg`` is its ``config.yaml``) and
    continues from its last checkpoint. The server's output (its progress) also goes to
    ``echo`` when given."""
    if not 0 < round_timeout:
        raise ConfigError(f"round_timeout={round_timeout:g} must be positive (seconds a round waits for replies)")
    if not 0 <= min_replies <= cfg.num_clients:
        raise ConfigError(f"min_replies={min_replies} must be between 0 and num_clients={cfg.num_clients}")
    if not resume:
        cfg = prepare_run(cfg, path)
    with LocalDeployment(Path(path) / "flower", cfg.num_clients, tls=tls, node_configs=shared_cores(cfg.num_clients)) as deployment:
        return deployment.run(APP_DIR, run_config(path, round_timeout, min_replies), timeout=timeout, echo=echo)


def shared_cores(num_nodes: int) -> list[dict[str, int]]:
    """Node configs for ``num_nodes`` SuperNodes on this machine: each client's torch
    gets an equal share of the cores (more threads than cores make every client wait
    for the others' spinning threads)."""
    return [{"threads": max(1, cpu_cores() // num_nodes)} for _ in range(num_nodes)]


def commands(path: Path, num_clients: int, round_timeout: float = 600.0, min_replies: int = 1) -> str:
    """How to run the prepared run directory ``path`` on a Flower deployment of one's own
    (SuperLink and SuperNodes on any machines): the commands, with the app's run config
    written to ``path/flower-run.toml``."""
    path = Path(path).resolve()
    rc = path / "flower-run.toml"
    rc.write_text(toml_document(run_config(path, round_timeout, min_replies)))
    last = num_clients - 1
    return "\n".join([
        f"The run directory {path} is ready. On the Flower deployment (flwr 1.41, contrafl[flower] installed everywhere):",
        "  server machine:",
        "    flower-superlink --insecure --disable-runtime-dependency-installation          # port 8000 (--host 0.0.0.0 to accept other machines)",
        f"  each client K = 0..{last}, on its machine, with config.yaml and partition.json of the run directory in RUN_DIR and the data in DATA_DIR:",
        "    flower-supernode --insecure --superlink SERVER:8000 --node-config \"partition-id=K run-dir='RUN_DIR' data-dir='DATA_DIR'\"",
        "  then, where flwr's config.toml names the SuperLink as CONNECTION:",
        f"    flwr run {APP_DIR} CONNECTION --stream --run-config {rc}",
        "(docs/flower.md: TLS, several machines, faults and restarts)",
    ])
