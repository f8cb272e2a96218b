"""The command line: user errors are one line with exit status 2, never a traceback."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from contrafl.cli import main, whole_lines

SUBSET = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar-10-batches-py"


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "contrafl", *args], capture_output=True, text=True, cwd=cwd)


USER_ERRORS = [
    (["dataset=cifar11"], "unknown dataset 'cifar11' (did you mean 'cifar10'?)"),
    (["dataset=cifar10", "data_dir=/nonexistent/dir"], "data_dir=/nonexistent/dir does not exist"),
    (["dataset=cifar10"], "needs data_dir=PATH; get the files with"),
    (["partition.beta=0"], "partition.beta='0' is invalid: expected > 0"),
    (["partition.beta=-1"], "partition.beta='-1' is invalid"),
    (["num_clients=5000"], "num_clients=5000 is larger than the 1347 training samples"),
    (["algorithm=mooon"], "did you mean 'moon'"),
    (["algorithm.mu=-1", "algorithm=moon"], "algorithm.mu='-1' is invalid"),
    (["rounds=0"], "rounds='0' is invalid"),
]


@pytest.mark.parametrize("args,fragment", USER_ERRORS)
def test_user_errors(args, fragment, tmp_path, capsys):
    """Each a one-line error and exit status 2 (the command line's own process: below)."""
    assert main(["run", "--out", str(tmp_path / "r"), *args]) == 2
    assert_one_error_line(capsys.readouterr().err, fragment)


@pytest.mark.parametrize("args,fragment", [USER_ERRORS[0], USER_ERRORS[5]])  # a setting's error, and one from the data
def test_user_errors_from_the_command_lines_process(args, fragment, tmp_path):
    """`python -m contrafl run ...`: one line on stderr (no warning, no traceback), exit status 2."""
    proc = run_cli("run", "--out", str(tmp_path / "r"), *args)
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, fragment)


def assert_one_error_line(err: str, fragment: str) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("contrafl: error: ") and fragment in lines[0], err


class _Writes(io.RawIOBase):
    """A raw stream that keeps every write it is given."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.writes.append(bytes(b))
        return len(b)


def test_an_error_line_is_written_in_one_piece_under_pythonunbuffered():
    """With PYTHONUNBUFFERED=1 stderr writes through and print() writes a line's text and
    its newline apart: two torchrun ranks printing the same error ran their lines into one
    ("...without torchruncontrafl: error: ..."). The CLI's stderr writes a line at once."""
    raw = _Writes()
    unbuffered = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    print("contrafl: error: one", file=unbuffered)
    assert raw.writes == [b"contrafl: error: one", b"\n"]  # what the ranks interleaved

    raw = _Writes()
    stream = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    whole_lines(stream)
    print("contrafl: error: one", file=stream)
    print("contrafl: error: two", file=stream)
    assert raw.writes == [b"contrafl: error: one\n", b"contrafl: error: two\n"]


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


def test_a_run_collects_garbage_during_its_rounds_and_leaves_the_collector_as_it_found_it(tmp_path, monkeypatch):
    """`contrafl run` starts with the cyclic garbage collector off (its start makes long-lived
    objects only), turns it on for the rounds, and gives the process back with it on and
    nothing frozen."""
    import gc

    from contrafl.engine import setup
    from contrafl.engine.simulation import Simulation

    starts, rounds = [], []
    prepare, run = setup.prepare, Simulation.run
    monkeypatch.setattr(setup, "prepare", lambda *a, **k: starts.append(gc.isenabled()) or prepare(*a, **k))
    monkeypatch.setattr(Simulation, "run", lambda self: rounds.append((gc.isenabled(), gc.get_freeze_count() > 0)) or run(self))
    assert main(["run", "--out", str(tmp_path / "r"), "rounds=1", "local_epochs=1", "--quiet"]) == 0
    assert starts == [False] and rounds == [(True, True)]
    assert gc.isenabled() and gc.get_freeze_count() == 0


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
    assert cfg["executor"] in ("sequential", "distributed") and isinstance(cfg["workers"], int)
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
    assert "| configuration | seeds | final (%) [95% CI] |" in out  # compare's tables: one per metric family (#54)
    assert "| moon | 0 |" in out and "| fedavg | 0, 1 |" in out  # the interrupted seed is left out of the table
    assert f"regenerate with `contrafl report {tmp_path / 'c'} --markdown`" in out
    assert main(["report", str(tmp_path / "nothing")]) == 2


def test_output_cut_by_its_reader_ends_quietly():
    """`contrafl list | head -1`: the reader leaves after a line (`contrafl list` writes
    more than a pipe holds), and contrafl stops without a BrokenPipeError traceback."""
    import subprocess
    import sys

    done = subprocess.run(f"{sys.executable} -m contrafl list | head -1", shell=True, capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("algorithms") and done.stdout.count("\n") == 1
    assert done.stderr == ""


@pytest.mark.parametrize(
    "command",
    [
        ["run", "rounds=1", "--out", "{proc}/run"],
        ["run", "rounds=1", "--out", "{file}"],
        ["run", "rounds=1", "--out", "{file}/run"],
        ["run", "rounds=1", "--out", "{readonly}/run"],
        ["compare", "fedavg", "moon", "rounds=1", "--out", "{proc}/cmp"],
        ["sweep", "{sweep}", "--out", "{proc}/sweep"],
        ["deploy", "rounds=1", "--out", "{proc}/run"],
        ["report", "{tmp}", "--html", "{proc}/report.html"],
        ["report", "{tmp}", "--html", "{tmp}"],
        ["plot-repr", "{tmp}", "--out", "{proc}/tsne.png"],
        ["partition", "--out", "{readonly}/p.png"],
    ],
)
def test_an_output_path_that_cannot_be_written_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys, command):
    """--out in /proc (nothing can be made there), an existing file, a folder inside a
    file, a read-only folder (its writes fail as they would for another user than root),
    --html naming a folder: one line, exit 2, nothing written."""
    import os

    readonly = tmp_path / "readonly"
    readonly.mkdir()
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if str(self).startswith(str(readonly)):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    (tmp_path / "a-file").write_text("x")
    sweep = tmp_path / "s.yaml"
    sweep.write_text("base: {rounds: 1}\ngrid: {algorithm: [fedavg]}\n")
    places = {"proc": "/proc", "file": str(tmp_path / "a-file"), "readonly": str(readonly), "sweep": str(sweep), "tmp": str(tmp_path)}
    before = sorted(os.listdir(tmp_path))
    assert main([part.format(**places) for part in command]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("contrafl: error: --") and "\n" not in err, err
    assert sorted(os.listdir(tmp_path)) == before and not list(readonly.iterdir())


def test_a_setting_given_as_an_option_gets_the_commands_usage_and_the_way_to_write_it(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "--rounds", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: contrafl run ") and "rounds=3 instead of --rounds 3" in err


def test_help_and_list_say_what_each_choice_is(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for setting, choices in [("executor", "auto, sequential, parallel, vectorized, distributed"), ("device", "auto, cpu, cuda"), ("optimizer", "sgd, adam")]:
        line = next(line for line in text.splitlines() if line.strip().startswith(setting + " "))
        assert f"[choices: {choices}]" in line
    deadline = next(line for line in text.splitlines() if line.strip().startswith("round_deadline "))
    assert deadline.endswith("[default: none]")  # None means no deadline here, not auto (docs/unreliable.md)
    assert main(["list", "augmentations"]) == 0
    listed = capsys.readouterr().out.splitlines()[1:]
    assert listed and all(len(line.split(maxsplit=1)) == 2 for line in listed)  # a description on every line


def test_one_round_and_one_epoch_are_singular(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "run"), "rounds=1", "local_epochs=1", "num_clients=2", "executor=sequential"]) == 0
    out = capsys.readouterr().out
    assert "1 round x 1 local epoch," in out and "done: 1 round in" in out and "1 rounds" not in out


def test_the_last_line_says_privacy_lost_replies_stragglers_and_simulated_time(tmp_path, capsys):
    settings = ["rounds=2", "num_clients=3", "local_epochs=1", "algorithm=fedprox", "executor=sequential",
                "client_speed=slow:0.34,4", "round_deadline=20", "stragglers=partial", "client_dropout=0.5",
                "dp=local", "dp.clip=0.5", "dp.noise_multiplier=0.5"]
    assert main(["run", "--out", str(tmp_path / "run"), *settings]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lost = sum(len(row.get("lost", [])) for row in rows)
    partial = [c for row in rows for c in row.get("stragglers", []) if c["done"]]
    assert lost and partial  # what this test is about: the seed makes both happen
    assert sum("partial work (steps done/planned by the deadline): " in line for line in out) == sum(1 for row in rows if any(c["done"] for c in row.get("stragglers", [])))
    done = out[-1]
    assert done.startswith("done: 2 rounds in ") and ")-DP (local)" in done and f"{lost} repl" in done and "lost" in done
    assert f"{len(partial)} partial" in done and "simulated time " in done
