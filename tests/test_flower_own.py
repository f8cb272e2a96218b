"""A deployment of one's own (`contrafl deploy --prepare-only`, TLS and SuperNode
authentication as across machines), run with the printed commands on one machine, in
which docs/flower.md's "When things fail" happens as written: a site's network drops for
a minute, then the SuperLink dies and is started again with the printed commands."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow  # real SuperLink and SuperNode processes, a minute without network

from contrafl.cli import main  # noqa: E402
from contrafl.engine.run_dir import read_summary  # noqa: E402
from contrafl.flower.deploy import APP_DIR  # noqa: E402
from contrafl.flower.launch import _Process, _terminate, free_port  # noqa: E402
from conftest import torch_threads  # noqa: E402
from netcut import Relay  # noqa: E402
from test_flower_faults import FAULTY_APP, final_model, metrics, replay  # noqa: E402

PACE_S = "5"
"""While the site's network is down, each client sleeps this long before it trains (the
faulty app's ``pace`` file): the run lasts past the drop on an idle machine too."""
ROUNDS = 18
DROP_S = 65.0
"""The network drop: longer than the SuperLink's patience with a silent node (two missed
heartbeats of 30 s), after which it lists the node offline."""


class Sites:
    """The processes of the printed commands: the SuperLink on the server's machine and a
    SuperNode per client, each in a folder of its own (its machine) with the copies the
    commands name; the flwr CLI's config.toml names the SuperLink ``cluster``."""

    def __init__(self, root: Path, run: Path, printed: list[str]) -> None:
        self.root, self.run = root, run
        self.superlink_command, self.register, self.supernode, self.flwr_run = (
            next(x for x in printed if x.startswith(start)) for start in ("flower-superlink", "flwr supernode register", "FLWR_HOME=", "flwr run")
        )
        self.port = free_port()
        self.env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0"}
        self.cli = {**self.env, "FLWR_HOME": str(root / "cli")}
        (root / "cli").mkdir()
        (root / "cli" / "config.toml").write_text(
            f'[superlink]\ndefault = "cluster"\n[superlink.cluster]\naddress = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{run / "flower" / "certs" / "ca.crt"}"\n'
        )
        self.processes: list[_Process] = []

    def start(self, name: str, command: str, home: Path) -> _Process:
        home.mkdir(parents=True, exist_ok=True)
        process = _Process(name, ["bash", "-c", command], {**self.env, "FLWR_HOME": str(home)}, self.root / "logs" / f"{name}.log")
        process.start()
        self.processes.append(process)
        return process

    def superlink(self) -> _Process:
        """The SuperLink's command, then the keys registered as printed."""
        process = self.start("superlink", self.superlink_command.replace("--port 8000", f"--port {self.port}"), self.root / "server" / "flwr-home")
        deadline = time.monotonic() + 60
        for k in range(3):
            command = self.register.replace("node-K", f"node-{k}").replace("CONNECTION", "cluster")
            while (done := subprocess.run(["bash", "-c", command], env=self.cli, capture_output=True, text=True, timeout=60)).returncode:
                assert time.monotonic() < deadline, done.stdout + done.stderr  # the SuperLink may still be starting
                time.sleep(0.5)
        return process

    def node(self, k: int, dial: int, extra: str) -> _Process:
        """SuperNode ``k``'s command on its machine, dialling port ``dial``, with one torch
        thread (the printed value is that of `contrafl run` in this process) and ``extra``
        node config."""
        machine = self.root / f"node-{k}"
        for part in ["flower/certs/ca.crt", f"flower/keys/node-{k}", "config.yaml", "partition.json"]:
            (machine / "run" / part).parent.mkdir(parents=True, exist_ok=True)
            (machine / "run" / part).write_bytes((self.run / part).read_bytes())
        command = (self.supernode.replace("flower-supernode", "contrafl-supernode").replace("NODE_HOME", str(machine / "flwr-home")).replace("RUN_DIR", str(machine / "run"))
                   .replace("partition-id=K", f"partition-id={k}").replace("node-K", f"node-{k}")
                   .replace("127.0.0.1:8000", f"127.0.0.1:{dial}").replace("--port 9094", f"--port {free_port()}")
                   .replace(re.search(r"threads=\d+", self.supernode)[0], f"threads=1 {extra}"))
        return self.start(f"node-{k}", command, machine / "flwr-home")

    def flwr(self, log: Path) -> subprocess.Popen:
        """The printed `flwr run`, with the test's app: contrafl's ClientApp with a pace."""
        command = self.flwr_run.replace(str(APP_DIR), str(FAULTY_APP)).replace("CONNECTION", "cluster")
        return subprocess.Popen(["bash", "-c", command], env=self.cli, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def rows_when(run: Path, ready, flwr: subprocess.Popen, timeout: float = 300.0) -> list[dict]:
    """metrics.jsonl's rows once ``ready(rows)``; fails when `flwr run` ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and flwr.poll() is None:
        if (run / "metrics.jsonl").is_file() and ready(rows := metrics(run)):
            return rows
        time.sleep(0.02)
    raise AssertionError(f"not reached; flwr run: {flwr.poll()}")


def sites_log(root: Path, k: int) -> str:
    """What SuperNode ``k`` printed (flwr's log: ``[RUN r, ROUND g]`` then what it did)."""
    return (root / "logs" / f"node-{k}.log").read_text(errors="replace")


def lost(row: dict) -> list[int]:
    return [x["client"] for x in row.get("lost", [])]


def test_a_site_offline_for_a_minute_then_the_superlink_restarted_with_the_printed_commands(tmp_path, capsys):
    """The SuperNodes are `contrafl-supernode` s (the printed `flower-supernode` command
    with contrafl's shorter waits, as docs/flower.md offers). Site 2's network drops
    after round 1 for 65 s (a relay between its SuperNode and the SuperLink passes
    nothing more and refuses new connections): its client is lost in the round under way
    once ``round-timeout`` (15 s) has passed, then offline and left out at once; the
    SuperLink lists its node offline after a minute. When the network is back, its
    SuperNode reconnects by itself, the server prints ``client 2 is back`` and trains it
    again from the state it kept, and no round it missed (their messages expired). Then
    the SuperLink is SIGKILLed: the ServerApp records the run as failed with what to do
    and exits (`flwr run` ends); the SuperLink and the SuperNodes are started again with
    the printed commands (the keys registered again: the SuperLink keeps its state in
    memory), and the printed `flwr run` continues from the last checkpoint to the end.
    The model equals that of a replay in which client 2 skipped the rounds it was lost
    in (or, had round 2's message reached it before the drop, trained it unheard)."""
    settings = ["algorithm=moon", "num_clients=3", f"rounds={ROUNDS}", "local_epochs=1", "executor=sequential", "eval_personal=false"]
    run = tmp_path / "server" / "run"
    assert main(["deploy", "--prepare-only", "--server-host", "127.0.0.1", "--round-timeout", "15", "--min-replies", "2",
                 "--out", str(run), *settings]) == 0
    sites = Sites(tmp_path, run, [line.strip() for line in capsys.readouterr().out.splitlines()])
    pace = tmp_path / "pace"
    relay = None
    try:
        superlink = sites.superlink()
        relay = Relay(("127.0.0.1", sites.port))
        nodes = [sites.node(k, relay.port if k == 2 else sites.port, f"pace='{pace}'") for k in range(3)]
        first = sites.flwr(tmp_path / "flwr-1.log")
        rows_when(run, lambda rows: len(rows) >= 1, first)
        relay.cut()
        pace.write_text(PACE_S)
        began = time.monotonic()
        rows_when(run, lambda rows: time.monotonic() - began > DROP_S, first)
        relay.restore()
        rows_when(run, lambda rows: len(rows) > 2 and not lost(rows[-1]), first)  # client 2 trained again
        pace.unlink()
        rows_when(run, lambda rows: len(rows) >= ROUNDS - 3, first)
        os.kill(superlink.popen.pid, signal.SIGKILL)  # the SuperLink alone (bash ran it in its place)
        superlink.popen.wait()  # reaped, as the shell or service manager that started it does
        assert first.wait(timeout=60) != 0
        deadline = time.monotonic() + 30  # the ServerApp records the run once its SuperExec is gone
        while (summary := read_summary(run))["status"] == "running":
            assert time.monotonic() < deadline, summary
            time.sleep(0.2)
        assert summary["status"] == "failed" and "start the SuperLink and the SuperNodes again" in summary["error"], summary
        _terminate(nodes, 10.0)  # the sites restart their SuperNodes with the printed commands
        sites.superlink()
        nodes = [sites.node(k, sites.port, "") for k in range(3)]
        second = sites.flwr(tmp_path / "flwr-2.log")
        assert second.wait(timeout=300) == 0, (tmp_path / "flwr-2.log").read_text()
    finally:
        if relay is not None:
            relay.close()
        _terminate(sites.processes, 10.0)
    first_log = (tmp_path / "flwr-1.log").read_text()
    rows = metrics(run)
    missed = [t for t, row in enumerate(rows) if lost(row)]
    assert all(lost(rows[t]) == [2] for t in missed) and missed == list(range(1, 1 + len(missed))), missed
    assert "no reply within 15s" in rows[1]["lost"][0]["reason"], rows[1]
    first_id = re.search(r"Node ID: (\d+)", sites_log(tmp_path, 2))[1]
    assert first_log.count("client 2 lost:") == 1 and f"client 2 is back (SuperNode {first_id})" in first_log, first_log  # the same node
    assert read_summary(run)["status"] == "completed"
    # client 2 trained a round it was lost in only if its train message reached it before the drop (its reply did not
    # get through); the messages that waited at the SuperLink for it expired (round-timeout + STALE_S) before it was back
    received = {int(r) for r in re.findall(r"ROUND (\d+)\]\n[^\n]*Receiving: train message", sites_log(tmp_path, 2))}
    assert set(missed[1:]).isdisjoint(received), (missed, received)
    with torch_threads(1):  # the SuperNodes' threads
        sim = replay(tmp_path / "replay", settings, absent={t: {2} for t in missed if t not in received},
                     late={t: {2} for t in missed if t in received})
    assert [r["test_acc"] for r in sim.history] == [r["test_acc"] for r in rows]
    for k, v in final_model(tmp_path / "replay").items():
        assert torch.equal(v, final_model(run)[k]), k
