"""Shared helpers for tests: small simulations on scikit-learn's digits."""

from __future__ import annotations

import pytest

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
