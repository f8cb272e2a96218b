"""contrafl's Flower ServerApp: ``flwr run`` with run config ``run-dir`` (a run directory
prepared by ``contrafl deploy``: its ``config.yaml`` and ``partition.json``); with
``secure-aggregation=true`` its training rounds run through SecAgg+
(:class:`~contrafl.flower.server.SecureTransport`).

The run continues from the directory's last checkpoint (from round 0 when it has none),
so a ServerApp started again after a crash or a kill resumes the run.

The ServerApp ends with its SuperLink: flwr's SuperExec, which started it, exits when
its SuperLink does; the ServerApp sees its parent change, records the run as
``failed`` in ``summary.json`` (with the last round it completed) and exits. It would
otherwise wait for the SuperLink forever (flwr retries without end), holding the run
directory's lock. A user error (too few replies, a diverged model) ends the run with one
line in the log, not a traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from . import codec  # noqa: F401  (first: a clear error when flwr is missing)
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..config import load_config
from ..engine.progress import Progress
from ..engine.run_dir import RunDir
from ..engine.setup import prepare
from ..engine.resume import resume
from ..errors import ContraflError
from ..words import count
from .node import REPRODUCIBLE_WARNING, reproducible_noise
from .secagg import refusal
from .server import GridTransport, SecureTransport, sum_spec

app = ServerApp()

EXIT_S = 10.0
"""Seconds the ServerApp takes at most to record its run once its SuperLink is gone."""


class SuperLinkGone(BaseException):
    """The ServerApp's SuperExec exited: its SuperLink stopped or died. A BaseException,
    so that no ``except Exception`` on the way (flwr's retries) holds it up."""


def _superlink_gone(signum: int, frame: object) -> None:
    raise SuperLinkGone(
        "the SuperLink stopped or died (the ServerApp's SuperExec exited); start the SuperLink and the SuperNodes again, "
        "then `flwr run` again: the run continues from its last checkpoint"
    )


def _watch_parent(parent: int) -> None:
    """Once this process's parent (flwr's SuperExec) is gone, SIGUSR1 to the main thread
    (:func:`_superlink_gone`), and exit :data:`EXIT_S` later if the run has not ended
    by then."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(EXIT_S)
    os._exit(1)


class _OneLine(logging.Filter):
    """flwr logs a ServerApp's exception with its traceback; a user error is one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ContraflError):
            record.msg, record.args, record.exc_info = f"contrafl: error: {exc}", (), None
        return True


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run (or resume) the run in ``run-dir`` with its clients on the grid's SuperNodes."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, _superlink_gone)
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    logging.getLogger("flwr").addFilter(_OneLine())
    try:
        run(grid, context)
    except SuperLinkGone as exc:
        print(f"contrafl: error: {exc}", flush=True)
        os._exit(1)  # flwr's exit would report to the SuperLink that is gone


def run(grid: Grid, context: Context) -> None:
    """The run of :func:`main`."""
    rc = context.run_config
    run_dir = RunDir(Path(str(rc["run-dir"])), resume=True)
    setup = prepare(load_config(run_dir.path / "config.yaml"))
    if reproducible_noise(setup.config):
        print(f"contrafl: warning: {REPRODUCIBLE_WARNING}", flush=True)
    secure = bool(rc.get("secure-aggregation", False))
    why = refusal(type(setup.algorithm), setup.algorithm.params, setup.config) if secure else None
    if why is not None:  # a run config written by hand: contrafl deploy refuses it before
        raise ContraflError(f"secure aggregation shows the server only sums over the clients, but {why}; run without secure-aggregation")
    if run_dir.taken_over:
        print(f"contrafl: {run_dir.taken_over}", flush=True)
    progress = Progress(setup.config.rounds)
    sim = resume(setup, run_dir, progress)
    settings = (setup.config.num_clients, float(rc["round-timeout"]), int(rc["min-replies"]), float(rc["wait-nodes"]))
    hooks = {"checkpointed": lambda: sim.checkpointed, "waited": progress.waited, "secret": setup.config.sampling == "secret"}
    if secure:
        spec, weights = sum_spec(setup, int(rc.get("max-weight", 0)) or None)
        sim.transport = SecureTransport(grid, context, setup.config.seed, spec, weights, *settings, **hooks)
    else:
        sim.transport = GridTransport(grid, *settings, **hooks)
    summary = sim.run()
    print(f"contrafl: {summary['status']} after {count(summary['rounds_completed'], 'round')}; results in {run_dir.path}")
