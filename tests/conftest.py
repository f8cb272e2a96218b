"""Shared helpers for tests: small simulations on scikit-learn's digits."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from contrafl.config import load_config
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation

FAST = ["rounds=2", "local_epochs=1", "num_clients=4", "eval_personal=false"]


def simulate(*overrides: str, run_dir=None) -> Simulation:
    """Run a small simulation (digits by default) and return it after the run."""
    sim = Simulation(prepare(load_config(None, [*FAST, *overrides])), run_dir, None)
    sim.run()
    return sim


@pytest.fixture
def run_sim():
    return simulate


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
