"""contrafl's ServerApp transport and ClientApp in one process (no Flower processes).

A stand-in for the Flower grid hands every message to contrafl's ClientApp with the
Context of the SuperNode it is addressed to, and turns what the ClientApp raises into
the error reply Flower's runtime makes of it. Checked here: a round never goes on with
fewer than ``min_replies`` replies, whatever keeps the clients from replying, and
SuperNodes whose node config does not fit the run are reported in one line, by the
server and by the node, and left out.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from contrafl.config import load_config  # noqa: E402
from contrafl.engine.run_dir import RunDir  # noqa: E402
from contrafl.engine.setup import prepare  # noqa: E402
from contrafl.engine.resume import resume  # noqa: E402
from contrafl.errors import ContraflError  # noqa: E402
from contrafl.flower import client_app  # noqa: E402
from contrafl.flower.deploy import prepare_run  # noqa: E402
from contrafl.flower.server import GridTransport  # noqa: E402
from conftest import error_reply  # noqa: E402
from test_orchestra import tiny_cifar  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "task_identity", "worker_dir")

SETTINGS = ["algorithm=fedavg", "num_clients=3", "rounds=2", "local_epochs=1", "executor=sequential", "eval_personal=false"]
WAIT_NODES = 0.3


class StandInGrid:
    """A grid whose SuperNodes (``{node id: node config}``) run contrafl's ClientApp on
    each message at once, as Flower's runtime does: an exception becomes an error reply."""

    def __init__(self, nodes: dict[int, dict], run_dir: Path) -> None:
        self.nodes, self.run_config = nodes, {"run-dir": str(run_dir)}
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def push_messages(self, messages) -> list[str]:
        ids = []
        for message in messages:
            message_id = message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            node = message.metadata.dst_node_id
            ids.append(message_id)
            if self.nodes[node].get("silent"):  # online, but its ClientApps never run
                continue
            context = Context(1, node, dict(self.nodes[node]), RecordDict(), self.run_config)
            try:
                self.replies[message_id] = client_app.app(message, context)
            except Exception as exc:
                self.replies[message_id] = error_reply(exc, message)
        return ids

    def pull_messages(self, message_ids) -> list[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def run_on(path: Path, nodes: dict[int, dict], min_replies: int, settings: list[str] = SETTINGS) -> dict:
    """The run of ``settings`` in ``path`` with its clients on ``nodes``: its summary (the
    exception that stopped it is raised)."""
    prepare_run(load_config(None, settings), path)
    sim = resume(prepare(load_config(path / "config.yaml")), RunDir(path, resume=True))
    sim.transport = GridTransport(StandInGrid(nodes, path), 3, round_timeout=5.0, min_replies=min_replies, wait_nodes=WAIT_NODES)
    return sim.run()


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_supernodes_that_do_not_fit_the_run_are_reported_once_and_left_out(tmp_path, capsys):
    """Client 0 has a SuperNode; the one meant for client 1 has no run directory, and the
    one meant for client 2 says partition-id=7 (of a 3-client run). Each unfit node says
    why in one line, in its log and in the server's, once, and is not used. With
    min_replies=1 the rounds go on with client 0 alone, the others recorded as lost with
    the reason; with min_replies=2 the first round stops the run at once."""
    missing = tmp_path / "nowhere"
    nodes = {11: {"partition-id": 0}, 12: {"partition-id": 7}, 13: {"partition-id": 1, "run-dir": str(missing)}}
    run_dir_problem = (
        f"node config run-dir='{missing}': no config.yaml and no partition.json there; copy config.yaml and partition.json "
        "of the server's run directory (config.yaml alone where each node holds its own data) to this machine and restart the SuperNode with --node-config run-dir set to their folder"
    )
    range_problem = "node config partition-id=7 is not a client of the run (0..2); restart the SuperNode with the partition-id of the client it serves"
    absent = f"no SuperNode serves partition 2 (waited wait-nodes={WAIT_NODES:g}s)"

    told = run_dir_problem.replace(str(missing), "<run-dir>")  # what the server is told: not the site's paths

    assert run_on(tmp_path / "one", nodes, min_replies=1)["status"] == "completed"
    for row in rows(tmp_path / "one"):
        assert row["lost"] == [{"client": 1, "reason": told}, {"client": 2, "reason": absent}]
        assert row["local_steps"] > 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"SuperNode 12 (partition-id=7) is not used: {range_problem}", f"SuperNode 13 (partition-id=1) is not used: {told}"]
    assert err.splitlines() == [f"contrafl: {range_problem}", f"contrafl: {run_dir_problem}"]  # the nodes' logs

    with pytest.raises(ContraflError) as stopped:
        run_on(tmp_path / "two", nodes, min_replies=2)
    assert str(stopped.value) == (
        f"round 1: 1 of 3 clients have a SuperNode that can serve them, fewer than min_replies=2 (client 1: {told}; "
        f"client 2: {absent}); resume the run once their SuperNodes are up and fit the run"
    )
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["status"] == "failed"
    assert rows(tmp_path / "two") == []


@pytest.mark.slow
def test_every_round_needs_min_replies_whatever_keeps_the_clients_from_replying(tmp_path, capsys):
    """A round without any SuperNode stops the run (min_replies=1); min_replies=0 accepts
    it, says so, and leaves the global model as it was. A client that cannot load its
    data (the SuperNode's data-dir has no dataset files) counts as missing too, found when
    the server first asks its SuperNode whom it serves (the answer comes once the client
    is loaded): min_replies=3 stops the run before it trains, with the node's one-line
    reason. A SuperNode online that never answers (its ClientApps do not run) is named, and one
    that does not say which partition it serves with its reason."""
    with pytest.raises(ContraflError, match=r"^round 1: 0 of 3 clients have a SuperNode that can serve them, fewer than min_replies=1 \(client 0: no SuperNode serves partition 0"):
        run_on(tmp_path / "none", {}, min_replies=1)
    with pytest.raises(ContraflError) as stopped:
        run_on(tmp_path / "silent", {11: {"partition-id": 0}, 14: {"partition-id": 1, "silent": True}, 15: {}}, min_replies=2)
    assert "(client 1: no SuperNode serves partition 1 (waited wait-nodes=0.3s; SuperNode 14 did not say which partition it serves; SuperNode 15 is not used: " in str(stopped.value)
    capsys.readouterr()

    assert run_on(tmp_path / "accepted", {}, min_replies=0)["status"] == "completed"
    for row in rows(tmp_path / "accepted"):
        assert row["local_steps"] == 0 and [lost["client"] for lost in row["lost"]] == [0, 1, 2]
    assert capsys.readouterr().out.splitlines() == [
        f"round {t}: no client replied (min_replies=0); the global model stays as it was" for t in (1, 2)
    ]
    initial = prepare(load_config(tmp_path / "accepted" / "config.yaml")).model.state_dict()
    final = torch.load(tmp_path / "accepted" / "checkpoint.pt", weights_only=False)["server"]["model"]
    assert all(torch.equal(v, final[k]) for k, v in initial.items())

    empty = tmp_path / "empty"
    empty.mkdir()
    settings = [*SETTINGS, "rounds=1", "batch_size=8", *tiny_cifar(tmp_path / "data")]
    nodes = {11: {"partition-id": 0}, 12: {"partition-id": 1, "data-dir": str(empty)}, 13: {"partition-id": 2}}
    with pytest.raises(ContraflError) as stopped:
        run_on(tmp_path / "data-run", nodes, min_replies=3, settings=settings)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"contrafl: missing file {empty}/cifar-10-batches-py/")  # the node's log
    told = err[0].removeprefix("contrafl: ").replace(str(empty), "<data-dir>")  # the server is not told the site's paths
    assert str(stopped.value).startswith(f"round 1: 2 of 3 clients have a SuperNode that can serve them, fewer than min_replies=3 (client 1: {told}); ")


class SlowNodes:
    """A grid on which the reply to the ``i``-th pushed message comes from the ``i + 1``-th
    pull on; the last message gets none when ``silent``."""

    def __init__(self, n: int, silent: bool = False) -> None:
        self.n, self.silent, self.pulls = n, silent, 0

    def push_messages(self, messages):
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        self.pulls += 1
        answered = min(self.pulls, self.n - 1 if self.silent else self.n)
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=m)) for m in message_ids if int(m[1:]) < answered]

    def get_node_ids(self):
        return list(range(self.n))


def test_polled_grid_waits_for_every_reply_or_the_timeout(monkeypatch):
    """``PolledGrid.send_and_receive`` pulls every ``POLL_S`` (not flwr's 3 s) until
    every reply is in, gives up once the timeout has passed with what came, and leaves
    the rest of the grid as it is."""
    from contrafl.flower import server

    sleeps = []
    monkeypatch.setattr(server.time, "sleep", sleeps.append)
    nodes = SlowNodes(3)
    got = server.PolledGrid(nodes).send_and_receive(["a", "b", "c"], timeout=None)
    assert sorted(r.metadata.reply_to_message_id for r in got) == ["m0", "m1", "m2"]
    assert nodes.pulls == 3 and sleeps == [server.POLL_S] * 2

    silent, clock = SlowNodes(3, silent=True), iter(range(100))  # one second per look at the clock
    monkeypatch.setattr(server.time, "monotonic", lambda: next(clock))
    got = server.PolledGrid(silent).send_and_receive(["a", "b", "c"], timeout=5)
    assert sorted(r.metadata.reply_to_message_id for r in got) == ["m0", "m1"] and silent.pulls == 6
    assert server.PolledGrid(silent).get_node_ids() == [0, 1, 2]
