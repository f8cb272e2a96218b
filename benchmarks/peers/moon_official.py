"""contrafl against the official MOON code (https://github.com/QinbinLi/MOON) on its
README's CIFAR-10 job, cut to 3 rounds.

    python benchmarks/peers/moon_official.py --moon PATH --data-dir DIR [--repeats 2] [--bf16]

PATH is a checkout of QinbinLi/MOON, run unchanged through ``run_peer.py`` (``.cuda()``
made a no-op without CUDA, torchvision's CIFAR checksums accepted so that a subset in
the official format loads); DIR is the ``cifar-10-batches-py`` folder. Run it with a
Python whose torch and torchvision both programs import (README.md here).

The job (MOON's README, ``--comm_round=3``): simple-cnn with its projection head (out
dim 256), MOON with mu 5 and temperature 0.5, 10 parties, Dirichlet(0.5) label skew, 10
local epochs, batch 64, SGD lr 0.01 momentum 0.9 weight decay 1e-5, random crop with
reflect padding 4 and horizontal flips. contrafl's ``dataset=cifar10`` defaults are
these settings; they are also given explicitly. Each program draws its own Dirichlet
partition with its own random generator, so the clients' shares differ, but both train
on all the official training samples every round: equal work up to the last
incomplete batch each client drops.

Start-up costs count: each program is timed from before its process starts to after it
exits (interpreter, imports, data loading, worker start-up). The official code also
evaluates every client's model on its training data and on the whole test set before and
after its local training, and the global model on the whole training and test sets,
every round; contrafl evaluates the global model on the test set once a round. That is
part of each program's job as its users run it.

``--bf16`` also runs contrafl with ``precision=auto`` (bfloat16 autocast where the CPU
has AMX or AVX512-BF16, else fp32) in every repeat and prints its ratio beside fp32's.
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

HERE = Path(__file__).resolve().parent


def moon_param_count(moon: Path) -> int:
    sys.path.insert(0, str(moon))
    try:
        spec = importlib.util.spec_from_file_location("moon_model", moon / "model.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        model = mod.ModelFedCon("simple-cnn", 256, 10, None)
        return sum(p.numel() for p in model.parameters())
    finally:
        sys.path.remove(str(moon))


def contrafl_param_count(overrides: list[str]) -> int:
    from contrafl.config import load_config
    from contrafl.engine.setup import prepare

    setup = prepare(load_config(None, overrides))
    return sum(p.numel() for p in setup.model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moon", required=True, type=Path, help="checkout of QinbinLi/MOON")
    p.add_argument("--data-dir", required=True, help="the cifar-10-batches-py folder")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--python", default=sys.executable, help="interpreter of both programs (default: this one)")
    p.add_argument("--work", type=Path, default=Path("/tmp/contrafl-peers/moon"), help="run directories and logs")
    p.add_argument("--bf16", action="store_true",
                   help="also time contrafl with precision=auto (bf16 where the CPU has AMX or AVX512-BF16)")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()

    moon = a.moon.resolve()
    if not (moon / "main.py").exists():
        fail(f"{moon} is not a checkout of QinbinLi/MOON (no main.py)")
    data_dir = Path(a.data_dir).resolve()
    if data_dir.name != "cifar-10-batches-py":
        fail("--data-dir must be the cifar-10-batches-py folder (torchvision's CIFAR10 looks for that name)")
    print_machine(a.python)

    overrides = [
        "dataset=cifar10", f"data_dir={data_dir}", "allow_subset=true",
        "model=moon_cnn", "model.projection=true", "model.projection_dim=256",
        "algorithm=moon", "algorithm.mu=5", "algorithm.temperature=0.5",
        f"rounds={a.rounds}", "num_clients=10", "sample_fraction=1.0",
        "partition=dirichlet", "partition.beta=0.5", "local_epochs=10", "batch_size=64",
        "optimizer=sgd", "lr=0.01", "momentum=0.9", "weight_decay=1e-5", "augment=cifar10", "seed=0",
    ]
    n_cf, n_moon = contrafl_param_count(overrides), moon_param_count(moon)
    print(f"model parameters: contrafl moon_cnn + projection 256: {n_cf:,}; MOON ModelFedCon(simple-cnn, 256): {n_moon:,}")
    if n_cf != n_moon:
        fail("the two models differ")

    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    cf_base = contrafl_command(a.python) + ["run"] + overrides
    peer_base = [a.python, str(HERE / "run_peer.py"), str(moon / "main.py"),
                 "--dataset=cifar10", "--model=simple-cnn", "--alg=moon", "--lr=0.01", "--mu=5",
                 "--epochs=10", f"--comm_round={a.rounds}", "--n_parties=10", "--partition=noniid",
                 "--beta=0.5", f"--datadir={data_dir.parent}", "--device=cpu"]
    print(f"contrafl: {show(cf_base + ['--out', str(a.work / 'contrafl-K'), '--quiet'])}")
    print(f"MOON:     {show(peer_base + [f'--logdir={a.work}/moon-K', f'--modeldir={a.work}/moon-K/models', '--log_file_name=log'])}")

    variants = {"contrafl": []} | ({"contrafl_bf16": ["precision=auto"]} if a.bf16 else {})
    times: dict[str, list[float]] = {name: [] for name in [*variants, "moon"]}
    accs: dict[str, list] = {name: [] for name in [*variants, "moon"]}
    for k in range(a.repeats):
        for name, extra in variants.items():
            out_dir = a.work / f"{name}-{k}"
            wall, rc, out = timed(cf_base + extra + ["--out", str(out_dir), "--quiet"], None, a.work / f"{name}-{k}.log")
            if rc != 0:
                print(out[-3000:])
                fail(f"contrafl exited {rc}")
            summary = json.loads((out_dir / "summary.json").read_text())
            acc = summary["final"].get("test_acc")
            times[name].append(wall)
            accs[name].append(acc)
            label = "contrafl" + (" (precision=auto)" if extra else "")
            print(f"  run {k}: {label} {wall:7.1f} s  test_acc after {a.rounds} rounds {acc}   (load {load()})")

        logdir = a.work / f"moon-{k}"
        cmd = peer_base + [f"--logdir={logdir}", f"--modeldir={logdir}/models", "--log_file_name=log"]
        wall, rc, out = timed(cmd, moon, a.work / f"moon-{k}.out")
        if rc != 0:
            print(out[-3000:])
            fail(f"the official MOON code exited {rc}")
        log = (logdir / "log.log").read_text() if (logdir / "log.log").exists() else out
        found = re.findall(r">> Global Model Test accuracy: ([0-9.]+)", log)
        acc = float(found[-1]) if found else None
        times["moon"].append(wall)
        accs["moon"].append(acc)
        print(f"  run {k}: MOON     {wall:7.1f} s  global test accuracy after {a.rounds} rounds {acc}   (load {load()})")

    m_cf, m_moon = median(times["contrafl"]), median(times["moon"])
    print(f"\nmedian: contrafl {m_cf:.1f} s, official MOON {m_moon:.1f} s -> MOON / contrafl = {m_moon / m_cf:.2f}x")
    result = {"times": times, "accs": accs, "ratio": m_moon / m_cf}
    if a.bf16:
        m_bf = median(times["contrafl_bf16"])
        print(f"median: contrafl precision=auto {m_bf:.1f} s -> MOON / contrafl = {m_moon / m_bf:.2f}x")
        result["ratio_bf16"] = m_moon / m_bf
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
