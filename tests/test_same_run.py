"""Every rank of a distributed run trains the same run (issue #36 item 1): a rank
started with other settings, other training data or another contrafl ends the run on
every rank with one line naming the difference, before round 1; other versions of torch
or Python are a warning."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import sys

import numpy as np
import pytest
import torch

from contrafl.config import load_config
from contrafl.data.base import ArrayDataset
from contrafl.data.partition import Partition
from contrafl.execution import distributed
from contrafl.engine.run_dir import RunDir
from contrafl.execution.same_run import Refused, data_digest, disagreement, identity
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from test_distributed import MOON, torchrun_path, two_launchers

SETUP = prepare(load_config(None, [*MOON, "executor=distributed"]))


def test_the_same_run_agrees_and_each_difference_is_named():
    ours = identity(SETUP)
    assert disagreement(1, ours, dict(ours)) == (None, None)
    other = identity(prepare(load_config(None, [*MOON, "executor=distributed", "seed=7", "lr=0.5", "workers=3", "device=cpu"])))
    error, warning = disagreement(2, ours, other)
    assert warning is None
    assert error.startswith(f"rank 2 (on {ours['host']}) was started with other settings than rank 0 (rank 0 -> rank 2: lr: 0.01 -> 0.5, seed: 0 -> 7)")
    assert "same `contrafl run` command on every machine" in error and "workers" not in error  # where it runs may differ
    error, _ = disagreement(1, ours, {**ours, "data": "0" * 64, "data_dir": "/elsewhere"})
    assert "has other training data in data_dir=/elsewhere than rank 0" in error
    error, _ = disagreement(1, ours, {**ours, "contrafl": "0.0.1", "data": "0" * 64})  # the first difference only
    assert error.endswith("runs contrafl 0.0.1 and rank 0 contrafl 0.1.0; install the same contrafl on every machine")
    error, warning = disagreement(1, ours, {**ours, "torch": "2.12.0", "python": "3.10.1"})
    assert error is None
    assert warning == (f"rank 1 (on {ours['host']}) runs torch 2.12.0 (rank 0: {torch.__version__}) and python 3.10.1 "
                       f"(rank 0: {ours['python']}): the run is reproducible bit for bit only with the same versions on every rank")


def test_the_data_digest_sees_one_changed_value_and_one_moved_sample():
    x, y = torch.zeros(6, 2, dtype=torch.float32), torch.tensor([0, 1, 0, 1, 0, 1])
    rows = [np.array([0, 1, 2]), np.array([3, 4, 5])]
    digest = data_digest(ArrayDataset(x, y), Partition("iid", {}, 0, rows))
    assert digest == data_digest(ArrayDataset(x.clone(), y.clone()), Partition("iid", {}, 0, [r.copy() for r in rows]))
    changed = x.clone()
    changed[4, 1] = 1e-6
    assert data_digest(ArrayDataset(changed, y), Partition("iid", {}, 0, rows)) != digest
    assert data_digest(ArrayDataset(x, 1 - y), Partition("iid", {}, 0, rows)) != digest
    moved = Partition("iid", {}, 0, [np.array([0, 1]), np.array([2, 3, 4, 5])])
    assert data_digest(ArrayDataset(x, y), moved) != digest
    as_int = data_digest(ArrayDataset(x.to(torch.int32), y), Partition("iid", {}, 0, rows))  # same bytes, other dtype
    assert as_int != digest


def test_a_forked_worker_that_trains_another_run_ends_the_run_before_round_1(tmp_path, monkeypatch):
    """Rank 0 refuses it: the run fails with the difference as its error, nothing is
    trained, and the forked workers are gone."""
    parent = os.getpid()
    real = distributed.identity

    def drifted(setup):
        mine = real(setup)
        return {**mine, "data": "f" * 64} if os.getpid() != parent else mine

    monkeypatch.setattr(distributed, "identity", drifted)  # the forked workers inherit it
    sim = Simulation(SETUP, RunDir(tmp_path / "run"))
    with pytest.raises(Refused, match=r"^rank [12] \(on .*\) has other training data"):
        sim.run()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "other training data" in summary["error"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and sim.rounds_done == 0
    assert multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized()


CASES = {  # the second (or first) machine's command: what each launcher's one error line says
    "a worker's setup": ([], ["lr=abc"], "could not start the run: lr='abc' is invalid", "lr='abc' is invalid"),
    "rank 0's setup": (["data_dir={missing}"], [], "data_dir={missing}", "rank 0 (on "),
}


@pytest.mark.slow
@pytest.mark.skipif(torchrun_path() is None, reason="no torchrun")
@pytest.mark.parametrize("case", list(CASES))
def test_torchrun_launchers_that_cannot_train_one_run_end_at_once_in_one_line_each(tmp_path, case):
    """docs/distributed.md's two-machine command, where one machine's command has an
    invalid setting, or no data at all: both launchers end within seconds (not the
    process group's 30 minutes), each printing one error line that names the rank that
    could not start and why, and rank 0's run directory, where it was made, records the
    run as failed. (Ranks that differ take rank 0's refusal tested with forked workers
    above.)"""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(120, 8)).astype(np.float32), rng.integers(0, 3, 120)
    np.savez(tmp_path / "a.npz", x_train=x, y_train=y, x_test=x[:30], y_test=y[:30])
    paths = {"missing": tmp_path / "missing.npz"}
    base = ["algorithm=fedavg", "dataset=arrays", f"data_dir={tmp_path / 'a.npz'}", "model=mlp", "num_clients=4",
            "rounds=2", "batch_size=8", "executor=distributed"]
    extra0, extra1, said0, said1 = (x.format(**paths) if isinstance(x, str) else [v.format(**paths) for v in x] for x in CASES[case])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = two_launchers(
        [[*base, *extra, "--quiet", "--out", str(tmp_path / f"node{node}")] for node, extra in enumerate((extra0, extra1))], env
    )
    outputs = [p.communicate(timeout=120)[0] for p in launchers]
    assert all(p.returncode != 0 for p in launchers), outputs
    for out, said in zip(outputs, (said0, said1)):
        errors = [line for line in out.splitlines() if line.startswith("contrafl: error: ")]
        assert len(errors) == 1 and said in errors[0], out
        assert "Traceback" not in out.split("failed (exitcode: 2)")[0]  # before torchrun's report of its exit status 2
    if (tmp_path / "node0").exists():
        summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
        assert summary["status"] == "failed" and said0 in summary["error"] and summary["rounds_completed"] == 0
    assert not (tmp_path / "node1").exists()


def test_identity_names_the_resolved_settings_not_where_they_run():
    elsewhere = dataclasses.replace(SETUP, config=dataclasses.replace(SETUP.config, workers=4, data_dir="/other", checkpoint_every=2))
    assert identity(elsewhere)["fingerprint"] == identity(SETUP)["fingerprint"]
    assert identity(elsewhere)["data"] == identity(SETUP)["data"]
    assert sys.version.startswith(identity(SETUP)["python"])
