"""Runs killed at any point resume to the metrics of a run that was never stopped.

A `contrafl run` subprocess kills itself with SIGKILL (no handler, no cleanup) at a
chosen point: in the middle of a round (after some clients' replies, and their states,
have come back: counted as the server checks them, or, for a transport whose workers
check them, as the round loop takes the outcomes) or in the middle of writing a checkpoint (the client states written,
the checkpoint file half written). `contrafl run --resume` must then end with a
metrics.jsonl byte-identical to the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from contrafl.cli import main
from contrafl.execution import signals
from contrafl.engine.simulation import Simulation
from test_orchestra import ORCHESTRA, tiny_cifar

CLIENTS = 4
SETTINGS = [f"num_clients={CLIENTS}", "rounds=4", "local_epochs=1", "executor=sequential", "eval_personal=true"]

# Runs the CLI with one function patched to SIGKILL the process at its N-th call.
KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from contrafl.engine import resumable, simulation
    from contrafl.execution import replies
    from contrafl.engine.checkpoint import save_atomic
    from contrafl import cli

    where, n = sys.argv[1], int(sys.argv[2])
    calls = 0

    def due():
        global calls
        calls += 1
        return calls == n

    if where == "round":  # after the n-th client reply of the run
        check = replies.begin_check

        def begin_check(reply, spec):
            result = check(reply, spec)
            if due():
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        replies.begin_check = begin_check
    elif where == "outcome":  # at the n-th stop point of the round loop: one before each round and each outcome
        point = simulation.stop_point

        def stop_point():
            if due():
                os.kill(os.getpid(), signal.SIGKILL)
            point()

        simulation.stop_point = stop_point
    else:  # while writing the n-th checkpoint file: half of it on disk, not renamed
        def torn_save(obj, path):
            if path.name == "checkpoint.pt" and due():
                tmp = path.with_name("." + path.name + ".tmp")
                torch.save(obj, tmp)
                data = tmp.read_bytes()
                tmp.write_bytes(data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            save_atomic(obj, path)

        resumable.save_atomic = torn_save
    sys.exit(cli.main(["run", *sys.argv[3:]]))
    """
)


def _killed_run(out, where: str, n: int, settings: list[str]) -> None:
    """``contrafl run`` killed at ``where``'s ``n``-th call, with this process's torch
    threads (results of some runs depend on the count, and the uninterrupted run to
    compare with runs here)."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, where, str(n), "--quiet", "--out", str(out), *settings],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]


def _uninterrupted(tmp_path, settings):
    assert main(["run", "--quiet", "--out", str(tmp_path / "clean"), *settings]) == 0
    return (tmp_path / "clean" / "metrics.jsonl").read_bytes()


# FedProx (FedAvg's state and messages, another local loss) is left out: FedAvg's case covers its resume.
ALGORITHMS = ["fedavg", "scaffold", "moon", "fedssc", "fedsiam_da", "solo"]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_killed_in_the_middle_of_a_round_resumes_exactly(tmp_path, algorithm):
    settings = [f"algorithm={algorithm}", *SETTINGS]
    clean = _uninterrupted(tmp_path, settings)
    run = tmp_path / "run"
    _killed_run(run, "round", 2 * CLIENTS + 2, settings)  # round 3, two clients done
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "running" and summary["rounds_completed"] == 2
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 4


def test_one_autoresume_command_starts_continues_and_completes_a_run(tmp_path, capsys, monkeypatch):
    """The README's command for a job that a scheduler may requeue: `contrafl run
    SETTINGS --out DIR --autoresume` starts the run in DIR; the same command, after the
    scheduler stopped the run in round 3 (SIGTERM), continues it to the bytes of an
    uninterrupted run; on the completed run it does nothing; with other settings it is
    one line naming them, and it needs --out."""
    settings = ["algorithm=moon", *SETTINGS]
    clean = _uninterrupted(tmp_path, settings)
    run = tmp_path / "run"
    command = ["--quiet", "--out", str(run), "--autoresume", *settings]
    train_locally = Simulation.train_locally

    def stopped(self, t, *args, **kwargs):
        if t == 2:
            signals._record(signal.SIGTERM, None)
        return train_locally(self, t, *args, **kwargs)

    monkeypatch.setattr(Simulation, "train_locally", stopped)
    assert main(["run", *command]) == 128 + signal.SIGTERM
    monkeypatch.undo()
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 2
    assert main(["run", *command]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean
    capsys.readouterr()
    assert main(["run", *command]) == 0
    assert capsys.readouterr().out == f"{run} has completed all 4 rounds; nothing to resume\n"
    assert main(["run", *command, "lr=0.5", "seed=7"]) == 2
    assert capsys.readouterr().err == (
        f"contrafl: error: --out {run} holds a run of other settings than this command's ({run}'s -> this command's: "
        f"lr: 0.01 -> 0.5, seed: 0 -> 7); choose another --out, or continue that run with `contrafl run --resume {run}`\n")
    assert main(["run", "--autoresume", *settings]) == 2
    assert "--autoresume continues the run in --out DIR" in capsys.readouterr().err
    assert main(["run", *command, "rounds=5", "executor=sequential"]) == 0  # extended, as --resume RUN rounds=5 would
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 5
    early = tmp_path / "early"  # a run killed before it wrote a file leaves its lock alone
    early.mkdir()
    (early / ".lock").touch()
    assert main(["run", "--quiet", "--out", str(early), "--autoresume", *settings, "rounds=1"]) == 0


# Personalised algorithms in PFLlib's protocol: per-client test splits of the pooled data,
# every client evaluated every round, Adam state kept across rounds (FedCRL's setting).
PERSONALIZED = ["pool=true", "test_fraction=0.25", "optimizer=adam", "lr=0.003", "persist_optimizer_state=true"]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedcrl", "ditto", "fedala"])
def test_personalized_killed_in_the_middle_of_a_round_resumes_exactly(tmp_path, algorithm):
    settings = [f"algorithm={algorithm}", *SETTINGS, *PERSONALIZED]
    clean = _uninterrupted(tmp_path, settings)
    assert b"personal_acc" in clean
    run = tmp_path / "run"
    _killed_run(run, "round", 2 * CLIENTS + 2, settings)
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean


# Self-supervised algorithms: kNN evaluation; FedBYOL keeps its target network on the
# clients, FedU2 its EUA weights and shared target on the server.
SELF_SUPERVISED = ["num_clients=4", "rounds=4", "local_epochs=1", "executor=sequential", "knn_k=5",
                   "model.projection_hidden=16", "model.projection_dim=8", "algorithm.predictor_hidden=16"]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedbyol", "fedu2", "fedu", "fedema"])
def test_self_supervised_killed_in_the_middle_of_a_round_resumes_exactly(tmp_path, algorithm):
    settings = [f"algorithm={algorithm}", *SELF_SUPERVISED]
    clean = _uninterrupted(tmp_path, settings)
    run = tmp_path / "run"
    _killed_run(run, "round", 2 * CLIENTS + 2, settings)
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean


@pytest.mark.slow
def test_orchestra_killed_in_the_middle_of_a_round_resumes_exactly(tmp_path):
    """Orchestra's state: the server's centroids; each client's target network, memory of
    projections and SGD momentum (persisted); on CIFAR-10-format images, augmented."""
    settings = [*ORCHESTRA, "num_clients=4", "rounds=3", "persist_optimizer_state=true", *tiny_cifar(tmp_path / "data")]
    clean = _uninterrupted(tmp_path, settings)
    run = tmp_path / "run"
    _killed_run(run, "round", 4 + 2, settings)  # round 2 (the first that trains), two clients done
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean


@pytest.mark.slow
def test_killed_while_writing_a_checkpoint_resumes_exactly(tmp_path):
    """A checkpoint torn while it is written is never read; the run resumes from the one
    before. SCAFFOLD: both the server's state and the clients' (the checkpoint's writing
    does not depend on what the states hold; the other kinds resume in the tests above)."""
    settings = ["algorithm=scaffold", *SETTINGS]
    clean = _uninterrupted(tmp_path, settings)
    run = tmp_path / "run"
    _killed_run(run, "checkpoint", 3, settings)  # the checkpoint after round 3
    assert (run / ".checkpoint.pt.tmp").is_file()  # the torn file, never renamed
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3  # round 3 was logged, its checkpoint was not written
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean


@pytest.mark.slow
def test_resume_with_checkpoints_every_few_rounds_and_spilled_client_states(tmp_path):
    """Client states spilled to disk (a tiny memory budget) and a checkpoint every 3
    rounds: a kill in round 5 resumes from round 3."""
    settings = ["algorithm=moon", *SETTINGS, "rounds=6", "checkpoint_every=3", "client_memory_gb=1e-6"]
    clean = _uninterrupted(tmp_path, settings)
    run = tmp_path / "run"
    _killed_run(run, "round", 4 * CLIENTS + 1, settings)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean
    timing = [json.loads(line)["round"] for line in (run / "timing.jsonl").read_text().splitlines()]
    assert timing == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_sigterm_records_interrupted_and_resumes(tmp_path):
    """SIGTERM (what `timeout` and schedulers send) stops with status interrupted, exit
    143 and a hint; the run then resumes to the uninterrupted metrics."""
    settings = ["algorithm=scaffold", *SETTINGS]
    clean = _uninterrupted(tmp_path, settings)
    run = tmp_path / "run"
    script = KILLER.replace("os.kill(os.getpid(), signal.SIGKILL)", "os.kill(os.getpid(), signal.SIGTERM)")
    proc = subprocess.run(
        [sys.executable, "-c", script, "round", str(2 * CLIENTS + 1), "--quiet", "--out", str(run), *settings],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("interrupted by SIGTERM after round 2")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == "stopped by SIGTERM"
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean


def test_a_resume_on_another_executor_chooses_its_workers_and_rank_executor_anew(tmp_path, capsys):
    """config.yaml keeps the workers and rank_executor chosen for the run's executor
    (workers=1 for the sequential one); resumed with another executor, they are chosen
    for that one unless given: a sequential run resumed with executor=distributed ran on
    one rank, and a distributed one resumed sequentially warned of its rank_executor."""
    from contrafl.config import load_config
    from contrafl.cores import cpu_cores

    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *SETTINGS, "rounds=1", "executor=sequential"]) == 0
    assert main(["run", "--quiet", "--resume", str(run), "rounds=2", "executor=distributed"]) == 0
    cfg = load_config(run / "config.yaml")
    assert (cfg.executor, cfg.workers, cfg.rank_executor) == ("distributed", min(cpu_cores(), CLIENTS), "sequential")
    capsys.readouterr()
    assert main(["run", "--quiet", "--resume", str(run), "rounds=3", "executor=sequential"]) == 0
    assert capsys.readouterr().err == ""
    cfg = load_config(run / "config.yaml")
    assert (cfg.executor, cfg.workers, cfg.rank_executor) == ("sequential", 1, "auto")
    assert main(["run", "--quiet", "--resume", str(run), "rounds=4", "executor=distributed", "workers=1"]) == 0
    assert load_config(run / "config.yaml").workers == 1


def test_resume_refuses_settings_that_change_results(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *SETTINGS, "rounds=2"]) == 0
    assert main(["run", "--resume", str(run), "lr=0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lr=0.5 would change what the resumed run computes" in err[0]
    assert main(["run", "--resume", str(run)]) == 0
    assert "nothing to resume" in capsys.readouterr().out
    assert main(["run", "--resume", str(tmp_path / "nope")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    # a run of an older contrafl (no checkpoint, no fingerprint) is not silently recomputed
    (run / "checkpoint.pt").unlink()
    (run / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    assert main(["run", "--resume", str(run)]) == 2
    assert "written by an older contrafl" in capsys.readouterr().err
