"""The client side of contrafl on Flower, in one process (no Flower needed).

A stand-in for the Flower grid hands every message to a new
:class:`~contrafl.flower.client.FlowerClient` (on Flower each message runs in a fresh
ClientApp process), which reads the run directory, keeps only its own rows of the data
and its state in files. Runs through it must give the simulator's metrics bit for bit:
training, the personal evaluation (evaluate messages), a client that was not sampled
for rounds, and a server that crashes after its clients have moved on and resumes from
an older checkpoint.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from contrafl.algorithms import ALGORITHMS
from contrafl.cli import main
from contrafl.config import load_config
from contrafl.data.partition import Partition
from contrafl.engine.run_dir import RunDir
from contrafl.engine.setup import own_rows, prepare
from contrafl.engine.resume import resume
from contrafl.engine.simulation import Simulation
from contrafl.errors import DataError
from contrafl.flower.client import FlowerClient
from contrafl.flower.deploy import prepare_run, simulator_threads
from contrafl.flower.server import outcome_of
from conftest import strict_json
from test_orchestra import tiny_cifar

pytestmark = pytest.mark.usefixtures("one_thread")

CLIENTS = 3


class FreshClients:
    """A transport whose every message reaches a new FlowerClient, with the tensors
    copied (as Flower's serialisation does); ``crash_in``: the round after whose replies
    the server process dies (KeyboardInterrupt); ``reuse``: one FlowerClient per client
    answers all its messages instead (as a SuperNode's worker does)."""

    def __init__(self, run_dir: Path, sim: Simulation, crash_in: int | None = None, reuse: bool = False) -> None:
        self.run_dir, self.sim, self.crash_in, self.reuse = run_dir, sim, crash_in, reuse
        self.clients: dict[int, FlowerClient] = {}

    def client(self, cid: int) -> FlowerClient:
        if not self.reuse:
            return FlowerClient(self.run_dir, cid)
        if cid not in self.clients:
            self.clients[cid] = FlowerClient(self.run_dir, cid)
        return self.clients[cid]

    def train(self, t, cids, message_for, phases):
        for cid in cids:
            message = pytree.tree_map_only(torch.Tensor, torch.clone, message_for(cid))
            yield outcome_of(cid, self.client(cid).train(t, message, self.sim.checkpointed))
        if t == self.crash_in:
            raise KeyboardInterrupt

    def evaluate(self, t, cids, message_for):
        for cid in reversed(cids):  # any order: the server sums in client order
            yield cid, self.client(cid).evaluate(t, message_for(cid))


def settings(algorithm: str, *extra: str) -> list[str]:
    return [f"algorithm={algorithm}", f"num_clients={CLIENTS}", "rounds=4", "local_epochs=1", "executor=sequential", *extra]


def metrics(path: Path) -> list[dict]:
    return [strict_json(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def simulator(tmp_path: Path, cfg) -> list[dict]:
    """The simulator's metrics of ``cfg``; its summary.json and metrics.jsonl are strict
    JSON (every algorithm of `contrafl list` goes through here)."""
    path = tmp_path / "sim"
    Simulation(prepare(cfg), RunDir(path)).run()
    assert strict_json((path / "summary.json").read_text())["status"] == "completed"
    return metrics(path)


def flower_run(path: Path, cfg, reuse: bool = False) -> Simulation:
    prepare_run(cfg, path)
    sim = resume(prepare(load_config(path / "config.yaml")), RunDir(path, resume=True))
    sim.transport = FreshClients(path, sim, reuse=reuse)
    sim.run()
    return sim


@pytest.mark.parametrize(
    "algorithm, extra",
    [
        ("fedcrl", ["pool=true", "test_fraction=0.25"]),  # personal layers; local test splits
        ("moon", ["sample_fraction=0.67", "eval_personal=true"]),  # previous models; unsampled rounds
        ("scaffold", ["persist_optimizer_state=true", "momentum=0.9", "checkpoint_every=3"]),
        ("scaffold", ["client_speed=lognormal:1", "speed_jitter=0.5", "round_deadline=25"]),  # late clients dropped
        ("fedprox", ["client_speed=slow:0.5,4", "round_deadline=25", "stragglers=partial"]),  # partial work
        # clients add noise; the server adds noise (reproducible noise to compare: the default is secret)
        ("fedavg", ["dp=local", "dp.clip=0.5", "dp.noise_multiplier=0.05", "dp.noise=reproducible", "sample_fraction=0.67"]),
        ("scaffold", ["dp=central", "dp.clip=0.5", "dp.noise_multiplier=0.05", "dp.noise=reproducible"]),
    ],
)
def test_fresh_client_processes_give_the_simulators_run(tmp_path, algorithm, extra):
    cfg = load_config(None, settings(algorithm, *extra))
    expected = simulator(tmp_path, cfg)
    flower_run(tmp_path / "flower", cfg)
    assert metrics(tmp_path / "flower") == expected
    assert any("personal_acc" in row for row in expected) == (algorithm not in ("scaffold", "fedprox", "fedavg"))
    assert all(("dp_epsilon" in row) == any(e.startswith("dp=") for e in extra) for row in expected)
    if "round_deadline=25" in extra:
        assert any("stragglers" in row for row in expected)
    states = sorted(p.relative_to(tmp_path / "flower" / "flower-clients").as_posix() for p in (tmp_path / "flower" / "flower-clients").rglob("*.pt"))
    if "checkpoint_every=3" in extra:  # checkpoint after round 3: each client keeps its state of round 3 and its newest
        assert states == [f"client-{c}/round-{r}.pt" for c in range(CLIENTS) for r in (3, 4)]


TINY_SSL = ["model.projection_hidden=16", "model.projection_dim=8", "knn_k=5"]
TINY = {  # what an algorithm needs to run on a tiny federation
    "orchestra": [*TINY_SSL, "augment=simclr", "algorithm.global_clusters=6", "algorithm.local_clusters=3", "algorithm.memory=8"],
    "fedsiam_da": ["model.projection_hidden=16", "model.projection_dim=8", "algorithm.predictor_hidden=16"],
}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS.names())
def test_every_algorithm_runs_through_fresh_client_processes(tmp_path, algorithm):
    """Every algorithm of `contrafl list`, 2 rounds on 3 clients of a tiny CIFAR-10:
    the clients' own rows, their state files and evaluate messages give the simulator's
    metrics bit for bit, through a new client per message (a ClientApp process each) and
    through one client that answers all the messages of its partition (a SuperNode's
    worker), which keeps nothing from one message to the next but what its files hold."""
    cls = ALGORITHMS.get(algorithm)
    extra = TINY.get(algorithm, [*TINY_SSL, "algorithm.predictor_hidden=16"] if not cls.supervised else [])
    overrides = ["rounds=2", "batch_size=8", *tiny_cifar(tmp_path, rows=48, test_rows=12), *extra]
    if cls.supervised:
        overrides += ["pool=true", "test_fraction=0.25", "eval_personal=true"]
    cfg = load_config(None, settings(algorithm, *overrides))
    expected = simulator(tmp_path, cfg)
    flower_run(tmp_path / "flower", cfg)
    assert metrics(tmp_path / "flower") == expected
    flower_run(tmp_path / "worker", cfg, reuse=True)
    assert metrics(tmp_path / "worker") == expected


def crash_and_resume(path: Path, cfg, crash_in: int, reuse: bool, rounds_done: int, states: list[str] | None = None) -> None:
    """The run of ``cfg`` in ``path`` with its server dying in round ``crash_in`` (from
    0) once its clients replied, then resumed (from ``rounds_done``, asserted) to its end
    with the same clients; ``states``: client 0's state files at the crash (asserted)."""
    prepare_run(cfg, path)
    sim = resume(prepare(load_config(path / "config.yaml")), RunDir(path, resume=True))
    sim.transport = transport = FreshClients(path, sim, crash_in=crash_in, reuse=reuse)
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert len(metrics(path)) == crash_in
    if states is not None:
        assert sorted(p.name for p in (path / "flower-clients" / "client-0").glob("*.pt")) == states
    sim = resume(prepare(load_config(path / "config.yaml")), RunDir(path, resume=True))
    assert sim.rounds_done == rounds_done
    transport.sim, transport.crash_in = sim, None
    sim.transport = transport
    sim.run()


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh clients", "workers"])
def test_a_server_resuming_an_older_checkpoint_finds_the_clients_states_of_that_round(tmp_path, reuse):
    """The server dies in round 4 after its clients trained (their states are of round 4)
    while its checkpoint is of round 2: the resumed run trains rounds 3 and 4 again from
    the clients' states of round 2 and ends with the uninterrupted run's metrics, also
    when the clients that answer are those that trained round 4 (SuperNodes' workers
    that outlived the server)."""
    cfg = load_config(None, settings("moon", "checkpoint_every=2"))
    expected = simulator(tmp_path, cfg)
    path = tmp_path / "flower"
    crash_and_resume(path, cfg, crash_in=3, reuse=reuse, rounds_done=2, states=["round-2.pt", "round-4.pt"])
    assert metrics(path) == expected


def test_workers_that_outlive_a_server_without_checkpoint_start_again_from_nothing(tmp_path):
    """The server dies in round 2, before its first checkpoint: the run starts again at
    round 1, and the clients that trained rounds 1 and 2 must train round 1 again from
    their initial state (SCAFFOLD's control variate: zero), not from the state they keep
    in memory."""
    cfg = load_config(None, settings("scaffold", "checkpoint_every=3"))
    expected = simulator(tmp_path, cfg)
    crash_and_resume(tmp_path / "flower", cfg, crash_in=1, reuse=True, rounds_done=0)
    assert metrics(tmp_path / "flower") == expected


def test_a_client_keeps_only_its_own_rows(tmp_path):
    cfg = load_config(None, settings("fedavg", "pool=true", "test_fraction=0.25"))
    full = prepare(cfg)
    mine = own_rows(full, 1)
    train, test = full.partition.train[1], full.partition.test[1]
    assert len(mine.data.train) == len(train) + len(test)
    assert torch.equal(mine.data.train.x, full.data.train.x[torch.as_tensor(np.concatenate([train, test]))])
    assert [len(r) for r in mine.partition.train] == [0, len(train), 0]
    assert mine.partition.test[1].tolist() == list(range(len(train), len(train) + len(test)))
    assert Simulation(mine).label_counts[1].tolist() == Simulation(full).label_counts[1].tolist()


def test_a_partition_that_does_not_fit_the_data_is_a_one_line_error(tmp_path):
    cfg = load_config(None, settings("fedavg"))
    partition = prepare(cfg).partition
    with pytest.raises(DataError, match="has 3 clients but num_clients=4"):
        prepare(load_config(None, settings("fedavg", "num_clients=4")), partition)
    too_far = Partition(partition.method, partition.options, partition.seed, [*partition.train[:2], np.array([10**6])])
    with pytest.raises(DataError, match="indexes training sample 1000000 but the data have"):
        prepare(cfg, too_far)


def test_deploy_prepare_only_writes_the_run_directory_and_prints_the_commands(tmp_path, capsys):
    """The commands listen on every interface, give each SuperNode its own FLWR_HOME and
    port and the torch threads of `contrafl run`'s clients (tests/test_flower_deploy.py
    runs them)."""
    run = tmp_path / "run"
    assert main(["deploy", "--prepare-only", "--insecure", "--round-timeout", "90", "--out", str(run), "algorithm=moon", "num_clients=3"]) == 0
    out = capsys.readouterr().out
    assert "register" not in out and not (run / "flower").exists()
    assert "each client K = 0..2" in out and f"--run-config {run.resolve()}/flower-run.toml" in out
    assert "flower-superlink --insecure --disable-runtime-dependency-installation --host 0.0.0.0 --port 8000" in out
    threads = simulator_threads(load_config(run / "config.yaml"))
    assert f"FLWR_HOME=NODE_HOME flower-supernode --insecure --superlink SERVER:8000 --port 9094 --node-config \"partition-id=K run-dir='RUN_DIR' threads={threads}\"" in out
    rc = tomllib.loads((run / "flower-run.toml").read_text())
    assert rc == {"run-dir": str(run.resolve()), "round-timeout": 90.0, "min-replies": 1, "wait-nodes": 120.0}
    assert Partition.load(run / "partition.json").to_json() == prepare(load_config(run / "config.yaml")).partition.to_json()


def test_deploy_prepare_only_secures_several_machines_by_default(tmp_path, capsys):
    """Without --insecure, --prepare-only serves the SuperLink over TLS with SuperNode
    authentication: a key pair per client (the private key readable by its owner only),
    the SuperLink's --enable-supernode-auth, one `flwr supernode register` per client's
    public key, and each SuperNode's private key. --no-auth keeps TLS alone."""
    run = tmp_path / "run"
    assert main(["deploy", "--prepare-only", "--server-host", "10.0.0.5", "--out", str(run), "num_clients=2"]) == 0
    out = capsys.readouterr().out
    keys = run.resolve() / "flower" / "keys"
    assert sorted(p.name for p in keys.iterdir()) == ["node-0", "node-0.pub", "node-1", "node-1.pub"]
    assert (keys / "node-0").stat().st_mode & 0o777 == 0o600
    assert (keys / "node-1.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    assert "--ssl-keyfile" in out and " --enable-supernode-auth " in out
    assert f"flwr supernode register {keys}/node-K.pub CONNECTION" in out
    assert "flower-supernode --root-certificates RUN_DIR/flower/certs/ca.crt --auth-supernode-private-key RUN_DIR/flower/keys/node-K --superlink 10.0.0.5:8000" in out
    assert main(["deploy", "--prepare-only", "--no-auth", "--secure-aggregation", "--min-replies", "3", "--server-host", "10.0.0.5", "--out", str(tmp_path / "tls"), "num_clients=3"]) == 0
    assert tomllib.loads((tmp_path / "tls" / "flower-run.toml").read_text())["secure-aggregation"] is True
    out = capsys.readouterr().out
    assert "--ssl-keyfile" in out and "--enable-supernode-auth" not in out and "register" not in out and not (tmp_path / "tls" / "flower" / "keys").exists()


def test_deploy_resume_needs_a_run_directory_alone(tmp_path, capsys):
    assert main(["deploy", "--resume", str(tmp_path)]) == 2
    assert "no config.yaml there" in capsys.readouterr().err
    assert main(["deploy", "--resume", str(tmp_path), "rounds=3"]) == 2
    assert "takes no config, KEY=VALUE" in capsys.readouterr().err


def test_deploy_checks_its_options_before_starting_anything(tmp_path, capsys):
    """A bad option, or a run directory in use, is one line on stderr and nothing else:
    no banner, no run directory, no processes."""
    def refused(*args: str) -> str:
        assert main(["deploy", *args, "algorithm=fedavg", "num_clients=3"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1, (out, err)
        return err

    assert "min_replies=4 must be between 0 and num_clients=3" in refused("--min-replies", "4", "--out", str(tmp_path / "run"))
    assert "round_timeout=0 must be positive" in refused("--round-timeout", "0", "--out", str(tmp_path / "run"))
    assert "--server-host is for --prepare-only" in refused("--server-host", "10.0.0.5", "--out", str(tmp_path / "run"))
    assert "give the names or addresses the SuperNodes dial with --server-host" in refused("--prepare-only", "--tls", "--out", str(tmp_path / "run"))
    assert "or --insecure on a network you trust" in refused("--prepare-only", "--out", str(tmp_path / "run"))
    assert "--auth needs TLS" in refused("--prepare-only", "--insecure", "--auth", "--out", str(tmp_path / "run"))
    assert "server host 'a b' is neither an IP address nor a DNS name" in refused("--prepare-only", "--server-host", "a b", "--out", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("")
    assert "already exists and is not empty" in refused("--out", str(tmp_path / "used"))


@pytest.mark.parametrize(
    "settings, why",
    [
        (["algorithm=fedamp"], "but FedAMP's server keeps every client's model"),
        (["algorithm=scaffold"], "but SCAFFOLD's server sums the clients' control-variate changes unweighted"),
        (["algorithm=fedavg", "dp=central"], "but dp=central clips each update at the server"),
        (["algorithm=fedavg", "round_deadline=5"], "but a straggler dropped at round_deadline sends no update"),
        (["algorithm=fedbyol", "algorithm.weighting=batches"], "weighs replies by their batches"),
        (["algorithm=fedavg", "num_clients=3", "sample_fraction=0.5"], "a round of 1 client is fewer than the 3 a secure sum needs"),
    ],
)
def test_secure_aggregation_is_refused_with_one_line_where_the_server_needs_more_than_the_mean(tmp_path, capsys, settings, why):
    assert main(["deploy", "--secure-aggregation", "--out", str(tmp_path / "run"), "num_clients=3", *settings]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and why in err and "deploy without --secure-aggregation" in err, err
