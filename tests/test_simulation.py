"""End-to-end behaviour of the round loop and the run directory."""

import json
import os

import pytest
import torch
import yaml

from contrafl.config import load_config
from contrafl.engine.checkpoint import history_rows
from contrafl.engine.run_dir import RunDir
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.errors import ClientUpdateError, ConfigError

from conftest import simulate


def test_run_directory_contents(tmp_path):
    sim = simulate("rounds=3", "eval_every=2", run_dir=RunDir(tmp_path / "run"))
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == [
        ".lock", "checkpoint.pt", "config.yaml", "label_counts.json", "metrics.jsonl", "partition.json", "summary.json", "timing.jsonl"
    ]
    counts = json.loads((run / "label_counts.json").read_text())
    partition = json.loads((run / "partition.json").read_text())
    assert [sum(c) for c in counts["counts"]] == [len(rows) for rows in partition["train"]]
    assert counts["classes"] == [str(i) for i in range(10)]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert "test_acc" not in rows[0] and "test_acc" in rows[1] and "test_acc" in rows[2]  # eval_every, and the last
    model_bytes = sum(v.numel() * v.element_size() for v in sim.server.model.values())
    assert rows[0]["bytes_down"] == {"model": 4 * model_bytes} == rows[0]["bytes_up"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    assert summary["final"]["test_acc"] == rows[2]["test_acc"]
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["round"] == 3 and history_rows(ckpt) == rows
    for k, v in sim.server.model.items():
        assert torch.equal(ckpt["server"]["model"][k], v)


def test_resolved_config_is_recorded(tmp_path):
    setup = prepare(load_config(None, ["algorithm=moon", "rounds=2"]))
    run = RunDir(tmp_path / "r")
    run.write_config(setup.config)
    cfg = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert cfg["algorithm"] == {"name": "moon", "mu": 1.0, "temperature": 0.5, "k": 1, "loss": "contrastive"}
    assert cfg["model"]["name"] == "mlp" and cfg["batch_size"] == 16 and cfg["local_epochs"] == 5
    assert cfg["partition"] == {"name": "dirichlet", "beta": 0.5, "min_size": 10}
    assert cfg["server_momentum"] == 0.0 and cfg["device"] == "cpu"
    # the recorded config reproduces the run's settings
    assert load_config(tmp_path / "r" / "config.yaml").algorithm.options["mu"] == 1.0


def test_same_seed_same_metrics_and_different_seed_differs(tmp_path):
    a = simulate("rounds=2", "seed=3", run_dir=RunDir(tmp_path / "a"))
    b = simulate("rounds=2", "seed=3", run_dir=RunDir(tmp_path / "b"))
    c = simulate("rounds=2", "seed=4")
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()
    assert a.history != c.history


def test_a_run_directory_is_written_by_one_process_at_a_time(tmp_path):
    import subprocess
    import sys

    first = RunDir(tmp_path / "r")
    (tmp_path / "r" / "config.yaml").write_text("{}\n")
    code = "from contrafl.engine.run_dir import RunDir; RunDir(%r, resume=True)" % str(tmp_path / "r")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and f"is in use by another contrafl process (pid {os.getpid()}, " in proc.stderr  # names its holder
    del first  # the lock goes with the object (and with the process, however it ends)
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_lock_whose_holder_was_killed_is_taken_over_with_a_line(tmp_path):
    """The OS releases the lock of a killed process; the next one says whose it took."""
    import subprocess
    import sys

    RunDir(tmp_path / "r").close()
    (tmp_path / "r" / "config.yaml").write_text("{}\n")
    assert RunDir(tmp_path / "r", resume=True).taken_over is None  # closed cleanly
    code = "import os; from contrafl.engine.run_dir import RunDir; d = RunDir(%r, resume=True); os.kill(os.getpid(), 9)" % str(tmp_path / "r")
    killed = subprocess.Popen([sys.executable, "-c", code])
    assert killed.wait() == -9
    taken = RunDir(tmp_path / "r", resume=True)
    assert taken.taken_over == f"took over the run directory's lock from python (pid {killed.pid}), which ended without releasing it"


def test_existing_run_dir_is_not_overwritten(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already exists"):
        RunDir(tmp_path / "r")


def test_diverging_client_update_is_rejected_and_partial_results_kept(tmp_path):
    sim = Simulation(prepare(load_config(None, ["rounds=5", "lr=1e30", "local_epochs=1", "num_clients=4"])), RunDir(tmp_path / "r"), None)
    with pytest.raises(ClientUpdateError, match="non-finite values") as info:
        sim.run()
    assert "lower lr" in str(info.value)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and "non-finite" in summary["error"]
    assert summary["rounds_completed"] == 0 and not (tmp_path / "r" / "checkpoint.pt").exists()


def test_sampling_and_fedavgm_server_momentum():
    sim = simulate("algorithm=fedavgm", "num_clients=6", "sample_fraction=0.5", "rounds=3")
    assert sim.cfg.server_momentum == 0.9
    assert all(len(r["clients"]) == 3 for r in sim.history)
    plain = simulate("algorithm=fedavg", "num_clients=6", "sample_fraction=0.5", "rounds=3")
    assert plain.history[0]["clients"] == sim.history[0]["clients"]
    assert plain.history[0]["test_acc"] != sim.history[0]["test_acc"]
    # momentum composes with any algorithm
    moon_m = simulate("algorithm=moon", "server_momentum=0.7", "rounds=2")
    assert moon_m.server_opt.momentum == 0.7


def test_solo_reports_client_accuracies_and_no_communication():
    sim = simulate("algorithm=solo", "rounds=2", "eval_personal=auto")
    last = sim.history[-1]
    assert "test_acc" not in last
    assert 0 < last["personal_acc"] <= 1 and last["personal_acc_std"] >= 0 and last["personal_clients"] == 4
    assert last["bytes_down"] == {} and last["bytes_up"] == {}
    # each client started from its own initialisation, not a shared one
    s0, s1 = sim.store.get(0)["algorithm"]["model"], sim.store.get(1)["algorithm"]["model"]
    assert not torch.equal(s0["l3.weight"], s1["l3.weight"])


def test_personal_evaluation_on_client_test_splits():
    sim = simulate("algorithm=solo", "test_fraction=0.25", "rounds=1", "eval_personal=true")
    assert sim.setup.partition.test is not None
    assert sim.history[-1]["personal_clients"] == 4


def test_personal_accuracy_is_sample_weighted_with_the_std_over_clients():
    """PFLlib's metric: sum_i correct_i / sum_i n_i, and the population std of the
    per-client accuracies; FedAvg's clients hold the received global model."""
    from contrafl.metrics.evaluate import evaluate

    sim = simulate("test_fraction=0.25", "pool=true", "rounds=2", "eval_personal=auto")
    correct, n, accs = 0.0, 0, []
    for rows in sim.setup.partition.test:
        rows = torch.as_tensor(rows)
        res = evaluate(sim.net, sim.server.model, sim.train.x[rows], sim.train.y[rows], sim.setup.eval_transform, 1000)
        correct, n = correct + res["acc"] * res["n"], n + res["n"]
        accs.append(res["acc"])
    last = sim.history[-1]
    assert last["personal_acc"] == pytest.approx(correct / n)
    assert last["personal_acc_std"] == pytest.approx(float(torch.tensor(accs).std(unbiased=False)))
    summary = sim.summary("completed", 1.0)
    best = max(sim.history, key=lambda r: r["personal_acc"])
    assert summary["best_personal_acc"] == best["personal_acc"] and summary["best_personal_round"] == best["round"]


def test_pooling_puts_the_official_test_set_into_the_clients_data():
    plain = prepare(load_config(None, ["num_clients=4"]))
    pooled = prepare(load_config(None, ["num_clients=4", "pool=true", "test_fraction=0.25", "normalize=half"]))
    assert len(pooled.data.train) == len(plain.data.train) + len(plain.data.test) and len(pooled.data.test) == 0
    assert sum(len(r) + len(t) for r, t in zip(pooled.partition.train, pooled.partition.test)) == len(pooled.data.train)
    assert pooled.config.eval_personal is True  # per-client test splits are evaluated by default
    with pytest.raises(ConfigError, match="pool=true .* set test_fraction=0.25"):
        prepare(load_config(None, ["pool=true"]))


def test_normalize_half_maps_pixels_to_minus_one_one(tmp_path):
    from test_datasets import write_cifar10

    write_cifar10(tmp_path, rows=6, test_rows=4)
    base = ["dataset=cifar10", f"data_dir={tmp_path}", "allow_subset=true", "num_clients=2", "augment=none"]
    setup = prepare(load_config(None, [*base, "normalize=half"]))
    assert setup.data.mean == setup.data.std == (0.5, 0.5, 0.5)
    x = torch.tensor([[[0, 255]] * 1] * 3, dtype=torch.uint8).unsqueeze(0)  # [1, 3, 1, 2]
    assert setup.eval_transform(x).flatten().tolist() == pytest.approx([-1.0, 1.0] * 3)
    assert setup.train_transform(x, setup.train_transform.sample(1, torch.Generator())).flatten().tolist() == pytest.approx([-1.0, 1.0] * 3)
    assert prepare(load_config(None, base)).data.mean != (0.5, 0.5, 0.5)


def test_a_message_per_client_is_counted_per_client():
    """An algorithm that sends client 0 an extra tensor: the round's bytes down are the
    sum of the messages each client received."""
    from contrafl.algorithms.fedavg import FedAvg

    class Extra(FedAvg):
        def message_for(self, message, server, cid, round):
            return {**message, "extra": torch.zeros(100)} if cid == 0 else message

    setup = prepare(load_config(None, ["num_clients=4", "rounds=1", "eval_personal=false"]))
    setup.algorithm = Extra(setup.algorithm.params, setup.algorithm.federation)
    sim = Simulation(setup)
    sim.run()
    model_bytes = sum(v.numel() * v.element_size() for v in sim.server.model.values())
    assert sim.history[0]["bytes_down"] == {"model": 4 * model_bytes, "extra": 400}
