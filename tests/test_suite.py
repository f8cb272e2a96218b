"""Experiment suites: configuration, resumption, tables; every shipped suite is valid."""

import json
import re
from pathlib import Path

import pytest
import yaml

from contrafl.cli import main
from contrafl.engine.setup import resolve
from contrafl.errors import ConfigError
from contrafl.metrics.history import mean_std
from contrafl.experiments.suite import Suite, _combine, _slug, format_table, load_suite, run_suite

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


SUITES = sorted(p for p in EXPERIMENTS.rglob("*.yaml") if p.parent.name not in ("sweeps", "robust"))  # sweep files


@pytest.mark.parametrize("path", SUITES, ids=lambda p: str(p.relative_to(EXPERIMENTS)))
def test_every_shipped_suite_is_valid(path):
    suite = load_suite(path)
    assert suite.seeds and suite.methods
    for method in suite.methods:
        cfg = suite.config(method, suite.seeds[0])
        resolve(cfg)
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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FedAvg", "MOON", "curves-test_acc.png", "results.json", "results.md", "suite.json"]
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
    assert (tmp_path / "curves-test_acc.png").read_bytes()[:4] == b"\x89PNG"
    # a second call finds every run finished and only re-tabulates
    log.clear()
    again = run_suite(_tiny_suite(), tmp_path, log=log.append)
    assert log[0] == f"tiny: 2 methods x 2 seeds -> {tmp_path}"
    assert all("done before, reused" in line for line in log[1:]) and len(log) == 5
    assert again["methods"]["MOON"]["test_acc"] == finals


def test_overrides_and_errors(tmp_path):
    suite = _tiny_suite()
    cfg = suite.config("MOON", 1, ["rounds=7", "algorithm.temperature=0.2"])
    assert cfg.rounds == 7 and cfg.seed == 1 and cfg.algorithm.options == {"mu": 5, "temperature": "0.2"}
    with pytest.raises(ConfigError, match="unknown method 'moom' in tiny .did you mean 'MOON'"):
        run_suite(suite, tmp_path, methods=["moom"])
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
    """compare names a method as `contrafl report` labels it (moon.mu=5: "moon mu=5"); a
    single seed's accuracy has no interval; results.json's mean of the last rounds covers
    the rounds the runs have (2 here, not 5)."""
    assert main(["compare", "fedavg", "moon", "moon.mu=5", "rounds=2", "local_epochs=1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| fedavg |" in out and "| moon mu=5 |" in out and "| moon |" not in out and "rounds to target" in out
    assert "± 0.00" not in out and "±" not in out  # one seed: its accuracy alone
    results = json.loads((tmp_path / "results.json").read_text())
    acc = results["methods"]["moon mu=5"]["test_acc"][0]
    assert f"| moon mu=5 | 0 | {100 * acc:.2f} (n=1: interval unknown) |" in out
    cfg = (tmp_path / "moon-mu-5" / "seed0" / "config.yaml").read_text()
    assert "mu: 5.0" in cfg
    assert main(["report", str(tmp_path), "--markdown"]) == 0
    table = capsys.readouterr().out  # compare's tables by metric family, as it printed them
    assert "**Global model: test accuracy" in table and f"| moon mu=5 | 0 | {100 * acc:.2f} (n=1: interval unknown) |" in table
    assert "accuracy (ours)" not in table
    assert results["methods"]["fedavg"]["test_acc_last_rounds"] == 2
    # the report labels the runs as compare named them
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines[1:]] == ["fedavg/seed0", "moon-mu-5/seed0"]
    assert "moon mu=5" in lines[2]


def test_every_key_of_results_json_is_documented():
    """docs/sweeps.md names every key a suite's (compare, experiment) and a sweep's
    results.json hold."""
    from contrafl.experiments import suite, sweep

    doc = (Path(__file__).resolve().parents[1] / "docs" / "sweeps.md").read_text()
    keys = set()
    for module in (suite, sweep):
        source = Path(module.__file__).read_text()
        keys |= set(re.findall(r'(?:entry|per_method|per_cell|results)\["([a-z_]+)"\]', source))
        keys |= set(re.findall(r'\{"(suite|sweep|target|methods|axes|cells|seeds|seed_list|settings|status)"', source))
    keys |= {"seed_list", "target", "test_acc_last_mean", "test_acc_last_rounds", "failed"}
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, f"results.json keys not described in docs/sweeps.md: {missing}"


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


def _final(path):
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["test_acc"]


def test_changed_setting_runs_anew_and_keeps_the_old_run(tmp_path):
    suite = Suite(name="t", base={"rounds": 2, "local_epochs": 1, "num_clients": 4},
                  methods={"MOON": {"algorithm": "moon"}})
    log = []
    first = run_suite(suite, tmp_path, log=log.append)
    mu1 = first["methods"]["MOON"]["test_acc"]
    log.clear()
    second = run_suite(suite, tmp_path, ["algorithm.mu=5"], log=log.append)
    assert any("algorithm.mu: 1.0 -> 5.0" in line and "running anew" in line for line in log)
    assert second["methods"]["MOON"]["test_acc"] != mu1
    assert yaml.safe_load((tmp_path / "MOON" / "seed0" / "config.yaml").read_text())["algorithm"]["mu"] == 5.0
    previous = list((tmp_path / "MOON" / ".previous").iterdir())
    assert len(previous) == 1 and _final(previous[0]) == mu1[0]
    # asking for mu=1 again brings the earlier run back instead of training again
    log.clear()
    third = run_suite(suite, tmp_path, log=log.append)
    assert third["methods"]["MOON"]["test_acc"] == mu1
    assert any("done before, reused" in line for line in log)


def test_methods_option_merges_into_the_table(tmp_path):
    suite = _tiny_suite()
    suite.seeds = [0]
    run_suite(suite, tmp_path, methods=["MOON"], log=lambda _: None)
    results = run_suite(suite, tmp_path, methods=["FedAvg"], log=lambda _: None)
    assert results["methods"]["MOON"]["seeds"] == 1 and results["methods"]["FedAvg"]["seeds"] == 1
    table = (tmp_path / "results.md").read_text()
    assert "| MOON |" in table and "| FedAvg |" in table and "-" not in table.splitlines()[2].split("|")[2]


def _fail_in_round(monkeypatch, failing: int):
    """Make every simulation raise in (0-based) round ``failing``; the original round."""
    from contrafl.engine.simulation import Simulation

    original = Simulation.run_round

    def broken(self, t):
        if t == failing:
            raise RuntimeError("injected failure")
        return original(self, t)

    monkeypatch.setattr(Simulation, "run_round", broken)
    return original


def test_failed_run_is_not_reused_and_resumes(tmp_path, monkeypatch):
    """An exception in round 4 marks the run failed (not completed); the next suite call
    resumes it from its checkpoint, and it ends with the metrics of an unbroken run."""
    from contrafl.engine.simulation import Simulation

    suite = Suite(name="f", base={"rounds": 5, "local_epochs": 1, "num_clients": 4, "executor": "sequential"},
                  methods={"SCAFFOLD": {"algorithm": "scaffold"}})
    clean = run_suite(suite, tmp_path / "clean", log=lambda _: None)
    original = _fail_in_round(monkeypatch, 3)
    log = []
    results = run_suite(suite, tmp_path / "s", log=log.append)
    assert results["failed"] == ["SCAFFOLD seed 0"] and results["methods"]["SCAFFOLD"]["seeds"] == 0
    assert any("FAILED: RuntimeError: injected failure" in line for line in log)
    summary = json.loads((tmp_path / "s" / "SCAFFOLD" / "seed0" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "RuntimeError: injected failure"
    assert summary["rounds_completed"] == 3
    assert "injected failure" in (tmp_path / "s" / "SCAFFOLD" / "seed0" / "error.txt").read_text()
    monkeypatch.setattr(Simulation, "run_round", original)
    log.clear()
    again = run_suite(suite, tmp_path / "s", log=log.append)
    assert any("resumed after round 3" in line for line in log)
    assert again["methods"]["SCAFFOLD"]["test_acc"] == clean["methods"]["SCAFFOLD"]["test_acc"]
    a = (tmp_path / "clean" / "SCAFFOLD" / "seed0" / "metrics.jsonl").read_bytes()
    assert (tmp_path / "s" / "SCAFFOLD" / "seed0" / "metrics.jsonl").read_bytes() == a


def test_seed_override_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"--seeds 7,"):
        run_suite(_tiny_suite(), tmp_path, ["seed=7"])


def test_relative_data_dir_is_relative_to_the_suite_file(tmp_path, monkeypatch):
    folder = tmp_path / "suites" / "x"
    folder.mkdir(parents=True)
    (folder / "s.yaml").write_text(yaml.safe_dump({
        "name": "s", "base": {"dataset": "cifar10", "data_dir": "../data"}, "methods": {"A": {}},
    }))
    suite = load_suite(folder / "s.yaml")
    assert suite.base["data_dir"] == str(tmp_path / "suites" / "data")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(f"data_dir={tmp_path / 'suites' / 'data'} does not exist")):
        run_suite(suite, tmp_path / "out")


def test_suite_cli_prints_one_line_on_ctrl_c(tmp_path, capsys, monkeypatch):
    from contrafl.engine.simulation import Simulation

    def interrupted(self, t):
        raise KeyboardInterrupt

    monkeypatch.setattr(Simulation, "run_round", interrupted)
    code = main(["compare", "fedavg", "moon", "rounds=2", "local_epochs=1", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and len(err) == 1
    assert err[0].startswith("contrafl: interrupted by SIGINT during fedavg seed 0")
    summary = json.loads((tmp_path / "fedavg" / "seed0" / "summary.json").read_text())
    assert summary["status"] == "interrupted"


def test_report_update_regenerates_marked_tables(tmp_path, capsys, monkeypatch):
    suite = _tiny_suite()
    suite.seeds = [0]
    run_suite(suite, tmp_path / "s", log=lambda _: None)
    doc = tmp_path / "results.md"
    elsewhere = "<!-- report other -->\n| run on another machine |\n<!-- end report -->\n"
    figure = "<!-- figure s curves figures/s-curves.png -->\n![old](x.png)\n<!-- end figure -->\n"
    doc.write_text("# Results\n\nprose\n<!-- report s -->\n| stale | table |\n<!-- end report -->\nmore prose\n" + elsewhere + figure)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["report", "--update", str(doc)]) == 0
    assert capsys.readouterr().out.strip().endswith(
        "2 tables and figures regenerated from their run directories (s, curves of s); left as they were, no run directory here: other"
    )
    text = doc.read_text()
    assert "stale" not in text and text.startswith("# Results\n\nprose\n<!-- report s -->\n| method |")
    assert "| MOON |" in text and "<!-- end report -->\nmore prose\n" + elsewhere in text
    assert "regenerate with `contrafl report s --markdown`" in text
    assert text.endswith("<!-- figure s curves figures/s-curves.png -->\n![curves of s](figures/s-curves.png)\n<!-- end figure -->\n")
    assert (tmp_path / "figures" / "s-curves.png").read_bytes()[:4] == b"\x89PNG"
    before = text
    assert main(["report", "--update", str(doc)]) == 0
    assert doc.read_text() == before


def test_run_stopped_before_its_first_checkpoint_restarts_cleanly(tmp_path, monkeypatch):
    """A run that failed after round 1 with no checkpoint yet (checkpoint_every=5) starts
    again from round 0 and does not keep its earlier metrics rows twice."""
    from contrafl.engine.simulation import Simulation

    suite = Suite(name="c", base={"rounds": 3, "local_epochs": 1, "num_clients": 4, "executor": "sequential",
                                  "checkpoint_every": 5}, methods={"FedAvg": {"algorithm": "fedavg"}})
    run_suite(suite, tmp_path / "clean", log=lambda _: None)
    original = _fail_in_round(monkeypatch, 1)
    run_suite(suite, tmp_path / "s", log=lambda _: None)
    run = tmp_path / "s" / "FedAvg" / "seed0"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1 and not (run / "checkpoint.pt").exists()
    monkeypatch.setattr(Simulation, "run_round", original)
    log = []
    run_suite(suite, tmp_path / "s", log=log.append)
    assert any("resumed after round 0" in line for line in log)
    clean = (tmp_path / "clean" / "FedAvg" / "seed0" / "metrics.jsonl").read_bytes()
    assert (run / "metrics.jsonl").read_bytes() == clean


@pytest.mark.slow
def test_settings_and_the_best_round_table(tmp_path):
    """A suite with settings runs every method in every setting; metric best reports the
    best round's client accuracy (mean ± std over seeds) and the client std then."""
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({
        "name": "t",
        "base": {"rounds": 3, "local_epochs": 1, "num_clients": 4, "pool": True, "test_fraction": 0.25},
        "settings": {"practical": {"partition": {"name": "dirichlet", "beta": 0.1, "min_size": 5}},
                     "pathological": {"partition": {"name": "pathological", "classes_per_client": 5, "least_samples": 5}}},
        "methods": {"FedAvg": {"algorithm": "fedavg"}, "FedProto": {"algorithm": "fedproto"}},
        "metric": "best",
        "seeds": [0, 1],
    }, sort_keys=False))
    suite = load_suite(path)
    assert list(suite.methods) == ["practical / FedAvg", "practical / FedProto", "pathological / FedAvg", "pathological / FedProto"]
    # a method's options of the setting's component merge into it
    merged = _combine({"partition": {"name": "dirichlet", "beta": 0.1}}, {"partition": {"min_size": 6}, "rounds": 2})
    assert merged == {"partition": {"name": "dirichlet", "beta": 0.1, "min_size": 6}, "rounds": 2}
    results = run_suite(suite, tmp_path / "out", methods=["FedProto"], log=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["pathological-FedProto", "practical-FedProto"]
    rows = [[json.loads(x) for x in (tmp_path / "out" / "practical-FedProto" / f"seed{s}" / "metrics.jsonl").read_text().splitlines()] for s in (0, 1)]
    best = [max(r, key=lambda x: x["personal_acc"]) for r in rows]
    entry = results["methods"]["practical / FedProto"]
    assert entry["best_acc"] == [b["personal_acc"] for b in best]
    mean, std = mean_std(entry["best_acc"])
    client_std = mean_std([b["personal_acc_std"] for b in best])[0]
    table = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert table[0] == "| method | practical: Acc (%) | practical: Std | pathological: Acc (%) | pathological: Std |"
    assert f"| FedProto | {100 * mean:.2f} ± {100 * std:.2f} | {100 * client_std:.2f} |" in table[3]
    assert table[2] == "| FedAvg | - | - | - | - |"


@pytest.mark.slow
def test_representation_metric_runs_probes_and_tables_them(tmp_path):
    """metric: representation reports the last round's kNN accuracy and each probe's
    accuracy (run once per finished run and kept in its representation/ folder)."""
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({
        "name": "t",
        "base": {"rounds": 2, "local_epochs": 1, "num_clients": 3, "knn_k": 5,
                 "model": {"name": "mlp", "projection_hidden": 16, "projection_dim": 8}},
        "methods": {"FedSimCLR": {"algorithm": "fedsimclr"}},
        "metric": "representation",
        "probes": ["linear"],
        "seeds": [0, 1],
    }, sort_keys=False))
    suite = load_suite(path)
    results = run_suite(suite, tmp_path / "out", log=lambda _: None)
    entry = results["methods"]["FedSimCLR"]
    runs = [tmp_path / "out" / "FedSimCLR" / f"seed{s}" for s in (0, 1)]
    last = [json.loads((r / "metrics.jsonl").read_text().splitlines()[-1])["knn_acc"] for r in runs]
    probe = [json.loads((r / "representation" / "linear.json").read_text()) for r in runs]
    assert entry["knn"] == last and entry["linear"] == [p["acc"] for p in probe]
    assert [p["seed"] for p in probe] == [0, 1]
    table = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert table[0] == "| method | kNN (%) | LP (%) |"
    mean, std = mean_std(last)
    assert table[2].startswith(f"| FedSimCLR | {100 * mean:.2f} ± {100 * std:.2f} |")
    # a second run of the suite reuses the runs and their probes
    stamp = (runs[0] / "representation" / "linear.json").stat().st_mtime_ns
    run_suite(suite, tmp_path / "out", log=lambda _: None)
    assert (runs[0] / "representation" / "linear.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("extra, message", [
    ({"metric": "representation", "probes": ["knn"]}, "probe 'knn' is invalid"),
    ({"probes": ["linear"]}, "probes need 'metric: representation'"),
])
def test_probe_errors(tmp_path, extra, message):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "methods": {"A": {}}, **extra}))
    with pytest.raises(ConfigError, match=message):
        load_suite(path)
