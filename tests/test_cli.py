"""The command line: user errors are one line with exit status 2, never a traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contrafl.cli import main

SUBSET = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar-10-batches-py"


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "contrafl", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["dataset=cifar11"], "unknown dataset 'cifar11' (did you mean 'cifar10'?)"),
        (["dataset=cifar10", "data_dir=/nonexistent/dir"], "data_dir=/nonexistent/dir does not exist"),
        (["dataset=cifar10"], "needs data_dir=PATH; get the files with"),
        (["partition.beta=0"], "partition.beta='0' is invalid: expected > 0"),
        (["partition.beta=-1"], "partition.beta='-1' is invalid"),
        (["num_clients=5000"], "num_clients=5000 is larger than the 1347 training samples"),
        (["algorithm=mooon"], "did you mean 'moon'"),
        (["algorithm.mu=-1", "algorithm=moon"], "algorithm.mu='-1' is invalid"),
        (["rounds=0"], "rounds='0' is invalid"),
    ],
)
def test_user_errors(args, fragment, tmp_path):
    proc = run_cli("run", "--out", str(tmp_path / "r"), *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("contrafl: error: ")
    assert fragment in lines[0]


def test_subset_needs_explicit_acceptance(tmp_path):
    if not SUBSET.exists():
        pytest.skip("no ../shared/data")
    proc = run_cli("run", "--out", str(tmp_path / "r"), "dataset=cifar10", f"data_dir={SUBSET}")
    assert proc.returncode == 2 and "allow_subset=true" in proc.stderr and "Traceback" not in proc.stderr


def test_run_writes_run_dir_and_prints_progress(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "r"), "rounds=2", "local_epochs=1"]) == 0
    out = capsys.readouterr().out
    assert "round 1/2" in out and "round 2/2" in out and "acc" in out and "ETA" in out
    assert "final test accuracy" in out
    assert (tmp_path / "r" / "partition.json").exists()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2


def test_list_and_help(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("fedavg", "moon", "solo", "digits", "cifar10", "dirichlet", "moon_cnn", "resnet50", "cifar100"):
        assert name in out
    proc = run_cli("run", "--help")
    assert proc.returncode == 0 and "local_epochs" in proc.stdout and "algorithm.mu" in proc.stdout
    for cmd in (["list", "--help"], ["data", "download", "--help"], ["partition", "--help"], ["report", "--help"]):
        assert run_cli(*cmd).returncode == 0


def test_partition_command_writes_heatmap(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert main(["partition", "num_clients=5", "partition.beta=0.1", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "client" in out.lower()


def test_report_rounds_to_target(tmp_path, capsys):
    for name, algo in (("a", "fedavg"), ("b", "moon")):
        assert main(["run", "--quiet", "--out", str(tmp_path / name), f"algorithm={algo}", "rounds=3", "local_epochs=1"]) == 0
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--target-from", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["run", "status", "algorithm"] and "rounds to" in lines[0]
    assert lines[1].split()[:3] == ["a", "completed", "fedavg"]
    assert 1 <= int(lines[1].split()[-1]) <= 3  # FedAvg reaches its own final accuracy by its last round


@pytest.mark.parametrize(
    "text, seeds",
    [("3", [0, 1, 2]), ("0,5,7", [0, 5, 7]), ("4,", [4]), ("1, 2", [1, 2])],
)
def test_seeds_option(text, seeds):
    from contrafl.cli import _seeds

    assert _seeds(text) == seeds


@pytest.mark.parametrize("text", ["0", "-1,2", "1,1", "x", ","])
def test_bad_seeds_are_one_line_errors(text, capsys):
    suite = Path(__file__).resolve().parents[1] / "experiments" / "reduced" / "cifar10_subset.yaml"
    assert main(["experiment", str(suite), f"--seeds={text}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--seeds {text!r}" in err[0] and "one seed: 4," in err[0]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("contrafl: error: "), err
    return err[0]


def test_settings_before_or_after_options(tmp_path, capsys):
    fast = ["local_epochs=1", "num_clients=4", "executor=sequential"]
    assert main(["run", "--out", str(tmp_path / "a"), "rounds=2", *fast, "--quiet"]) == 0
    assert main(["run", "rounds=2", "--quiet", *fast, "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()
    suite = tmp_path / "s.yaml"
    suite.write_text("name: s\nmethods: {FedAvg: {algorithm: fedavg}}\nseeds: [0, 1]\n")
    assert main(["experiment", str(suite), "--seeds", "1", "rounds=2", *fast, "--out", str(tmp_path / "e")]) == 0
    assert (tmp_path / "e" / "FedAvg" / "seed0" / "summary.json").is_file()
    assert not (tmp_path / "e" / "FedAvg" / "seed1").exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["run", "one.yaml", "--out", str(tmp_path / "c"), "extra.yaml"])
    assert info.value.code == 2 and "unrecognized arguments: extra.yaml" in capsys.readouterr().err


def test_zero_local_epochs_is_an_error(capsys):
    assert main(["run", "local_epochs=0"]) == 2
    assert "local_epochs='0' is invalid: expected >= 1" in _one_error_line(capsys)


def test_warning_for_clients_that_take_no_step(tmp_path, capsys):
    assert main(["run", "--quiet", "--out", str(tmp_path / "r"), "num_clients=60", "batch_size=32",
                 "rounds=1", "local_epochs=1", "executor=sequential"]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "clients have fewer than batch_size=32 training samples and take no local step" in err


def test_case_insensitive_names_are_recorded_canonically(tmp_path):
    assert main(["run", "--quiet", "--out", str(tmp_path / "r"), "algorithm=MOON", "optimizer=SGD",
                 "rounds=1", "local_epochs=1", "num_clients=3"]) == 0
    text = (tmp_path / "r" / "config.yaml").read_text()
    assert "name: moon" in text and "optimizer: sgd" in text


def test_config_records_the_executor_that_ran(tmp_path):
    assert main(["run", "--quiet", "--out", str(tmp_path / "r"), "rounds=1", "local_epochs=1", "num_clients=3"]) == 0
    import yaml

    cfg = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert cfg["executor"] in ("sequential", "parallel") and isinstance(cfg["workers"], int)
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["executor"] == cfg["executor"]


def test_report_shows_status_names_and_suite_directories(tmp_path, capsys):
    fast = ["rounds=2", "local_epochs=1", "num_clients=4", "executor=sequential"]
    assert main(["compare", "fedavg", "moon", *fast, "--seeds", "2", "--out", str(tmp_path / "c")]) == 0
    (tmp_path / "c" / "moon" / "seed1" / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    capsys.readouterr()
    assert main(["report", str(tmp_path / "c")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["run", "status", "algorithm"]
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["fedavg/seed0", "fedavg/seed1", "moon/seed0", "moon/seed1"]
    assert lines[4].split()[1] == "interrupted" and lines[1].split()[1] == "completed"
    assert main(["report", str(tmp_path / "c"), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| method | accuracy (ours) | seeds | per seed | mean of last 5 rounds |" in out
    assert "| moon |" in out and "| 0 |" in out  # the interrupted seed is left out of the table
    assert f"regenerate with `contrafl report {tmp_path / 'c'} --markdown`" in out
    assert main(["report", str(tmp_path / "nothing")]) == 2
