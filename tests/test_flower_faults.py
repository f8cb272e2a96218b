"""Faults on a real Flower deployment (a SuperLink and 3 SuperNodes as subprocesses on
127.0.0.1): a client process killed during a round, malformed updates, the server
killed and the run resumed. Each run is compared with an in-process replay of what the fault
should amount to: the same metrics, or the same global model, to the last bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
from contrafl.engine.simulation import Simulation  # noqa: E402
from contrafl.execution.outcomes import ClientOutcome  # noqa: E402
from contrafl.flower.deploy import APP_DIR, prepare_run, run_config, shared_cores  # noqa: E402
from contrafl.flower.launch import CONNECTION, FlowerLaunchError, LocalDeployment  # noqa: E402
from contrafl.flower.lifetime import marked, program  # noqa: E402
from conftest import torch_threads  # noqa: E402
from flower_faulty_app.faultyapp.client_app import corrupt  # noqa: E402

FAULTY_APP = Path(__file__).parent / "flower_faulty_app"
CLIENTS = 3
COMMON = [f"num_clients={CLIENTS}", "local_epochs=1", "executor=sequential", "eval_personal=false"]


class Replay:
    """The simulator's in-process clients with faults: ``absent`` ({round: clients}) are
    lost in those rounds, ``late`` ({round: clients}) train in them (their state moves
    on) but are lost, ``faults`` ({client: "nan" | "shape"}) corrupt their replies."""

    def __init__(
        self, sim: Simulation, absent: dict[int, set[int]] = {}, late: dict[int, set[int]] = {}, faults: dict[int, str] = {},
    ) -> None:
        self.sim, self.absent, self.late, self.faults = sim, absent, late, faults

    def train(self, t, cids, message_for, phases):
        gone = self.absent.get(t, set())
        for outcome in self.sim.train_locally(t, [c for c in cids if c not in gone], message_for, phases):
            if outcome.cid in self.late.get(t, set()):
                outcome = ClientOutcome(outcome.cid, None, lost="late")
            elif outcome.cid in self.faults:
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


def wait_for_rows(
    path: Path, n: int, thread: threading.Thread, outcome: list, timeout: float = 300.0, checkpointed: bool = False,
) -> list[dict]:
    """The metrics once the run has written ``n`` rounds (and, with ``checkpointed``, the
    checkpoint of round ``n``: the metrics row comes before it). Fails with the run's
    outcome (``in_background``'s list) when it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and thread.is_alive():
        if (path / "metrics.jsonl").is_file() and len(rows := metrics(path)) >= n:
            if not checkpointed or read_summary(path).get("checkpointed_rounds", 0) >= n:
                return rows
        time.sleep(0.05)
    ended = f"the run ended: {outcome[0]}" if outcome else f"{timeout} s passed"
    raise AssertionError(f"the run did not reach round {n}; {ended}")


def in_background(deployment: LocalDeployment, app: Path, config: dict) -> tuple[threading.Thread, list]:
    """``deployment.run`` in a thread; the list gets its result or its exception."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append(deployment.run(app, config, timeout=600))
        except FlowerLaunchError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
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
    metrics.jsonl records client 2 as lost with that reason. Client 2 is then offline:
    later rounds leave it out at once, without waiting for it (the rounds after the
    first take 2-3 s), until its SuperNode, restarted once round 2 is recorded, comes
    online; the server finds it and asks whom it serves while a round waits for its
    replies, and from the next round on the restarted SuperNode trains its client from
    the state it kept on disk (MOON's previous local model). The global model is that
    of a replay in which client 2 kept its state and skipped the rounds it missed."""
    settings = ["algorithm=moon", *COMMON, "rounds=8"]  # rounds without client 2 take 2 s: its restart may span a few
    run = tmp_path / "flower-run"
    prepare_run(load_config(None, settings), run)
    with LocalDeployment(tmp_path / "flower", CLIENTS, supernode_poll=0.2) as deployment:
        config = {**run_config(run, round_timeout=15, min_replies=2), "wait-nodes": 60.0}
        thread, outcome = in_background(deployment, APP_DIR, config)
        wait_for_rows(run, 1, thread, outcome)
        deployment.kill_node(2)
        rows = wait_for_rows(run, 2, thread, outcome)
        deployment.restart_node(2)
        thread.join()
    assert not isinstance(outcome[0], Exception), outcome[0]
    rows = metrics(run)
    missed = [t for t, row in enumerate(rows) if row.get("lost")]
    assert [[lost["client"] for lost in rows[t]["lost"]] for t in missed] == [[2]] * len(missed)
    assert missed == list(range(1, 1 + len(missed))) and missed[-1] < 7, missed  # lost from round 2 on, back by round 8
    reason = rows[1]["lost"][0]["reason"]  # whichever comes first: the round's timeout or Flower's verdict on the node
    assert "no reply within 15s" in reason or reason.startswith("error 5: Error: Node Unavailable"), reason
    for t in missed[1:]:
        assert rows[t]["lost"][0]["reason"] == f"offline: {reason} in round 2; left out until its SuperNode is back", rows[t]
    assert [s["seconds"] < 15 for s in map(json.loads, (run / "timing.jsonl").read_text().splitlines())][2:] == [True] * 6
    log = outcome[0].log_path.read_text()
    assert log.count("client 2 lost:") == 1 and "client 2 is back (SuperNode" in log, log
    assert sorted((run / "flower-clients" / "client-2").iterdir())[-1].name == "round-8.pt"
    sim = replay(tmp_path / "replay", settings, absent={t: {2} for t in missed})
    assert [r["test_acc"] for r in sim.history] == [r["test_acc"] for r in rows]
    for k, v in final_model(tmp_path / "replay").items():
        assert torch.equal(v, final_model(run)[k]), k


def kill_superlink(run: Path) -> int:
    """SIGKILL the SuperLink of `contrafl deploy`'s deployment of ``run`` (the one on the
    port of its flwr config), and nothing else; its pid."""
    port = tomllib.loads((run / "flower" / "flwr_home" / "config.toml").read_text())["superlink"][CONNECTION]["address"].rsplit(":", 1)[1]
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"flower-superlink") for a in argv) and b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
            pid = int(entry.name)
            os.kill(pid, signal.SIGKILL)
            return pid
    raise AssertionError(f"no SuperLink on port {port}")


def test_a_server_killed_and_restarted_resumes_from_its_last_checkpoint(tmp_path, capsys):
    """`contrafl deploy`'s SuperLink alone is killed once round 2 is recorded, while round
    3 may be under way: contrafl deploy stops the deployment, leaves no process of it
    behind (the ServerApp and SuperExec the SuperLink started included, which once kept
    the run directory locked), and says in one line, as summary.json does, what died,
    after which round, and how to resume.
    `contrafl deploy --resume` on a new SuperLink and new SuperNodes continues the run
    directory from its last checkpoint, keeps the first run's logs and ends with the
    simulator's metrics and model. (tests/test_flower_client.py checks that clients which
    went on to later rounds go back to the states of the checkpoint's round.)"""
    settings = ["algorithm=moon", *COMMON, "rounds=3"]
    run = tmp_path / "flower-run"
    exit_status: list[int] = []
    thread = threading.Thread(target=lambda: exit_status.append(main(["deploy", "--tls", "--round-timeout", "120", "--out", str(run), *settings])))
    thread.start()
    wait_for_rows(run, 2, thread, exit_status, checkpointed=True)
    pid = kill_superlink(run)
    thread.join()
    assert exit_status == [2]
    assert not marked(f"{(run / 'flower').resolve()}|"), "a process of the deployment outlived it"
    summary = json.loads((run / "summary.json").read_text())
    done = len(metrics(run))
    why = f"the SuperLink (pid {pid}) was killed by SIGKILL after round {done} of 3; continue from its last checkpoint with `contrafl deploy --resume {run}`"
    assert summary["status"] == "failed" and summary["error"] == why
    err = capsys.readouterr().err
    assert err == f"contrafl: error: {why}\n", err
    assert summary["checkpointed_rounds"] >= 2 and (run / "checkpoint.pt").is_file()
    first_log = (run / "flower" / "logs" / "run-1.log").read_text()
    assert main(["deploy", "--resume", str(run), "--insecure"]) == 2  # TLS is the run's: not dropped without a word
    assert "the run was deployed with TLS, which --insecure would drop" in capsys.readouterr().err
    assert main(["deploy", "--resume", str(run)]) == 0  # the recorded round timeout and TLS
    out = capsys.readouterr().out
    assert "on a local Flower deployment of 3 SuperNodes (TLS)" in out and out.rstrip().splitlines()[-1].startswith("done: 3 rounds in ")
    starts = [line for line in (run / "flower" / "logs" / "superlink.log").read_text().splitlines() if line.startswith("=== ")]
    assert len(starts) == 2 and all("--ssl-certfile" in line and "--insecure" not in line for line in starts), starts
    assert json.loads((run / "summary.json").read_text())["executor"] == "flower"
    assert (run / "flower" / "logs" / "run-1.log").read_text() == first_log and "round 3/3" in (run / "flower" / "logs" / "run-2.log").read_text()
    sim = tmp_path / "sim"
    with torch_threads(shared_cores(CLIENTS)[0]["threads"]):  # each client's threads in the deployment
        Simulation(prepare(load_config(None, settings)), RunDir(sim)).run()
    assert metrics(run) == metrics(sim)
    for k, v in final_model(sim).items():
        assert torch.equal(v, final_model(run)[k]), k


def test_contrafl_deploy_killed_takes_its_whole_deployment_with_it(tmp_path):
    """`contrafl deploy` SIGKILLed once round 1 is recorded: its SuperLink and SuperNodes
    die with it (parent-death signals), the ServerApp with its SuperLink, after it
    recorded the run as failed (it would otherwise wait for the SuperLink forever,
    holding the run directory), the runners and workers with their SuperNodes. No
    process of the deployment is left (checked by its mark), and `contrafl deploy
    --resume` finishes the run."""
    run = tmp_path / "flower-run"
    settings = ["algorithm=fedavg", *COMMON, "rounds=3"]
    deploy = subprocess.Popen([sys.executable, "-m", "contrafl", "deploy", "--out", str(run), *settings],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").is_file() and metrics(run)):
        assert deploy.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    mark = f"{(run / 'flower').resolve()}|"
    assert {program(argv) for argv in marked(mark).values()} >= {"flower-superlink", "flwr-serverapp", "contrafl.flower.runner"}
    deploy.kill()
    deploy.wait()
    deadline = time.monotonic() + 30
    while marked(mark):
        assert time.monotonic() < deadline, sorted(map(program, marked(mark).values()))
        time.sleep(0.1)
    summary = read_summary(run)
    assert summary["status"] == "failed" and "SuperLinkGone: the SuperLink stopped or died" in summary["error"], summary
    assert main(["deploy", "--resume", str(run)]) == 0
    assert read_summary(run)["status"] == "completed" and len(metrics(run)) == 3


def test_a_run_that_diverges_on_a_deployment_ends_in_one_line(tmp_path, capsys):
    """dp=local with its defaults diverges in round 2 (FedAvg, digits): the deployment,
    like the simulator, says so in one line, the ServerApp's log holds no traceback, and
    summary.json says failed with the same reason."""
    run = tmp_path / "run"
    assert main(["deploy", "--out", str(run), "algorithm=fedavg", *COMMON, "rounds=3", "dp=local"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("contrafl: error: client ") and "has non-finite values" in err[0], err
    assert err[0].endswith(f"(round 2 of 3; once that is fixed, continue with `contrafl deploy --resume {run}`)"), err
    assert "Traceback" not in captured.out and "Exit Code" not in captured.out and "Traceback" not in (run / "flower" / "logs" / "run-1.log").read_text()
    summary = read_summary(run)
    assert summary["status"] == "failed" and "has non-finite values" in summary["error"]
    assert not marked(f"{(run / 'flower').resolve()}|")
