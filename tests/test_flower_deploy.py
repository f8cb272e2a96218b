"""contrafl on a real Flower deployment: a SuperLink and 3 SuperNodes as subprocesses on
127.0.0.1 run the same algorithm objects as the simulator.

The clients train with the simulator's sequential executor, on the same plans and seeds,
in processes of the same machine and torch build, and the server runs the simulator's
own round loop, so a run must end with the simulator's metrics and final parameters to
the last bit (no tolerance: any difference is a difference in what was computed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow  # real SuperLink and SuperNode processes

from contrafl.cli import main  # noqa: E402
from contrafl.config import load_config  # noqa: E402
from contrafl.engine.privacy import clip, gaussian, updates  # noqa: E402
from contrafl.engine.setup import prepare  # noqa: E402
from contrafl.engine.simulation import Simulation  # noqa: E402
from contrafl.flower.auth import make_node_key  # noqa: E402
from contrafl.flower.deploy import APP_DIR, prepare_run, run_config, shared_cores  # noqa: E402
from contrafl.flower.launch import LocalDeployment, _Process, _terminate, free_port  # noqa: E402
from conftest import torch_threads  # noqa: E402
from contrafl.rng import generator  # noqa: E402

CLIENTS = 3
COMMON = [f"num_clients={CLIENTS}", "rounds=2", "local_epochs=1", "executor=sequential", "eval_personal=false"]
SSL = ["knn_k=5", "model.projection_hidden=16", "model.projection_dim=8", "algorithm.predictor_hidden=16"]
# Client state (control variates, previous models), personal layers with evaluate
# messages; FedU2 (a target network, thread-sensitive results) runs in the several-machines
# test below, FedAvg's plain path is part of each of these.
RUNS = {
    "scaffold": [],
    "moon": [],
    "fedcrl": ["pool=true", "test_fraction=0.25", "eval_personal=true"],  # evaluate messages
    # a straggler cut short, one dropped at the deadline (its reply says so), local DP noise
    # (reproducible, to compare: each SuperNode warns that it protects nothing)
    "fedprox": ["client_speed=slow:0.34,100", "round_deadline=20", "stragglers=partial", "dp=local", "dp.clip=0.5", "dp.noise_multiplier=0.05", "dp.noise=reproducible"],
}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    # contrafl deploy's SuperNodes; stopped without waiting long for their goodbyes (one of them may wait the whole grace)
    with LocalDeployment(tmp_path_factory.mktemp("flower"), CLIENTS, supernode_poll=0.2, stop_grace=2.0) as d:
        yield d


@pytest.mark.parametrize("algorithm", list(RUNS))
def test_deployment_equals_the_simulator(tmp_path, deployment, algorithm):
    settings = [f"algorithm={algorithm}", *COMMON, *RUNS[algorithm]]
    prepare_run(load_config(None, settings), tmp_path / "flower-run")
    deployment.run(APP_DIR, run_config(tmp_path / "flower-run", round_timeout=120, min_replies=CLIENTS), timeout=600)
    assert main(["run", "--quiet", "--out", str(tmp_path / "sim"), *settings]) == 0
    rows = [[json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in ("sim", "flower-run")]
    assert len(rows[0]) == 2 and rows[0] == rows[1]
    if algorithm == "fedprox":
        assert {c["done"] > 0 for c in rows[0][0]["stragglers"]} == {True, False} and "dp_epsilon" in rows[0][0]
    models = [torch.load(tmp_path / r / "checkpoint.pt", weights_only=False)["server"] for r in ("sim", "flower-run")]
    for k, v in models[0]["model"].items():
        assert torch.equal(v, models[1]["model"][k]), k
    summary = json.loads((tmp_path / "flower-run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2


CURIOUS_APP = Path(__file__).parent / "flower_curious_app"


def test_a_curious_server_cannot_subtract_the_clients_secret_local_noise(tmp_path, deployment):
    """docs/privacy.md's threat model, attacked: a server that follows the protocol and
    keeps everything it holds (its run directory, config.yaml with the seed, every reply:
    tests/flower_curious_app) regenerates each client's local DP noise from the seed, as
    contrafl's code draws it with dp.noise=reproducible, and subtracts it. On a
    reproducible run it recovers each client's clipped update (cosine 1 with the update
    the client computed on its own data); with the default secret noise, drawn on the
    SuperNodes, the attack's cosine is that of independent noise (within 6 standard
    deviations of 20 draws the attacker could equally have subtracted)."""
    z, clip_to = 10.0, 0.5
    for noise in ("reproducible", "secret"):
        settings = ["algorithm=fedavg", *COMMON, "rounds=1", "dp=local", f"dp.clip={clip_to}", f"dp.noise_multiplier={z}", f"dp.noise={noise}"]
        run = tmp_path / noise
        prepare_run(load_config(None, settings), run)
        result = deployment.run(CURIOUS_APP, run_config(run, round_timeout=120, min_replies=CLIENTS), timeout=600)
        assert ("dp.noise=reproducible: the DP noise comes from config.yaml's seed" in result.log_path.read_text()) == (noise == "reproducible")
        cfg = load_config(run / "config.yaml")  # what the server holds, the seed included
        received = {cid: torch.load(run / "received" / f"round-1-client-{cid}.pt", weights_only=True) for cid in range(CLIENTS)}
        assert all(r["num_samples"] == 1 for r in received.values())
        sim = Simulation(prepare(cfg))  # the clients' side: their data, their training of round 1
        message = sim.algorithm.broadcast(sim.server, 0)
        sim.privacy = None
        for cid, kept in received.items():
            plain = next(iter(sim.train_locally(0, [cid], lambda c: message, sim.algorithm.phases(0)))).reply
            truth = flat(updates(clip(plain.payload, message, clip_to)[0], message))
            got = updates(kept["payload"], message)
            attack = cosine(flat(got) - flat(gaussian(got, z * clip_to, generator(cfg.seed, "dp", 0, cid))), truth)
            if noise == "reproducible":
                assert attack > 0.99999, (cid, attack)
            else:
                g = torch.Generator().manual_seed(cid)
                independent = torch.tensor([
                    cosine(flat(got) - z * clip_to * torch.randn(truth.shape, generator=g, dtype=torch.float64), truth) for _ in range(20)
                ])
                assert abs(attack - float(independent.mean())) < 6 * float(independent.std()) + 1e-4, (cid, attack)
                assert abs(attack) < 0.05
        assert json.loads((run / "summary.json").read_text())["dp"]["noise"] == noise


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten().double() for t in tensors])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_secure_aggregation_gives_the_plain_deployments_run_up_to_quantisation(tmp_path, deployment):
    """FedAvg through Flower's SecAgg+ (its workflow and client mod) on 3 SuperNodes: the
    server gets each client's structure in the clear and only sums (the sample-weighted
    mean of the models, the total samples, steps and loss); the global model stays within SecAgg+'s
    quantisation of the plain deployment's (the simulator's) (steps of 16 / 2**22 per value: 4.6e-5 measured
    after 2 rounds, the documented tolerance 2e-4), the first round's training is the same, and a
    second secure run of its first round gives that round's numbers bit for bit (the
    stochastic rounding is seeded from the run's seed)."""
    settings = ["algorithm=fedavg", *COMMON]
    runs = {"plain": settings, "secure": settings, "again": [*settings, "rounds=1"]}  # again: the first round once more
    # the plain deployment's run is the simulator's, bit for bit (test_deployment_equals_the_simulator)
    assert main(["run", "--quiet", "--out", str(tmp_path / "plain"), *settings]) == 0
    for name in ("secure", "again"):
        prepare_run(load_config(None, runs[name]), tmp_path / name)
        deployment.run(APP_DIR, run_config(tmp_path / name, 300, CLIENTS, secure_aggregation=True), timeout=600)
    rows = {name: [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()] for name in runs}
    models = {name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["server"]["model"] for name in runs}
    assert rows["secure"][:1] == rows["again"]  # the same first round bit for bit (a run's rounds are a prefix of a longer run's)
    assert rows["secure"][0]["train_loss"] == pytest.approx(rows["plain"][0]["train_loss"], abs=1e-4)  # the same local training (losses summed in fixed point)
    assert rows["secure"][0]["local_steps"] == rows["plain"][0]["local_steps"]
    deviation = max(float((v - models["plain"][k]).abs().max()) for k, v in models["secure"].items())
    assert 0 < deviation < 2e-4, deviation
    assert abs(rows["secure"][-1]["test_acc"] - rows["plain"][-1]["test_acc"]) <= 0.01

    # clients' noise (reproducible, to compare with the simulator), then the secure mean
    noisy = ["algorithm=fedavg", *COMMON, "rounds=1", "dp=local", "dp.clip=0.5", "dp.noise_multiplier=0.05", "dp.noise=reproducible"]
    prepare_run(load_config(None, noisy), tmp_path / "noisy")
    deployment.run(APP_DIR, run_config(tmp_path / "noisy", 300, CLIENTS, secure_aggregation=True), timeout=600)
    assert main(["run", "--quiet", "--out", str(tmp_path / "noisy-sim"), *noisy]) == 0
    secure_rows, sim_rows = ([json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in ("noisy", "noisy-sim"))
    assert [r["dp_epsilon"] for r in secure_rows] == [r["dp_epsilon"] for r in sim_rows]
    assert abs(secure_rows[-1]["test_acc"] - sim_rows[-1]["test_acc"]) <= 0.01


def test_contrafl_deploy_with_tls_equals_the_simulator(tmp_path, capsys):
    """`contrafl deploy --auth`: its own SuperLink over TLS (certificates generated for the
    run) with SuperNode authentication (a key registered per SuperNode) and SuperNodes,
    the run directory of `contrafl run`, the simulator's metrics."""
    settings = ["algorithm=moon", "num_clients=2", "rounds=1", "local_epochs=1", "executor=sequential", "eval_personal=false"]
    assert main(["deploy", "--auth", "--round-timeout", "120", "--out", str(tmp_path / "flower-run"), *settings]) == 0
    out = capsys.readouterr().out
    assert "(TLS, SuperNode authentication)" in out
    assert sorted(p.name for p in (tmp_path / "flower-run" / "flower" / "keys").iterdir()) == ["node-0", "node-0.pub", "node-1", "node-1.pub"]
    assert "SuperNode authentication is disabled" not in (tmp_path / "flower-run" / "flower" / "logs" / "superlink.log").read_text()
    logs = sorted((tmp_path / "flower-run" / "flower" / "logs").glob("*.log"))
    assert len(logs) >= 4 and not [p.name for p in logs if "Traceback" in p.read_text()]  # nor at the deployment's stop
    assert "round 1/1  |####################|  loss" in out  # the server's progress, as it comes
    # not a terminal: no colour codes, no empty log line, the end said once
    assert "\x1b[" not in out and not any(line.strip() in ("INFO :", "INFO  :") or line.strip() == "INFO" for line in out.splitlines())
    assert out.count("completed") == 1 and "contrafl: completed after 1 round; results in" in out
    assert (tmp_path / "flower-run" / "flower" / "certs").is_dir()
    states = sorted(p.relative_to(tmp_path / "flower-run" / "flower-clients").as_posix() for p in (tmp_path / "flower-run" / "flower-clients").rglob("*"))
    assert states == ["client-0", "client-0/data.json", "client-0/round-1.pt", "client-1", "client-1/data.json", "client-1/round-1.pt"]
    with torch_threads(shared_cores(2)[0]["threads"]):  # each client's threads in the deployment
        assert main(["run", "--quiet", "--out", str(tmp_path / "sim"), *settings]) == 0
    assert (tmp_path / "sim" / "metrics.jsonl").read_text() == (tmp_path / "flower-run" / "metrics.jsonl").read_text()


def test_the_several_machines_commands_give_contrafl_runs_metrics_and_report_what_does_not_fit(tmp_path, capsys):
    """docs/flower.md's several machines, followed as written on one machine: the
    commands `contrafl deploy --prepare-only --server-host 127.0.0.2` prints, a
    folder per machine (the SuperLink's with the run directory; each SuperNode's with its
    FLWR_HOME and its copy of config.yaml, partition.json and the CA certificate), the
    flwr CLI's config.toml as the docs say. The certificate names 127.0.0.2, which the
    SuperNodes dial, and 127.0.0.1, which the SuperLink's own SuperExec dials. The run
    ends with the metrics of `contrafl run` of the same settings, bit for bit (FedU2's
    depend on the clients' torch threads, which the commands set).

    SuperNode authentication is on (the default for several machines): the flwr CLI
    registers the clients' public keys as printed, and each SuperNode gets its private
    key. Beside the 3 SuperNodes: one whose key is not registered (refused: it cannot
    activate, exits with flwr's code 305, and the run goes on without it), one that dials
    127.0.0.3 (not in the certificate: a TLS error in its log, and it exits), one with
    partition-id=7 and one whose run-dir has no run files (their operators registered
    their own keys). These two say why in one line in their logs and the server's, and
    are not used."""
    settings = ["algorithm=fedu2", "num_clients=3", "rounds=1", "local_epochs=1", "eval_personal=false", *SSL]
    run = tmp_path / "server" / "run"
    assert main(["deploy", "--prepare-only", "--server-host", "127.0.0.2", "--out", str(run), *settings]) == 0
    printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
    superlink, register, supernode, flwr_run = (
        next(x for x in printed if x.startswith(start)) for start in ("flower-superlink", "flwr supernode register", "FLWR_HOME=", "flwr run")
    )
    port = free_port()
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    processes: list[_Process] = []

    def start(name: str, command: str, home: Path) -> _Process:
        home.mkdir(parents=True, exist_ok=True)
        process = _Process(name, ["bash", "-c", command], {**env, "FLWR_HOME": str(home)}, tmp_path / "logs" / f"{name}.log")
        process.start()
        processes.append(process)
        return process

    cli = {**env, "FLWR_HOME": str(tmp_path / "cli")}
    keys = run / "flower" / "keys"
    for name in ("node-7", "node-no-run", "node-unlisted"):  # keys their operators made (ssh-keygen's equals)
        make_node_key(keys / name)

    def node(name: str, partition: str, copy: bool = True, server: str = "127.0.0.2", key: str | None = None) -> _Process:
        machine = tmp_path / name
        key = key or f"node-{partition}"
        parts = ["flower/certs/ca.crt", f"flower/keys/{key}"] + (["config.yaml", "partition.json"] if copy else [])
        for part in parts:
            (machine / "run" / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(run / part, machine / "run" / part)
        command = (supernode.replace("NODE_HOME", str(machine / "flwr-home")).replace("RUN_DIR", str(machine / "run"))
                   .replace("partition-id=K", f"partition-id={partition}").replace("keys/node-K", f"keys/{key}")
                   .replace("127.0.0.2:8000", f"{server}:{port}").replace("--port 9094", f"--port {free_port()}"))
        return start(name, command, machine / "flwr-home")

    try:
        start("superlink", superlink.replace("--port 8000", f"--port {port}"), tmp_path / "server" / "flwr-home")
        (tmp_path / "cli" / "config.toml").parent.mkdir()
        (tmp_path / "cli" / "config.toml").write_text(
            f'[superlink]\ndefault = "cluster"\n[superlink.cluster]\naddress = "127.0.0.2:{port}"\n'
            f'root-certificates = "{run / "flower" / "certs" / "ca.crt"}"\n'
        )
        deadline = time.monotonic() + 60
        for key in ["node-0", "node-1", "node-2", "node-7", "node-no-run"]:
            command = register.replace("node-K", key).replace("CONNECTION", "cluster")
            while (done := subprocess.run(["bash", "-c", command], env=cli, capture_output=True, text=True, timeout=60)).returncode:
                assert time.monotonic() < deadline, done.stdout + done.stderr  # the SuperLink may still be starting
                time.sleep(0.5)
        nodes = [node(f"node-{k}", str(k)) for k in range(3)]
        unfit = [node("node-7", "7"), node("node-no-run", "1", copy=False, key="node-no-run")]
        wrong_host = node("node-wrong-host", "0", server="127.0.0.3")
        unlisted = node("node-unlisted", "2", key="node-unlisted")
        deadline = time.monotonic() + 120
        while not all("SuperNode ID" in p.log_text() for p in nodes + unfit) or wrong_host.running() or unlisted.running():
            assert time.monotonic() < deadline, "the SuperNodes did not start"
            time.sleep(0.2)
        online = subprocess.run(["flwr", "supernode", "list", "cluster", "--format", "json"], env=cli, capture_output=True, text=True, timeout=60)
        server = subprocess.run(["bash", "-c", flwr_run.replace("CONNECTION", "cluster")], env={**env, "FLWR_HOME": str(tmp_path / "cli")},
                                capture_output=True, text=True, timeout=240)
    finally:
        _terminate(processes, 10.0)
    log = server.stdout + server.stderr
    assert server.returncode == 0, log
    assert json.loads((run / "summary.json").read_text())["status"] == "completed", log
    assert "certificate is not valid for '127.0.0.3'" in wrong_host.log_text()
    assert "Failed to activate SuperNode" in unlisted.log_text() and "Exit Code: 305" in unlisted.log_text()
    listed = json.loads(online.stdout[online.stdout.index("{"):])["nodes"]
    assert len(listed) == 5 and all(n["status"] == "online" for n in listed)  # the 5 registered keys, not the unlisted one
    problems = [
        ("7", "node config partition-id=7 is not a client of the run (0..2); restart the SuperNode with the partition-id of the client it serves"),
        ("1", f"node config run-dir='{tmp_path / 'node-no-run' / 'run'}': no config.yaml and no partition.json there; copy config.yaml and "
              "partition.json of the server's run directory (config.yaml alone where each node holds its own data) to this machine and restart the SuperNode with --node-config run-dir set to their folder"),
    ]
    for process, (partition, problem) in zip(unfit, problems):
        node_log = process.log_text()
        assert "Traceback" not in node_log and node_log.count(problem) == 1 and f"contrafl: {problem}" in node_log, node_log
        node_id = node_log.split("SuperNode ID: ")[1].split()[0]
        told = problem.replace(str(tmp_path / "node-no-run" / "run"), "<run-dir>")  # the server is not told the site's paths
        assert f"SuperNode {node_id} (partition-id={partition}) is not used: {told}" in log, log
    assert str(tmp_path / "node-no-run") not in log
    subprocess.run([sys.executable, "-m", "contrafl", "run", "--quiet", "--out", str(tmp_path / "sim"), *settings], env=env, check=True)
    assert (run / "metrics.jsonl").read_text() == (tmp_path / "sim" / "metrics.jsonl").read_text()
