"""Secure aggregation where the sites keep their own data (issue #53): three SuperNodes
over TLS, each with its own folder of images, training FedAvg and FedCRL through SecAgg+
with a public ``max-weight``. The run ends as its simulation does (``contrafl run ...
partition=natural``) up to SecAgg+'s quantisation, and a curious server that records
every message it receives (``tests/flower_curious_app``) finds no client's sample
count, label counts, steps or loss in any of them, nor any client's evaluation (its test
samples, correct predictions, loss): only sums.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow  # real SuperLink and SuperNode processes

from conftest import torch_threads  # noqa: E402
from contrafl.cli import main  # noqa: E402
from contrafl.config import load_config  # noqa: E402
from contrafl.flower.deploy import prepare_run, run_config  # noqa: E402
from contrafl.flower.launch import LocalDeployment  # noqa: E402
from contrafl.flower.packed import named_arrays  # noqa: E402
from contrafl.flower.secagg import REST, SECURE  # noqa: E402
from contrafl.flower.wire import unpack  # noqa: E402
from test_flower_node_data import FEDERATION, image_tree  # noqa: E402

CURIOUS_APP = Path(__file__).parent / "flower_curious_app"  # tests/test_flower_deploy.py's curious server, recording every message
SITES = {"site-a": ["cat", "dog"], "site-b": ["dog", "owl"], "site-c": ["cat", "dog", "owl"]}
SETTINGS = ["num_clients=3", "rounds=2", "local_epochs=2", "batch_size=8", "model=mlp", "model.hidden=[32]",
            "model.projection_dim=8", "executor=sequential", "eval_personal=false"]
MAX_WEIGHT = 40


def values(node: dict) -> list:
    """Every scalar of a codec tree's JSON."""
    if "value" in node:
        return [node["value"]]
    subs = [sub for _, sub in node["dict"]] if "dict" in node else node.get("list", node.get("tuple", []))
    return [v for sub in subs for v in values(sub)]


@pytest.mark.parametrize("algorithm", ["fedavg", "fedcrl"])
def test_sites_that_keep_their_data_train_through_secure_sums_and_the_server_learns_no_count(tmp_path, algorithm):
    root = tmp_path / "data"
    for k, (site, classes) in enumerate(SITES.items()):
        image_tree(root / "clients" / site, classes, 5 + 2 * k, k)
    settings = [f"algorithm={algorithm}", *SETTINGS]
    run = tmp_path / "server" / "run"
    prepare_run(load_config(None, [*FEDERATION, "node_data=own", *settings]), run)
    nodes = []
    for k, site in enumerate(SITES):
        machine = tmp_path / f"node-{k}"  # the run's config.yaml and the site's own data, nothing else
        (machine / "run").mkdir(parents=True)
        shutil.copy(run / "config.yaml", machine / "run" / "config.yaml")
        shutil.copytree(root / "clients" / site, machine / "data")
        nodes.append({"partition-id": k, "run-dir": str(machine / "run"), "data": str(machine / "data"), "threads": 1})
    rc = run_config(run, round_timeout=120, min_replies=3, secure_aggregation=True, max_weight=MAX_WEIGHT) | {"record": str(tmp_path / "seen")}
    with LocalDeployment(tmp_path / "flower", 3, tls=True, node_configs=nodes, supernode_poll=0.2) as deployment:
        deployment.run(CURIOUS_APP, rc, timeout=400)
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"

    with torch_threads(1):  # each SuperNode's torch threads
        assert main(["run", "--quiet", "--out", str(tmp_path / "sim"), *FEDERATION, f"data_dir={root}", "partition=natural",
                     "global_eval=federated", *settings]) == 0
    rows = [[json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()] for path in (tmp_path / "sim", run)]
    assert [r["local_steps"] for r in rows[0]] == [r["local_steps"] for r in rows[1]]
    evaluated = algorithm == "fedavg"  # FedCRL's models are personal: no global model to evaluate
    assert all(("test_acc" in r) == evaluated for r in rows[0] + rows[1])
    if evaluated:
        assert all(a["test_acc"] == pytest.approx(b["test_acc"], abs=0.06) for a, b in zip(*rows))  # at most one of ~18 test images apart
        assert all(a["test_loss"] == pytest.approx(b["test_loss"], abs=1e-4) for a, b in zip(*rows))
    assert all(a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-4) for a, b in zip(*rows))
    models = [torch.load(path / "checkpoint.pt", weights_only=False)["server"] for path in (tmp_path / "sim", run)]
    deviation = max(float((v - models[1]["model"][k]).abs().max()) for k, v in models[0]["model"].items() if v.is_floating_point())
    assert deviation < 2e-4, deviation  # SecAgg+'s quantisation: 16 / 2**22 per value, times max-weight over the round's samples
    if algorithm == "fedcrl":  # the global label representations: each label's count-weighted mean, from the sums
        sim, secure = models[0]["extras"]["prototypes"], models[1]["extras"]["prototypes"]
        assert torch.equal(sim["mask"], secure["mask"]) and float((sim["reps"] - secure["reps"]).abs().max()) < 2e-4

    seen = sorted((tmp_path / "seen").iterdir())
    assert not [path.name for path in seen if "evaluate" in path.name]  # federated evaluation too goes through SecAgg+ only
    masked = [unpack(path.read_bytes()) for path in seen if "train" in path.name and b"contrafl-rest" in path.read_bytes()]
    evaluations = [c for c in masked if json.loads(str(c["fitres.metrics"][SECURE])).get("scores")]
    collected = [c for c in masked if not json.loads(str(c["fitres.metrics"][SECURE])).get("scores")]
    assert len(collected) == 3 * 2 and len(evaluations) == 3 * 2 * evaluated  # each client's masked reply (and evaluation), each round
    for content in evaluations:  # its test samples, correct predictions and loss: masked, nothing in the clear
        rest = unpack(bytes(content["fitres.metrics"][REST]))
        assert json.loads(str(rest["tree"]["json"])) == {"dict": []} and named_arrays(rest) == {}
    for content in collected:  # what a curious server gets of a client's training besides the masked vector
        assert set(content["fitres.metrics"]) == {REST, SECURE} and dict(content["fitres.num_examples"]) == {"num_examples": MAX_WEIGHT}
        assert not content["fitres.parameters"]  # the parameters travel masked only
        rest = unpack(bytes(content["fitres.metrics"][REST]))
        assert set(values(json.loads(str(rest["tree"]["json"])))) == {None}  # no sample count, steps, loss or loss part
        assert named_arrays(rest) == {}  # no label counts (nor any other tensor: the payload's are all masked)
    for r in range(2):  # one layout for a round's clients: it tells nothing of one
        assert len({str(c["fitres.metrics"][SECURE]) for c in collected[3 * r:3 * r + 3]}) == 1


def test_the_secure_sites_command_of_the_docs_as_written(tmp_path, monkeypatch):
    """docs/flower.md's `contrafl deploy --tls --secure-aggregation --max-weight ...
    --node-data ...` in a folder holding `clients/site-{a,b,c}` (one round instead of
    20): a real deployment over TLS, whose sites train FedCRL through secure sums, ends
    completed with its clients' accuracy."""
    import shlex

    from PIL import Image
    import numpy as np

    monkeypatch.chdir(tmp_path)
    section = (Path(__file__).parents[1] / "docs" / "flower.md").read_text().split("## Secure aggregation (SecAgg+)")[1].split("\n## ")[0]
    (command,) = [c for c in (b.split("```")[0].replace("\\\n", " ") for b in section.split("```bash\n")[1:]) if "--max-weight" in c]
    classes = ["benign", "malignant", "normal"]
    for k, site in enumerate(["site-a", "site-b", "site-c"]):
        for split, n in (("train", 6), ("test", 2)):
            for c in classes[k:] if k else classes[:2]:
                (tmp_path / "clients" / site / split / c).mkdir(parents=True, exist_ok=True)
                for i in range(n):
                    Image.fromarray(np.full((32, 32, 3), 40 * (k + 1) + 20 * classes.index(c) + i, np.uint8)).save(tmp_path / "clients" / site / split / c / f"{i}.png")
    args = shlex.split(command.replace("rounds=20", "rounds=1"))[1:]
    assert args[:2] == ["deploy", "--tls"] and "--secure-aggregation" in args and "algorithm=fedcrl" in args
    assert main([*args, "--out", "run"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 1
