"""contrafl on a real Flower deployment: a SuperLink and 3 SuperNodes as subprocesses on
127.0.0.1 run the same algorithm objects as the simulator.

The clients train with the simulator's sequential executor, on the same plans and seeds,
in processes of the same machine and torch build, and the server runs the simulator's
own round loop, so a run must end with the simulator's metrics and final parameters to
the last bit (no tolerance: any difference is a difference in what was computed).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("flwr")

from contrafl.cli import main  # noqa: E402
from contrafl.config import load_config  # noqa: E402
from contrafl.flower.deploy import APP_DIR, prepare_run, run_config, shared_cores  # noqa: E402
from contrafl.flower.launch import LocalDeployment  # noqa: E402
from conftest import torch_threads  # noqa: E402

CLIENTS = 3
COMMON = [f"num_clients={CLIENTS}", "rounds=2", "local_epochs=1", "executor=sequential", "eval_personal=false"]
SSL = ["knn_k=5", "model.projection_hidden=16", "model.projection_dim=8", "algorithm.predictor_hidden=16"]
RUNS = {
    "fedavg": [],
    "scaffold": [],
    "moon": [],
    "fedcrl": ["pool=true", "test_fraction=0.25", "eval_personal=true"],  # evaluate messages
    "fedu2": SSL,
}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with LocalDeployment(tmp_path_factory.mktemp("flower"), CLIENTS) as d:
        yield d


@pytest.mark.parametrize("algorithm", list(RUNS))
def test_deployment_equals_the_simulator(tmp_path, deployment, algorithm):
    settings = [f"algorithm={algorithm}", *COMMON, *RUNS[algorithm]]
    prepare_run(load_config(None, settings), tmp_path / "flower-run")
    deployment.run(APP_DIR, run_config(tmp_path / "flower-run", round_timeout=120, min_replies=CLIENTS), timeout=600)
    assert main(["run", "--quiet", "--out", str(tmp_path / "sim"), *settings]) == 0
    rows = [[json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in ("sim", "flower-run")]
    assert len(rows[0]) == 2 and rows[0] == rows[1]
    models = [torch.load(tmp_path / r / "checkpoint.pt", weights_only=False)["server"] for r in ("sim", "flower-run")]
    for k, v in models[0]["model"].items():
        assert torch.equal(v, models[1]["model"][k]), k
    summary = json.loads((tmp_path / "flower-run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2


def test_contrafl_deploy_with_tls_equals_the_simulator(tmp_path, capsys):
    """`contrafl deploy --tls`: its own SuperLink (certificates generated for the run) and
    SuperNodes, the run directory of `contrafl run`, the simulator's metrics."""
    settings = ["algorithm=moon", "num_clients=2", "rounds=1", "local_epochs=1", "executor=sequential", "eval_personal=false"]
    assert main(["deploy", "--tls", "--round-timeout", "120", "--out", str(tmp_path / "flower-run"), *settings]) == 0
    out = capsys.readouterr().out
    assert "round 1/1  |####################|  loss" in out and "finished:completed" in out  # the server's progress, as it comes
    assert (tmp_path / "flower-run" / "flower" / "certs").is_dir()
    states = sorted(p.relative_to(tmp_path / "flower-run" / "flower-clients").as_posix() for p in (tmp_path / "flower-run" / "flower-clients").rglob("*"))
    assert states == ["client-0", "client-0/round-0.pt", "client-1", "client-1/round-0.pt"]
    with torch_threads(shared_cores(2)[0]["threads"]):  # each client's threads in the deployment
        assert main(["run", "--quiet", "--out", str(tmp_path / "sim"), *settings]) == 0
    assert (tmp_path / "sim" / "metrics.jsonl").read_text() == (tmp_path / "flower-run" / "metrics.jsonl").read_text()
