"""Shared helpers of the peer benchmarks: the machine, timed subprocesses, medians.

Nothing here imports contrafl or a peer at import time: every timed program runs in its
own process, started the way its users start it, and is timed from before the process
starts to after it exits (interpreter start-up, imports, data loading and worker start-up
count).

The second half holds what ``pfl_research.py`` and ``flower_simulation.py`` share to show
that the two programs do the same work: the two shapes of the job, contrafl's side of
the work (its partition, sampling schedule, initial weights and a probe of its model's
outputs, written as a spec file that the peer reads; what a contrafl run did, read from
its run directory), the checks of one program's record against the spec, and the peer's
side of the model and the data (MOON's CNN with its head, CIFAR-10 read from its python
pickles). contrafl is imported only by the benchmark's own process, never by a timed one;
torch only where a function needs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pickle
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any


def cpu_info() -> dict[str, object]:
    """CPU model, logical cores usable by this process, and the SIMD flags that decide
    the fp32 peak (avx2/fma/avx512f)."""
    model, flags, mhz = "unknown", set(), None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model == "unknown":
            model = value
        elif key == "flags" and not flags:
            flags = set(value.split())
        elif key == "cpu MHz" and mhz is None:
            try:
                mhz = float(value)
            except ValueError:
                pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": model,
        "cores": cores,
        "mhz": mhz,
        "avx2": "avx2" in flags,
        "fma": "fma" in flags,
        "avx512f": "avx512f" in flags,
        "python": platform.python_version(),
    }


def print_machine(python: str) -> dict[str, object]:
    info = cpu_info()
    torch_version = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__, torch.get_num_threads())"],
        capture_output=True, text=True,
    ).stdout.strip()
    print(f"machine: {info['model']}, {info['cores']} cores, cpu MHz {info['mhz']}, "
          f"avx2={info['avx2']} fma={info['fma']} avx512f={info['avx512f']}")
    print(f"python: {python} ({info['python']}); torch, intra-op threads: {torch_version}")
    print(f"load average at start: {load()}")
    return info


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def timed(cmd: list[str], cwd: str | Path | None, log: Path, env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Run ``cmd`` to completion; return (wall seconds from before the process starts
    to after it exits, exit status, its stdout+stderr). The output also goes to ``log``."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)
    wall = time.perf_counter() - start
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout)
    return wall, proc.returncode, proc.stdout


def show(cmd: list[str], cwd: str | Path | None = None) -> str:
    text = " ".join(shlex.quote(c) for c in cmd)
    return f"(cd {shlex.quote(str(cwd))} && {text})" if cwd else text


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def contrafl_command(python: str) -> list[str]:
    """The ``contrafl`` console script beside ``python`` (as a user types it), else
    ``python -m contrafl``."""
    script = Path(python).parent / "contrafl"
    return [str(script)] if script.exists() else [python, "-m", "contrafl"]


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


# -- equal work: the shapes of the job ---------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One shape of the FedAvg job that contrafl and a peer both run (issue #36)."""

    name: str
    clients: int
    fraction: float  # of the clients sampled per round
    partition: tuple[str, ...]  # contrafl's partition settings
    rounds: int
    epochs: int
    batch_size: int
    lr: float
    eval_every: int


SHAPES: dict[str, Shape] = {
    # cross-silo: every client every round, several local epochs of large batches; lr 0.05 because plain SGD
    # at 0.01 leaves the global model at chance after 10 rounds (test accuracy 0.10, seed 0), where the
    # accuracies could not show that the programs did the same work (0.05: 0.24)
    "silo": Shape("silo", 10, 1.0, ("partition=dirichlet", "partition.beta=0.5"), 10, 5, 64, 0.05, 1),
    # pfl's CIFAR-10 benchmark round (benchmarks/image_classification, configs/baseline.yaml): 50 images a
    # user (100 users on the 10% subset), 50 users a round, 1 epoch of batches of 10, local lr 0.1, central
    # lr 1, evaluation every 10 rounds
    "device": Shape("device", 100, 0.5, ("partition=iid",), 100, 1, 10, 0.1, 10),
}


def eval_rounds(rounds: int, every: int) -> list[int]:
    """The rounds after which contrafl evaluates (``eval_every``: every ``every``-th and the last)."""
    return [t for t in range(1, rounds + 1) if t % every == 0 or t == rounds]


def contrafl_overrides(shape: Shape, data_dir: str, seed: int, rounds: int) -> list[str]:
    """contrafl's settings of ``shape``: FedAvg on MOON's CNN with its projection head
    (``model=moon_cnn``), CIFAR-10, plain SGD, no augmentation, the last partial batch kept."""
    return [
        "dataset=cifar10", f"data_dir={data_dir}", "allow_subset=true", "algorithm=fedavg",
        "model=moon_cnn", "augment=none", f"num_clients={shape.clients}", *shape.partition,
        f"sample_fraction={shape.fraction}", f"rounds={rounds}", f"local_epochs={shape.epochs}",
        f"batch_size={shape.batch_size}", "drop_last=false", "optimizer=sgd", f"lr={shape.lr}",
        "momentum=0", "weight_decay=0", "server_lr=1", f"eval_every={shape.eval_every}", f"seed={seed}",
    ]


# -- equal work: contrafl's side ---------------------------------------------------------

PROBE_IMAGES = 8
"""Test images whose logits under the initial weights the peer must reproduce."""

EVAL_BATCH_SIZE = 1000
"""contrafl's ``eval_batch_size`` (its default), used by the peers' evaluation too."""


def make_spec(shape: Shape, data_dir: str, seed: int, rounds: int, work: Path) -> dict[str, Any]:
    """Build contrafl's setup of ``shape`` for ``seed`` in this process and write what the
    peer needs to do the same work into ``work``: the partition (each client's rows of the
    training set, data_batch_1..5 in order), the sampled clients of every round
    (``contrafl.engine.sampling.sample_schedule``, what a run of that config samples), the
    initial global model (``init-*.pt``), the normalisation, hashes of the labels, and the
    logits of the first test images under the initial weights. Returns the spec (with its
    path under ``"path"``)."""
    import numpy as np
    import torch
    from contrafl.config import fingerprint, load_config
    from contrafl.engine.sampling import sample_schedule
    from contrafl.engine.setup import prepare

    # on the CPU (a GPU machine too): the device is left out of the config's fingerprint
    setup = prepare(load_config(None, [*contrafl_overrides(shape, data_dir, seed, rounds), "device=cpu"]))
    cfg = setup.config
    clients = [np.asarray(rows, dtype=np.int64).tolist() for rows in setup.partition.train]
    schedule = sample_schedule(cfg.num_clients, cfg.sample_fraction, cfg.rounds, cfg.seed)
    state = {k: v.detach().clone().contiguous() for k, v in setup.model.state_dict().items()}
    init = work / f"init-{shape.name}-seed{seed}.pt"
    torch.save(state, init)
    setup.model.eval()
    with torch.no_grad():
        logits = setup.model(setup.eval_transform(setup.data.test.x[:PROBE_IMAGES])).logits
    spec = {
        "shape": shape.name, "seed": seed, "data_dir": data_dir,
        "mean": list(setup.data.mean), "std": list(setup.data.std),
        "train_labels_sha256": labels_sha256(setup.data.train.y.numpy()),
        "test_labels_sha256": labels_sha256(setup.data.test.y.numpy()),
        "clients": clients, "schedule": [sorted(s) for s in schedule],
        "rounds": cfg.rounds, "local_epochs": cfg.local_epochs, "batch_size": cfg.batch_size, "lr": cfg.lr,
        "eval_rounds": eval_rounds(cfg.rounds, cfg.eval_every), "eval_batch_size": cfg.eval_batch_size,
        "init": str(init), "init_sha256": state_sha256(state),
        "probe_logits": logits.tolist(), "fingerprint": fingerprint(cfg),
        "local_steps": [planned_steps(clients, s, cfg.local_epochs, cfg.batch_size) for s in schedule],
    }
    path = work / f"spec-{shape.name}-seed{seed}.json"
    path.write_text(json.dumps(spec))
    return {**spec, "path": str(path)}


def planned_steps(clients: list[list[int]], sampled: list[int], epochs: int, batch_size: int) -> int:
    """Local steps of one round: each sampled client's epochs of ``ceil(n / batch_size)``
    batches (the last partial batch kept)."""
    return sum(epochs * math.ceil(len(clients[c]) / batch_size) for c in sampled)


def describe_work(spec: dict[str, Any]) -> str:
    """One line on the work of ``spec``."""
    sizes = [len(rows) for rows in spec["clients"]]
    return (f"{len(sizes)} clients ({min(sizes)}-{max(sizes)} images, {sum(sizes)} in all), "
            f"{len(spec['schedule'][0])} a round, {spec['rounds']} rounds of {spec['local_epochs']} epoch(s), "
            f"batch {spec['batch_size']}, lr {spec['lr']:g}: {sum(spec['local_steps'])} local steps; "
            f"evaluated after rounds {compact(spec['eval_rounds'])}; initial weights sha256 {spec['init_sha256'][:12]}")


def compact(rounds: list[int]) -> str:
    """``[10, 20, ..., 100]`` written short."""
    return str(rounds) if len(rounds) <= 4 else f"[{rounds[0]}, {rounds[1]}, ..., {rounds[-1]}]"


def jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of one of contrafl's ``.jsonl`` files."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def contrafl_record(run_dir: Path) -> dict[str, Any]:
    """What a contrafl run did, from its run directory: each round's clients and local
    steps and the test accuracy of every evaluation (``metrics.jsonl``), the seconds of
    its rounds, evaluations included (``timing.jsonl``), its partition (``partition.json``)
    and its config's fingerprint (``summary.json``)."""
    rows = jsonl_rows(run_dir / "metrics.jsonl")
    return {
        "rounds_s": sum(r["seconds"] for r in jsonl_rows(run_dir / "timing.jsonl")),
        "clients": [sorted(r["clients"]) for r in rows],
        "local_steps": [r["local_steps"] for r in rows],
        "test_acc": {int(r["round"]): r["test_acc"] for r in rows if "test_acc" in r},
        "partition": json.loads((run_dir / "partition.json").read_text())["train"],
        "fingerprint": json.loads((run_dir / "summary.json").read_text())["fingerprint"],
    }


def peer_record(paths: list[Path]) -> dict[str, Any]:
    """A peer's record, merged over the files its processes wrote (one per pfl rank):
    each round's clients (the union) and local steps (the sum), the accuracies (all
    processes hold the same ones), the init hash, the largest probe difference and the
    seconds of the rounds (the slowest process's, where the peer measures them)."""
    parts = [json.loads(p.read_text()) for p in paths]
    rounds = len(parts[0]["clients"])
    if any(len(p["clients"]) != rounds for p in parts):
        fail(f"the peer's processes recorded different numbers of rounds: {[len(p['clients']) for p in parts]}")
    return {
        "clients": [sorted(c for p in parts for c in p["clients"][t]) for t in range(rounds)],
        "local_steps": [sum(p["local_steps"][t] for p in parts) for t in range(rounds)],
        "test_acc": {int(k): v for k, v in parts[0]["test_acc"].items()},
        "init_sha256": {p["init_sha256"] for p in parts},
        "probe_max_abs_diff": max(p["probe_max_abs_diff"] for p in parts),
        "threads": [p.get("threads") for p in parts],
        "processes": len(parts),
        "query_s": parts[0].get("query_s"),
        "rounds_s": max(p["rounds_s"] for p in parts) if all("rounds_s" in p for p in parts) else None,
    }


def work_problems(spec: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """How ``record`` (contrafl's or a peer's) differs from the work of ``spec``: the
    clients of each round, the local steps of each round, the evaluated rounds, and
    contrafl's partition and config, or the peer's initial weights."""
    out = []
    if len(record["clients"]) != spec["rounds"]:
        out.append(f"{len(record['clients'])} rounds instead of {spec['rounds']}")
    for t, (got, want) in enumerate(zip(record["clients"], spec["schedule"]), 1):
        if got != want:
            out.append(f"round {t} trained clients {got} instead of {want}")
            break
    for t, (got, want) in enumerate(zip(record["local_steps"], spec["local_steps"]), 1):
        if got != want:
            out.append(f"round {t} took {got} local steps instead of {want}")
            break
    if sorted(record["test_acc"]) != spec["eval_rounds"] and not record.get("floor"):  # the floor evaluates nothing
        out.append(f"evaluated after rounds {sorted(record['test_acc'])} instead of {spec['eval_rounds']}")
    if "partition" in record and record["partition"] != spec["clients"]:
        out.append("contrafl's run partitioned the data otherwise than the spec")
    if "fingerprint" in record and record["fingerprint"] != spec["fingerprint"]:
        out.append(f"contrafl's run has config fingerprint {record['fingerprint']}, the spec {spec['fingerprint']}")
    if "init_sha256" in record and record["init_sha256"] != {spec["init_sha256"]}:
        out.append(f"the peer started from weights {sorted(record['init_sha256'])}, not contrafl's {spec['init_sha256']}")
    if record.get("probe_max_abs_diff", 0.0) > PROBE_TOLERANCE:
        out.append(f"the peer's model gives other logits than contrafl's (max |diff| {record['probe_max_abs_diff']:.2e})")
    return out


def final_accuracy(record: dict[str, Any]) -> float | None:
    """The test accuracy of the last evaluation."""
    return record["test_acc"][max(record["test_acc"])] if record["test_acc"] else None


def spread(xs: list[float]) -> str:
    """``min-max (mean, n)`` of accuracies over seeds."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{min(xs):.3f}-{max(xs):.3f} (mean {statistics.fmean(xs):.3f}, {len(xs)} seeds)"


# -- equal work: the peer's side (no contrafl here) --------------------------------------

PROBE_TOLERANCE = 1e-4
"""Largest difference allowed between contrafl's and the peer's probe logits."""


def labels_sha256(labels: Any) -> str:
    """sha256 of labels as little-endian int64."""
    import numpy as np

    return hashlib.sha256(np.asarray(labels, dtype="<i8").tobytes()).hexdigest()


def state_sha256(state: dict[str, Any]) -> str:
    """sha256 of a state dict: every tensor's name and float32 bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def read_cifar10(data_dir: str | Path) -> tuple[Any, Any, Any, Any]:
    """CIFAR-10 from its python pickles (``data_batch_1..5`` in order, ``test_batch``; the
    10% subset too): uint8 images ``[N, 3, 32, 32]`` and int64 labels, train then test."""
    import numpy as np

    def batch(name: str) -> tuple[Any, Any]:
        with open(Path(data_dir) / name, "rb") as f:
            d = pickle.load(f, encoding="latin1")
        x = np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        return x, np.asarray(d["labels"], dtype=np.int64)

    parts = [batch(f"data_batch_{i}") for i in range(1, 6)]
    x_test, y_test = batch("test_batch")
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), x_test, y_test


def normalised(x: Any, spec: dict[str, Any]) -> Any:
    """uint8 images as float32 tensors, ``(x / 255 - mean) / std`` per channel (contrafl's
    normalisation, with the spec's constants)."""
    import torch

    mean = torch.tensor(spec["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(spec["std"], dtype=torch.float32).view(1, -1, 1, 1)
    return (torch.from_numpy(x).float() / 255 - mean) / std


def peer_data(spec: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """The spec's data set as the peer reads it: normalised train and test images and
    their labels (torch tensors), checked to be the labels contrafl read."""
    import torch

    x_train, y_train, x_test, y_test = read_cifar10(spec["data_dir"])
    if labels_sha256(y_train) != spec["train_labels_sha256"] or labels_sha256(y_test) != spec["test_labels_sha256"]:
        raise SystemExit(f"error: {spec['data_dir']} holds other labels than the data contrafl read")
    return normalised(x_train, spec), torch.from_numpy(y_train), normalised(x_test, spec), torch.from_numpy(y_test)


def moon_cnn() -> Any:
    """MOON's simple-cnn with its projection head and classifier (MOON's ``ModelFedCon``,
    contrafl's ``model=moon_cnn``), parameter names as in both: ``features.{conv1, conv2,
    fc1, fc2}`` (conv 5x5 3->6, pool, ReLU, conv 5x5 6->16, pool, ReLU, 400->120, ReLU,
    120->84, ReLU), ``l1`` 84->84, ReLU, ``l2`` 84->256, classifier ``l3`` 256->10. The
    forward pass returns the logits."""
    from torch import nn
    from torch.nn import functional as F

    class Features(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, 6, 5), nn.Conv2d(6, 16, 5)
            self.fc1, self.fc2 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv1(x)), 2)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            return F.relu(self.fc2(F.relu(self.fc1(x.flatten(1)))))

    class MoonCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = Features()
            self.l1, self.l2, self.l3 = nn.Linear(84, 84), nn.Linear(84, 256), nn.Linear(256, 10)

        def forward(self, x):
            return self.l3(self.l2(F.relu(self.l1(self.features(x)))))

    return MoonCNN()


def load_initial_weights(net: Any, spec: dict[str, Any], x_test: Any) -> dict[str, Any]:
    """Load contrafl's initial weights into the peer's ``net`` (names and shapes must
    match: ``strict``), check that ``net`` then gives contrafl's logits on the probe
    images (the same function, not only the same parameters), and return the evidence:
    the hash of ``net``'s weights and the largest logit difference."""
    import torch

    net.load_state_dict(torch.load(spec["init"], weights_only=True), strict=True)
    net.eval()
    with torch.no_grad():
        logits = net(x_test[:PROBE_IMAGES])
    diff = (logits - torch.tensor(spec["probe_logits"])).abs().max().item()
    if diff > PROBE_TOLERANCE:
        raise SystemExit(f"error: the peer's model gives other logits than contrafl's (max |diff| {diff:.2e})")
    return {"init_sha256": state_sha256(net.state_dict()), "probe_max_abs_diff": diff}


# -- equal work: running and reporting ---------------------------------------------------

@dataclass(frozen=True)
class Program:
    """One timed program of a comparison: its command for a spec and a result path, and
    how to read what it did (a record for :func:`work_problems`) after it exits."""

    name: str
    command: Any  # (spec, out: Path) -> list[str]
    record: Any  # (out: Path) -> dict
    cwd: Path | None = None


@dataclass
class Run:
    """One timed run."""

    program: str
    seed: int
    pair: int
    wall: float
    accuracy: float | None
    steps: int
    rounds_s: float | None  # the program's own clock, from its first round's start to its last's end


def contrafl_program(python: str, settings: str = "") -> Program:
    """contrafl as its users run it: its console script, ``contrafl run SETTINGS --out DIR
    --quiet``, with ``settings`` (e.g. ``executor=distributed workers=2``) added, which
    must change how it runs, not what it computes (its record is checked like the
    others')."""

    def command(spec: dict[str, Any], out: Path) -> list[str]:
        shape = SHAPES[spec["shape"]]
        overrides = contrafl_overrides(shape, spec["data_dir"], spec["seed"], spec["rounds"])
        return contrafl_command(python) + ["run", *overrides, *settings.split(), "--out", str(out), "--quiet"]

    return Program(f"contrafl {settings}".strip(), command, contrafl_record)


def floor_program(python: str) -> Program:
    """``floor.py --spec SPEC --out DIR``: the spec's batches through the plain loop
    (:mod:`floor`), timed as a program, so that the floor alternates with the programs and
    a change of the machine's speed hits it too. It evaluates nothing (no accuracy)."""
    script = Path(__file__).resolve().parent / "floor.py"

    def command(spec: dict[str, Any], out: Path) -> list[str]:
        return [python, str(script), "--spec", spec["path"], "--out", str(out)]

    return Program("floor", command, lambda out: json.loads((out / "record.json").read_text()))


def benchmark_parser(doc: str, seeds_help: str, rounds_help: str, work: Path) -> argparse.ArgumentParser:
    """The options every peer benchmark takes (a script adds its peer's own); ``--peer``
    and ``--out`` start the peer's process."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2].parent / "shared/data/cifar-10-batches-py"),
                   help="the cifar-10-batches-py folder (default: ../shared/data/cifar-10-batches-py beside the repository)")
    p.add_argument("--shape", choices=["silo", "device", "both"], default="both")
    p.add_argument("--seeds", type=int, default=5, help=seeds_help)
    p.add_argument("--pairs", type=int, default=1, help="runs of each program per seed (alternating)")
    p.add_argument("--rounds", type=int, help=rounds_help)
    p.add_argument(
        "--contrafl", nargs="+", default=[""], metavar="SETTINGS",
        help="contrafl's variants, each one quoted string of execution settings, e.g. "
             "'' 'executor=distributed workers=2' (default: '', its automatic executor); "
             "the first is the one the ratios divide by",
    )
    p.add_argument("--floor", action="store_true",
                   help="also time floor.py on each seed's batches, alternating with the programs "
                        "(a plain PyTorch loop of the same steps on 2 one-thread processes: the arithmetic floor)")
    p.add_argument("--python", default=sys.executable, help="interpreter of both programs (default: this one)")
    p.add_argument("--work", type=Path, default=work, help="specs, runs and logs")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--peer", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p


def run_benchmark(a: argparse.Namespace, peers: list[Program], rounds: Mapping[str, int] | None = None) -> None:
    """Compare contrafl's variants (``--contrafl``) with ``peers`` on the shapes of
    :func:`benchmark_parser`'s options ``a``, each shape for ``--rounds``, else
    ``rounds[shape]``, else its own; print the machine and the tables, and write them to
    ``--json``."""
    data_dir = Path(a.data_dir).resolve()
    if not (data_dir / "data_batch_1").exists():
        fail(f"{data_dir} holds no CIFAR-10 python batches (data_batch_1, ...)")
    print_machine(a.python)
    compile_contrafl(a.python)
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    programs = [contrafl_program(a.python, c) for c in a.contrafl] + peers + ([floor_program(a.python)] if a.floor else [])
    results = []
    for name in (["silo", "device"] if a.shape == "both" else [a.shape]):
        shape = SHAPES[name]
        n = a.rounds or (rounds or {}).get(name, shape.rounds)
        runs = compare(programs, shape, n, a.seeds, a.pairs, str(data_dir), a.work)
        results.append(report(shape, n, runs, [prog.name for prog in programs]))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


def compile_contrafl(python: str) -> None:
    """Compile contrafl's modules to bytecode once, before any run is timed, as installing
    a package from a wheel leaves it (the peers' packages were compiled when pip installed
    them): an editable install under ``PYTHONDONTWRITEBYTECODE=1`` (this environment's
    setting) would otherwise compile them again in every run, about 0.2 s of its start."""
    where = subprocess.run([python, "-c", "import contrafl, os; print(os.path.dirname(contrafl.__file__))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([python, "-m", "compileall", "-q", where], check=True)
    print(f"contrafl's modules compiled to bytecode ({where})")


def compare(programs: list[Program], shape: Shape, rounds: int, seeds: int, pairs: int,
            data_dir: str, work: Path) -> list[Run]:
    """Run every program ``pairs`` times for each of ``seeds`` seeds, alternating (the
    programs one after another for each seed and pair), each timed as a whole process;
    check every run's work against the seed's spec and stop at the first difference."""
    runs: list[Run] = []
    for seed in range(seeds):
        spec = make_spec(shape, data_dir, seed, rounds, work)
        print(f"\n--- {shape.name}, seed {seed}: {describe_work(spec)}")
        for pair in range(pairs):
            for program in programs:
                runs.append(run_once(program, spec, pair, work))
    return runs


def run_once(program: Program, spec: dict[str, Any], pair: int, work: Path) -> Run:
    """Time one run of ``program`` on ``spec``; check its work; print one line."""
    tag = f"{program.name.replace(' ', '-')}-{spec['shape']}-seed{spec['seed']}-pair{pair}"
    out = work / tag
    shutil.rmtree(out, ignore_errors=True)
    cmd = program.command(spec, out)
    if spec["seed"] == 0 and pair == 0:
        print(f"  {program.name}: {show(cmd, program.cwd)}")
    wall, rc, text = timed(cmd, program.cwd, work / f"{tag}.log")
    if rc != 0:
        print(text[-4000:])
        fail(f"{program.name} exited {rc} (log: {work / f'{tag}.log'})")
    record = program.record(out)
    problems = work_problems(spec, record)
    if problems:
        fail(f"{program.name} did other work than the spec {spec['path']}: " + "; ".join(problems))
    acc, steps = final_accuracy(record), sum(record["local_steps"])
    in_rounds = f" ({record['rounds_s']:.1f} s in its rounds)" if record.get("rounds_s") is not None else ""
    what = (f"test accuracy after {max(record['test_acc'])} rounds {acc:.4f}, {steps} local steps, same clients, "
            f"steps and evaluations as the spec" if acc is not None else f"{steps} local steps of the spec's clients, no evaluation")
    print(f"  seed {spec['seed']} pair {pair}: {program.name:<16} {wall:7.1f} s{in_rounds}  {what}"
          f"{peer_evidence(record)}   (load {load()})")
    return Run(program.name, spec["seed"], pair, wall, acc, steps, record.get("rounds_s"))


def peer_evidence(record: dict[str, Any]) -> str:
    """The peer's checks of its model, for the run's line."""
    if "init_sha256" not in record:
        return ""
    query = (f", {record['query_s']:.2f} s asking the nodes their partition, the actors' start-up included"
             if record.get("query_s") is not None else "")
    return (f", contrafl's initial weights, probe logits within {record['probe_max_abs_diff']:.1e}"
            f" ({record['processes']} process(es), torch threads {record['threads']}{query})")


def report(shape: Shape, rounds: int, runs: list[Run], programs: list[str]) -> dict[str, Any]:
    """Print the wall times, medians, ratios to contrafl and the accuracy spread of each
    program on ``shape``, and the seconds in the rounds (start-up and exit left out) where
    the programs measure them; return them."""
    base = median([r.wall for r in runs if r.program == programs[0]])
    base_rounds = [r.rounds_s for r in runs if r.program == programs[0]]
    base_rounds_m = median(base_rounds) if base_rounds and None not in base_rounds else None
    print(f"\n=== {shape.name} ({rounds} rounds): wall time from process start to exit, the time in the rounds "
          "(each program's own clock, evaluations included), and final test accuracy")
    print(f"| program | runs (s) | median (s) | / {programs[0]} | per pair | in rounds, median (s) | / {programs[0]} "
          "| accuracy per seed | accuracy spread |")
    print("|---|---|---|---|---|---|---|---|---|")
    out: dict[str, Any] = {"shape": shape.name, "rounds": rounds, "programs": {}}
    for name in programs:
        mine = [r for r in runs if r.program == name]
        m = median([r.wall for r in mine])
        pairs = [r.wall / b.wall for r in mine for b in runs
                 if b.program == programs[0] and (b.seed, b.pair) == (r.seed, r.pair)]
        by_seed = {r.seed: r.accuracy for r in mine}
        in_rounds = [r.rounds_s for r in mine]
        rounds_m = median(in_rounds) if None not in in_rounds else None
        rounds_cells = (f"{rounds_m:.1f} | {rounds_m / base_rounds_m:.2f}x" if rounds_m is not None and base_rounds_m
                        else "- | -")
        print(f"| {name} | {', '.join(f'{r.wall:.1f}' for r in mine)} | {m:.1f} | {m / base:.2f}x | "
              f"{min(pairs):.2f}-{max(pairs):.2f}x | {rounds_cells} | {' '.join('-' if a is None else f'{a:.3f}' for a in by_seed.values())} | "
              f"{spread(list(by_seed.values()))} |")
        out["programs"][name] = {"wall_s": [r.wall for r in mine], "median_s": m, "ratio": m / base,
                                 "rounds_s": in_rounds, "rounds_median_s": rounds_m,
                                 "pair_ratios": pairs, "accuracy_by_seed": by_seed,
                                 "local_steps": sorted({r.steps for r in mine})}
    floors = {(r.seed, r.pair): r for r in runs if r.program == "floor"}
    if floors:  # issue #57's measure: each contrafl run's whole process over its pair's floor (the steps alone)
        for name in [n for n in programs if n.startswith("contrafl")]:
            mine = [(r, floors[(r.seed, r.pair)]) for r in runs if r.program == name and (r.seed, r.pair) in floors]
            ratios = [r.wall / f.rounds_s for r, f in mine]
            whole = [r.wall / f.wall for r, f in mine]
            print(f"{name} / floor (its whole process over the same seed and pair's steps in the plain loop): "
                  f"median {median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} pairs; "
                  f"over the floor's whole process (torch's import and the batches' making included): "
                  f"median {median(whole):.2f}x")
            out["programs"][name]["floor_ratios"] = ratios
            out["programs"][name]["floor_process_ratios"] = whole
    return out
