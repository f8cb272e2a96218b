"""Scale: 100, 1,000 and 10,000 simulated clients on one machine, 10 sampled per round.

For each total number of clients N and each stateful algorithm (SCAFFOLD's control
variates, Ditto's personal models, FedCRL's local models and prototypes, FedALA's local
models), one run in a fresh process:

- every client holds the same number of samples of a fixed synthetic task (features of a
  random linear teacher), so the 10 clients sampled in a round cost the same whatever N;
- ``sample_fraction = 10 / N``, and the schedule replaced by the smallest run's, so that
  every N trains the same clients (ids below the smallest N) in the same rounds, with
  the same states to create, spill and load; the global model is evaluated on a test set of fixed size
  in the last round only, and the clients' own models are not (``eval_personal=false``:
  evaluating every client is the one cost that must grow with N);
- a checkpoint after every round in a run directory, client states beyond
  ``client_memory_gb`` spilled to disk.

Printed per run: the setup time (data, partition, models), the median seconds per round
(rounds 2 and later) and its ratio to the 100-client run, the peak resident memory, the
training data's size (which grows with N: every client brings its samples) and the
client states on disk only at the end (spilled beyond the budget). Targets (issue #21): the round time of 10,000 clients within
1.2x of 100's, the peak memory under the budget plus a constant, setup linear in N.

    python benchmarks/scale.py                       # 100, 1000, 10000 clients, 4 algorithms
    python benchmarks/scale.py --clients 100 10000 --algorithms scaffold --rounds 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, peak_rss_mb, run_isolated  # noqa: E402

SAMPLES_PER_CLIENT = 32
FEATURES = 32
CLASSES = 10
TEST_SAMPLES = 2000
SAMPLED = 10


def register_dataset(num_clients: int) -> None:
    """Register ``scale``: SAMPLES_PER_CLIENT x ``num_clients`` training samples and a
    fixed test set of a random linear teacher's labels (learnable, cheap to make)."""
    import numpy as np

    from contrafl.data.base import FederatedDataset
    from contrafl.data.datasets import _split
    from contrafl.data.registry import DATASETS, DatasetSpec

    def load(req):
        rng = np.random.default_rng(0)
        teacher = rng.standard_normal((FEATURES, CLASSES))

        def draw(n):
            x = rng.standard_normal((n, FEATURES), dtype=np.float32)  # no float64 copy in the peak memory
            return x, (x @ teacher).argmax(axis=1)

        return FederatedDataset("scale", _split(*draw(SAMPLES_PER_CLIENT * num_clients)), _split(*draw(TEST_SAMPLES)),
                                [str(c) for c in range(CLASSES)])

    DATASETS.add("scale", DatasetSpec(name="scale", summary="scale benchmark", load=load, default_model="mlp",
                                      augment="none", recommended={"batch_size": 16, "rounds": 5, "local_epochs": 1},
                                      needs_data_dir=False))


def worker(payload: dict) -> dict:
    import torch

    from contrafl.config import load_config
    from contrafl.engine.run_dir import RunDir
    from contrafl.engine.sampling import sample_schedule
    from contrafl.engine.setup import prepare
    from contrafl.engine.simulation import Simulation

    torch.set_num_threads(1)
    n = payload["clients"]
    register_dataset(n)
    overrides = [
        "dataset=scale", "partition=iid", f"num_clients={n}", f"sample_fraction={SAMPLED / n}",
        f"algorithm={payload['algorithm']}", f"rounds={payload['rounds']}", f"eval_every={payload['rounds']}",
        "eval_personal=false", "local_epochs=1", "batch_size=16", "executor=sequential",
        f"client_memory_gb={payload['budget_gb']}", "seed=0",
    ]
    start = time.perf_counter()
    setup = prepare(load_config(None, overrides))
    with tempfile.TemporaryDirectory() as folder:
        sim = Simulation(setup, RunDir(Path(folder) / "run"), None)
        # the clients of the smallest run: every N trains the same clients in the same rounds
        sim.schedule = sample_schedule(payload["same_as"], SAMPLED / payload["same_as"], payload["rounds"], 0)
        setup_s = time.perf_counter() - start
        sim.run()
        timing = [json.loads(line)["seconds"] for line in (Path(folder) / "run" / "timing.jsonl").read_text().splitlines()]
        spilled = sim.store.spilled
    data = setup.data.train
    return {
        "data_mb": (data.x.nbytes + data.y.nbytes) / 2**20,
        "setup_s": setup_s,
        "round_s": statistics.median(timing[1:-1] or timing[1:]),  # not the warm-up round, nor the evaluated last one
        "peak_mb": peak_rss_mb(),
        "spilled": spilled,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--algorithms", nargs="+", default=["scaffold", "ditto", "fedcrl", "fedala"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--budget-gb", type=float, default=0.002, help="client_memory_gb (small: states spill)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    print(f"machine: {machine()}")
    print(f"{SAMPLES_PER_CLIENT} samples per client, {SAMPLED} clients sampled per round, {args.rounds} rounds, "
          f"client_memory_gb={args.budget_gb} ({args.budget_gb * 1024:.0f} MiB), sequential executor, 1 thread")
    print(f"{'algorithm':<10} {'clients':>8} {'setup s':>8} {'s/round':>8} {'x N=' + str(args.clients[0]):>8} "
          f"{'peak MiB':>9} {'data MiB':>9} {'spilled':>8}")
    for algorithm in args.algorithms:
        base = None
        for n in args.clients:
            payload = {"clients": n, "same_as": args.clients[0], "algorithm": algorithm, "rounds": args.rounds, "budget_gb": args.budget_gb}
            r = run_isolated(Path(__file__), payload)
            base = base or r["round_s"]
            print(f"{algorithm:<10} {n:>8} {r['setup_s']:>8.2f} {r['round_s']:>8.3f} {r['round_s'] / base:>8.2f} "
                  f"{r['peak_mb']:>9.0f} {r['data_mb']:>9.1f} {r['spilled']:>8}", flush=True)


if __name__ == "__main__":
    main()
