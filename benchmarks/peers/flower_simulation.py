"""contrafl against Flower's simulation (flwr 1.41, Ray backend, https://flower.ai) on equal
work: FedAvg on MOON's CNN with its head, CIFAR-10.

    python benchmarks/peers/flower_simulation.py [--shape silo|device|both] [--seeds 5] [--pairs 1]

Compared: contrafl (``contrafl run ... --quiet``, its automatic executor) against a Flower
app run by ``flwr.simulation.run_simulation`` with the Ray backend: a ``ClientApp`` whose
``train`` handler trains the message's model on its node's partition (``partition-id``
from the node config, a PyTorch ``DataLoader`` with ``shuffle=True``, SGD) and replies
with the model and its metrics, and a ``ServerApp`` that runs Flower's ``FedAvg``
(``strategy.start`` with the initial ``ArrayRecord`` and a server-side ``evaluate_fn`` on
the test set, no federated evaluation), as Flower's PyTorch quickstart has it. Each Ray
actor takes ``--client-cpus`` cores (default 1: two actors on two cores, each with one
torch thread; Flower's own default of 2 runs one). Each program runs as a whole process,
timed from before it starts to after it exits (Flower's includes starting and stopping
Ray), and the two alternate. The shapes are ``pfl_research.py``'s (``_common.SHAPES``):
``silo``, 10 clients (Dirichlet(0.5)), all in every round, 5 epochs, batch 64, lr 0.05, 10
rounds, evaluated after every round; ``device``, 100 clients of about 50 images (IID), 50
a round, 1 epoch of batches of 10, lr 0.1, 20 rounds here (Flower starts a ClientApp run
per message, so 100 rounds would take long), evaluated every 10. Both: plain SGD, the
clients' models averaged weighted by their sample counts, no augmentation, the last
partial batch kept.

Equal work is shown, not assumed, as in ``pfl_research.py``: this process builds
contrafl's setup for each seed and writes a spec (contrafl's partition, its sampled
clients of every round, its initial model, the normalisation, hashes of the labels, the
logits of the first test images under the initial weights). The ServerApp loads the
initial weights into its model by name and checks the logits; it asks every node once for
its ``partition-id`` (a query message) and then sends each round's train messages to the
nodes of contrafl's clients of that round (a ``FedAvg`` whose ``configure_train`` picks
them instead of sampling at random); each ClientApp trains on the spec's rows of its
partition and replies with its partition id and its number of batches, which the
strategy's ``train_metrics_aggr_fn`` gathers. After each run the records are checked
against the spec: contrafl's partition and config fingerprint, and for both programs each
round's clients and local steps and the rounds evaluated.

What still differs: the batch order (contrafl's generator and the ``DataLoader``'s each
reshuffle every epoch, from different streams; seed ``s`` is contrafl's ``seed=s``, which
also draws the partition, the sampling and the initial weights that Flower takes over,
and the seed of Flower's loaders), hence the accuracies over several seeds; and Flower's
one query message per node at the start, which contrafl does not need.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    Program, benchmark_parser, fail, load_initial_weights, moon_cnn, peer_data, peer_record, run_benchmark,
)

HERE = Path(__file__).resolve()
DEVICE_ROUNDS = 20
"""Rounds of the device shape against Flower (issue #36)."""


# -- this benchmark's process -------------------------------------------------------------

def flower_program(python: str, client_cpus: float) -> Program:
    """Flower's run of a spec: ``python flower_simulation.py --peer SPEC --out DIR``."""

    def command(spec: dict[str, Any], out: Path) -> list[str]:
        return [python, str(HERE), "--peer", spec["path"], "--out", str(out), "--client-cpus", f"{client_cpus:g}"]

    def record(out: Path) -> dict[str, Any]:
        path = out / "record.json"
        if not path.exists():
            fail(f"Flower's ServerApp wrote no record ({path})")
        return peer_record([path])

    return Program("flower", command, record)


def main() -> None:
    p = benchmark_parser(__doc__, "seeds 0..N-1: contrafl's seed=s, the seed of Flower's loaders",
                         f"override the shape's rounds (silo 10, device {DEVICE_ROUNDS})", Path("/tmp/contrafl-peers/flower"))
    p.add_argument("--client-cpus", type=float, default=1.0, help="CPUs of each Ray actor running ClientApps (default 1)")
    a = p.parse_args()
    if a.peer is not None:
        return run_flower(a.peer, a.out, a.client_cpus)
    run_benchmark(a, [flower_program(a.python, a.client_cpus)], rounds={"device": DEVICE_ROUNDS})


# -- Flower's process (``--peer``) --------------------------------------------------------

def run_flower(spec_path: Path, out: Path, client_cpus: float) -> None:
    """Run the spec's FedAvg job as a Flower app in the simulation runtime (Ray backend)."""
    # This file imported as a module: Ray pickles the ClientApp's handlers by reference, so
    # each actor imports it once and keeps its data loaded between messages (_DATA).
    import flower_simulation as app
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    spec = json.loads(spec_path.read_text())
    client_app = ClientApp()
    client_app.train()(app.client_train)
    client_app.query()(app.client_query)
    server_app = ServerApp()

    @server_app.main()
    def server(grid: Grid, context: Context) -> None:
        app.server_main(grid, spec, spec_path, out)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=len(spec["clients"]),
                   backend_name="ray", backend_config={"client_resources": {"num_cpus": client_cpus, "num_gpus": 0.0}})


# ServerApp ---------------------------------------------------------------------------------

def server_main(grid: Any, spec: dict[str, Any], spec_path: Path, out: Path) -> None:
    """The ServerApp's main: contrafl's initial model, FedAvg over contrafl's sampled
    clients, the test accuracy after contrafl's evaluated rounds; writes ``out/record.json``."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord

    torch.manual_seed(spec["seed"])
    _, _, x_test, y_test = peer_data(spec)
    net = moon_cnn()
    evidence = load_initial_weights(net, spec, x_test)
    start = time.perf_counter()
    node_of = partition_nodes(grid, len(spec["clients"]))
    query_s = time.perf_counter() - start
    strategy = scheduled_fedavg(spec["schedule"], node_of)
    config = ConfigRecord({"spec": str(spec_path), "lr": spec["lr"], "local-epochs": spec["local_epochs"],
                           "batch-size": spec["batch_size"], "seed": spec["seed"]})
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=spec["rounds"],
                            train_config=config, evaluate_fn=central_evaluate(net, x_test, y_test, spec))
    rounds = range(1, spec["rounds"] + 1)
    train = result.train_metrics_clientapp
    out.mkdir(parents=True, exist_ok=True)
    (out / "record.json").write_text(json.dumps({
        "clients": [[int(c) for c in train[t]["clients"]] for t in rounds],
        "local_steps": [int(train[t]["local-steps"]) for t in rounds],
        "test_acc": {t: float(m["accuracy"]) for t, m in result.evaluate_metrics_serverapp.items()},
        "threads": max(int(train[t]["threads"]) for t in rounds),
        "query_s": query_s,
        **evidence,
    }))


def partition_nodes(grid: Any, nodes: int, wait_s: float = 120.0) -> dict[int, int]:
    """The node id of every ``partition-id``: one query message to each node."""
    from flwr.app import Message, MessageType, RecordDict

    deadline = time.monotonic() + wait_s
    while len(ids := list(grid.get_node_ids())) < nodes and time.monotonic() < deadline:
        time.sleep(0.1)
    replies = grid.send_and_receive([Message(RecordDict(), dst_node_id=i, message_type=MessageType.QUERY) for i in ids])
    node_of = {int(r.content["metrics"]["partition-id"]): r.metadata.src_node_id for r in replies if not r.has_error()}
    if len(node_of) != nodes:
        raise SystemExit(f"error: {len(node_of)} of {nodes} nodes told their partition-id")
    return node_of


def scheduled_fedavg(schedule: list[list[int]], node_of: dict[int, int]) -> Any:
    """Flower's ``FedAvg`` (sample-weighted averaging of the replies' ``ArrayRecord``),
    training each round the nodes of contrafl's clients of that round, without federated
    evaluation; its training metrics are each round's clients, local steps and mean loss."""
    from flwr.app import MessageType, RecordDict
    from flwr.serverapp.strategy import FedAvg

    class ScheduledFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            config["server-round"] = server_round
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
            nodes = [node_of[c] for c in schedule[server_round - 1]]
            return self._construct_messages(record, nodes, MessageType.TRAIN)

    fraction = len(schedule[0]) / len(node_of)  # for the strategy's log; configure_train takes the schedule
    return ScheduledFedAvg(fraction_train=fraction, fraction_evaluate=0.0, train_metrics_aggr_fn=round_metrics)


def round_metrics(records: list[Any], weighting_key: str) -> Any:
    """A round's training metrics: the clients that replied, their local steps (summed),
    their mean loss (weighted by samples) and their torch threads."""
    from flwr.app import MetricRecord

    metrics = [next(iter(r.metric_records.values())) for r in records]
    total = sum(m[weighting_key] for m in metrics)
    return MetricRecord({
        "clients": sorted(int(m["partition-id"]) for m in metrics),
        "local-steps": sum(int(m["local-steps"]) for m in metrics),
        "train_loss": sum(m["train_loss"] * m[weighting_key] for m in metrics) / total,
        "threads": max(int(m["threads"]) for m in metrics),
    })


def central_evaluate(net: Any, x: Any, y: Any, spec: dict[str, Any]) -> Any:
    """The ``evaluate_fn`` of ``strategy.start``: the global model's test accuracy and
    loss after contrafl's evaluated rounds (``None``, no evaluation, otherwise: also
    before training, when Flower calls it with round 0)."""
    import torch
    from flwr.app import ArrayRecord, MetricRecord
    from torch.nn import functional as F

    rounds, batch = set(spec["eval_rounds"]), spec["eval_batch_size"]

    @torch.no_grad()
    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round not in rounds:
            return None
        net.load_state_dict(arrays.to_torch_state_dict())
        net.eval()
        correct, loss = 0, 0.0
        for i in range(0, len(y), batch):
            logits = net(x[i:i + batch])
            correct += (logits.argmax(-1) == y[i:i + batch]).sum().item()
            loss += F.cross_entropy(logits, y[i:i + batch], reduction="sum").item()
        return MetricRecord({"accuracy": correct / len(y), "loss": loss / len(y)})

    return evaluate


# ClientApp ---------------------------------------------------------------------------------

_DATA: dict[str, tuple[dict[str, Any], Any, Any]] = {}
"""Per process (Ray actor): the spec and its normalised training set, read once."""


def client_query(msg: Any, context: Any) -> Any:
    """Tell the server this node's ``partition-id``."""
    from flwr.app import Message, MetricRecord, RecordDict

    metrics = MetricRecord({"partition-id": int(context.node_config["partition-id"])})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


def client_train(msg: Any, context: Any) -> Any:
    """Train the received model on this node's partition (the spec's rows of client
    ``partition-id``) and reply with it, its sample count, batches and loss."""
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from torch.utils.data import DataLoader, TensorDataset

    config = msg.content["config"]
    pid = int(context.node_config["partition-id"])
    x, y = client_partition(str(config["spec"]), pid)
    net = moon_cnn()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    g = torch.Generator().manual_seed(int(config["seed"]) * 1_000_003 + int(config["server-round"]) * 1_009 + pid)
    loader = DataLoader(TensorDataset(x, y), batch_size=int(config["batch-size"]), shuffle=True, generator=g)
    steps, loss = train(net, loader, int(config["local-epochs"]), float(config["lr"]))
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y), "local-steps": steps,
                            "partition-id": pid, "threads": torch.get_num_threads()})
    return Message(content=RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)


def client_partition(spec_path: str, pid: int) -> tuple[Any, Any]:
    """Client ``pid``'s images and labels (loaded once per process)."""
    import torch

    if spec_path not in _DATA:
        spec = json.loads(Path(spec_path).read_text())
        x, y, _, _ = peer_data(spec)
        _DATA[spec_path] = (spec, x, y)
    spec, x, y = _DATA[spec_path]
    rows = torch.as_tensor(spec["clients"][pid], dtype=torch.long)
    return x[rows], y[rows]


def train(net: Any, loader: Any, epochs: int, lr: float) -> tuple[int, float]:
    """Plain SGD over ``loader`` for ``epochs`` epochs; (steps, mean loss)."""
    import torch
    from torch.nn import functional as F

    opt = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    steps, total = 0, 0.0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            steps += 1
            total += loss.item()
    return steps, total / max(steps, 1)


if __name__ == "__main__":
    main()
