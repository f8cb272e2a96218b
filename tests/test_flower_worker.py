"""A SuperNode's ClientApps served by a worker that stays alive between messages, and
``contrafl-supernode``'s changes to Flower's SuperNode, without Flower processes.

The stand-in grid of test_flower_server.py hands every message to contrafl's ClientApp
in this process; with the node config's default ``worker=true`` the ClientApp forwards
it to its node's worker process, started by the first message.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402
import numpy as np  # noqa: E402

from contrafl.config import load_config  # noqa: E402
from contrafl.engine.run_dir import RunDir  # noqa: E402
from contrafl.engine.setup import prepare  # noqa: E402
from contrafl.engine.simulation import Simulation  # noqa: E402
from contrafl.flower import supernode  # noqa: E402
from contrafl.flower.wire import pack, unpack  # noqa: E402
from test_flower_server import SETTINGS, StandInGrid, rows, run_on  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "task_identity", "worker_dir")


def test_records_travel_to_the_worker_unchanged():
    """pack/unpack: the same records, keys and order; arrays byte for byte with their
    dtype, shape and stype; config and metric values exactly (floats, nan, bytes, lists)."""
    record = RecordDict({
        "arrays": ArrayRecord({"w": Array(np.arange(6, dtype=np.float32).reshape(2, 3)), "b": Array(np.array([True, False])),
                               "empty": Array(np.zeros((0, 4), dtype=np.int64))}),
        "tree": ConfigRecord({"json": '{"x": 1}', "format": 1, "raw": b"\x00\xff", "names": ["a", "b"], "ok": True, "f": 0.1}),
        "metrics": MetricRecord({"loss": float("nan"), "acc": [0.25, 1 / 3], "n": 7}),
    })
    back = unpack(pack(record))
    assert list(back) == ["arrays", "tree", "metrics"]
    assert list(back["arrays"]) == ["w", "b", "empty"]
    for key, array in record["arrays"].items():
        got = back["arrays"][key]
        assert (got.dtype, got.shape, got.stype, got.data) == (array.dtype, array.shape, array.stype, array.data)
        assert np.array_equal(got.numpy(), array.numpy())
    assert dict(back["tree"]) == dict(record["tree"])
    assert math.isnan(back["metrics"]["loss"]) and back["metrics"]["acc"] == [0.25, 1 / 3] and back["metrics"]["n"] == 7
    assert type(back["tree"]["ok"]) is bool and type(back["metrics"]["n"]) is int


class KillingGrid(StandInGrid):
    """The stand-in grid that SIGKILLs every worker of ``folder`` before the train
    messages of round ``kill_before`` (counted from 0)."""

    def __init__(self, nodes, run_dir, folder: Path, kill_before: int) -> None:
        super().__init__(nodes, run_dir)
        self.folder, self.kill_before, self.workers_seen = folder, kill_before, []

    def push_messages(self, messages):
        messages = list(messages)
        rounds = {m.metadata.group_id for m in messages if m.metadata.message_type == "train"}
        if rounds:
            pids = sorted(int(p.read_text()) for p in self.folder.glob("*.pid"))
            self.workers_seen.append(pids)
            if str(self.kill_before) in rounds:
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
        return super().push_messages(messages)


@pytest.mark.slow  # real worker processes, killed and started again (about 14 s)
def test_workers_answer_as_the_clientapp_does_and_a_killed_one_is_replaced(tmp_path, worker_dir):
    """3 rounds of SCAFFOLD (a client state in every round) through the SuperNodes'
    workers give the simulator's metrics bit for bit; each node's worker serves all
    its messages (one process per node, the same in rounds 1 and 2); workers killed
    before round 3 are replaced by new ones, which start from the clients' state files,
    and the run still equals the simulator's."""
    settings = [*SETTINGS, "algorithm=scaffold", "rounds=3"]
    expected = tmp_path / "sim"
    Simulation(prepare(load_config(None, settings)), RunDir(expected)).run()

    # the workers take this process's torch threads (one_thread): results of some runs depend on the count
    nodes = {11 + c: {"partition-id": c, "threads": torch.get_num_threads()} for c in range(3)}
    path = tmp_path / "flower"
    from contrafl.engine.resume import resume
    from contrafl.flower.deploy import prepare_run
    from contrafl.flower.server import GridTransport

    prepare_run(load_config(None, settings), path)
    sim = resume(prepare(load_config(path / "config.yaml")), RunDir(path, resume=True))
    grid = KillingGrid(nodes, path, worker_dir, kill_before=2)
    sim.transport = GridTransport(grid, 3, round_timeout=60.0, min_replies=3, wait_nodes=5.0)
    assert sim.run()["status"] == "completed"
    assert rows(path) == rows(expected)
    first, second, third = grid.workers_seen
    assert len(first) == 3 and first == second  # started by the queries, kept across rounds
    assert len(third) == 3 and set(third) == set(second)  # listed just before they were killed
    assert {int(p.read_text()) for p in worker_dir.glob("*.pid")}.isdisjoint(third)  # new workers
    # the killed workers' files were swept when the new ones started
    assert sorted(p.suffix for p in worker_dir.iterdir()) == [".lock"] * 3 + [".pid"] * 3 + [".sock"] * 3

    pid_file = sorted(worker_dir.glob("*.pid"))[0]
    os.kill(int(pid_file.read_text()), signal.SIGTERM)  # as when the SuperNode's group is stopped
    deadline = time.monotonic() + 10
    while (pid_file.exists() or pid_file.with_suffix(".sock").exists()) and time.monotonic() < deadline:
        time.sleep(0.05)  # the worker removes its pid file, then its socket
    assert not pid_file.exists() and not pid_file.with_suffix(".sock").exists()


@pytest.mark.slow
def test_a_worker_reports_what_does_not_fit_in_one_line_and_worker_false_answers_in_process(tmp_path, capsys, worker_dir):
    """A node whose data-dir has no dataset: its worker cannot load the client and says
    why in one line (the node's log and the server's record of the lost client), as the
    ClientApp does itself with worker=false; the run's other clients reply."""
    from test_orchestra import tiny_cifar

    empty = tmp_path / "empty"
    empty.mkdir()
    settings = [*SETTINGS, "rounds=1", "batch_size=8", *tiny_cifar(tmp_path / "data")]
    lost = {}
    for worker in (True, False):
        nodes = {11: {"partition-id": 0, "worker": worker}, 12: {"partition-id": 1, "data-dir": str(empty), "worker": worker},
                 13: {"partition-id": 2, "worker": worker}}
        assert run_on(tmp_path / f"worker-{worker}", nodes, min_replies=2, settings=settings)["status"] == "completed"
        (row,) = rows(tmp_path / f"worker-{worker}")
        lost[worker] = row["lost"]
        err = capsys.readouterr().err.splitlines()
        assert err == [f"contrafl: {row['lost'][0]['reason'].replace('<data-dir>', str(empty))}"]  # the node's log: its paths
    assert lost[True] == lost[False] and [x["client"] for x in lost[True]] == [1]
    assert lost[True][0]["reason"].startswith("missing file <data-dir>/cifar-10-batches-py/")  # the server: not the site's paths
    assert str(empty) not in lost[True][0]["reason"]
    assert len(list(worker_dir.glob("*.sock"))) == 3  # worker=false started none


def test_a_worker_folder_too_long_for_a_socket_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """CONTRAFL_WORKER_DIR whose sockets' paths would pass the 107 bytes of a Unix
    socket: the node says so in one line, naming the folder, the length and the fix
    (flwr reported ``OSError: AF_UNIX path too long``), and is not used."""
    long = tmp_path / ("w" * 90)
    monkeypatch.setenv("CONTRAFL_WORKER_DIR", str(long))
    with pytest.raises(Exception, match="0 of 3 clients have a SuperNode that can serve them"):
        run_on(tmp_path / "run", {11: {"partition-id": 0}}, min_replies=1)
    problem = (f"the SuperNode's worker sockets would be in '{long}', whose socket paths are {len(str(long)) + 30} bytes long, "
               "more than the 107 a Unix socket allows; set CONTRAFL_WORKER_DIR to a shorter folder")
    assert f"SuperNode 11 (partition-id=0) is not used: {problem}\n" in capsys.readouterr().out
    assert not long.exists()


def test_a_bad_worker_value_is_a_one_line_error(tmp_path):
    nodes = {11: {"partition-id": 0, "worker": "maybe"}}
    with pytest.raises(Exception, match="node config worker='maybe' is not true or false"):
        run_on(tmp_path / "run", nodes, min_replies=1)


def test_contrafl_supernode_caps_the_supernodes_waits_and_runs_clientapps_in_the_runner(monkeypatch):
    """The SuperNode loop's sleeps are capped at the poll interval (the rest of ``time``
    unchanged); its start of a plain flower-superexec becomes the runner with the same
    arguments, anything else starts as it was; a poll interval that is not a positive
    number is a one-line error."""
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    clock = supernode.capped_time(0.05)
    clock.sleep(3)
    clock.sleep(0.01)
    assert slept == [0.05, 0.01]
    assert clock.monotonic is time.monotonic and clock.time is time.time

    started = []
    monkeypatch.setattr(supernode.subprocess, "Popen", lambda argv, *a, **k: started.append(argv))
    argv = ["flower-superexec", "--insecure", "--runtime-api-address", "127.0.0.1:9094", "--parent-pid", "7"]
    supernode.runner_popen(argv)
    supernode.runner_popen(["flower-superexec", "--root-certificates", "ca.pem", "--runtime-api-address", "x:1"])
    supernode.runner_popen(["something-else", "--insecure"])
    assert started == [
        [supernode.sys.executable, "-m", "contrafl.flower.runner", *argv[1:]],
        ["flower-superexec", "--root-certificates", "ca.pem", "--runtime-api-address", "x:1"],
        ["something-else", "--insecure"],
    ]
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("CONTRAFL_SUPERNODE_POLL_S", bad)
        with pytest.raises(SystemExit, match=f"CONTRAFL_SUPERNODE_POLL_S='{bad}' is not a positive number"):
            supernode.poll_interval()
    monkeypatch.setenv("CONTRAFL_SUPERNODE_POLL_S", "0.5")
    assert supernode.poll_interval() == 0.5


class Exits:
    """A process that has exited with ``status``."""

    def __init__(self, pid: int, status: int) -> None:
        self.pid, self.status = pid, status

    def wait(self) -> int:
        return self.status


def test_a_runner_that_exits_is_started_again_unless_its_supernode_stops(monkeypatch, capsys):
    """:func:`supernode.keep_running` starts a runner that exited again, with one line,
    waiting longer while they die young, and longer still after a SIGTERM (the SuperNode's
    group stopped?); once the SuperNode is stopping it starts none."""
    import threading

    waits, stopping = [], threading.Event()
    monkeypatch.setattr(stopping, "wait", lambda seconds: waits.append(seconds) or len(waits) > 3)
    started = iter([Exits(2, -signal.SIGTERM), Exits(3, 1), Exits(4, 0)])
    supernode.keep_running(Exits(1, -signal.SIGKILL), lambda: next(started), stopping)
    assert waits == [1.0, supernode.GROUP_STOP_S, 4.0, 8.0]  # each died young: the wait doubles; a SIGTERM waits longer for a stop
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" after ")[0] for line in err] == [
        "contrafl-supernode: its ClientApp runner (pid 1) was killed by SIGKILL",
        "contrafl-supernode: its ClientApp runner (pid 2) was killed by SIGTERM",
        "contrafl-supernode: its ClientApp runner (pid 3) exited with status 1",
    ]
    assert next(started, None) is None and len(err) == 3  # stopping: the last one that exited is not replaced
    assert supernode.ended(-9) == "was killed by SIGKILL" and supernode.ended(-40) == "was killed by signal 40"  # a real-time signal has no name

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:  # SIGTERM sets the flag, and the handler installed before (flwr's) still runs
        got = []
        signal.signal(signal.SIGTERM, lambda *_: got.append("flwr"))
        flag = supernode.stopping_flag()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.wait(5) and got == ["flwr"]
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_the_clientapp_imports_neither_torch_nor_the_engine():
    """What every message's ClientApp process imports: flwr and contrafl's light modules
    (the worker holds torch)."""
    import subprocess
    import sys

    code = "import sys, contrafl.flower.client_app; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'contrafl'))))"
    out = subprocess.run([sys.executable, "-c", f"import json; {code}"], capture_output=True, text=True, check=True).stdout
    modules = json.loads(out)
    assert not [m for m in modules if m.startswith("torch")]
    assert not [m for m in modules if m.startswith(("contrafl.engine", "contrafl.execution", "contrafl.algorithms", "contrafl.models", "contrafl.data"))]


@pytest.mark.slow
def test_a_sigterm_while_the_worker_exits_leaves_no_traceback_in_the_log(tmp_path):
    """A stopped deployment signals the SuperNode's group more than once; a SIGTERM that
    reaches the worker while it runs the interpreter's exit handlers is ignored (it
    printed ``Exception ignored in atexit callback`` and a traceback into the SuperNode's
    log), and the worker ends with status 0."""
    import subprocess
    import sys

    code = (
        "import atexit, os, signal, sys, time\n"
        "from contrafl.flower import worker\n"
        "worker.Worker.__init__ = lambda self, *args: None\n"
        "worker.Worker.serve = lambda self: None  # a worker that has served and exits\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2)))  # the group's SIGTERM, late\n"
        "sys.argv = ['worker', sys.argv[1], '1', sys.argv[2]]\n"
        "worker.main()\n"
    )
    settings = {"partition_id": 0, "run_dir": str(tmp_path), "run_dir_setting": "run-dir", "state_dir": None, "data_dir": None, "threads": 1}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "w.sock"), json.dumps(settings)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
