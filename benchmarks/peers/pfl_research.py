"""contrafl against pfl-research (Apple's ``pfl`` 0.6.0, https://github.com/apple/pfl-research)
on equal work: FedAvg on MOON's CNN with its head, CIFAR-10.

    python benchmarks/peers/pfl_research.py [--shape silo|device|both] [--seeds 5] [--pairs 1]

Compared: contrafl (``contrafl run ... --quiet``, its automatic executor) against pfl in
one process and pfl under ``torchrun --standalone --nproc-per-node N`` (``--processes``,
default 2; pfl's distributed simulation: each process trains part of every cohort, the
updates are all-reduced). On a machine with a GPU pfl trains on it (its default
device); contrafl's variants name ``device=cuda``, e.g. ``--contrafl "device=cuda"
"device=cuda executor=distributed workers=4"``; several pfl processes share one GPU
(:func:`share_gpus`). Each
program runs as a whole process, timed from before it starts to after it exits, and the
three alternate (contrafl, pfl, pfl under torchrun, contrafl, ...). Two shapes
(``_common.SHAPES``): ``silo``, 10 clients (Dirichlet(0.5) label skew), all in every round,
5 epochs, batch 64, lr 0.05, 10 rounds, evaluated after every round; ``device``, pfl's
CIFAR-10 benchmark round: 100 clients of about 50 images (IID), 50 a round, 1 epoch of
batches of 10, lr 0.1, 100 rounds, evaluated every 10. Both: plain SGD (no momentum, no
weight decay), central learning rate 1, updates weighted by the clients' sample counts,
no augmentation, the last partial batch kept, the global model evaluated on the test set.

pfl's side is written as pfl's own CIFAR-10 benchmark (``benchmarks/image_classification/
pytorch/train.py``) sets up a run: a ``pfl.data.FederatedDataset`` of the users' slices with
a user sampler, ``pfl.model.pytorch.PyTorchModel`` with ``torch.optim.SGD`` as its local and
central optimisers, ``pfl.algorithm.FederatedAveraging`` with ``NNAlgorithmParams`` and
``NNTrainHyperParams``, a ``SimulatedBackend`` with ``WeightByDatapoints``, and pfl's
``CentralEvaluationCallback``. It runs from this file (``--peer SPEC --out DIR``, a process of
its own that does not import contrafl; it shares only ``_common``'s model and CIFAR reader).

Equal work is shown, not assumed. For every seed, this process builds contrafl's setup
(``contrafl.engine.setup.prepare``) and writes a spec file: contrafl's partition (each
client's rows of the training set), the clients contrafl samples in every round
(``contrafl.engine.sampling.sample_schedule``), its initial global model, the normalisation,
hashes of the labels, and the logits of the first test images under the initial weights.
pfl reads the same CIFAR pickles (labels checked against the hashes), builds each user
from the same rows, samples the same users each round (pfl's ``MinimizeReuseUserSampler``,
which hands out the ids of a list in order, over contrafl's schedule), and loads the
initial weights into its model by name (``strict``) and checks that it then gives
contrafl's logits (so the architectures compute the same function). After each run the
records are checked against the spec: contrafl's ``partition.json`` and config
fingerprint, and for every program each round's clients and local steps (contrafl's
``metrics.jsonl``; pfl's users as its dataset hands them out and its ``loss`` calls,
summed over the torchrun processes) and the rounds evaluated. The first difference stops
the benchmark.

What still differs: the batch order. contrafl reshuffles each client's samples every epoch;
pfl's ``Dataset.iter`` cuts the user's data into batches in its stored order, the same
every epoch and round, so each user's rows are permuted once per run (as pfl's benchmark
permutes the data set once before partitioning). Hence several seeds (``--seeds``): seed
``s`` is contrafl's ``seed=s`` (which also draws the partition, the sampling and the
initial weights, which the peer then takes over) and pfl's ``numpy``/``torch`` seed; the
accuracies are printed per seed and as a spread. And pfl evaluates each user of the
first round on its own training data before and after training (``do_evaluation`` is true
in pfl's iteration 0 whatever ``evaluation_frequency``): two forward passes over the first
round's samples, about 1% of the arithmetic of either full shape. The central evaluation runs after the same rounds as
contrafl's (a ``CentralEvaluationCallback`` told contrafl's rounds; none before training).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    Program, benchmark_parser, fail, load_initial_weights, moon_cnn, peer_data, peer_record, run_benchmark,
)

HERE = Path(__file__).resolve()
ACCURACY = "Central val | accuracy"


# -- this benchmark's process -------------------------------------------------------------

def pfl_program(python: str, processes: int) -> Program:
    """pfl's run of a spec: ``python pfl_research.py --peer SPEC --out FILE`` in one
    process, or the same under ``torchrun --standalone --nproc-per-node N``."""

    def command(spec: dict[str, Any], out: Path) -> list[str]:
        peer = [str(HERE), "--peer", spec["path"], "--out", str(out)]
        return [python, *peer] if processes == 1 else [*torchrun(python), "--standalone", f"--nproc-per-node={processes}", *peer]

    def record(out: Path) -> dict[str, Any]:
        files = sorted(out.glob("rank*.json"))
        if len(files) != processes:
            fail(f"pfl wrote {len(files)} records into {out}, expected {processes}")
        return peer_record(files)

    return Program("pfl" if processes == 1 else f"pfl torchrun {processes}", command, record)


def torchrun(python: str) -> list[str]:
    """``torchrun`` beside ``python`` (its console script), else ``python -m torch.distributed.run``."""
    script = Path(python).parent / "torchrun"
    return [str(script)] if script.exists() else [python, "-m", "torch.distributed.run"]


def main() -> None:
    p = benchmark_parser(__doc__, "seeds 0..N-1: contrafl's seed=s, pfl's shuffle seed s",
                         "override the shape's rounds (quick checks)", Path("/tmp/contrafl-peers/pfl-research"))
    p.add_argument("--configs", nargs="+", choices=["single", "torchrun"], default=["single", "torchrun"],
                   help="pfl in one process, under torchrun --nproc-per-node N (--processes), or both")
    p.add_argument("--processes", type=int, nargs="+", default=[2], metavar="N",
                   help="pfl's processes under torchrun, one config each (default: 2; on one GPU pfl's docs "
                        "advise trying 1 to 5 processes a GPU)")
    a = p.parse_args()
    if a.peer is not None:
        return run_pfl(a.peer, a.out)
    peers = [pfl_program(a.python, n) for c in a.configs for n in ([1] if c == "single" else a.processes)]
    run_benchmark(a, peers)


# -- pfl's process (``--peer``) -----------------------------------------------------------

def run_pfl(spec_path: Path, out: Path) -> None:
    """Run the spec's FedAvg job with pfl, as pfl's CIFAR-10 benchmark sets one up, and
    write what this process did to ``out/rank<R>.json``."""
    share_gpus()
    import numpy as np
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops import pytorch_ops
    from pfl.model.pytorch import PyTorchModel

    spec = json.loads(spec_path.read_text())
    torch.random.manual_seed(spec["seed"])
    np.random.seed(spec["seed"])
    x_train, y_train, x_test, y_test = peer_data(spec)
    journal = Journal()
    train_data = federated_dataset(spec, x_train, y_train, journal)

    net = classifier(moon_cnn(), journal)
    evidence = load_initial_weights(net, spec, x_test)
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), 1.0))
    backend = SimulatedBackend(training_data=train_data, val_data=train_data, postprocessors=[WeightByDatapoints()])
    rounds = spec["rounds"]
    algorithm_params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds,
                                         train_cohort_size=len(spec["schedule"][0]), val_cohort_size=0)
    train_params = NNTrainHyperParams(local_learning_rate=spec["lr"], local_num_epochs=spec["local_epochs"],
                                      local_batch_size=spec["batch_size"])
    eval_params = NNEvalHyperParams(local_batch_size=spec["eval_batch_size"])
    evaluation = central_evaluation(x_test, y_test, eval_params, set(spec["eval_rounds"]))
    FederatedAveraging().run(algorithm_params=algorithm_params, backend=backend, model=model,
                             model_train_params=train_params, model_eval_params=eval_params,
                             callbacks=[evaluation, journal.callback()])

    rank = pytorch_ops.distributed.global_rank
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "clients": journal.clients, "local_steps": journal.steps, "test_acc": evaluation.accuracy,
        "threads": torch.get_num_threads(), "rounds_s": journal.ended - journal.started, **evidence,
    }))


def share_gpus() -> None:
    """Let several pfl processes share a GPU, as pfl's docs advise for small models
    ("Multi-process training": ``torchrun --nproc_per_node`` above the GPUs). pfl 0.6.0
    puts the process of ``LOCAL_RANK`` r on ``cuda:r`` and all-reduces over NCCL, so with
    more processes than GPUs rank r >= GPUs has no device, and NCCL refuses two ranks on
    one GPU. Here, before pfl starts its process group (when it is imported), the
    processes take the GPUs round robin (``cuda:r % GPUs``, through pfl's
    ``PFL_PYTORCH_DEVICE``) and all-reduce over Gloo (the model's update, once a
    round). Nothing changes with one process per GPU or without a GPU."""
    import os

    import torch
    import torch.distributed as dist

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available() or per_node <= torch.cuda.device_count():
        return
    gpus = torch.cuda.device_count()
    os.environ["PFL_PYTORCH_DEVICE"] = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % gpus}"
    set_device, init_process_group = torch.cuda.set_device, dist.init_process_group
    torch.cuda.set_device = lambda device: set_device(device % gpus if isinstance(device, int) else device)
    dist.init_process_group = lambda backend=None, *args, **kwargs: init_process_group("gloo", *args, **kwargs)


class Journal:
    """What this pfl process did: the users its federated dataset handed out, the local
    steps (``loss`` calls) of every central iteration, and the seconds from the start of
    training to the end of the last iteration (its evaluations included)."""

    def __init__(self) -> None:
        self.clients: list[list[int]] = []
        self.steps: list[int] = []
        self.users: list[int] = []
        self.loss_calls = 0
        self.started = self.ended = 0.0

    def close_round(self) -> None:
        """File the current iteration's users and steps."""
        self.clients.append(sorted(self.users))
        self.steps.append(self.loss_calls - sum(self.steps))
        self.users = []

    def callback(self) -> Any:
        """A pfl callback that closes the round after every central iteration (the last
        callback: after the iteration's evaluation)."""
        import time

        from pfl.callback.base import TrainingProcessCallback
        from pfl.metrics import Metrics

        journal = self

        class JournalCallback(TrainingProcessCallback):
            def on_train_begin(self, *, model) -> Metrics:
                journal.started = time.perf_counter()
                return Metrics()

            def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
                journal.close_round()
                journal.ended = time.perf_counter()
                return False, Metrics()

        return JournalCallback()


def federated_dataset(spec: dict[str, Any], x: Any, y: Any, journal: Journal) -> Any:
    """pfl's federated dataset of the spec's users (contrafl's client rows), each user's
    rows in one random order for the run (pfl's ``Dataset.iter`` does not reshuffle), and
    pfl's ``MinimizeReuseUserSampler`` over contrafl's schedule (it hands the listed ids
    out in order, so each cohort is contrafl's round). Under torchrun the processes
    share each cohort balanced by the users' sizes (``user_id_to_weight``, as pfl's own
    benchmarks of users of unequal sizes set it). This also keeps the cohorts exact: with
    no weights, each process draws one user for every process at each of its turns, so
    a cohort the processes do not divide (50 users on 4) takes 52 ids from the list on
    some processes and shifts every later round."""
    import numpy as np
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import MinimizeReuseUserSampler

    users = {}
    for uid, rows in enumerate(spec["clients"]):
        order = np.random.permutation(np.asarray(rows, dtype=np.int64))
        users[uid] = (x[order], y[order])

    def make_dataset(user_id: int) -> Dataset:
        journal.users.append(int(user_id))
        return Dataset(raw_data=list(users[user_id]), user_id=str(user_id))

    sampler = MinimizeReuseUserSampler([uid for cohort in spec["schedule"] for uid in cohort])
    weights = {uid: len(rows) for uid, rows in enumerate(spec["clients"])}
    return FederatedDataset(make_dataset, sampler, user_id_to_weight=weights)


def classifier(net: Any, journal: Journal) -> Any:
    """``net`` with the ``loss`` and ``metrics`` methods pfl's ``PyTorchModel`` calls (as
    pfl's benchmark attaches ``image_classification_loss`` / ``_metrics``); ``loss`` runs
    once per local step, so it counts them."""
    import types

    import torch
    from pfl.metrics import Weighted
    from torch.nn import functional as F

    def loss(self, inputs, targets, eval=False):
        self.eval() if eval else self.train()
        journal.loss_calls += 1
        return F.cross_entropy(self(inputs), targets)

    @torch.no_grad()
    def metrics(self, inputs, targets, eval=True):
        self.eval() if eval else self.train()
        logits = self(inputs)
        correct = (logits.argmax(-1) == targets).sum().item()
        total = F.cross_entropy(logits, targets, reduction="sum").item()
        return {"loss": Weighted(total, len(inputs)), "accuracy": Weighted(correct, len(inputs))}

    net.loss = types.MethodType(loss, net)
    net.metrics = types.MethodType(metrics, net)
    return net


def central_evaluation(x_test: Any, y_test: Any, eval_params: Any, rounds: set[int]) -> Any:
    """pfl's ``CentralEvaluationCallback`` on the test set, after the given rounds only
    (contrafl's; pfl's own schedule evaluates before training and after every
    ``frequency``-th iteration from the second on). Keeps the accuracies by round."""
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.metrics import Metrics

    class EvaluateAfterRounds(CentralEvaluationCallback):
        def __init__(self) -> None:
            super().__init__(Dataset(raw_data=[x_test, y_test]), model_eval_params=eval_params, frequency=1)
            self.accuracy: dict[int, float] = {}

        def on_train_begin(self, *, model) -> Metrics:
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            done = central_iteration + 1
            if done not in rounds:
                return False, Metrics()
            # frequency 1 and an iteration number above 0: pfl's callback evaluates now
            stop, metrics = super().after_central_iteration(aggregate_metrics, model, central_iteration=done)
            self.accuracy[done] = next(v.overall_value for k, v in metrics if str(k) == ACCURACY)
            return stop, metrics

    return EvaluateAfterRounds()


if __name__ == "__main__":
    main()
