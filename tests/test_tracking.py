"""Tracking (#20 item 4): TensorBoard, MLflow and CSV get the config, every round's
metrics and the summary, read back here with each library's own reader; a resumed run
continues the same MLflow run and TensorBoard/CSV hold each round once."""

from __future__ import annotations

import csv
import io
import json
import signal
from pathlib import Path

import numpy as np
import pytest

from contrafl.cli import main
from contrafl.config import EXECUTION_SETTINGS, fingerprint, load_config
from contrafl.engine import tracking
from contrafl.execution.signals import Interrupted
from contrafl.engine.simulation import Simulation
from contrafl.engine.tracking import CSVTracker, Tracking, flatten
from contrafl.errors import ConfigError

SETTINGS = ["rounds=3", "num_clients=3", "local_epochs=1", "executor=sequential", "eval_personal=true"]


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    """One SQLite store for the module's runs (creating one takes a second)."""
    pytest.importorskip("mlflow")
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def scalars(run: Path, tag: str) -> dict[int, float]:
    """TensorBoard's ``tag`` by step, as TensorBoard reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    events = acc.Scalars(tag)
    assert len({e.step for e in events}) == len(events), f"{tag} has a step twice: {[e.step for e in events]}"
    return {e.step: e.value for e in events}


def csv_rows(run: Path) -> list[dict[str, str]]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def as_csv(row: dict) -> dict[str, str]:
    """A metrics.jsonl row as metrics.csv writes it (None: empty)."""
    return {k: "" if v is None else str(v) for k, v in flatten(row).items()}


def mlflow_run(run: Path, uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return client, client.get_run(json.loads((run / "mlflow" / "run.json").read_text())["run_id"])


# -- settings and flattening ---------------------------------------------------------
def test_tracking_setting_is_validated_canonical_and_not_fingerprinted():
    assert load_config(None, ["tracking=CSV, MLflow"]).tracking == "mlflow,csv"
    assert load_config(None, []).tracking == "none" and load_config(None, ["tracking_uri=auto"]).tracking_uri is None
    for bad in ("tensorbord", "csv,", "none,csv"):
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"tracking={bad}"])
        message = str(info.value)
        assert "\n" not in message and f"tracking={bad!r} is invalid" in message
        assert "tensorboard, mlflow, csv" in message
    assert {"tracking", "tracking_uri"} <= set(EXECUTION_SETTINGS)
    assert fingerprint(load_config(None, ["tracking=mlflow", "tracking_uri=sqlite:///x.db"])) == fingerprint(load_config(None, []))


def test_flatten_names_every_scalar_of_a_row():
    row = {
        "round": 2, "clients": [0, 2], "train_loss": float("nan"), "local_steps": 7,
        "loss_parts": {"ce": 1.5, "con": 0.25}, "rejected": [{"client": 1, "reason": "x"}],
        "client_acc": [0.5, None], "client_n": [10, 0], "bytes_up": {"model": 100, "extra": 4},
    }
    assert flatten(row) == {
        "round": 2, "clients": 2, "train_loss": None, "local_steps": 7, "loss_parts/ce": 1.5, "loss_parts/con": 0.25,
        "rejected": 1, "client_acc/0": 0.5, "client_acc/1": None, "client_n/0": 10, "client_n/1": 0,
        "bytes_up/model": 100, "bytes_up/extra": 4,
    }


def test_a_missing_library_is_a_one_line_error_before_the_run(tmp_path, monkeypatch, capsys):
    find_spec = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *SETTINGS, "tracking=csv,mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tracking=mlflow needs the mlflow package" in err[0]
    assert 'pip install "contrafl[tracking]"' in err[0]
    assert not (tmp_path / "run").exists()  # before the data was loaded


class Failing:
    name = "failing"

    def __init__(self, fail_in: str) -> None:
        self.fail_in, self.rows = fail_in, []

    def start(self, config, history):
        if self.fail_in == "start":
            raise OSError("store unreachable")

    def log_round(self, row):
        if self.fail_in == "log_round" and row["round"] == 2:
            raise OSError("disk full")
        self.rows.append(row["round"])

    def finish(self, summary):
        self.rows.append(summary["status"])


def test_a_tracker_that_fails_during_the_run_is_dropped_with_a_warning():
    warn = io.StringIO()
    bad, good = Failing("log_round"), Failing("never")
    group = Tracking([bad, good], warn)
    group.start({}, [])
    for t in (1, 2, 3):
        group.log_round({"round": t})
    group.finish({"status": "completed"})
    assert bad.rows == [1] and good.rows == [1, 2, 3, "completed"]
    assert warn.getvalue() == (
        "contrafl: warning: tracking=failing failed in round 2 (OSError: disk full); "
        "it logs nothing more in this run, metrics.jsonl has every round\n"
    )
    with pytest.raises(ConfigError, match=r"^tracking=failing cannot start: OSError: store unreachable; check tracking_uri"):
        Tracking([Failing("start")]).start({}, [])


def test_a_failing_tracker_loses_no_round_of_the_run(tmp_path, monkeypatch, capsys):
    def broken(self, row):
        raise OSError("disk full")

    monkeypatch.setattr(CSVTracker, "log_round", broken)
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *SETTINGS, "tracking=csv"]) == 0
    assert [r["round"] for r in rows_of(run)] == [1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert "tracking=csv failed in round 1 (OSError: disk full)" in capsys.readouterr().err
    assert csv_rows(run) == []  # the header of start, no round


# -- each backend, read back with its own library -------------------------------------
def test_tensorboard_mlflow_and_csv_hold_the_run(tmp_path, mlflow_uri):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *SETTINGS, "tracking=tensorboard,mlflow,csv", f"tracking_uri={mlflow_uri}"]) == 0
    rows = rows_of(run)
    summary = json.loads((run / "summary.json").read_text())
    assert [r["round"] for r in rows] == [1, 2, 3] and "client_acc" in rows[0] and "test_acc" in rows[0]

    # TensorBoard: every scalar per round (float32), per-client histograms, config and summary texts
    for key in ("test_acc", "train_loss", "personal_acc", "client_acc/2", "bytes_up/model"):
        assert scalars(run, key) == {r["round"]: np.float32(flatten(r)[key]) for r in rows}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"histograms": 0, "tensors": 0})
    acc.Reload()
    assert [h.step for h in acc.Histograms("client_acc")] == [1, 2, 3]
    assert acc.Histograms("client_acc")[0].histogram_value.num == 3
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "algorithm: fedavg" in config and "tracking: tensorboard,mlflow,csv" in config
    final = acc.Tensors("summary/text_summary")
    assert [e.step for e in final] == [3] and '"status": "completed"' in final[0].tensor_proto.string_val[0].decode()
    assert scalars(run, "summary/best_test_acc") == {3: np.float32(summary["best_test_acc"])}

    # MLflow: params, metric histories, the summary artifact and the status
    client, mlrun = mlflow_run(run, mlflow_uri)
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    assert mlrun.data.params["algorithm"] == "fedavg" and mlrun.data.params["num_clients"] == "3"
    assert mlrun.data.params["partition.beta"] == "0.5" and mlrun.data.tags["contrafl.status"] == "completed"
    for key in ("test_acc", "train_loss", "local_steps", "client_acc/1", "client_n/0"):
        history = client.get_metric_history(mlrun.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["round"], float(flatten(r)[key])) for r in rows]
    assert mlrun.data.metrics["summary/best_test_acc"] == summary["best_test_acc"]
    artifact = client.download_artifacts(mlrun.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(artifact).read_text()) == summary
    assert "algorithm: fedavg" in Path(client.download_artifacts(mlrun.info.run_id, "config.yaml", str(tmp_path))).read_text()

    # CSV: metrics.csv is metrics.jsonl, flattened; config and summary as key,value
    assert csv_rows(run) == [{**dict.fromkeys(csv_rows(run)[0], ""), **as_csv(r)} for r in rows]
    with open(run / "csv" / "summary.csv", newline="") as f:
        assert dict(csv.reader(f))["best_test_acc"] == str(summary["best_test_acc"])
    with open(run / "csv" / "config.csv", newline="") as f:
        assert dict(csv.reader(f))["algorithm"] == "fedavg"


def test_a_resumed_run_continues_its_mlflow_run_and_logs_each_round_once(tmp_path, monkeypatch, mlflow_uri):
    """Stopped in round 4 after round 3 was tracked but not checkpointed (checkpoints
    every 2 rounds), the run resumes from round 2 and computes round 3 again.
    TensorBoard's and metrics.csv's round 3 must be the recomputed one (the stopped run
    tracked a marked value), MLflow's run the same one, finished."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    settings = [*SETTINGS, "rounds=4", "checkpoint_every=2", "tracking=tensorboard,mlflow,csv", f"tracking_uri={mlflow_uri}"]
    run_round, log_round = Simulation.run_round, Tracking.log_round

    def stopped_in_round_4(self, t):
        if t == 3:
            raise Interrupted(signal.SIGTERM)
        return run_round(self, t)

    def marked(self, row):
        log_round(self, {**row, "test_acc": -1.0} if row["round"] == 3 else row)

    monkeypatch.setattr(Simulation, "run_round", stopped_in_round_4)
    monkeypatch.setattr(Tracking, "log_round", marked)
    assert main(["run", "--quiet", "--out", str(run), *settings]) == 128 + signal.SIGTERM
    client, stopped = mlflow_run(run, mlflow_uri)
    assert stopped.info.status == "KILLED" and stopped.data.tags["contrafl.rounds_logged"] == "3"
    assert scalars(run, "test_acc")[3] == -1.0 and csv_rows(run)[2]["test_acc"] == "-1.0"
    monkeypatch.undo()

    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    rows = rows_of(run)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    _, resumed = mlflow_run(run, mlflow_uri)
    assert resumed.info.run_id == stopped.info.run_id and resumed.info.status == "FINISHED"
    assert scalars(run, "test_acc") == {r["round"]: np.float32(r["test_acc"]) for r in rows}
    assert csv_rows(run) == [{**dict.fromkeys(csv_rows(run)[0], ""), **as_csv(r)} for r in rows]
    # MLflow cannot delete values: round 3 holds the stopped run's and the recomputed one
    history = [(m.step, m.value) for m in client.get_metric_history(resumed.info.run_id, "test_acc")]
    assert sorted(history) == sorted([(r["round"], r["test_acc"]) for r in rows] + [(3, -1.0)])
    assert [(m.step, m.value) for m in client.get_metric_history(resumed.info.run_id, "train_loss") if m.step != 3] == [
        (r["round"], r["train_loss"]) for r in rows if r["round"] != 3
    ]


def test_mlflow_store_defaults_to_the_run_directory(tmp_path, monkeypatch):
    """Without tracking_uri or $MLFLOW_TRACKING_URI: a SQLite store in RUN_DIR/mlflow,
    the artifacts beside it, nothing in the working directory."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *SETTINGS, "rounds=1", "tracking=mlflow"]) == 0
    uri = f"sqlite:///{(run / 'mlflow' / 'mlflow.db').resolve()}"
    client, mlrun = mlflow_run(run, uri)
    assert mlrun.info.status == "FINISHED" and [m.step for m in client.get_metric_history(mlrun.info.run_id, "test_acc")] == [1]
    assert mlrun.info.artifact_uri.startswith((run / "mlflow" / "artifacts").resolve().as_uri())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert json.loads((run / "mlflow" / "run.json").read_text()) == {"run_id": mlrun.info.run_id, "tracking_uri": None}
