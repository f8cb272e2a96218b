"""contrafl against PFLlib (https://github.com/TsingZ0/PFLlib) on equal work.

    python benchmarks/peers/pfllib.py --pfllib PATH --data-dir DIR \
        [--algorithms fedavg moon fedproto ditto fedrep fedala] [--repeats 2]

PATH is a PFLlib checkout (commit d832e76 or newer; only its ``system/`` folder is run,
unchanged); DIR holds CIFAR-10's official python files (``cifar-10-batches-py``; the 10%
subset works). Run it with a Python whose torch both programs import (README.md here).

Both programs train on the same samples: contrafl's partition (PFLlib's protocol:
official train + test pooled, Dirichlet(beta) over clients, each client's share split
75/25 into its train and test sets, inputs normalised with 0.5/0.5, no augmentation) is
written as PFLlib's per-client files ``PATH/dataset/<name>/{train,test}/<cid>.npz`` plus
``config.json``, the layout and format of PFLlib's ``dataset/generate_Cifar10.py``. The
model is PFLlib's FedAvgCNN for CIFAR-10 (``-m CNN``: 2 conv + fc1 to 512 + fc to 10;
contrafl ``model=fedavg_cnn model.dim=512 model.projection=false``, parameter counts
checked equal), the optimiser plain SGD (lr 0.005, no momentum, no weight decay), batch
64 with the last incomplete batch dropped (both), every client every round, evaluation
every round on every client's test set.

Rounds: PFLlib's servers loop ``for i in range(global_rounds + 1)`` and evaluate at the
*start* of each iteration, so ``-gr R-1`` trains R rounds and evaluates R times (the
first evaluation before any training, the last after R-1 rounds); contrafl's
``rounds=R`` trains R rounds and evaluates after each. Both do R rounds of training and
R evaluations. The accuracy printed beside each time is the last evaluation each
program made, and, for a like-for-like number, contrafl's after R-1 rounds.

Runs alternate (contrafl, PFLlib, contrafl, PFLlib, ...) so that a change of load on the
machine hits both; each is timed from before its process starts to after it exits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import contrafl_command, fail, load, median, print_machine, show, timed  # noqa: E402

# contrafl algorithm -> (PFLlib -algo, PFLlib's extra flags, contrafl's overrides), with
# every hyper-parameter that the two programs share set to the same value explicitly.
ALGORITHMS: dict[str, tuple[str, list[str], list[str]]] = {
    "fedavg": ("FedAvg", [], ["algorithm=fedavg"]),
    # PFLlib's MOON defaults (-mu 0, -tau 1) switch the contrastive term off; MOON's
    # paper values for this CNN in contrafl's PFLlib-protocol suite: mu 1, tau 0.5.
    "moon": ("MOON", ["-mu", "1", "-tau", "0.5"],
             ["algorithm=moon", "algorithm.mu=1", "algorithm.temperature=0.5"]),
    "fedproto": ("FedProto", ["-lam", "1"], ["algorithm=fedproto", "algorithm.lam=1"]),
    # PFLlib's Ditto default -mu 0 leaves the personal model unregularised; 1 is Ditto's
    # paper value and contrafl's default.
    "ditto": ("Ditto", ["-mu", "1", "-pls", "1"],
              ["algorithm=ditto", "algorithm.lam=1", "algorithm.personal_epochs=1"]),
    "fedrep": ("FedRep", ["-pls", "1"], ["algorithm=fedrep", "algorithm.head_epochs=1"]),
    "fedala": ("FedALA", ["-et", "1", "-s", "80", "-p", "2"],
               ["algorithm=fedala", "algorithm.eta=1", "algorithm.rand_percent=80", "algorithm.layers=2"]),
}


def common_overrides(a: argparse.Namespace) -> list[str]:
    return [
        "dataset=cifar10", f"data_dir={a.data_dir}", "allow_subset=true",
        "pool=true", "test_fraction=0.25", "normalize=half", "augment=none",
        "model=fedavg_cnn", "model.dim=512", "model.projection=false",
        f"num_clients={a.clients}", "partition=dirichlet", f"partition.beta={a.beta}",
        "sample_fraction=1.0", f"rounds={a.rounds}", f"local_epochs={a.local_epochs}",
        f"batch_size={a.batch_size}", "drop_last=true", "optimizer=sgd", f"lr={a.lr}",
        "momentum=0", "weight_decay=0", "eval_every=1", f"seed={a.seed}",
    ]


def write_pfllib_dataset(a: argparse.Namespace, pfllib: Path) -> tuple[str, int]:
    """Write contrafl's partition as PFLlib's per-client npz files; return the dataset's
    name (relative to PFLlib's ``dataset/``) and contrafl's parameter count."""
    import numpy as np
    from contrafl.config import load_config
    from contrafl.engine.setup import prepare

    setup = prepare(load_config(None, common_overrides(a) + ["algorithm=fedavg"]))
    data, part = setup.data, setup.partition
    if part.test is None:
        fail("contrafl's partition has no per-client test split")
    # contrafl's eval transform: (x / 255 - mean) / std with mean = std = 0.5, which is
    # PFLlib's ToTensor() + Normalize((0.5,)*3, (0.5,)*3).
    mean = np.asarray(data.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(data.std, dtype=np.float32).reshape(1, -1, 1, 1)
    x_all = data.train.x.numpy()
    y_all = data.train.y.numpy().astype(np.int64)

    name = f"Cifar10_contrafl_n{a.clients}_b{a.beta}_s{a.seed}"
    root = pfllib / "dataset" / name
    shutil.rmtree(root, ignore_errors=True)
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir(parents=True)
    stats = []
    for cid in range(a.clients):
        for split, rows in (("train", part.train[cid]), ("test", part.test[cid])):
            rows = np.asarray(rows)
            x = ((x_all[rows].astype(np.float32) / 255.0 - mean) / std).astype(np.float32)
            with open(root / split / f"{cid}.npz", "wb") as f:
                np.savez_compressed(f, data={"x": x, "y": y_all[rows]})
        labels = y_all[np.concatenate([np.asarray(part.train[cid]), np.asarray(part.test[cid])])]
        stats.append([[int(c), int(n)] for c, n in zip(*np.unique(labels, return_counts=True))])
    config = {
        "num_clients": a.clients, "num_classes": data.num_classes, "non_iid": True,
        "balance": False, "partition": "dir", "Size of samples for labels in clients": stats,
        "alpha": a.beta, "batch_size": a.batch_size, "written_by": "contrafl benchmarks/peers/pfllib.py",
    }
    (root / "config.json").write_text(json.dumps(config))
    n_train = sum(len(r) for r in part.train)
    n_test = sum(len(r) for r in part.test)
    print(f"data: contrafl's partition -> {root}: {a.clients} clients, {n_train} train + {n_test} test samples, "
          f"train sizes {[len(r) for r in part.train]}")
    return name, sum(p.numel() for p in setup.model.parameters())


def pfllib_param_count(pfllib: Path) -> int:
    spec = importlib.util.spec_from_file_location("pfllib_models", pfllib / "system/flcore/trainmodel/models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.FedAvgCNN(in_features=3, num_classes=10, dim=1600)
    return sum(p.numel() for p in model.parameters())


def pfllib_accuracy(out: str) -> tuple[float | None, float | None]:
    """(last, best) 'Averaged Test Accuracy' printed (for Ditto the last one of a round
    is the personalised models')."""
    accs = [float(m) for m in re.findall(r"Averaged Test Accuracy: ([0-9.]+)", out)]
    return (accs[-1], max(accs)) if accs else (None, None)


def contrafl_accuracy(run_dir: Path, rounds: int) -> tuple[float | None, float | None, str]:
    """(accuracy after the last round, after ``rounds - 1`` rounds, metric name):
    personal_acc where the run evaluated clients' own models, else test_acc."""
    rows = jsonl(run_dir / "metrics.jsonl")
    key = "personal_acc" if any("personal_acc" in r for r in rows) else "test_acc"
    by_round = {r["round"]: r.get(key) for r in rows}
    return by_round.get(rounds), by_round.get(rounds - 1), key


def pfllib_round_seconds(out: str) -> list[float]:
    """PFLlib's per-round times (training and that round's evaluation): its servers print
    them as ``----- time cost ----- T`` (FedAvg, ...) or as a rule of 50 dashes and ``T`` (MOON, ...)."""
    return [float(m) for m in re.findall(r"^-+(?: time cost -+)? ([0-9.]+(?:e-?[0-9]+)?)$", out, flags=re.M)]


def contrafl_round_seconds(run_dir: Path) -> list[float]:
    """contrafl's per-round seconds (timing.jsonl: training, aggregation, evaluation)."""
    path = run_dir / "timing.jsonl"
    return [row["seconds"] for row in jsonl(path)] if path.exists() else []


def jsonl(path: Path) -> list[dict]:
    """The rows of one of contrafl's ``.jsonl`` files."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pfllib", required=True, type=Path, help="PFLlib checkout (d832e76 or newer)")
    p.add_argument("--data-dir", required=True, help="directory of cifar-10-batches-py's files")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--repeats", type=int, default=2, help="runs of each program per algorithm (alternating)")
    p.add_argument("--python", default=sys.executable, help="interpreter of both programs (default: this one)")
    p.add_argument("--work", type=Path, default=Path("/tmp/contrafl-peers/pfllib"), help="run directories and logs")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--beta", type=float, default=0.1, help="Dirichlet concentration (PFLlib's default alpha)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both programs train (PFLlib's -dev)")
    p.add_argument("--contrafl", nargs="+", default=[], metavar="SETTING",
                   help="more settings of contrafl's runs (e.g. pad_finished_clients=true)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--bf16", action="store_true",
                   help="also time contrafl with precision=auto (bfloat16 autocast where the CPU has AMX or AVX512-BF16) "
                        "in every repeat; its ratio is reported beside fp32's")
    a = p.parse_args()

    pfllib = a.pfllib.resolve()
    if not (pfllib / "system" / "main.py").exists():
        fail(f"{pfllib} is not a PFLlib checkout (no system/main.py)")
    a.data_dir = str(Path(a.data_dir).resolve())
    print_machine(a.python)
    name, n_contrafl = write_pfllib_dataset(a, pfllib)
    n_pfllib = pfllib_param_count(pfllib)
    print(f"model parameters: contrafl fedavg_cnn(dim=512, no projection) {n_contrafl:,}; "
          f"PFLlib FedAvgCNN(3, 10, 1600) {n_pfllib:,}")
    if n_contrafl != n_pfllib:
        fail("the two models differ")

    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    results = []
    for algo in a.algorithms:
        peer_algo, peer_flags, cf_overrides = ALGORITHMS[algo]
        cf_base = contrafl_command(a.python) + ["run"] + common_overrides(a) + cf_overrides + [f"device={a.device}", *a.contrafl]
        peer_cmd = [a.python, "-u", "main.py", "-data", name, "-m", "CNN", "-algo", peer_algo,
                    "-gr", str(a.rounds - 1), "-ls", str(a.local_epochs), "-lbs", str(a.batch_size),
                    "-lr", str(a.lr), "-nc", str(a.clients), "-jr", "1", "-eg", "1", "-t", "1",
                    "-dev", a.device] + peer_flags
        print(f"\n=== {algo}")
        print(f"contrafl: {show(cf_base + ['--out', str(a.work / f'contrafl-{algo}-K'), '--quiet'])}")
        print(f"PFLlib:   {show(peer_cmd, pfllib / 'system')}")
        times: dict[str, list[float]] = {"contrafl": [], "pfllib": [], "contrafl_bf16": []}
        rounds: dict[str, list[float]] = {"contrafl": [], "pfllib": [], "contrafl_bf16": []}  # per round, all but the first
        accs: dict[str, list] = {"contrafl": [], "pfllib": [], "contrafl_bf16": []}
        for k in range(a.repeats):
            if a.bf16:
                out_dir = a.work / f"contrafl-bf16-{algo}-{k}"
                wall, rc, out = timed(cf_base + ["precision=auto", "--out", str(out_dir), "--quiet"], None, a.work / f"contrafl-bf16-{algo}-{k}.log")
                if rc == 0:
                    last, prev, key = contrafl_accuracy(out_dir, a.rounds)
                    times["contrafl_bf16"].append(wall)
                    rounds["contrafl_bf16"] += contrafl_round_seconds(out_dir)[1:]
                    accs["contrafl_bf16"].append((last, prev))
                    print(f"  run {k}: contrafl precision=auto {wall:7.1f} s  {key} after {a.rounds} rounds {fmt(last)}, "
                          f"after {a.rounds - 1} {fmt(prev)}   (load {load()})")
            out_dir = a.work / f"contrafl-{algo}-{k}"
            wall, rc, out = timed(cf_base + ["--out", str(out_dir), "--quiet"], None, a.work / f"contrafl-{algo}-{k}.log")
            if rc != 0:
                print(out[-3000:])
                print(f"  contrafl exited {rc}; {algo} skipped")
                break
            last, prev, key = contrafl_accuracy(out_dir, a.rounds)
            times["contrafl"].append(wall)
            rounds["contrafl"] += contrafl_round_seconds(out_dir)[1:]
            accs["contrafl"].append((last, prev))
            print(f"  run {k}: contrafl {wall:7.1f} s  {key} after {a.rounds} rounds {fmt(last)}, "
                  f"after {a.rounds - 1} {fmt(prev)}   (load {load()})")
            wall, rc, out = timed(peer_cmd, pfllib / "system", a.work / f"pfllib-{algo}-{k}.log")
            if rc != 0:
                print(out[-3000:])
                print(f"  PFLlib exited {rc}; {algo} skipped")
                break
            last, best = pfllib_accuracy(out)
            times["pfllib"].append(wall)
            rounds["pfllib"] += pfllib_round_seconds(out)[1:]
            accs["pfllib"].append((last, best))
            print(f"  run {k}: PFLlib   {wall:7.1f} s  Averaged Test Accuracy after {a.rounds - 1} rounds "
                  f"{last}, best {best}   (load {load()})")
        if not times["pfllib"] or len(times["pfllib"]) < len(times["contrafl"]):
            continue
        m_cf, m_peer = median(times["contrafl"]), median(times["pfllib"])
        print(f"  median: contrafl {m_cf:.1f} s, PFLlib {m_peer:.1f} s -> PFLlib / contrafl = {m_peer / m_cf:.2f}x")
        if rounds["contrafl"] and rounds["pfllib"]:
            r_cf, r_peer = median(rounds["contrafl"]), median(rounds["pfllib"])
            print(f"  median round (after the first): contrafl {r_cf:.2f} s, PFLlib {r_peer:.2f} s -> {r_peer / r_cf:.2f}x"
                  + (f"; precision=auto {median(rounds['contrafl_bf16']):.2f} s -> {r_peer / median(rounds['contrafl_bf16']):.2f}x"
                     if rounds["contrafl_bf16"] else ""))
        result = {"algorithm": algo, "contrafl_s": times["contrafl"], "pfllib_s": times["pfllib"],
                  "contrafl_round_s": rounds["contrafl"], "pfllib_round_s": rounds["pfllib"],
                  "contrafl_bf16_round_s": rounds["contrafl_bf16"],
                  "contrafl_acc_last_prev": accs["contrafl"], "pfllib_acc_last_best": accs["pfllib"],
                  "ratio": m_peer / m_cf}
        if times["contrafl_bf16"]:
            m_bf = median(times["contrafl_bf16"])
            print(f"  median: contrafl precision=auto {m_bf:.1f} s -> PFLlib / contrafl = {m_peer / m_bf:.2f}x")
            result.update(contrafl_bf16_s=times["contrafl_bf16"], contrafl_bf16_acc_last_prev=accs["contrafl_bf16"], ratio_bf16=m_peer / m_bf)
        results.append(result)

    print("\n| algorithm | contrafl (s) | PFLlib (s) | PFLlib / contrafl | contrafl acc (R / R-1 rounds) | PFLlib acc (R-1 rounds) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        cf_acc = r["contrafl_acc_last_prev"][0]
        peer_acc = r["pfllib_acc_last_best"][0]
        print(f"| {r['algorithm']} | {median(r['contrafl_s']):.1f} | {median(r['pfllib_s']):.1f} | "
              f"{r['ratio']:.2f}x | {fmt(cf_acc[0])} / {fmt(cf_acc[1])} | {fmt(peer_acc[0])} |")
    if any("ratio_bf16" in r for r in results):
        print("\n| algorithm | contrafl precision=auto (s) | PFLlib / contrafl | contrafl acc (R / R-1 rounds) |")
        print("|---|---|---|---|")
        for r in results:
            if "ratio_bf16" in r:
                acc = r["contrafl_bf16_acc_last_prev"][0]
                print(f"| {r['algorithm']} | {median(r['contrafl_bf16_s']):.1f} | {r['ratio_bf16']:.2f}x | {fmt(acc[0])} / {fmt(acc[1])} |")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
