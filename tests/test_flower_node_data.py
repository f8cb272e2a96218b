"""A real Flower federation whose sites keep their data: a SuperLink over TLS and
SuperNodes as subprocesses on 127.0.0.1, each with a folder of images no other node has,
and a run directory of its own holding only the run's config.yaml (no partition.json, no
dataset). The run ends equal, bit for bit, to `contrafl run` of the same per-client
folders (``dataset=folder partition=natural``); a node whose classes do not fit the
federation is refused with one line in its log and the server's, and the run goes on
without it.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow  # real SuperLink and SuperNode processes

from PIL import Image  # noqa: E402

from contrafl.cli import main  # noqa: E402
from contrafl.config import load_config  # noqa: E402
from contrafl.flower.deploy import APP_DIR, prepare_run, run_config  # noqa: E402
from contrafl.flower.launch import LocalDeployment  # noqa: E402
from conftest import torch_threads  # noqa: E402

SITES = {"site-a": ["cat", "dog"], "site-b": ["dog", "owl"], "site-c": ["cat", "dog", "owl"]}
FEDERATION = ["dataset=folder", "dataset.classes=[cat,dog,owl]", "dataset.shape=[3,8,8]", "normalize=half"]
SETTINGS = ["algorithm=moon", "num_clients=3", "rounds=2", "local_epochs=1", "batch_size=8", "model=mlp", "model.hidden=[32]",
            "model.projection_dim=8", "executor=sequential", "eval_personal=false"]


def image_tree(folder: Path, classes: list[str], per_class: int, seed: int) -> None:
    """``folder/{train,test}/<class>/<i>.png``: 8x8 RGB images, a colour per class."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("test", max(1, per_class // 3))):
        for c in classes:
            (folder / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                pixels[..., 0] = {"cat": 20, "dog": 120, "owl": 220, "horse": 60}[c]
                Image.fromarray(pixels).save(folder / split / c / f"{i}.png")


def test_sites_with_their_own_folders_equal_the_simulation_and_a_node_that_does_not_fit_is_refused(tmp_path):
    root = tmp_path / "data"
    for k, (site, classes) in enumerate(SITES.items()):
        image_tree(root / "clients" / site, classes, 6 + 2 * k, k)
    image_tree(tmp_path / "stranger", ["cat", "horse"], 4, 9)  # classes the federation does not have

    run = tmp_path / "server" / "run"
    prepare_run(load_config(None, [*FEDERATION, "node_data=own", *SETTINGS]), run)
    nodes = []
    for k, data in enumerate([root / "clients" / s for s in SITES] + [tmp_path / "stranger"]):
        machine = tmp_path / f"node-{k}"  # a machine with the run's config.yaml and its own data, nothing else
        (machine / "run").mkdir(parents=True)
        shutil.copy(run / "config.yaml", machine / "run" / "config.yaml")
        shutil.copytree(data, machine / "data")
        nodes.append({"partition-id": min(k, 1) if k == 3 else k, "run-dir": str(machine / "run"), "data": str(machine / "data"), "threads": 1})
    with LocalDeployment(tmp_path / "flower", 4, tls=True, node_configs=nodes, supernode_poll=0.2) as deployment:
        result = deployment.run(APP_DIR, run_config(run, round_timeout=120, min_replies=3), timeout=400)
        logs = [(deployment.log_dir / f"supernode-{k}.log").read_text() for k in range(4)]
    server_log = result.log_path.read_text()

    with torch_threads(1):  # each SuperNode's torch threads
        assert main(["run", "--quiet", "--out", str(tmp_path / "sim"), *FEDERATION, f"data_dir={root}", "partition=natural",
                     "global_eval=federated", *SETTINGS]) == 0
    rows = [[json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()] for path in (tmp_path / "sim", run)]
    assert len(rows[0]) == 2 and rows[0] == rows[1] and all("test_acc" in row for row in rows[1])
    models = [torch.load(path / "checkpoint.pt", weights_only=False)["server"]["model"] for path in (tmp_path / "sim", run)]
    assert all(torch.equal(v, models[1][k]) for k, v in models[0].items())

    problem = "client 1's data do not fit the federation:"
    assert logs[3].count(f"contrafl: {problem}") == 1 and "'horse'" in logs[3] and "Traceback" not in logs[3], logs[3]
    assert f"(partition-id=1) is not used: {problem}" in server_log, server_log
    assert str(tmp_path / "node-3") not in server_log  # a refusal does not tell the server where the site keeps its data
    for k in range(3):  # each node's states in its own run directory; no node read another's folder
        assert sorted(p.name for p in (tmp_path / f"node-{k}" / "run" / "flower-clients" / f"client-{k}").iterdir()) == ["data.json", "round-1.pt", "round-2.pt"]
        assert not (tmp_path / f"node-{k}" / "run" / "partition.json").exists()
    assert not (run / "label_counts.json").exists()


def walkthrough() -> list[str]:
    """The commands of docs/flower.md's "Three sites, three folders", continued lines joined."""
    section = (Path(__file__).parents[1] / "docs" / "flower.md").read_text().split("## Three sites, three folders")[1].split("\n## ")[0]
    return [block.split("```")[0].replace("\\\n", " ") for block in section.split("```bash\n")[1:]]


def test_the_three_sites_walkthrough_as_written(tmp_path, monkeypatch, capsys):
    """docs/flower.md's commands in a folder holding `sites/clients/site-{a,b,c}` (one
    round instead of 20): the simulation runs; the deployment on this machine starts
    its SuperNodes with each site's folder over TLS (the test above runs such a
    deployment to the simulation's metrics); the several-machines commands give one
    SuperNode command per site, with its own data and no partition.json."""
    monkeypatch.chdir(tmp_path)
    classes = ["benign", "malignant", "normal"]
    for k, site in enumerate(["site-a", "site-b", "site-c"]):
        for split, n in (("train", 4), ("test", 1)):
            for c in classes[k:] if k else classes[:2]:
                (tmp_path / "sites" / "clients" / site / split / c).mkdir(parents=True, exist_ok=True)
                for i in range(n):
                    Image.fromarray(np.full((32, 32, 3), 40 * (k + 1) + i, np.uint8)).save(tmp_path / "sites" / "clients" / site / split / c / f"{i}.png")
    simulate, deploy, prepare_only = (command.replace("rounds=20", "rounds=1").split()[1:] for command in walkthrough())
    assert main(simulate) == 0
    assert '"test_acc"' in (tmp_path / "runs" / "sites-sim" / "metrics.jsonl").read_text()

    started = {}

    def deployment(cfg, path, settings, **options):  # what contrafl deploy starts, recorded instead
        started.update(cfg=cfg, path=path, settings=settings)
        return SimpleNamespace(run_id=1, status="finished:completed", seconds=0.0)

    monkeypatch.setattr("contrafl.flower.deploy.deploy", deployment)
    assert main(deploy) == 0
    assert started["settings"].tls and started["cfg"].node_data == "own" and started["cfg"].data_dir is None
    assert started["settings"].node_data == tuple(f"sites/clients/{s}" for s in ("site-a", "site-b", "site-c"))
    assert load_config(tmp_path / "runs" / "sites" / "config.yaml").dataset.options["classes"] == classes

    assert main(prepare_only + ["--out", str(tmp_path / "runs" / "sites-remote")]) == 0
    printed = capsys.readouterr().out
    nodes = [line.strip() for line in printed.splitlines() if line.strip().startswith("FLWR_HOME=")]
    assert len(nodes) == 3 and all(f"partition-id={k} run-dir='RUN_DIR' data='/srv/images'" in nodes[k] for k in range(3))
    assert "on its machine: config.yaml, flower/certs/ca.crt and its private key" in printed and "needs no partition.json" in printed
