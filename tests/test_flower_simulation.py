"""contrafl's Flower app on Flower's simulation runtime (Ray): `flwr run` on a local
simulation SuperLink with 3 simulated SuperNodes gives the simulator's metrics bit for
bit. Needs the flower-simulation extra (ray); skipped without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from contrafl.cli import main  # noqa: E402
from contrafl.flower.deploy import APP_DIR  # noqa: E402

SETTINGS = ["algorithm=moon", "num_clients=3", "rounds=2", "local_epochs=1", "executor=sequential", "eval_personal=false"]


@pytest.mark.slow
def test_flower_simulation_runtime_equals_the_simulator(tmp_path):
    assert main(["deploy", "--prepare-only", "--insecure", "--out", str(tmp_path / "run"), *SETTINGS]) == 0
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home"), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    try:
        subprocess.run(
            [str(bin_dir / "flwr"), "run", str(APP_DIR), "--stream", "--run-config", str(tmp_path / "run" / "flower-run.toml"),
             "--federation-config", "num-supernodes=3"],
            env=env, check=True, timeout=600, stdin=subprocess.DEVNULL, capture_output=True,
        )
    finally:  # flwr leaves the simulation SuperLink it started running
        subprocess.run(["pkill", "-f", str(tmp_path / "home")], check=False)
    assert main(["run", "--quiet", "--out", str(tmp_path / "sim"), *SETTINGS]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == (tmp_path / "sim" / "metrics.jsonl").read_text()
