"""Shared helpers for tests: small simulations on scikit-learn's digits."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from contrafl.config import load_config
from contrafl.cores import cores_each, cpu_cores
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation

FAST = ["rounds=2", "local_epochs=1", "num_clients=4", "eval_personal=false"]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers (`-n auto` in pyproject.toml's addopts) share the cores: each
    # gets its share of torch threads, and so do the processes its tests start
    # (OMP_NUM_THREADS), whose OpenMP threads sleep when idle rather than spin: spinning
    # threads of two workers on the same cores made some tests 5x slower.
    _threads = cores_each(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(_threads)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core this process may use (xdist counts the machine's,
    which in a container can be far more than it is given)."""
    return cpu_cores()


LOG_LINES = 40
"""Lines of each Flower process's log shown with a failed test (the folder is gone by the
time a CI's output is read)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran a Flower deployment in its ``tmp_path``: the last
    :data:`LOG_LINES` lines of each of its processes' logs (``logs/*.log``) and of the
    ``contrafl deploy`` output it kept (``*.err``), as sections of its report."""
    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if not report.failed or call.when != "call" or tmp_path is None:
        return
    logs = sorted(p for p in Path(tmp_path).rglob("*") if p.is_file() and (p.parent.name == "logs" and p.suffix == ".log" or p.suffix == ".err"))
    for log in logs[:30]:
        tail = log.read_text(errors="replace").splitlines()[-LOG_LINES:]
        report.sections.append((f"last {len(tail)} lines of {log.relative_to(tmp_path)}", "\n".join(tail)))


def setup_warnings(*overrides: str) -> list[str]:
    """The warnings of a run of ``overrides`` (digits by default), before it trains."""
    return prepare(load_config(None, list(overrides))).warnings


def simulate(*overrides: str, run_dir=None) -> Simulation:
    """Run a small simulation (digits by default) and return it after the run."""
    sim = Simulation(prepare(load_config(None, [*FAST, *overrides])), run_dir, None)
    sim.run()
    return sim


@pytest.fixture
def run_sim():
    return simulate


@pytest.fixture
def worker_dir(monkeypatch):
    """The folder of the SuperNode workers that ClientApps in this test start
    (``CONTRAFL_WORKER_DIR``; a short one in the temporary directory, as a Unix socket's
    path is at most 107 bytes and pytest's ``tmp_path`` may be longer); every worker still
    listening there is stopped after the test."""
    folder = Path(tempfile.mkdtemp(prefix="cw-"))
    monkeypatch.setenv("CONTRAFL_WORKER_DIR", str(folder))
    yield folder
    from contrafl.flower import worker

    for sock in folder.glob("*.sock"):
        worker.stop(sock)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def task_identity(monkeypatch):
    """The run, node and task ids Flower's runtime gives the process that makes messages."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def error_reply(exc: Exception, message):
    """The error reply flwr's runtime makes of what a ClientApp (or one of its mods)
    raised on ``message`` (``run_clientapp``: code 2, the exception's type and text)."""
    from flwr.app import Error, Message

    return Message(Error(2, f"{type(exc)}:<'{exc}'>"), reply_to=message)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module of tiny models (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): more threads only add synchronisation on a
    busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` for a block (results depend on the count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def strict_json(text: str):
    """json.loads that rejects NaN and Infinity (RFC 8259), as many parsers do."""

    def reject(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=reject)


CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]


def chromium_screenshot(page, png, tmp_path, size=(1200, 2400)):
    """Open the HTML file ``page`` in headless Chromium (Debian's ``chromium``, which
    ``.ci/run`` installs) and write a screenshot of ``size`` pixels to ``png``; return
    the page's DOM after rendering."""
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("headless Chromium is not installed (Debian package chromium; .ci/run installs it)")
    common = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]
    url = page.absolute().as_uri()
    subprocess.run([*common, f"--window-size={size[0]},{size[1]}", f"--screenshot={png}", url],
                   check=True, capture_output=True, timeout=120)
    dom = subprocess.run([*common, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120)
    return dom.stdout


def check_screenshot(png, size=(1200, 2400)) -> None:
    """A screenshot of ``size`` that is not blank and shows coloured figures (the
    tables and text are grey; curves, boxes and heatmaps are coloured)."""
    from matplotlib.image import imread

    image = imread(png)[..., :3]
    assert image.shape[:2] == (size[1], size[0])
    assert image.std() > 0.05  # not one colour
    coloured = (image.max(axis=2) - image.min(axis=2)) > 0.25
    assert coloured.mean() > 0.005, "no coloured figure rendered"
    dark = image.max(axis=2) < 0.3
    assert dark[:200].mean() > 0.002  # the title and first table's text at the top


def missing_clients_keep_state(sim: Simulation, rounds: int, missing) -> int:
    """Run SCAFFOLD's ``sim`` for ``rounds`` rounds and check that the clients
    ``missing(t)`` of each round (dropped out, late) come out of it with the state they
    had, control variates unchanged, and appear as lost; how many of them had a state."""
    import copy

    kept = 0
    for t in range(rounds):
        absent = missing(t)
        before = {cid: copy.deepcopy(sim.store.get(cid)) for cid in absent}
        row = sim.run_round(t)
        assert {x["client"] for x in row.get("lost", [])} == absent
        for cid, state in before.items():
            after = sim.store.get(cid)
            assert (state is None) == (after is None)
            if state is not None:
                kept += 1
                assert all(torch.equal(v, after["algorithm"]["c_i"][k]) for k, v in state["algorithm"]["c_i"].items())
    return kept


BYZFL_MISSING = "ByzFL is not installed: pip install --no-deps byzfl==0.0.11 (as .ci/run does)"


def load_byzfl(module: str):
    """``byzfl.<module>`` without ``import byzfl``, whose benchmark module pulls in
    torchvision (which does not load with the pinned torch): a bare ``byzfl`` package
    module stands in while it loads, then all ``byzfl`` modules leave ``sys.modules``
    again (the loaded classes keep working). None where ByzFL is not installed."""
    import importlib
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("byzfl")
    if spec is None:
        return None
    package = types.ModuleType("byzfl")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["byzfl"] = package
    try:
        return importlib.import_module(f"byzfl.{module}")
    finally:
        for name in [k for k in sys.modules if k == "byzfl" or k.startswith("byzfl.")]:
            del sys.modules[name]
