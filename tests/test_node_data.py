"""Federations whose nodes hold their own data (``node_data=own``), in one process.

Each client reads only its own files (:func:`~contrafl.engine.setup.prepare_node`), the
server holds no training data (:func:`~contrafl.engine.setup.federation_data`) and
evaluates the global model by federated evaluation or on its own test set. A stand-in
grid hands every message to a new :class:`~contrafl.flower.client.FlowerClient` built
from its node's data alone; the run equals the simulation over the same per-client data
(``partition=natural``) bit for bit. Nodes whose data do not fit the federation are
refused with one line. (A real deployment: test_flower_deploy.py.)
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from contrafl.config import load_config
from contrafl.data.base import FederatedDataset
from contrafl.data.registry import DATASETS, DatasetSpec, LoadRequest
from contrafl.data.user import CommonOptions, Part, assemble, natural_key
from contrafl.engine.run_dir import RunDir
from contrafl.engine.setup import prepare, prepare_node
from contrafl.engine.resume import resume
from contrafl.engine.simulation import Simulation
from contrafl.errors import ConfigError, ContraflError, DataError
from contrafl.flower.client import FlowerClient
from contrafl.flower.deploy import commands, prepare_run
from contrafl.flower.server import outcome_of
from conftest import strict_json

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = ["cat", "dog", "owl"]


def read_part(folder: Path, name: str) -> Part:
    """``folder/train.npz`` and ``folder/test.npz`` (``x`` uint8 images, ``y`` class names)."""
    splits = {}
    for split in ("train", "test"):
        with np.load(folder / f"{split}.npz") as f:
            splits[split] = (f["x"], f["y"].astype(str))
    names = sorted(set(splits["train"][1]) | set(splits["test"][1]))
    index = {n: i for i, n in enumerate(names)}
    return Part(
        name,
        splits["train"][0], np.array([index[n] for n in splits["train"][1]], dtype=np.int64),
        splits["test"][0], np.array([index[n] for n in splits["test"][1]], dtype=np.int64),
        names, str(folder),
    )


def load_sites(req: LoadRequest) -> FederatedDataset:
    """``ROOT/clients/<name>/`` (one client each, natural), or ``ROOT`` itself (one client)."""
    root = Path(req.data_dir)
    if (root / "clients").is_dir():
        names = sorted((p.name for p in (root / "clients").iterdir()), key=natural_key)
        return assemble("sites", [read_part(root / "clients" / n, n) for n in names], req.options, natural=True)
    return assemble("sites", [read_part(root, root.name)], req.options, natural=False)


@pytest.fixture(autouse=True)
def sites_dataset():
    """A dataset of the user's files, registered for this module's tests."""
    if "sites" not in DATASETS:
        DATASETS.add("sites", DatasetSpec(
            "sites", "per-client npz files (tests)", load_sites, default_model="moon_cnn", augment="none",
            recommended={"batch_size": 8, "rounds": 2, "local_epochs": 1}, options=CommonOptions,
        ))
    yield


def write_site(folder: Path, classes: list[str], n_train: int, n_test: int, seed: int, size: int = 8) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for split, n in (("train", n_train), ("test", n_test)):
        y = np.array([classes[i % len(classes)] for i in range(n)])
        x = rng.integers(0, 256, (n, 3, size, size), dtype=np.uint8)
        x[:, 0] = np.array([CLASSES.index(c) * 80 if c in CLASSES else 0 for c in y], dtype=np.uint8)[:, None, None]  # learnable
        np.savez(folder / f"{split}.npz", x=x, y=y)


@pytest.fixture
def sites(tmp_path) -> Path:
    """Three sites with different class mixes and sizes."""
    root = tmp_path / "data"
    write_site(root / "clients" / "site-a", ["cat", "dog"], 24, 8, 0)
    write_site(root / "clients" / "site-b", ["dog", "owl"], 16, 6, 1)
    write_site(root / "clients" / "site-c", ["cat", "dog", "owl"], 20, 0, 2)  # no test data
    return root


TINY = ["model=mlp", "model.projection_dim=8", "batch_size=8", "rounds=3", "local_epochs=1", "executor=sequential", "lr=0.05"]
FEDERATION = ["dataset.classes=[cat,dog,owl]", "dataset.shape=[3,8,8]", "dataset.mean=[0.4,0.5,0.5]", "dataset.std=[0.3,0.29,0.29]"]


def simulation_config(root: Path, algorithm: str, *extra: str):
    return load_config(None, [
        "dataset=sites", f"data_dir={root}", "partition=natural", "num_clients=3", f"algorithm={algorithm}",
        *FEDERATION, *TINY, *extra,
    ])


def federation_config(algorithm: str, *extra: str):
    return load_config(None, ["dataset=sites", "node_data=own", "num_clients=3", f"algorithm={algorithm}", *FEDERATION, *TINY, *extra])


class Nodes:
    """A transport whose every message reaches a new FlowerClient of its node's own data."""

    def __init__(self, run_dir: Path, sim: Simulation, data: dict[int, Path]) -> None:
        self.run_dir, self.sim, self.data = run_dir, sim, data

    def client(self, cid: int) -> FlowerClient:
        return FlowerClient(self.run_dir, cid, data=self.data[cid])

    def train(self, t, cids, message_for, phases):
        for cid in cids:
            message = pytree.tree_map_only(torch.Tensor, torch.clone, message_for(cid))
            yield outcome_of(cid, self.client(cid).train(t, message, self.sim.checkpointed))

    def evaluate(self, t, cids, message_for):
        for cid in reversed(cids):
            yield cid, self.client(cid).evaluate(t, message_for(cid))

    def evaluate_model(self, t, cids, state):
        for cid in reversed(cids):  # any order: the server sums in client order
            yield cid, self.client(cid).evaluate_model(t, pytree.tree_map_only(torch.Tensor, torch.clone, state))


def metrics(path: Path) -> list[dict]:
    return [strict_json(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def federated_run(path: Path, cfg, data: dict[int, Path]) -> list[dict]:
    prepare_run(cfg, path)
    sim = resume(prepare(load_config(path / "config.yaml")), RunDir(path, resume=True))
    sim.transport = Nodes(path, sim, data)
    sim.run()
    return metrics(path)


@pytest.mark.parametrize("algorithm, extra", [("moon", []), ("fedcrl", ["eval_personal=true"]), ("fedavg", ["sample_fraction=0.67"])])
def test_a_federation_of_own_data_equals_the_simulation_over_the_same_per_client_data(tmp_path, sites, algorithm, extra):
    sim_path = tmp_path / "sim"
    Simulation(prepare(simulation_config(sites, algorithm, "global_eval=federated", *extra)), RunDir(sim_path)).run()
    expected = metrics(sim_path)
    data = {k: sites / "clients" / name for k, name in enumerate(["site-a", "site-b", "site-c"])}
    got = federated_run(tmp_path / "fed", federation_config(algorithm, *extra), data)
    assert got == expected
    if algorithm != "fedcrl":
        assert all(row["test_clients"] == 2 for row in got if "test_acc" in row)  # site-c has no test data
    assert not (tmp_path / "fed" / "label_counts.json").exists()  # the server does not know the clients' labels


def test_server_side_evaluation_on_a_test_set_the_server_holds(tmp_path, sites):
    held = tmp_path / "server-test"
    write_site(held, CLASSES, 9, 3, 7)
    cfg = federation_config("fedavg", f"server_test={held}")
    assert prepare(cfg).config.global_eval == "server"
    data = {k: sites / "clients" / name for k, name in enumerate(["site-a", "site-b", "site-c"])}
    rows = federated_run(tmp_path / "fed", cfg, data)
    assert all("test_acc" in row and "test_clients" not in row for row in rows)
    assert len(prepare(cfg).data.test) == 12  # the server test set's samples, train and test files alike


def test_the_simulation_of_natural_per_client_data_gives_each_client_its_own_test_data(sites):
    setup = prepare(simulation_config(sites, "fedavg"))
    assert [len(rows) for rows in setup.partition.train] == [24, 16, 20]
    assert [len(rows) for rows in setup.partition.test] == [8, 6, 0]
    assert setup.data.classes == CLASSES and len(setup.data.test) == 14
    assert setup.config.global_eval == "server"
    with pytest.raises(ConfigError, match="test_fraction=0.25 would split"):
        prepare(simulation_config(sites, "fedavg", "test_fraction=0.25"))


@pytest.mark.parametrize(
    "settings, message",
    [
        (["dataset.classes=null"], "dataset.classes is not set"),
        (["dataset.mean=null", "dataset.std=null"], "normalisation cannot come from data the server does not hold"),
        (["data_dir=/somewhere"], "drop it"),
        (["knn_every=2"], "knn_every=0"),
        (["test_fraction=0.2"], "test_fraction=0"),
        (["global_eval=server"], "server_test=PATH"),
        (["algorithm=fedu2", "augment=none", "algorithm.even_steps=true"], "largest client's sample count; set algorithm.even_steps=false"),
    ],
)
def test_a_federation_config_that_does_not_say_what_the_nodes_agree_on_is_one_line(settings, message):
    with pytest.raises(ConfigError, match=message) as info:
        prepare(federation_config("fedavg", *settings))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="not read from a user's files"):
        prepare(load_config(None, ["dataset=digits", "node_data=own"]))


def test_a_node_whose_data_do_not_fit_the_federation_is_refused_with_one_line(tmp_path, sites):
    cfg = federation_config("fedavg")
    write_site(tmp_path / "horses", ["cat", "horse"], 8, 2, 3)
    write_site(tmp_path / "big", ["cat"], 8, 2, 3, size=16)
    for folder, message in [(tmp_path / "horses", "class 'horse'"), (tmp_path / "big", r"shape \[3, 16, 16\]"), (sites, "holds the data of 3 clients")]:
        with pytest.raises(DataError, match=message) as info:
            prepare_node(cfg, folder, 0)
        assert "\n" not in str(info.value)
    setup = prepare_node(cfg, sites / "clients" / "site-b", 1)
    assert [len(rows) for rows in setup.partition.train] == [0, 16, 0] and [len(r) for r in setup.partition.test] == [0, 6, 0]
    assert sorted(set(setup.data.train.y.tolist())) == [1, 2]  # dog, owl: labels by the federation's class list


def test_prepare_only_prints_each_nodes_command_with_its_own_data(tmp_path, sites):
    cfg = prepare_run(federation_config("fedavg"), tmp_path / "run")
    data = [str(sites / "clients" / n) for n in ("site-a", "site-b", "site-c")]
    text = commands(tmp_path / "run", cfg, node_data=data)
    for k, where in enumerate(data):
        assert f"partition-id={k} run-dir='RUN_DIR' data='{where}'" in text
    assert "partition.json" not in text.split("for each client")[1].split("\n")[0].replace("needs no partition.json", "")
    assert not dataclasses.asdict(cfg)["data_dir"]


def test_secure_aggregation_with_sites_data_needs_a_public_max_weight(tmp_path, sites):
    """The server of node_data=own knows no client's sample count: secure aggregation
    weighs the updates by a public bound, --max-weight, which it needs (not under
    dp=local, where every reply weighs 1 and labels are hidden)."""
    from contrafl.flower.deploy import check_settings

    with pytest.raises(ConfigError, match="secure aggregation with node_data=own needs --max-weight N, a public bound"):
        check_settings(resolve_own("fedavg"), 600, 3, secure_aggregation=True)
    check_settings(resolve_own("fedavg"), 600, 3, secure_aggregation=True, max_weight=500)
    check_settings(resolve_own("fedcrl"), 600, 3, secure_aggregation=True, max_weight=500)
    with pytest.raises(ConfigError, match="--max-weight 500 bounds the weights of secure sums; add --secure-aggregation"):
        check_settings(resolve_own("fedavg"), 600, 3, max_weight=500)


def resolve_own(algorithm: str):
    from contrafl.engine.setup import resolve

    return resolve(federation_config(algorithm))


def test_a_simulation_of_a_federation_config_is_refused_with_the_way_to_simulate_it(tmp_path, capsys):
    from contrafl.cli import main

    assert main(["run", "--out", str(tmp_path / "run"), "dataset=sites", "node_data=own", *FEDERATION, *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "data_dir=ROOT partition=natural" in err and not (tmp_path / "run").exists()


def test_a_site_whose_data_change_between_rounds_is_refused_with_what_changed(tmp_path, sites):
    """A client records its data (count and SHA-256) when the run begins; a site whose
    files change afterwards (a sample added, a value edited) is refused in one line when
    its client loads them again (a restarted worker or SuperNode), as is a record that
    is not one. The same data again are accepted."""
    run = tmp_path / "run"
    prepare_run(federation_config("fedavg"), run)
    site = sites / "clients" / "site-b"
    FlowerClient(run, 1, data=site)
    FlowerClient(run, 1, data=site)  # the same data: accepted
    original = (site / "train.npz").read_bytes()
    write_site(tmp_path / "more", ["dog", "owl"], 17, 6, 5)
    (site / "train.npz").write_bytes((tmp_path / "more" / "train.npz").read_bytes())
    with pytest.raises(ContraflError, match=r"^client 1's data changed since the run began \(22 samples then, 23 now\); put the run's data back") as info:
        FlowerClient(run, 1, data=site)
    assert "\n" not in str(info.value)
    with np.load(tmp_path / "more" / "train.npz") as arrays:
        x, y = arrays["x"][:16], arrays["y"][:16]
    np.savez(site / "train.npz", x=x, y=y)  # 16 samples again, other pixels
    with pytest.raises(ContraflError, match=r"\(the same count, other values\)"):
        FlowerClient(run, 1, data=site)
    (site / "train.npz").write_bytes(original)
    FlowerClient(run, 1, data=site)
    (run / "flower-clients" / "client-1" / "data.json").write_text("[")
    with pytest.raises(ContraflError, match="is not a record of its data; remove it"):
        FlowerClient(run, 1, data=site)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs (as root where mounts are allowed), unmounted afterwards."""
    import subprocess

    folder = tmp_path / "tiny"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


def test_a_site_whose_disk_fills_says_so_in_one_line_and_trains_again_once_it_has_room(tmp_path, sites, tiny_disk):
    """The client's state of a round cannot be saved on a full disk: it sends no reply
    (the server counts it lost, with the reason), leaves no temporary file behind, and
    trains the round again from its last state once the disk has room."""
    run = tmp_path / "run"
    cfg = federation_config("moon")  # MOON keeps a state: the client's previous model
    prepare_run(cfg, run)
    sim = Simulation(prepare(cfg))
    message = sim.algorithm.message_for(sim.algorithm.broadcast(sim.server, 0), sim.server, 1, 0)
    client = FlowerClient(run, 1, state_dir=tiny_disk, data=sites / "clients" / "site-b")
    ballast = tiny_disk / "ballast"
    ballast.write_bytes(b"\0" * (shutil.disk_usage(tiny_disk).free - 8192))  # 8 KiB left
    with pytest.raises(ContraflError, match=rf"^client 1 cannot save its state of round 1 in {tiny_disk / 'client-1'} \(.+\); free space there") as info:
        client.train(0, message, 0)
    assert "\n" not in str(info.value) and sorted(p.name for p in (tiny_disk / "client-1").iterdir()) == ["data.json"]
    ballast.unlink()
    reply = client.train(0, message, 0)
    assert reply["num_samples"] == 16 and sorted(p.name for p in (tiny_disk / "client-1").iterdir()) == ["data.json", "round-1.pt"]
