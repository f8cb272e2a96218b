"""Experiment tracking: a run's resolved config, every round's metrics and its summary,
also written for TensorBoard, MLflow or as CSV files (``tracking=tensorboard,mlflow,csv``,
docs/tracking.md).

``metrics.jsonl`` stays the record of a run: a round is appended there (and
checkpointed) before any tracker sees it, and a tracker that fails during the run is
dropped with a warning while the run goes on. A tracker that cannot start (its library
is missing, its store cannot be opened) stops the run before round 1.

Trackers take the rows of ``metrics.jsonl`` flattened to scalars (:func:`flatten`):
``loss_parts/align``, ``bytes_up/model``, one value per client for the per-client
arrays (``client_acc/3``) and the length of other lists (``clients``, ``rejected``,
``lost``), each at step ``round``. On a resume a tracker gets the rounds of the
checkpoint (:meth:`Tracker.start`) and then the rounds computed again.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

import numpy as np
import yaml

from ..config import TRACKERS
from ..errors import ConfigError, ContraflError, one_line
from ..files import write_atomic
from .run_dir import finite, to_json

INSTALL = 'pip install "contrafl[tracking]"'
# the packages a tracker needs (MLflow's SQLite store needs SQLAlchemy and Alembic, which mlflow-skinny leaves out)
LIBRARIES = {"tensorboard": ("tensorboard",), "mlflow": ("mlflow", "sqlalchemy", "alembic"), "csv": ()}

Scalar = float | int | str | None


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """The scalars of a metrics row or a summary by name: nested mappings as
    ``key/name``, the per-client arrays (``client_acc``, ``client_loss``, ``client_n``)
    one entry per client ``client_acc/3``, other lists (``clients``, ``rejected``) by
    their length; non-finite numbers as ``None`` (as ``metrics.jsonl`` writes them)."""
    out: dict[str, Scalar] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, (list, tuple)):
            if str(key).startswith("client_"):
                out.update(flatten({str(i): v for i, v in enumerate(value)}, f"{name}/"))
            else:
                out[name] = len(value)
        elif isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, float):
            out[name] = value if math.isfinite(value) else None
        elif value is None or isinstance(value, (int, str)):
            out[name] = value
    return out


def numbers(tree: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric entries of :func:`flatten` (no ``round``: it is the step)."""
    return {k: float(v) for k, v in flatten(tree, prefix).items() if isinstance(v, (int, float)) and k != "round"}


def config_params(config: Mapping[str, Any]) -> dict[str, str]:
    """A resolved configuration as ``{setting: text}``: a component's name under its own
    key and its options as ``component.option``; values as JSON (``null``, ``true``,
    ``[200, 200]``), strings as they are."""

    def text(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value)

    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out[key] = text(value.get("name"))
            out.update({f"{key}.{o}": text(v) for o, v in value.items() if o != "name"})
        else:
            out[key] = text(value)
    return out


class Tracker(Protocol):
    """One tracking backend of a run."""

    name: str

    def start(self, config: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Open the backend for the run with resolved ``config``; ``history`` holds the
        rounds done before (those of the checkpoint a resumed run continues from)."""
        ...

    def log_round(self, row: dict[str, Any]) -> None:
        """Round ``row["round"]``'s row of ``metrics.jsonl``."""
        ...

    def finish(self, summary: dict[str, Any]) -> None:
        """The run's ``summary.json`` as it ends (completed, interrupted or failed); close."""
        ...


class TensorBoardTracker:
    """Event files in ``RUN_DIR/tensorboard`` through ``torch.utils.tensorboard``: every
    number of a row as a scalar at step ``round``, the per-client arrays also as
    histograms, the config (text ``config``) and the summary (text ``summary`` and
    scalars ``summary/...`` at the step of the last round done).

    A resumed run writes a new event file in the same directory with
    ``purge_step`` = the first round it computes again, so TensorBoard hides what the
    stopped run logged from that round on and shows each round once."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "tensorboard"
        self.writer: Any = None

    def start(self, config: dict[str, Any], history: list[dict[str, Any]]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        earlier = sorted(self.path.glob("events.out.tfevents.*"))
        if earlier:
            _next_second_after(earlier)
            self.writer = SummaryWriter(str(self.path), purge_step=len(history) + 1)
            return
        self.writer = SummaryWriter(str(self.path))
        self.writer.add_text("config", _code(yaml.safe_dump(config, sort_keys=False)), 0)
        for row in history:  # tracking turned on by the resume
            self.log_round(row)
        self.writer.flush()

    def log_round(self, row: dict[str, Any]) -> None:
        step = row["round"]
        for key, value in numbers(row).items():
            self.writer.add_scalar(key, value, step)
        for key, values in row.items():
            if key.startswith("client_") and isinstance(values, list):
                known = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
                if known:
                    self.writer.add_histogram(key, np.asarray(known, dtype=np.float64), step)
        self.writer.flush()  # a killed run keeps what it logged

    def finish(self, summary: dict[str, Any]) -> None:
        step = summary.get("rounds_completed", 0)
        self.writer.add_text("summary", _code(to_json(summary, indent=2)), step)
        for key, value in numbers(summary, "summary/").items():
            self.writer.add_scalar(key, value, step)
        self.writer.close()


def _code(text: str) -> str:
    """``text`` as a Markdown code block (TensorBoard renders text as Markdown)."""
    return "".join(f"    {line}\n" for line in text.splitlines())


def _next_second_after(files: Sequence[Path]) -> None:
    """Wait, if need be, until the second after the newest event file's time stamp.
    Event files are read in the order of their names, which start with the second they
    were opened in; a resume in the same second (a test) could otherwise sort first."""
    stamps = [int(m.group(1)) for f in files if (m := re.match(r"events\.out\.tfevents\.(\d+)\.", f.name))]
    wait = max(stamps, default=0) + 1 - time.time()
    if wait > 0:
        time.sleep(wait)


class MLflowTracker:
    """One MLflow run (through ``MlflowClient``, no global MLflow state): the config as
    params (``algorithm``, ``algorithm.mu``, ...) and a ``config.yaml`` artifact, every
    number of a row as a metric at step ``round``, the summary as a ``summary.json``
    artifact, ``summary/...`` metrics and the run's status (completed: FINISHED,
    interrupted: KILLED, failed: FAILED).

    The store is ``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a SQLite database
    of the run's own, ``RUN_DIR/mlflow/mlflow.db`` with artifacts in
    ``RUN_DIR/mlflow/artifacts``; the experiment is ``$MLFLOW_EXPERIMENT_NAME``, else
    ``contrafl``. ``RUN_DIR/mlflow/run.json`` keeps the run's id, so that a resumed run
    continues the same MLflow run: it logs the checkpoint's rounds the MLflow run has
    not seen (tag ``contrafl.rounds_logged``) and then the rounds it computes again, which
    MLflow keeps next to the values the stopped run logged for them (MLflow cannot
    delete metric values; they are equal on the same device)."""

    name = "mlflow"
    ROUNDS_TAG = "contrafl.rounds_logged"
    STATUS = {"completed": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}

    def __init__(self, run_dir: Path, tracking_uri: str | None) -> None:
        self.run_dir = run_dir
        self.state_path = run_dir / "mlflow" / "run.json"
        self.given_uri = tracking_uri
        self.client: Any = None
        self.run_id = ""

    def own_uri(self) -> str:
        """The default store: a SQLite database in the run directory."""
        return "sqlite:///" + str((self.run_dir / "mlflow" / "mlflow.db").resolve())

    def start(self, config: dict[str, Any], history: list[dict[str, Any]]) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        state = json.loads(self.state_path.read_text()) if self.state_path.is_file() else {}
        if "run_id" in state:  # the store of the run to continue (None: the run directory's)
            uri = self.given_uri or state.get("tracking_uri")
        else:
            uri = self.given_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri or self.own_uri())
        run = None
        if state.get("run_id") and state.get("tracking_uri") == uri:
            try:
                run = self.client.get_run(state["run_id"])
            except MlflowException:  # deleted, or another store
                run = None
        params = config_params(config)
        if run is None:
            run = self.client.create_run(
                self._experiment(uri), run_name=self.run_dir.name, tags={"contrafl.run_dir": str(self.run_dir.resolve())}
            )
            logged = 0
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
            logged = int(run.data.tags.get(self.ROUNDS_TAG, 0))
            params = {k: v for k, v in params.items() if k not in run.data.params}  # params cannot change
        self.run_id = run.info.run_id
        write_atomic(self.state_path, lambda f: f.write(to_json({"run_id": self.run_id, "tracking_uri": uri}).encode()))
        self._params(params)
        self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")
        for row in history:
            if row["round"] > logged:
                self.log_round(row)

    def _experiment(self, uri: str | None) -> str:
        """The id of the experiment in store ``uri`` (None: the run directory's),
        created when it does not exist yet, with its artifacts beside a SQLite store
        (not in the working directory)."""
        from mlflow.exceptions import MlflowException

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "contrafl"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        if uri is None:
            location: str | None = (self.run_dir / "mlflow" / "artifacts").resolve().as_uri()
        elif uri.startswith("sqlite:///") and not uri.endswith(":memory:"):
            location = (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
        else:
            location = None  # the server's artifact root
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created meanwhile by another run
            return self.client.get_experiment_by_name(name).experiment_id

    def _params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(_key(k), v[:500]) for k, v in params.items()]  # 500: the limit of older servers
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def _metrics(self, values: dict[str, float], step: int, tags: dict[str, str]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        items = [Metric(_key(k), v, now, step) for k, v in values.items()]
        chunks = [items[i : i + 900] for i in range(0, len(items), 900)] or [[]]  # MLflow: 1000 entities a call
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            self.client.log_batch(self.run_id, metrics=chunk, tags=[RunTag(k, v) for k, v in tags.items()] if last else [])

    def log_round(self, row: dict[str, Any]) -> None:
        self._metrics(numbers(row), row["round"], {self.ROUNDS_TAG: str(row["round"])})

    def finish(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, finite(summary), "summary.json")
        status = summary.get("status", "failed")
        self._metrics(numbers(summary, "summary/"), summary.get("rounds_completed", 0), {"contrafl.status": status})
        self.client.set_terminated(self.run_id, self.STATUS.get(status, "FAILED"))


def _key(name: str) -> str:
    """``name`` with the characters MLflow refuses in a key replaced by ``_``."""
    return re.sub(r"[^\w./\- ]", "_", name)[:250]


class CSVTracker:
    """``RUN_DIR/csv/metrics.csv``: a row per round and a column per :func:`flatten`
    entry (empty where a round has no value), always equal to ``metrics.jsonl`` (a
    resume rewrites it from the checkpoint's rounds); ``config.csv`` and
    ``summary.csv``: ``key,value`` lines."""

    name = "csv"

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "csv"
        self.rows: list[dict[str, Scalar]] = []
        self.columns: list[str] = []

    def start(self, config: dict[str, Any], history: list[dict[str, Any]]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._pairs("config.csv", config_params(config))
        self.rows = []
        self.columns = []
        for row in history:
            self._add(flatten(row))
        self._rewrite()

    def _add(self, flat: dict[str, Scalar]) -> bool:
        """Keep ``flat``; whether it brings new columns."""
        self.rows.append(flat)
        new = [k for k in flat if k not in self.columns]
        self.columns += new
        return bool(new)

    def _rewrite(self) -> None:
        text = io.StringIO()
        if self.columns:  # else an empty file: no round yet
            writer = csv.DictWriter(text, self.columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows(self.rows)
        write_atomic(self.path / "metrics.csv", lambda f: f.write(text.getvalue().encode()))

    def log_round(self, row: dict[str, Any]) -> None:
        flat = flatten(row)
        if self._add(flat):
            self._rewrite()
            return
        with open(self.path / "metrics.csv", "a", newline="") as f:
            csv.DictWriter(f, self.columns, lineterminator="\n").writerow(flat)

    def finish(self, summary: dict[str, Any]) -> None:
        self._pairs("summary.csv", flatten(summary))

    def _pairs(self, name: str, pairs: Mapping[str, Any]) -> None:
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(["key", "value"])
        writer.writerows(pairs.items())
        write_atomic(self.path / name, lambda f: f.write(text.getvalue().encode()))


def names(tracking: str) -> list[str]:
    """The trackers of a ``tracking`` setting (``none``: none)."""
    return [n for n in tracking.split(",") if n in TRACKERS]


def require(tracking: str) -> None:
    """Stop with a one-line :class:`ConfigError` when a tracker's library is missing."""
    for name in names(tracking):
        for package in LIBRARIES[name]:
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"tracking={name} needs the {package} package, which is not installed: {INSTALL}, or set tracking=none")


class Tracking:
    """The trackers of a run, started and fed together. One that fails after it started
    is dropped with a warning on ``warn``; the run and the other trackers go on."""

    def __init__(self, trackers: list[Tracker], warn: TextIO | None = None) -> None:
        self.trackers = trackers
        self.active: list[Tracker] = []
        self.warn = warn or sys.stderr

    def start(self, config: dict[str, Any], history: list[dict[str, Any]]) -> None:
        for tracker in self.trackers:
            try:
                tracker.start(config, history)
            except ContraflError:
                raise
            except Exception as exc:
                raise ConfigError(
                    f"tracking={tracker.name} cannot start: {one_line(exc)}; check tracking_uri and the store, or set tracking=none"
                ) from exc
            self.active.append(tracker)

    def log_round(self, row: dict[str, Any]) -> None:
        for tracker in list(self.active):
            try:
                tracker.log_round(row)
            except Exception as exc:
                self._drop(tracker, f"in round {row['round']}", exc)

    def finish(self, summary: dict[str, Any]) -> None:
        for tracker in list(self.active):
            try:
                tracker.finish(summary)
            except Exception as exc:
                self._drop(tracker, "at the end of the run", exc)
        self.active = []

    def _drop(self, tracker: Tracker, when: str, exc: Exception) -> None:
        self.active.remove(tracker)
        self.warn.write(
            f"contrafl: warning: tracking={tracker.name} failed {when} ({one_line(exc)}); "
            "it logs nothing more in this run, metrics.jsonl has every round\n"
        )
        self.warn.flush()


def open_tracking(tracking: str, tracking_uri: str | None, run_dir: Path) -> Tracking | None:
    """The trackers of setting ``tracking`` for the run in ``run_dir`` (not started), or
    None for ``tracking=none``."""
    require(tracking)
    make = {
        "tensorboard": lambda: TensorBoardTracker(run_dir),
        "mlflow": lambda: MLflowTracker(run_dir, tracking_uri),
        "csv": lambda: CSVTracker(run_dir),
    }
    chosen = names(tracking)
    return Tracking([make[n]() for n in chosen]) if chosen else None
