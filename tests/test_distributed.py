"""The distributed executor (issue #36 item 1): persistent worker processes on
torch.distributed train each round's clients, their states moving exactly between ranks;
a run equals the sequential executor's to float tolerance, the same world size
reproduces it bit for bit (forked workers or torchrun's two launchers on 127.0.0.1), a
killed run resumes to the same bytes, and a failing worker ends the run with its error."""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from contrafl.algorithms.registry import ALGORITHMS
from contrafl.cli import main, serve_rank
from contrafl.config import load_config
from contrafl.errors import ConfigError
from contrafl.execution.clients import LocalClients
from contrafl.execution import distributed
from contrafl.execution.distributed import assign, split_tail
from contrafl.execution.partial import restore
from contrafl.engine.run_dir import RunDir
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from conftest import setup_warnings
from test_resume import _killed_run

# MOON keeps every client's previous model: a state that must follow the client to the
# rank that trains it; half the clients per round, so that the shares change.
MOON = ["algorithm=moon", "num_clients=6", "sample_fraction=0.5", "rounds=4", "local_epochs=1"]


def metrics(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def torchrun_path() -> str | None:
    """torchrun beside this Python (its virtual environment's), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return beside if os.path.exists(beside) else shutil.which("torchrun")


def two_launchers(args_of_node: list[list[str]], env: dict[str, str]) -> list[subprocess.Popen]:
    """docs/distributed.md's two-machine command on 127.0.0.1: one torchrun launcher per
    node, one process each, running `contrafl run` with that node's arguments."""
    port = str(free_port())
    return [
        subprocess.Popen(
            [torchrun_path(), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
             "--master-port", port, "-m", "contrafl", "run", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node, args in enumerate(args_of_node)
    ]


def test_shares_are_balanced_and_keep_clients_on_the_rank_that_holds_their_state():
    steps = {0: 10, 1: 10, 2: 10, 3: 10, 4: 5, 5: 5}
    assert assign(steps, {}, 2) == [[0, 2, 4], [1, 3, 5]]  # longest first to the least loaded
    assert assign(steps, {0: 1, 1: 1}, 2) == [[2, 3, 4], [0, 1, 5]]  # 0 and 1 stay on rank 1
    # rank 1 holds every client: it keeps them while its load is within 1.1x the mean (25)
    assert assign(steps, {c: 1 for c in steps}, 2) == [[2, 3, 5], [0, 1, 4]]
    shares = assign({c: 1 + c % 3 for c in range(20)}, {}, 3)
    assert sorted(c for s in shares for c in s) == list(range(20))
    assert max(sum(1 + c % 3 for c in s) for s in shares) - min(sum(1 + c % 3 for c in s) for s in shares) <= 1


def test_the_tail_is_the_stateless_clients_with_the_fewest_steps_longest_first():
    steps = {0: 6, 1: 5, 2: 6, 3: 5, 4: 5, 5: 6, 6: 2}
    assert split_tail(steps, steps, 0.25) == [4, 6]  # a quarter of 35 steps: 2 + 5 fit, a second 5 does not
    assert split_tail(steps, [0, 2, 5, 6], 0.25) == [5, 6]  # 1, 3 and 4 hold a state: 2 + 6 fit
    assert split_tail(steps, steps, 0.0) == [] and split_tail({}, [], 0.25) == []
    assert split_tail(steps, steps, 1.0) == [0, 2, 5, 1, 3, 4, 6]


FEDAVG = ["algorithm=fedavg", "num_clients=8", "sample_fraction=1", "rounds=2", "local_epochs=1",
          "executor=distributed", "workers=2"]


@pytest.mark.parametrize("takes", ["rank 0", "the worker"])
def test_who_trains_the_tail_changes_no_bit(tmp_path, monkeypatch, takes):
    """The tail's clients go to whichever rank is free first: luck. Whether rank 0 or the
    worker trains all of them, the run computes the same bytes as when they share them
    (the tail's replies travel one by one; only the fixed shares are summed on a rank)."""
    base = tmp_path / "shared"
    assert Simulation(prepare(load_config(None, FEDAVG)), RunDir(base)).run()["status"] == "completed"
    parent, taken = os.getpid(), distributed.taken
    got = multiprocessing.get_context("fork").Queue()

    def one_rank_takes_all(claim, tail):
        here = "rank 0" if os.getpid() == parent else "the worker"
        if here != takes:  # the other rank takes none, and waits for the answer or sends its own
            return
        for cid in taken(claim, tail):
            got.put(cid)
            yield cid

    monkeypatch.setattr(distributed, "taken", one_rank_takes_all)  # the forked worker inherits it
    run = tmp_path / "one"
    assert Simulation(prepare(load_config(None, FEDAVG)), RunDir(run)).run()["status"] == "completed"
    assert got.qsize() > 0  # a tail there was, and one rank trained it
    assert (run / "metrics.jsonl").read_bytes() == (base / "metrics.jsonl").read_bytes()
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True)["server"]["model"] for d in (run, base))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_distributed_run_equals_the_sequential_one_and_repeats_itself_bit_for_bit(tmp_path):
    """3 ranks (two forked workers) on MOON: the metrics and the final models equal the
    sequential executor's to float tolerance; a second run with 3 ranks, bit for bit;
    the workers end with the run."""
    runs = {}
    for name, executor in [("sequential", ["executor=sequential"]), ("ranks", ["executor=distributed", "workers=3"]),
                           ("again", ["executor=distributed", "workers=3"])]:
        sim = Simulation(prepare(load_config(None, [*MOON, *executor])), RunDir(tmp_path / name))
        started = []
        start = distributed.start

        def keep(*args, start=start):
            started.append(start(*args))
            return started[-1]

        distributed.start = keep
        try:
            assert sim.run()["status"] == "completed"
        finally:
            distributed.start = start
        if started:
            assert started[0].world == 3 and started[0].copies  # states left rank 0
            assert not any(p.is_alive() for p in started[0].workers)
        runs[name] = sim
    seq, ranks = metrics(tmp_path / "sequential"), metrics(tmp_path / "ranks")
    for a, b in zip(seq, ranks):
        assert a["clients"] == b["clients"] and a["local_steps"] == b["local_steps"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["test_acc"] == pytest.approx(a["test_acc"], abs=1e-9)
    for k, v in runs["sequential"].server.model.items():
        torch.testing.assert_close(runs["ranks"].server.model[k], v, rtol=1e-4, atol=1e-5)
    assert (tmp_path / "ranks" / "metrics.jsonl").read_bytes() == (tmp_path / "again" / "metrics.jsonl").read_bytes()
    for cid in range(6):  # rank 0 holds every client's newest state, as the sequential run does
        torch.testing.assert_close(runs["ranks"].store.get(cid), runs["sequential"].store.get(cid), rtol=1e-4, atol=1e-5)


def test_a_worker_serves_its_clients_without_a_round_loop(tmp_path, monkeypatch):
    """The workers train their shares with LocalClients of their own and never build a
    Simulation (the round loop): a worker that tried would fail the run."""
    parent, init = os.getpid(), Simulation.__init__
    served = multiprocessing.get_context("fork").Queue()
    train_locally = LocalClients.train_locally

    def only_rank_0(self, *args, **kwargs):
        assert os.getpid() == parent, "a worker built a Simulation"
        init(self, *args, **kwargs)

    def counted(self, t, cids, *args, **kwargs):
        if os.getpid() != parent:
            served.put((type(self).__name__, len(cids)))
        return train_locally(self, t, cids, *args, **kwargs)

    monkeypatch.setattr(Simulation, "__init__", only_rank_0)  # the forked workers inherit the patches
    monkeypatch.setattr(LocalClients, "train_locally", counted)
    sim = Simulation(prepare(load_config(None, [*MOON, "executor=distributed", "workers=2"])), RunDir(tmp_path / "run"))
    assert sim.run()["status"] == "completed"
    seen = [served.get(timeout=10) for _ in range(served.qsize())] if served.qsize() else []
    assert seen and {name for name, _ in seen} == {"LocalClients"} and sum(n for _, n in seen) > 0


def test_ranks_that_stack_their_share_equal_the_vectorized_run(tmp_path, monkeypatch):
    """``rank_executor=vectorized``: each rank trains its share of the round as one stack
    (as one process would on a GPU, where ``auto`` chooses it); the run equals the
    vectorized executor's in one process to float tolerance, and rank 0 trained its
    share stacked."""
    from contrafl.execution.vectorized import VectorizedExecutor

    stacked = []
    train = VectorizedExecutor.train
    monkeypatch.setattr(VectorizedExecutor, "train", lambda ex, jobs, *a, **k: stacked.append(len(jobs)) or train(ex, jobs, *a, **k))
    runs = {}
    for name, executor in [("one", ["executor=vectorized"]), ("ranks", ["executor=distributed", "workers=2", "rank_executor=vectorized"])]:
        sim = Simulation(prepare(load_config(None, [*MOON, *executor])), RunDir(tmp_path / name))
        assert sim.run()["status"] == "completed"
        runs[name] = sim
    assert runs["ranks"].cfg.rank_executor == "vectorized" and runs["ranks"].local_executor == "vectorized"
    assert len(stacked) == 2 * 4 and max(stacked[4:]) < 3  # one stack of 3 clients a round, then rank 0's shares
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "ranks")):
        assert a["clients"] == b["clients"] and a["local_steps"] == b["local_steps"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    for k, v in runs["one"].server.model.items():
        torch.testing.assert_close(runs["ranks"].server.model[k], v, rtol=1e-4, atol=1e-5)


def test_rank_executor_is_chosen_by_device_and_algorithm():
    """``rank_executor=auto``: stacked on a GPU, one client after the other on a CPU
    (until ``choose_stacking``, which sees the model and the partition:
    tests/test_stacked.py); a stack for an algorithm that cannot be vectorised is one
    line."""
    from contrafl.engine.setup import choose_rank_executor

    cfg = load_config(None, ["executor=distributed"])
    fedavg = ALGORITHMS.get("fedavg")
    unstackable = type("Unstackable", (fedavg,), {"vectorizable": False, "name": "unstackable"})
    assert choose_rank_executor(cfg, "distributed", fedavg, torch.device("cuda")) == "vectorized"
    assert choose_rank_executor(cfg, "distributed", fedavg, torch.device("cpu")) == "sequential"
    assert choose_rank_executor(cfg, "distributed", unstackable, torch.device("cuda")) == "sequential"
    assert choose_rank_executor(cfg, "vectorized", fedavg, torch.device("cuda")) == "auto"  # not read
    wanted = load_config(None, ["executor=distributed", "rank_executor=vectorized"])
    assert choose_rank_executor(wanted, "distributed", fedavg, torch.device("cpu")) == "vectorized"
    with pytest.raises(ConfigError, match="rank_executor=vectorized is not possible: algorithm unstackable cannot be vectorized"):
        choose_rank_executor(wanted, "distributed", unstackable, torch.device("cpu"))


def test_ranks_beyond_a_rounds_clients_are_a_warning():
    """``workers`` above the clients a round trains starts ranks that never get a client:
    valid, and said, with how many to use."""
    def idle_warnings(*overrides: str) -> list[str]:
        return [w for w in setup_warnings("executor=distributed", "num_clients=4", "sample_fraction=0.5", *overrides) if "ranks" in w]

    assert idle_warnings("workers=3") == [
        "workers=3 starts 3 ranks, and a round trains 2 clients: 1 rank is given no client and only waits; "
        "use at most 2 ranks (workers unset: the cores, and no more than a round's clients)"
    ]
    assert idle_warnings("workers=2") == []
    assert idle_warnings("workers=3", "sample_fraction=1") == []


def test_rank_executor_without_the_distributed_executor_is_a_warning():
    def warnings(*overrides: str) -> list[str]:
        return [w for w in setup_warnings(*overrides) if "rank_executor" in w]

    assert warnings("executor=sequential", "rank_executor=vectorized") == [
        "rank_executor=vectorized has no effect with executor=sequential: it says how each rank of "
        "executor=distributed trains its share of a round's clients"
    ]
    assert warnings("executor=distributed", "workers=2", "rank_executor=sequential") == []
    assert warnings("executor=sequential") == []


@pytest.mark.slow
def test_killed_in_the_middle_of_a_round_resumes_to_the_same_bytes(tmp_path):
    """Rank 0 killed (SIGKILL) after some replies of round 4: its forked workers die with
    it; `--resume` starts new ones, which hold no state, and ends byte-identical to the
    uninterrupted run: the checkpoint keeps which worker trained each client last, so
    the resumed rounds share the clients among the ranks as the uninterrupted run did
    (without it, round 5 differed in the last digits: other shares, other sums)."""
    settings = [*MOON, "rounds=5", "executor=distributed", "workers=2"]
    assert main(["run", "--quiet", "--out", str(tmp_path / "clean"), *settings]) == 0
    run = tmp_path / "run"
    _killed_run(run, "outcome", 3 * (1 + 3) + 1 + 2, settings)  # round 4, two of its three outcomes taken
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 3
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == (tmp_path / "clean" / "metrics.jsonl").read_bytes()
    assert not processes_naming(str(run))  # the killed rank 0's forked workers died with it


def test_killed_while_the_ranks_take_the_tail_resumes_to_the_same_bytes(tmp_path):
    """FedAvg's clients hold no state, so every round has a tail. Rank 0 killed (SIGKILL)
    after five of round 3's eight outcomes, in its share or the tail: the resumed run
    ends byte-identical to the uninterrupted one (which rank trained a tail client is
    recorded nowhere, and needs not be)."""
    settings = [*FEDAVG, "rounds=4"]
    assert main(["run", "--quiet", "--out", str(tmp_path / "clean"), *settings]) == 0
    run = tmp_path / "run"
    _killed_run(run, "outcome", 2 * (1 + 8) + 1 + 5, settings)
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 2
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == (tmp_path / "clean" / "metrics.jsonl").read_bytes()
    assert not processes_naming(str(run))


def test_stacked_ranks_killed_in_a_round_resume_to_the_same_bytes(tmp_path):
    """Ranks that stack their clients on a CPU (``rank_executor=auto``: MOON's clients,
    each with its previous model, 10 a rank of 67-68 digits: width 8.75) killed after five of round
    2's twenty outcomes: the resumed run stacks them again and ends byte-identical to the
    uninterrupted one."""
    settings = ["algorithm=moon", "num_clients=20", "partition=iid", "sample_fraction=1", "rounds=3", "local_epochs=1",
                "batch_size=10", "executor=distributed", "workers=2"]
    assert main(["run", "--quiet", "--out", str(tmp_path / "clean"), *settings]) == 0
    assert "rank_executor: vectorized" in (tmp_path / "clean" / "config.yaml").read_text()
    run = tmp_path / "run"
    _killed_run(run, "outcome", (1 + 20) + 1 + 5, settings)
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 1
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == (tmp_path / "clean" / "metrics.jsonl").read_bytes()
    assert not processes_naming(str(run))


def on_the_workers(monkeypatch, t: int, act) -> None:
    """``act()`` in each forked worker as it is given round ``t``'s clients (``t``
    counted from 0), before they train: the workers inherit the patch."""
    parent, train_locally = os.getpid(), LocalClients.train_locally

    def acting(self, round_, *args, **kwargs):
        if os.getpid() != parent and round_ == t:
            act()
        return train_locally(self, round_, *args, **kwargs)

    monkeypatch.setattr(LocalClients, "train_locally", acting)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> bytes:
    """metrics.jsonl of MOON's run on 2 ranks that nothing stopped."""
    out = tmp_path_factory.mktemp("clean") / "run"
    assert main(["run", "--quiet", "--out", str(out), *MOON, "executor=distributed", "workers=2"]) == 0
    return (out / "metrics.jsonl").read_bytes()


def test_a_worker_killed_in_round_3_ends_the_run_in_one_line_and_the_run_resumes_to_the_same_bytes(tmp_path, monkeypatch, capsys, uninterrupted):
    """A forked worker killed by SIGKILL (the out-of-memory killer's signal) while it
    trains round 3: rank 0 ends at once with one line naming the rank, how its process
    ended and the resume command (exit status 1, no traceback); the resumed run ends
    byte-identical to the uninterrupted one."""
    settings = [*MOON, "executor=distributed", "workers=2"]
    on_the_workers(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGKILL))
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["run", "--quiet", "--out", str(run), *settings]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.fullmatch(
        r"contrafl: error: rank 1 is gone \([^;()]*; its process \d+: killed by signal 9, SIGKILL: out of memory\?\) "
        rf"in round 3; `contrafl run --resume {re.escape(str(run))}` continues from round 3", err), err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("RankLost: rank 1 is gone")
    monkeypatch.undo()
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == uninterrupted


@pytest.mark.slow
def test_a_rank_busy_for_longer_than_the_process_groups_timeout_is_waited_for(tmp_path, monkeypatch):
    """The process group's timeout is for joining it: a worker whose answer waits for
    rank 0's share of round 2, and rank 0 waiting for a worker's share of round 3, each
    longer than that timeout, are waited for (the run failed with `rank 0 is gone
    (Timed out waiting ... for send operation to complete)` while Gloo's waits used it)."""
    monkeypatch.setattr(distributed, "TIMEOUT", datetime.timedelta(seconds=1))
    parent, train_locally = os.getpid(), LocalClients.train_locally

    def slow(self, t, *args, **kwargs):
        if t == (1 if os.getpid() == parent else 2):
            time.sleep(1.5)
        return train_locally(self, t, *args, **kwargs)

    monkeypatch.setattr(LocalClients, "train_locally", slow)  # the forked worker inherits it
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *MOON, "executor=distributed", "workers=2"]) == 0
    assert [m["round"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_silent_worker_ends_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """A worker whose process stops (SIGSTOP: its connections stay open, as where its
    machine or the network is gone) is not heard from: rank 0 ends the run after
    :data:`distributed.SILENCE_S` seconds of its silence with one line and the resume
    command, and kills it."""
    monkeypatch.setattr(distributed, "SILENCE_S", 1.5)
    monkeypatch.setattr(distributed, "BEAT_S", 0.1)
    on_the_workers(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGSTOP))
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *MOON, "executor=distributed", "workers=2"]) == 1
    assert re.fullmatch(
        r"contrafl: error: rank 1 is gone \(not heard from for [12] s: its process stopped, or its machine or the network down\) "
        rf"in round 3; `contrafl run --resume {re.escape(str(run))}` continues from round 3\n", capsys.readouterr().err)
    assert multiprocessing.active_children() == []


def _silent_rank_0(port: int, rank: int) -> None:
    """Rank ``rank`` of 2 on 127.0.0.1: rank 0 (the store's host) joins and stops itself;
    rank 1, whose process group its program made (as one that calls contrafl's API
    under torchrun may), waits for a packet from it, and exits with 3 on
    :class:`RankLost`."""
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=distributed.TIMEOUT)
    if rank == 1:
        torch.distributed.init_process_group("gloo", store=store, rank=1, world_size=2)
    distributed._join(rank, 2, store)
    if rank == 0:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        distributed.receive(0)
    except distributed.RankLost as lost:
        print(lost, flush=True)
        distributed._leave()
        os._exit(3)
    os._exit(0)


@pytest.mark.slow
def test_a_worker_whose_rank_0_falls_silent_ends(monkeypatch, capfd):
    """Rank 0 stopped (its machine gone, with the store it hosts): a worker waiting for its
    packet gives up after :data:`distributed.SILENCE_S` seconds and leaves the group,
    though the store no longer answers its own sign of life."""
    monkeypatch.setattr(distributed, "SILENCE_S", 1.5)
    monkeypatch.setattr(distributed, "BEAT_S", 0.1)
    ctx, port = multiprocessing.get_context("fork"), free_port()
    ranks = [ctx.Process(target=_silent_rank_0, args=(port, rank)) for rank in range(2)]
    for p in ranks:
        p.start()
    ranks[1].join(30)
    ranks[0].kill()
    ranks[0].join()
    assert ranks[1].exitcode == 3
    assert "rank 0 is gone (not heard from for" in capfd.readouterr().out


def test_a_worker_stopped_in_round_3_stops_the_run_and_it_resumes_to_the_same_bytes(tmp_path, monkeypatch, capsys, uninterrupted):
    """A stop request on a worker (SIGTERM from a scheduler on that machine, recorded as
    its handler records it) is its answer to the round's packet: rank 0 stops the run
    as a stop of its own would (status interrupted, 128 + the signal, the resume
    command), and the resumed run ends byte-identical to the uninterrupted one."""
    from contrafl.execution import signals

    settings = [*MOON, "executor=distributed", "workers=2"]
    on_the_workers(monkeypatch, 2, lambda: signals._record(signal.SIGTERM, None))
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["run", "--quiet", "--out", str(run), *settings]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == f"interrupted by SIGTERM after round 2; `contrafl run --resume {run}` continues from round 3"
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    monkeypatch.undo()
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == uninterrupted


@pytest.mark.slow
def test_a_stop_requested_while_a_worker_sends_its_answer_stops_the_run_as_interrupted(tmp_path, monkeypatch, capsys, uninterrupted):
    """A stop request that lands on a worker while its answer waits for rank 0 to take
    it (rank 0 still training its own share) neither cuts that message after its size
    nor ends the worker before rank 0 has taken its last word: the answer arrives whole,
    the stop is the worker's answer to the next packet, and rank 0 stops the run as
    interrupted, not as a lost rank; the run resumes to the same bytes."""
    from contrafl.execution import signals

    parent, send, train_locally = os.getpid(), distributed.send, LocalClients.train_locally
    answers = []

    def stopped_while_sending(obj, peer):
        if os.getpid() != parent and isinstance(obj, tuple):
            answers.append(obj)
            if len(answers) == 2:  # round 2's answer, which rank 0 takes 1 s late
                signals._record(signal.SIGTERM, None)  # as the SIGTERM handler records it
        send(obj, peer)

    def slow_rank_0(self, round_, *args, **kwargs):
        yield from train_locally(self, round_, *args, **kwargs)
        if os.getpid() == parent and round_ >= 1:
            time.sleep(1.0)

    monkeypatch.setattr(distributed, "send", stopped_while_sending)
    monkeypatch.setattr(LocalClients, "train_locally", slow_rank_0)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["run", "--quiet", "--out", str(run), *MOON, "executor=distributed", "workers=2"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == f"interrupted by SIGTERM after round 2; `contrafl run --resume {run}` continues from round 3"
    monkeypatch.undo()
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == uninterrupted


@pytest.mark.slow
@pytest.mark.skipif(torchrun_path() is None, reason="no torchrun")
def test_sigterm_to_a_torchrun_worker_stops_both_launchers_as_interrupted(tmp_path):
    """A scheduler's SIGTERM to the worker rank's process (its own machine's) while the
    run trains: both ranks end as stopped (exit 143, rank 0 with the resume command), not
    as failed."""
    settings = ["algorithm=moon", "num_clients=20", "rounds=500", "local_epochs=2", "executor=distributed", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = two_launchers([[*settings, "--out", str(tmp_path / f"node{node}")] for node in (0, 1)], env)
    metrics = tmp_path / "node0" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
        time.sleep(0.1)
    worker = [pid for pid in processes_naming(str(tmp_path / "node1"))  # torchrun's child, not torchrun
              if open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[1:4] == [b"-u", b"-m", b"contrafl"]]
    assert len(worker) == 1
    os.kill(worker[0], signal.SIGTERM)
    outputs = [p.communicate(timeout=120)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [1, 1], outputs  # torchrun's own status for a failed worker
    assert "(exitcode: 143)" in outputs[0] and "(exitcode: 143)" in outputs[1]
    assert re.search(rf"^interrupted by SIGTERM after round \d+; `contrafl run --resume {re.escape(str(tmp_path / 'node0'))}`", outputs[0], re.M)
    assert "contrafl: interrupted by SIGTERM" in outputs[1]
    assert json.loads((tmp_path / "node0" / "summary.json").read_text())["status"] == "interrupted"


def test_a_rank_that_loses_rank_0_under_torchrun_ends_in_one_line(monkeypatch, capsys):
    def lost(setup, rank, world):
        raise distributed.RankLost(0, distributed._connection(RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.1]:28587. "
            "This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error.")))

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "serve_launched", lost)
    assert serve_rank(None) == 1
    assert capsys.readouterr().err == (
        "contrafl: error: rank 0 is gone (Connection closed by peer [10.0.0.1]:28587); rank 1 ends with it "
        "(`contrafl run --resume RUN` on every machine continues the run)\n")
    monkeypatch.setenv("RANK", "0")
    assert serve_rank(None) is None


@pytest.mark.parametrize("ending", [
    "stop",  # Ctrl-C reaches every rank of a launcher at once, and rank 0 may end first
    "user error",
    "bug",
])
def test_a_worker_whose_stop_or_error_finds_rank_0_gone_ends_with_its_own(monkeypatch, ending):
    """A worker tells rank 0 why it ends (its stop, a user error, a bug's traceback).
    Where rank 0 is gone by then, the worker ends with its own reason, not with
    `rank 0 is gone`: a Ctrl-C on a torchrun job printed that error on rank 1 after
    rank 0's `interrupted by SIGINT`."""
    from types import SimpleNamespace

    from contrafl.execution.signals import Interrupted

    raised = {"stop": Interrupted(signal.SIGINT), "user error": ConfigError("lr=-1 is invalid"), "bug": ValueError("boom")}[ending]
    told = []

    def send(obj, peer):
        if told:  # the identity went through; rank 0 is gone before the last word
            raise distributed.RankLost(0, "Connection closed by peer [127.0.0.1]:29500")
        told.append(obj)

    def answer(sim, store, packet, counter):
        raise raised

    monkeypatch.setattr(distributed, "send", send)
    monkeypatch.setattr(distributed, "receive", lambda *args, **kwargs: {"t": 0})
    monkeypatch.setattr(distributed, "identity", lambda setup: "rank 1")
    monkeypatch.setattr(distributed, "_answer", answer)
    monkeypatch.setattr(distributed, "_leave", lambda: None)
    sim = SimpleNamespace(setup=None, device=torch.device("cpu"), store=SimpleNamespace(close=lambda: None))
    with pytest.raises(type(raised)) as ended:
        distributed.serve(sim, None)
    assert ended.value is raised


def processes_naming(text: str) -> list[int]:
    """The processes whose command line holds ``text`` (Linux's /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(torchrun_path() is None, reason="no torchrun")
def test_torchrun_on_two_launchers_equals_the_run_with_the_same_ranks_bit_for_bit_and_resumes(tmp_path):
    """docs/distributed.md's two-machine command, on 127.0.0.1 with one process per
    launcher (one thread each, as the forked workers of a 2-core machine have): rank 0
    writes the run, rank 1 nothing, and the metrics equal `workers=2`'s byte for byte.
    Then its `--resume RUN rounds=4` on both launchers, RUN on a filesystem both see
    (here one machine): the launchers above rank 0 read its config without taking rank
    0's lock on it, and the extended run equals the same extension with `workers=2`."""
    settings = [*MOON, "rounds=2", "executor=distributed"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}

    def local(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "contrafl", "run", *args, "workers=2", "--quiet"],
                              env={**env, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]

    def launched(*args: str) -> None:
        launchers = two_launchers([[*args, "--quiet"]] * 2, env)
        outputs = [p.communicate(timeout=300)[0] for p in launchers]
        assert [p.returncode for p in launchers] == [0, 0], outputs

    local(*settings, "--out", str(tmp_path / "local"))
    launched(*settings, "--out", str(tmp_path / "launched"))
    metrics = tmp_path / "launched" / "metrics.jsonl"
    assert metrics.read_bytes() == (tmp_path / "local" / "metrics.jsonl").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launched", "local"]  # rank 1 wrote nothing
    local("--resume", str(tmp_path / "local"), "rounds=4")
    launched("--resume", str(tmp_path / "launched"), "rounds=4")
    assert len(metrics.read_text().splitlines()) == 4
    assert metrics.read_bytes() == (tmp_path / "local" / "metrics.jsonl").read_bytes()


def test_a_failing_worker_ends_the_run_with_its_error(tmp_path, monkeypatch):
    """A worker whose training raises: rank 0 raises its first line (the run directory
    records the run as failed) and the workers are gone."""
    parent = os.getpid()
    train_locally = LocalClients.train_locally

    def broken(self, *args, **kwargs):
        if os.getpid() != parent:
            raise RuntimeError("the GPU caught fire")
        return train_locally(self, *args, **kwargs)

    monkeypatch.setattr(LocalClients, "train_locally", broken)  # the forked worker inherits it
    sim = Simulation(prepare(load_config(None, [*MOON, "executor=distributed", "workers=2"])), RunDir(tmp_path / "run"))
    with pytest.raises(distributed.WorkerError, match="a worker failed with RuntimeError: the GPU caught fire"):
        sim.run()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_spawned_workers_where_fork_is_unsafe_equal_forked_ones_bit_for_bit(tmp_path, monkeypatch):
    """Where the workers cannot be forked (macOS, Windows: :func:`distributed.can_fork`)
    they are spawned and load the run's data anew from its config: the same bytes of
    metrics as forked workers, and `executor=parallel` (a fork every round) is one line."""
    settings = [*MOON, "executor=distributed", "workers=2"]
    assert main(["run", "--quiet", "--out", str(tmp_path / "forked"), *settings]) == 0
    monkeypatch.setattr(distributed, "can_fork", lambda: False)
    monkeypatch.setattr("contrafl.engine.setup.can_fork", lambda: False)
    spawned = []
    monkeypatch.setattr(distributed.mp, "get_context", lambda method, real=distributed.mp.get_context: spawned.append(method) or real(method))
    assert main(["run", "--quiet", "--out", str(tmp_path / "spawned"), *settings]) == 0
    assert spawned == ["spawn"]
    assert (tmp_path / "spawned" / "metrics.jsonl").read_bytes() == (tmp_path / "forked" / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="executor=parallel forks its workers every round, which is safe on Linux only"):
        prepare(load_config(None, [*MOON, "executor=parallel"]))


def test_default_ranks_are_the_cores_but_no_more_than_a_rounds_clients(monkeypatch):
    """On 8 cores, 3 clients a round: 3 ranks (none started to stay idle); `workers`
    set is kept; the parallel executor keeps the cores."""
    monkeypatch.setattr("contrafl.engine.setup.cpu_cores", lambda: 8)
    assert prepare(load_config(None, [*MOON, "executor=distributed"])).config.workers == 3
    assert prepare(load_config(None, [*MOON, "executor=auto"])).config.workers == 3
    assert prepare(load_config(None, [*MOON, "executor=distributed", "workers=5"])).config.workers == 5
    assert prepare(load_config(None, [*MOON, "executor=parallel"])).config.workers == 8


def test_a_worker_that_ends_before_it_joins_is_one_error_at_once(monkeypatch):
    """Rank 0 does not wait for a worker that has ended: the error names its exit code,
    and the main-module guard only when a script of the user's started the run (not
    contrafl's command line)."""
    import multiprocessing
    import types

    store = torch.distributed.HashStore()
    gone = multiprocessing.get_context("fork").Process(target=sys.exit, args=(3,))
    gone.start()
    gone.join()
    with pytest.raises(distributed.WorkerError, match=r"^worker 1 ended \(exit code 3\) before it joined the run .*__main__"):
        distributed.await_worker(store, 1, gone)
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=None, __file__="/venv/bin/contrafl"))
    with pytest.raises(distributed.WorkerError) as raised:
        distributed.await_worker(store, 1, gone)
    assert "__main__" not in str(raised.value)
    store.set(distributed.joined_key(2), "1")
    distributed.await_worker(store, 2, gone)  # joined: no wait, whatever became of it since


def test_another_executor_under_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "launched_run", contextlib.nullcontext)  # no second rank to meet here
    assert main(["run", "executor=parallel", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "executor=parallel under torchrun" in err and "executor=distributed" in err


def test_what_a_rank_that_ended_before_round_1_tells_the_others():
    from contrafl.execution.signals import Interrupted

    assert distributed._why(Interrupted(signal.SIGTERM)) == "was stopped by SIGTERM before round 1"
    assert distributed._why(ConfigError("lr='abc' is invalid\nsee docs")) == "could not start the run: lr='abc' is invalid"
    assert distributed._why(MemoryError()) == "could not start the run: MemoryError"
    assert distributed._connection(RuntimeError("[gloo/pair.cc:537] Read error [10.0.0.2]:3723: Connection reset by peer. Check the logs.")) == (
        "Read error [10.0.0.2]:3723: Connection reset by peer")


def test_rank_and_world_size_set_without_a_launcher_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert main(["run", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (
        "contrafl: error: RANK=0 and WORLD_SIZE=2 are set, but not the rest of a launcher's environment (environment "
        "variable MASTER_ADDR expected, but not set); start contrafl under torchrun, or unset RANK and WORLD_SIZE\n")
    assert not (tmp_path / "run").exists()


def test_a_rank_that_cannot_reach_the_others_is_one_line(tmp_path, capsys, monkeypatch):
    """A machine that cannot reach the rendezvous (a firewall, the wrong address): one
    line once the join's timeout has passed, not torch's traceback and C++ frames; and
    Gloo's connection errors lose their source locations."""
    monkeypatch.setattr(distributed, "TIMEOUT", datetime.timedelta(seconds=1))
    port = free_port()  # nobody listens there
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--quiet", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"contrafl: error: rank 1 could not join the other ranks \(The client socket has timed out after 1000ms while trying "
        rf"to connect to \(127\.0\.0\.1, {port}\)\); every machine must reach the rendezvous address and port and each "
        r"other: check the firewall, and set GLOO_SOCKET_IFNAME to the network interface that joins the machines where "
        r"they have several\n", err), err
    assert distributed._connection(RuntimeError(
        "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] timed out "
        "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:58765$1")) == (
        "Gloo connectFullMesh failed with timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:58765$1")


def test_workers_send_their_valid_replies_as_one_mean_and_a_bad_reply_alone(tmp_path, monkeypatch):
    """MOON's server needs only the sample-weighted mean of the replies: a worker checks
    its clients' replies as the server would and sends the valid ones as their mean,
    which rank 0 puts in each one's place (engine.partial.restore); a reply that fails
    the checks (NaN from client 2 in round 2) comes alone, and rank 0 rejects it with
    the sequential executor's reason. Metrics and models agree to float tolerance."""
    moon = ALGORITHMS.get("moon")
    client_end = moon.client_end

    def corrupt(self, task, result, state, ctx):
        reply, new_state = client_end(self, task, result, state, ctx)
        if ctx.round == 1 and ctx.cid == 2:
            reply.payload = {**reply.payload, "model": {k: v * float("nan") for k, v in reply.payload["model"].items()}}
        return reply, new_state

    monkeypatch.setattr(moon, "client_end", corrupt)  # the forked workers inherit it
    restored, shares = [], []
    monkeypatch.setattr(distributed, "restore", lambda reply, mean: restored.append(reply.cid) or restore(reply, mean))
    monkeypatch.setattr(distributed, "assign", lambda *a: shares.append(assign(*a)) or shares[-1])
    runs = {}
    for executor in (["executor=sequential"], ["executor=distributed", "workers=2"]):
        sim = Simulation(prepare(load_config(None, [*MOON, "on_bad_update=skip", *executor])), RunDir(tmp_path / executor[0]))
        assert sim.sums_replies
        sim.run()
        runs[executor[0]] = sim
    seq, ranks = metrics(tmp_path / "executor=sequential"), metrics(tmp_path / "executor=distributed")
    assert [r.get("rejected") for r in ranks] == [r.get("rejected") for r in seq] and seq[1]["rejected"]
    bad = {r["client"] for r in seq[1]["rejected"]}
    assert bad == {2} and 2 in shares[1][1] and len(restored) == sum(len(share[1]) for share in shares) - 1  # all but the bad
    for a, b in zip(seq, ranks):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5) and b["bytes_up"] == a["bytes_up"]
    for k, v in runs["executor=sequential"].server.model.items():
        torch.testing.assert_close(runs["executor=distributed"].server.model[k], v, rtol=1e-4, atol=1e-5)


def test_rank_0s_progress_counts_the_workers_steps(tmp_path, monkeypatch):
    """The round's progress on rank 0 plans every client's steps and counts the workers'
    as they report them (a counter in the process group's store): by the round's last
    outcome it has counted all of them, as many as the round's local_steps."""
    monkeypatch.setattr(distributed, "REPORT_S", 0.0)  # the forked workers report every step

    class Recorder:
        def __init__(self):
            self.seen: dict[int, list[tuple[int, int, int]]] = {}

        def working(self, work):
            self.seen.setdefault(work.round, []).append((work.all_steps_done(), work.steps_done, work.steps))

        def resume_at(self, rounds):
            pass

        def round_done(self, row):
            pass

    recorder = Recorder()
    sim = Simulation(prepare(load_config(None, [*MOON, "executor=distributed", "workers=2"])), RunDir(tmp_path / "run"), recorder)
    sim.run()
    for row in metrics(tmp_path / "run"):
        seen = recorder.seen[row["round"]]
        assert {planned for _, _, planned in seen} == {row["local_steps"]}
        assert seen[-1][0] == row["local_steps"] > seen[-1][1]  # all counted, some on the worker


@pytest.mark.parametrize(
    "settings",
    [
        ["client_dropout=0.3"],
        ["algorithm=fedprox", "drop_last=false", "client_speed=uniform:2,8", "round_deadline=1", "stragglers=partial"],
        ["algorithm=fedavg", "dp=local", "dp.clip=1", "dp.noise_multiplier=0.3", "dp.noise=reproducible", "on_bad_update=skip"],
        ["algorithm=fedavg", "dp=central", "dp.clip=1", "dp.noise_multiplier=0.3", "dp.noise=reproducible"],
    ],
    ids=["dropout", "stragglers", "local-dp", "central-dp"],
)
def test_dropout_stragglers_and_dp_are_the_sequential_executors(tmp_path, settings):
    """Each worker's clients' replies travel one by one where a setting looks at single
    updates (DP: clipped, and noised, on rank 0 for central DP, on the client's rank for
    local DP): the metrics are the sequential executor's."""
    rows = {}
    for executor in (["executor=sequential"], ["executor=distributed", "workers=2"]):
        cfg = load_config(None, [*MOON, *settings, *executor])
        Simulation(prepare(cfg), RunDir(tmp_path / executor[0])).run()
        rows[executor[0]] = metrics(tmp_path / executor[0])
    for a, b in zip(rows["executor=sequential"], rows["executor=distributed"]):
        for key in ("clients", "local_steps", "lost", "stragglers", "round_time"):
            assert a.get(key) == b.get(key)
        assert b["test_acc"] == pytest.approx(a["test_acc"], abs=0.02)
        assert (b["train_loss"] is None) == (a["train_loss"] is None)
        if a["train_loss"] is not None:
            assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    assert any(r.get("lost") or r.get("stragglers") or r.get("dp_epsilon") for r in rows["executor=sequential"])
