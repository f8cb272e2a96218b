"""Faults on a real Flower deployment (a SuperLink and 3 SuperNodes as subprocesses on
127.0.0.1): a client process killed during a round, malformed updates, the server
killed and the run resumed. Each run is compared with an in-process replay of what the fault
should amount to: the same metrics, or the same global model, to the last bit."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import tomllib
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow  # real SuperLink and SuperNode processes

from contrafl.cli import main  # noqa: E402
from contrafl.config import load_config  # noqa: E402
from contrafl.engine.run_dir import RunDir, read_summary  # noqa: E402
from contrafl.engine.setup import prepare  # noqa: E402
from contrafl.engine.simulation import ClientOutcome, Simulation  # noqa: E402
from contrafl.flower.deploy import APP_DIR, prepare_run, run_config, shared_cores  # noqa: E402
from contrafl.flower.launch import CONNECTION, FlowerLaunchError, LocalDeployment, _descendants  # noqa: E402
from conftest import torch_threads  # noqa: E402
from flower_faulty_app.faultyapp.client_app import corrupt  # noqa: E402

FAULTY_APP = Path(__file__).parent / "flower_faulty_app"
CLIENTS = 3
COMMON = [f"num_clients={CLIENTS}", "local_epochs=1", "executor=sequential", "eval_personal=false"]


class Replay:
    """The simulator's in-process clients with faults: ``absent`` ({round: clients}) are
    lost in those rounds, ``faults`` ({client: "nan" | "shape"}) corrupt their replies."""

    def __init__(self, sim: Simulation, absent: dict[int, set[int]] = {}, faults: dict[int, str] = {}) -> None:
        self.sim, self.absent, self.faults = sim, absent, faults

    def train(self, t, cids, message_for, phases):
        gone = self.absent.get(t, set())
        for outcome in self.sim.train_locally(t, [c for c in cids if c not in gone], message_for, phases):
            if outcome.cid in self.faults:
                outcome.reply.payload = corrupt(outcome.reply.payload, self.faults[outcome.cid])
            yield outcome
        for cid in sorted(gone):
            yield ClientOutcome(cid, None, lost="absent")


def replay(path: Path, settings: list[str], **faults) -> Simulation:
    sim = Simulation(prepare(load_config(None, settings)), RunDir(path))
    sim.transport = Replay(sim, **faults)
    sim.run()
    return sim


def metrics(path: Path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def final_model(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path / "checkpoint.pt", weights_only=False)["server"]["model"]


def wait_for_rows(path: Path, n: int, thread: threading.Thread, timeout: float = 300.0, checkpointed: bool = False) -> list[dict]:
    """The metrics once the run has written ``n`` rounds (and, with ``checkpointed``, the
    checkpoint of round ``n``: the metrics row comes before it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and thread.is_alive():
        if (path / "metrics.jsonl").is_file() and len(rows := metrics(path)) >= n:
            if not checkpointed or read_summary(path).get("checkpointed_rounds", 0) >= n:
                return rows
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach round {n}")


def in_background(deployment: LocalDeployment, app: Path, config: dict) -> tuple[threading.Thread, list]:
    """``deployment.run`` in a thread; the list gets its result or its exception."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append(deployment.run(app, config, timeout=600))
        except FlowerLaunchError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def test_malformed_updates_are_rejected_with_their_reason_and_the_round_goes_on(tmp_path):
    """Client 1 sends a NaN, client 2 a tensor of the wrong shape: the server's validator
    rejects both (on_bad_update=skip), the server log says why, and the round
    aggregates client 0 alone, as the simulator does with the same corrupted replies."""
    settings = ["algorithm=fedavg", *COMMON, "rounds=1", "on_bad_update=skip"]
    run = tmp_path / "flower-run"
    prepare_run(load_config(None, settings), run)
    faults = [{}, {"fault": "nan"}, {"fault": "shape"}]
    with LocalDeployment(tmp_path / "flower", CLIENTS, node_configs=faults, supernode_poll=0.2) as deployment:
        result = deployment.run(FAULTY_APP, run_config(run, round_timeout=120, min_replies=CLIENTS), timeout=600)
    rows = metrics(run)
    for row in rows:
        reasons = {r["client"]: r["reason"] for r in row["rejected"]}
        assert sorted(reasons) == [1, 2] and "non-finite" in reasons[1] and "shape" in reasons[2], reasons
    log = result.log_path.read_text()
    assert f"client 1's update rejected: {rows[0]['rejected'][0]['reason']}" in log
    replay(tmp_path / "replay", settings, faults={1: "nan", 2: "shape"})
    assert metrics(tmp_path / "replay") == rows


def test_a_client_killed_in_a_round_is_lost_and_rejoins_with_its_state(tmp_path):
    """SuperNode 2 is killed (SIGKILL) as round 2 starts: round 2 completes with the
    other two once ``round_timeout`` (15 s; the other two answer within 2-5 s, a
    loaded machine's too) has passed, or once the SuperLink reports the node unavailable
    (it misses its heartbeats), whichever comes first (``min_replies=2``);
    metrics.jsonl records client 2 as lost with that reason, and the restarted SuperNode
    trains rounds 3 and 4 from the state its client kept on disk (MOON's previous local model): the global model is
    that of a replay in which client 2 kept its state and skipped round 2."""
    settings = ["algorithm=moon", *COMMON, "rounds=4"]
    run = tmp_path / "flower-run"
    prepare_run(load_config(None, settings), run)
    with LocalDeployment(tmp_path / "flower", CLIENTS, supernode_poll=0.2) as deployment:
        config = {**run_config(run, round_timeout=15, min_replies=2), "wait-nodes": 60.0}
        thread, outcome = in_background(deployment, APP_DIR, config)
        wait_for_rows(run, 1, thread)
        deployment.kill_node(2)
        rows = wait_for_rows(run, 2, thread)
        deployment.restart_node(2)
        thread.join()
    assert not isinstance(outcome[0], Exception), outcome[0]
    rows = metrics(run)
    assert [[lost["client"] for lost in row.get("lost", [])] for row in rows] == [[], [2], [], []]
    reason = rows[1]["lost"][0]["reason"]  # whichever comes first: the round's timeout or Flower's verdict on the node
    assert "no reply within 15s" in reason or reason.startswith("error 5: Error: Node Unavailable"), reason
    assert sorted((run / "flower-clients" / "client-2").iterdir())[-1].name == "round-4.pt"
    sim = replay(tmp_path / "replay", settings, absent={1: {2}})
    assert [r["test_acc"] for r in sim.history] == [r["test_acc"] for r in rows]
    for k, v in final_model(tmp_path / "replay").items():
        assert torch.equal(v, final_model(run)[k]), k


def kill_superlink(run: Path) -> None:
    """SIGKILL the SuperLink of `contrafl deploy`'s deployment of ``run`` (the one on the
    port of its flwr config) and everything it started (SuperExec, ServerApp)."""
    port = tomllib.loads((run / "flower" / "flwr_home" / "config.toml").read_text())["superlink"][CONNECTION]["address"].rsplit(":", 1)[1]
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"flower-superlink") for a in argv) and b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
            pid = int(entry.name)
            for child, _ in _descendants(pid):
                os.kill(child, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
            return
    raise AssertionError(f"no SuperLink on port {port}")


def test_a_server_killed_and_restarted_resumes_from_its_last_checkpoint(tmp_path):
    """`contrafl deploy`'s SuperLink (and the ServerApp with it) is killed once round 2 is
    recorded, while round 3 may be under way: contrafl deploy stops the deployment (a
    machine restart) and records the run as failed, with the reason and how to resume.
    `contrafl deploy --resume` on a new SuperLink and new SuperNodes continues the run
    directory from its last checkpoint, keeps the first run's logs and ends with the
    simulator's metrics and model. (tests/test_flower_client.py checks that clients which
    went on to later rounds go back to the states of the checkpoint's round.)"""
    settings = ["algorithm=moon", *COMMON, "rounds=3"]
    run = tmp_path / "flower-run"
    exit_status: list[int] = []
    thread = threading.Thread(target=lambda: exit_status.append(main(["deploy", "--round-timeout", "120", "--out", str(run), *settings])))
    thread.start()
    wait_for_rows(run, 2, thread, checkpointed=True)
    kill_superlink(run)
    thread.join()
    assert exit_status == [2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("the Flower deployment stopped before the run ended (FlowerLaunchError: flwr run ")
    assert summary["error"].endswith(f"; continue from its last checkpoint with `contrafl deploy --resume {run}`")
    assert summary["checkpointed_rounds"] >= 2 and (run / "checkpoint.pt").is_file()
    first_log = (run / "flower" / "logs" / "run-1.log").read_text()
    assert main(["deploy", "--resume", str(run), "--round-timeout", "120"]) == 0
    assert (run / "flower" / "logs" / "run-1.log").read_text() == first_log and "round 3/3" in (run / "flower" / "logs" / "run-2.log").read_text()
    sim = tmp_path / "sim"
    with torch_threads(shared_cores(CLIENTS)[0]["threads"]):  # each client's threads in the deployment
        Simulation(prepare(load_config(None, settings)), RunDir(sim)).run()
    assert metrics(run) == metrics(sim)
    for k, v in final_model(sim).items():
        assert torch.equal(v, final_model(run)[k]), k
