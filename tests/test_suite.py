"""Experiment suites: configuration, resumption, tables; every shipped suite is valid."""

import json
import re
from pathlib import Path

import pytest
import yaml

from contrafl.cli import main
from contrafl.engine.setup import check_components
from contrafl.errors import ConfigError
from contrafl.eval.metrics import mean_std
from contrafl.eval.suite import Suite, _slug, format_table, load_suite, run_suite

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(EXPERIMENTS)))
def test_every_shipped_suite_is_valid(path):
    suite = load_suite(path)
    assert suite.seeds and suite.methods
    for method in suite.methods:
        cfg = suite.config(method, suite.seeds[0])
        check_components(cfg)
        assert cfg.seed == suite.seeds[0]


def _tiny_suite():
    return Suite(
        name="tiny",
        base={"rounds": 2, "local_epochs": 1, "num_clients": 4},
        methods={"FedAvg": {"algorithm": "fedavg"}, "MOON": {"algorithm": {"name": "moon", "mu": 5}}},
        seeds=[0, 1],
        paper={"FedAvg": "1.0", "MOON": "2.0"},
        target={"from": "FedAvg"},
    )


def test_run_suite_tables_and_resumes(tmp_path):
    log = []
    results = run_suite(_tiny_suite(), tmp_path, log=log.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FedAvg", "MOON", "curves.png", "results.json", "results.md"]
    finals = []
    for seed in (0, 1):
        rows = [json.loads(x) for x in (tmp_path / "MOON" / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
        finals.append(rows[-1]["test_acc"])
    mean, std = mean_std(finals)
    moon = results["methods"]["MOON"]
    assert moon["test_acc"] == finals and moon["test_acc_mean"] == mean and moon["test_acc_std"] == std
    assert results["target"] == results["methods"]["FedAvg"]["test_acc_mean"]
    table = (tmp_path / "results.md").read_text()
    assert f"| MOON | {100 * mean:.2f} ± {100 * std:.2f} | 2 | 2.0 |" in table
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # a second call finds every run finished and only re-tabulates
    log.clear()
    again = run_suite(_tiny_suite(), tmp_path, log=log.append)
    assert log[0] == f"tiny: 2 methods x 2 seeds -> {tmp_path}"
    assert all("skipped" in line for line in log[1:]) and len(log) == 5
    assert again["methods"]["MOON"]["test_acc"] == finals


def test_overrides_and_errors(tmp_path):
    suite = _tiny_suite()
    cfg = suite.config("MOON", 1, ["rounds=7", "algorithm.temperature=0.2"])
    assert cfg.rounds == 7 and cfg.seed == 1 and cfg.algorithm.options == {"mu": 5, "temperature": "0.2"}
    with pytest.raises(ConfigError, match="unknown method 'moon'"):
        run_suite(suite, tmp_path, methods=["moon"])
    bad = Suite(name="bad", base={}, methods={"A": {"algorithm": {"name": "moon", "mu": -1}}})
    with pytest.raises(ConfigError, match="algorithm.mu=-1 is invalid"):
        run_suite(bad, tmp_path)
    missing = Suite(name="m", base={"dataset": "cifar10", "data_dir": str(tmp_path / "nope")}, methods={"A": {}})
    with pytest.raises(ConfigError, match="nope does not exist"):
        run_suite(missing, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing ran
    (tmp_path / "x.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError, match="has no 'methods'"):
        load_suite(tmp_path / "x.yaml")


def test_solo_is_reported_over_clients():
    suite = Suite(name="s", base={}, methods={"SOLO": {"algorithm": "solo"}}, seeds=[0])
    results = {"methods": {"SOLO": {"seeds": 1, "personal_acc_mean": 0.4, "personal_acc_client_std": 0.05}}, "target": None}
    assert "| SOLO | 40.00 ± 5.00 (clients) | 1 |" in format_table(suite, results)


def test_compare_command(tmp_path, capsys):
    assert main(["compare", "fedavg", "moon", "moon.mu=5", "rounds=2", "local_epochs=1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| fedavg |" in out and "| moon |" in out and "rounds to" in out
    cfg = (tmp_path / "moon" / "seed0" / "config.yaml").read_text()
    assert "mu: 5.0" in cfg


def test_method_directory_names():
    assert _slug("MOON + FedAvgM (mu=5)") == "MOON-FedAvgM-mu-5"
    assert _slug("FedSiam-DA") == "FedSiam-DA"


@pytest.mark.parametrize(
    "names, message",
    [
        (["MOON (mu=5)", "MOON mu 5"], "methods 'MOON (mu=5)' and 'MOON mu 5' would share the run directory 'MOON-mu-5'"),
        (["+ +"], "method name '+ +' has no letters or digits"),
    ],
)
def test_method_names_must_give_distinct_directories(tmp_path, names, message):
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "methods": {n: {"algorithm": "fedavg"} for n in names}}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_suite(path)
