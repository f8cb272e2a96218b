"""contrafl sweep over several GPUs and machines: a GPU of its own for each running cell,
and --shard I/N, the disjoint shares of a sweep's runs that a cluster's job array runs
into one output directory."""

from __future__ import annotations

import dataclasses
import io
import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from contrafl.cli import main
from contrafl.errors import ConfigError
from contrafl.experiments import sweep as sweep_module
from contrafl.experiments.sweep import (
    Sweep, default_workers, in_shard, load_sweep, parse_shard, run_sweep, sweep_gpus, sweep_report, visible_gpus,
)
from test_sweep import SPEC  # the digits sweep of 2 x 2 cells x 2 seeds

TINY = "base: {dataset: digits, rounds: 1, num_clients: 2, local_epochs: 1}\ngrid: {algorithm: [fedavg, fedprox]}\nseeds: [0, 1]\n"
"""2 cells x 2 seeds of one round: about 3 s a run on one core."""


def _dry_run(spec: Path, out: Path, shard: str, capsys) -> list[str]:
    """The runs (``"<cell> seed <k>"``) that ``--shard shard`` would run."""
    assert main(["sweep", str(spec), "--out", str(out), "--shard", shard, "--dry-run"]) == 0
    return [line.strip().partition(": ")[0] for line in capsys.readouterr().out.splitlines()[1:]]


def test_shares_are_disjoint_cover_every_run_and_follow_the_sweep_file_alone(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    everything = _dry_run(spec, out, "1/1", capsys)
    assert len(everything) == 8
    for n in (2, 3, 8, 9):
        shares = [_dry_run(spec, out, f"{i}/{n}", capsys) for i in range(1, n + 1)]
        assert sorted(sum(shares, [])) == sorted(everything)  # disjoint, and every run in one
        assert shares[0] == everything[::n]  # run k (in the sweep's order) goes to share k mod N
    assert _dry_run(spec, out, "2/4", capsys) == _dry_run(spec, out, "2/4", capsys)
    assert not out.exists()
    assert in_shard(list(range(5)), None) == [0, 1, 2, 3, 4] and in_shard(list(range(5)), (2, 2)) == [1, 3]
    assert parse_shard(" 3/4") == (3, 4)


@pytest.mark.parametrize("value", ["5/4", "0/4", "a/b", "2", "1/0", "2/4/8", "1.5/4", ""])
def test_bad_shard_values_are_one_line_errors(tmp_path, capsys, value):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--shard", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"contrafl: error: --shard {value or repr(value)} is invalid: expected I/N with 1 <= I <= N, e.g. --shard 2/4")
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError):
        parse_shard(value)


STAND_IN = """\
import json, os, sys, time
from pathlib import Path
start = time.monotonic()
time.sleep(float(sys.argv[2]))
path = Path(sys.argv[1])
path.mkdir(parents=True, exist_ok=True)
(path / "metrics.jsonl").write_text(json.dumps({"round": 1, "test_acc": 0.5}) + "\\n")
(path / "summary.json").write_text(json.dumps({"status": "completed"}))
(path / "stand_in.json").write_text(json.dumps([os.environ.get("CUDA_VISIBLE_DEVICES"), start, time.monotonic()]))
"""
"""A run's stand-in (argv: its run directory and how long it takes): it records the GPU
its environment gives it and when it ran, and leaves a completed run."""


@pytest.fixture
def stand_ins(monkeypatch):
    """Runs of the sweep replaced by :data:`STAND_IN` processes lasting ``delays[k]`` for the
    k-th started; the environment each was given is in ``envs``, its run directory in
    ``paths``."""
    started = SimpleNamespace(delays=[], envs=[], paths=[])

    def spawn(argv, log, env):
        path = argv[argv.index("--out") + 1]
        started.envs.append(env)
        started.paths.append(Path(path))
        delay = started.delays[len(started.envs) - 1]
        return subprocess.Popen([sys.executable, "-c", STAND_IN, path, str(delay)], stdout=log, stderr=subprocess.STDOUT, env=env)

    monkeypatch.setattr(sweep_module, "_spawn", spawn)
    return started


def _on_cuda(monkeypatch) -> None:
    """The sweep's runs resolved to device=cuda on this CPU-only machine (their stand-ins
    never use it)."""
    real = sweep_module.resolved_configs
    monkeypatch.setattr(sweep_module, "resolved_configs", lambda *a: {k: dataclasses.replace(c, device="cuda") for k, c in real(*a).items()})


def test_each_running_cell_gets_a_gpu_of_its_own_and_freed_ones_are_taken_again(tmp_path, monkeypatch, stand_ins):
    """Two visible GPUs (the parent's CUDA_VISIBLE_DEVICES=3,5): two runs at a time, each
    with CUDA_VISIBLE_DEVICES one of them; the third run takes the GPU of the first, which
    ended while the second still holds the other."""
    monkeypatch.setattr(sweep_module, "visible_gpus", lambda: ["3", "5"])
    _on_cuda(monkeypatch)
    stand_ins.delays = [0.8, 2.5, 0.3, 0.3]
    spec = tmp_path / "s.yaml"
    spec.write_text(TINY)
    out = tmp_path / "out"
    stream = io.StringIO()
    run_sweep(load_sweep(spec), out, stream=stream)
    assert "4 to run, 2 at a time (" in stream.getvalue() and "; CUDA_VISIBLE_DEVICES 3, 5)" in stream.getvalue()
    runs = [json.loads((path / "stand_in.json").read_text()) for path in stand_ins.paths]  # in the order started
    assert [env["CUDA_VISIBLE_DEVICES"] for env in stand_ins.envs] == [gpu for gpu, _, _ in runs]
    assert [gpu for gpu, _, _ in runs[:3]] == ["3", "5", "3"]  # the first's GPU, given back, goes to the third
    for k, (gpu, start, end) in enumerate(runs):  # no two runs on one GPU at once
        assert all(other[0] != gpu for other in runs[k + 1:] if other[1] < end), runs
    logs = sorted(p.read_text() for p in (out / "logs").glob("*.log"))
    assert sum("CUDA_VISIBLE_DEVICES=5)" in log for log in logs) >= 1


def test_workers_given_share_the_gpus_and_cpu_runs_keep_their_environment(tmp_path, monkeypatch, stand_ins):
    monkeypatch.setattr(sweep_module, "visible_gpus", lambda: ["0"])
    spec = tmp_path / "s.yaml"
    spec.write_text("base: {dataset: digits, rounds: 1, num_clients: 2, device: cpu}\ngrid: {algorithm: [fedavg, fedprox]}\n")
    stand_ins.delays = [0.2, 0.2]
    stream = io.StringIO()
    run_sweep(load_sweep(spec), tmp_path / "cpu", stream=stream, workers=2)
    assert stand_ins.envs == [None, None]  # on the CPU: the parent's environment, unchanged
    assert "2 to run, 2 at a time (" in stream.getvalue() and "CUDA" not in stream.getvalue()

    _on_cuda(monkeypatch)
    stand_ins.envs.clear()
    stand_ins.paths.clear()
    stream = io.StringIO()
    run_sweep(load_sweep(spec), tmp_path / "gpu", stream=stream, workers=2)  # --workers 2 on one GPU: both on it
    assert [env["CUDA_VISIBLE_DEVICES"] for env in stand_ins.envs] == ["0", "0"]
    assert "2 at a time (" in stream.getvalue() and "CUDA_VISIBLE_DEVICES 0, 2 runs a GPU)" in stream.getvalue()


def test_the_gpus_come_from_the_parents_cuda_visible_devices(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, GPU-1a2b,7")
    assert visible_gpus() == ["4", "GPU-1a2b"]  # PyTorch sees 2 of the 3 listed
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == ["0", "1"]
    cuda, cpu = SimpleNamespace(device="cuda"), SimpleNamespace(device="cpu")
    assert sweep_gpus([cpu, cuda]) == ["0", "1"] and sweep_gpus([cpu]) == []
    assert default_workers([cuda], ["0", "1"]) == 2 and default_workers([cuda], []) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert visible_gpus() == []


def test_a_share_warns_of_another_share_recorded_with_other_settings(tmp_path):
    sweep = Sweep(name="s", base={"rounds": 1}, grid={"lr": [0.1, 0.2]})
    other = {"shard": "1/2", "sweep": dataclasses.asdict(sweep), "overrides": ["rounds=5"]}
    (tmp_path / "sweep-shard-1-of-2.json").write_text(json.dumps(other))
    stream = io.StringIO()
    sweep_module._record_shard(sweep, tmp_path, [], (2, 2), [], stream)
    assert stream.getvalue().startswith(f"warning: share 1/2 ({tmp_path / 'sweep-shard-1-of-2.json'}) ran another sweep or other settings (KEY=VALUE rounds=5)")
    assert stream.getvalue().count("\n") == 1
    record = json.loads((tmp_path / "sweep-shard-2-of-2.json").read_text())
    assert (record["shard"], record["runs"], record["overrides"]) == ("2/2", [], [])
    stream = io.StringIO()
    sweep_module._record_shard(sweep, tmp_path, ["rounds=5"], (1, 2), [], stream)  # itself, and share 2 of the same sweep: none
    assert "share 2/2" in stream.getvalue() and "share 1/2" not in stream.getvalue()


def _runs(out: Path) -> dict[str, bytes]:
    return {str(p.parent.relative_to(out)): p.read_bytes() for p in sorted(out.glob("*/seed*/metrics.jsonl"))}


@pytest.mark.slow
def test_two_shares_into_one_directory_give_the_unsharded_sweep(tmp_path, capsys):
    """Share 1/2 and then 2/2 into one directory: after the first, the report shows the
    other's runs as not started; after both, every run's metrics are those of the
    unsharded sweep bit for bit, and so is the table."""
    spec = tmp_path / "s.yaml"
    spec.write_text(TINY.replace("seeds: [0, 1]", "seeds: [0]"))  # a run per cell, a cell per share
    out = tmp_path / "shared"
    assert main(["sweep", str(spec), "--out", str(out), "--shard", "1/2", "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"s: 2 cells x 1 seed = 2 runs, share 1/2: 1 run -> {out}\n")
    assert "share 1/2 done; the table has the runs of every share" in printed
    assert sorted(_runs(out)) == ["algorithm-fedavg/seed0"]
    assert main(["report", str(out), "--markdown"]) == 0
    table = capsys.readouterr().out
    assert table.count("| 1 completed |") == 1 and table.count("| 1 not started |") == 1
    assert main(["sweep", str(spec), "--out", str(out), "--shard", "2/2", "--workers", "2"]) == 0
    capsys.readouterr()
    assert main(["sweep", str(spec), "--out", str(tmp_path / "whole"), "--workers", "2"]) == 0
    capsys.readouterr()
    assert _runs(out) == _runs(tmp_path / "whole") and len(_runs(out)) == 2
    assert sweep_report(out) == sweep_report(tmp_path / "whole") and sweep_report(out).count("| 1 completed |") == 2
    assert (out / "results.md").read_text().strip() == sweep_report(out)
    merged, whole = (json.loads((d / "results.json").read_text()) for d in (out, tmp_path / "whole"))
    assert merged["cells"] == whole["cells"] and merged["shard"] == "2/2" and "shard" not in whole
    records = [json.loads((out / f"sweep-shard-{i}-of-2.json").read_text()) for i in (1, 2)]
    assert [r["runs"] for r in records] == [["algorithm=fedavg seed 0"], ["algorithm=fedprox seed 0"]]
    assert all(r["failed"] == [] and r["finished"] for r in records)
    assert main(["sweep", str(spec), "--out", str(out), "--shard", "1/2"]) == 0  # done: reused
    assert "the 1 run done before, reused" in capsys.readouterr().out


def _wait_for(process: subprocess.Popen, text: str, timeout: float = 120) -> None:
    seen = []
    for line in process.stdout:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"{text!r} not printed; output: {''.join(seen)}")


@pytest.mark.slow
def test_an_interrupted_share_resumes_its_own_runs_only(tmp_path):
    """Share 1/2 stopped by SIGINT after its first run: run again, it reruns its missing
    run only, and leaves alone what another share has in the directory (here a run of
    share 2 that has not written its summary yet, which the share that runs it would
    start anew)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(TINY.replace("rounds: 1", "rounds: 2"))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "contrafl", "sweep", str(spec), "--out", str(out), "--shard", "1/2", "--workers", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _wait_for(process, "[1/2] algorithm=fedavg seed 0: test acc")
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and err.strip().startswith("contrafl: sweep interrupted by SIGINT: 1 of 2 runs done"), err
    first = (out / "algorithm-fedavg" / "seed0" / "metrics.jsonl").read_bytes()
    theirs = out / "algorithm-fedavg" / "seed1"
    theirs.mkdir(parents=True)
    (theirs / "started.txt").write_text("share 2 is running this\n")
    again = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "1 done before, reused; 1 to run" in again.stdout and again.stdout.count("] algorithm=") == 1
    assert "[2/2] algorithm=fedprox seed 0: test acc" in again.stdout
    assert (out / "algorithm-fedavg" / "seed0" / "metrics.jsonl").read_bytes() == first
    assert (theirs / "started.txt").is_file() and not (out / "algorithm-fedprox" / "seed1").exists()
    assert sweep_report(out).count("| 1 completed, 1 not started |") == 2
