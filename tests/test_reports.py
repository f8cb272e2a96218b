"""What runs report: strict JSON, per-client arrays and loss parts in metrics.jsonl, the
best round of personalised runs, `contrafl report` for every kind of run (self-supervised,
failed, stopped), `eval-repr` of runs without a global encoder, and the spectrum plot."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from contrafl.cli import format_summary, main
from contrafl.config import load_config
from contrafl.engine.run_dir import RunDir, finite, to_json
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.experiments.probe import _spectrum_record
from contrafl.experiments.report import report
from contrafl.experiments.suite import _final_line
from conftest import strict_json

FAST = ["rounds=2", "local_epochs=1", "num_clients=4", "executor=sequential"]


def run(tmp_path, name: str, *overrides: str) -> Simulation:
    sim = Simulation(prepare(load_config(None, [*FAST, *overrides])), RunDir(tmp_path / name))
    sim.run()
    return sim


def test_strict_json_writes_null_for_non_finite_numbers():
    obj = {"a": float("nan"), "b": [1.0, float("inf"), {"c": -float("inf")}], "d": (2, 3.5), "e": "x"}
    assert finite(obj) == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, 3.5], "e": "x"}
    assert strict_json(to_json(obj)) == finite(obj)


def test_fedproto_writes_strict_json(tmp_path):
    """FedProto's prototype scores have no loss: its personal_loss is left out, not NaN,
    and both files parse with a parser that rejects NaN and Infinity (every algorithm's
    files are parsed so by tests/test_flower_client.py)."""
    run(tmp_path, "proto", "algorithm=fedproto", "test_fraction=0.25")
    summary = strict_json((tmp_path / "proto" / "summary.json").read_text())
    rows = [strict_json(line) for line in (tmp_path / "proto" / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and "personal_loss" not in summary["final"]
    assert all("personal_loss" not in r and r["client_loss"] == [None] * 4 and None not in r["client_acc"] for r in rows)


def test_the_last_lines_name_each_metric_family_as_the_tables_do():
    """A run's last line and a suite's line of a finished run give every family the run
    evaluated, in the words of :data:`~contrafl.experiments.report.METRICS` and
    ``ATTACK_METRICS``; a representation suite its kNN accuracy only."""
    final = {"test_acc": 0.5, "knn_acc": 0.25, "backdoor_success": 0.125, "personal_backdoor_success": 0.0625}
    summary = {"rounds_completed": 3, "wall_time_s": 1.0, "final": final, "best_knn_acc": 0.25, "best_knn_round": 3,
               "bytes_total": {"down": {}, "up": {}}}
    line = format_summary(summary)
    assert "final test accuracy 0.5000" in line and "; backdoor success 0.1250; client backdoor success 0.0625;" in line
    assert _final_line(SimpleNamespace(metric="final"), summary) == (
        "final test accuracy 0.5000, final kNN accuracy 0.2500, final backdoor success 0.1250, final client backdoor success 0.0625")
    assert _final_line(SimpleNamespace(metric="representation"), summary) == "final kNN accuracy 0.2500"
    assert _final_line(SimpleNamespace(metric="final"), {"final": {}}) == "no evaluated accuracy"


def test_per_client_arrays_and_the_best_round_of_personalised_runs(tmp_path):
    sim = run(tmp_path, "ditto", "algorithm=ditto", "test_fraction=0.25", "rounds=3")
    rows = [strict_json(line) for line in (tmp_path / "ditto" / "metrics.jsonl").read_text().splitlines()]
    test_rows = sim.setup.partition.test
    for row in rows:
        assert row["client_n"] == [len(r) for r in test_rows]
        accs, ns, losses = row["client_acc"], row["client_n"], row["client_loss"]
        # the aggregates are the formulas of these arrays
        assert row["personal_acc"] == pytest.approx(sum(a * n for a, n in zip(accs, ns)) / sum(ns), abs=1e-12)
        assert row["personal_loss"] == pytest.approx(sum(v * n for v, n in zip(losses, ns)) / sum(ns), abs=1e-12)
        mean = sum(accs) / len(accs)
        assert row["personal_acc_std"] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in accs) / len(accs)), abs=1e-12)
        assert all(round(a * n) == pytest.approx(a * n, abs=1e-9) for a, n in zip(accs, ns))  # counts of correct samples
    summary = strict_json((tmp_path / "ditto" / "summary.json").read_text())
    best = max(rows, key=lambda r: r["personal_acc"])
    assert summary["best_personal_round"] == best["round"] and not any(k.startswith("client_") for k in summary["final"])
    line = format_summary(summary)
    assert f"best {best['personal_acc']:.4f} ± {best['personal_acc_std']:.4f} (round {best['round']})" in line
    table = report([tmp_path / "ditto"]).splitlines()
    assert table[0].split()[4:7] == ["metric", "final", "best"]
    assert f"{best['personal_acc']:.4f}±{best['personal_acc_std']:.4f} (round {best['round']})" in table[1]
    # the per-client view: one line per client with the arrays' values, and the spread
    text = report([tmp_path / "ditto"], clients=True)
    section = text.split("\n\n")[1].splitlines()
    final = rows[-1]
    worst = min(final["client_acc"])  # 4 clients: the worst 10% is the worst client
    assert f"worst 10% {worst:.4f}" in section[0] and f"best round {best['round']}" in section[0]
    for cid, line in enumerate(section[2:]):
        assert line.split() == [str(cid), str(final["client_n"][cid]), f"{final['client_acc'][cid]:.4f}",
                                f"{final['client_loss'][cid]:.4f}", f"{best['client_acc'][cid]:.4f}"]


@pytest.mark.slow
def test_loss_parts_are_logged_per_round(tmp_path):
    """Each scalar statistic of the local loss, summed over the round's steps and divided
    by them as the total is: MOON's CE and contrastive term add up to its loss."""
    sim = run(tmp_path, "moon", "algorithm=moon", "algorithm.mu=2")
    first, second = sim.history
    assert set(first["loss_parts"]) == {"ce"}  # round 1 has no previous model: CE only
    assert first["loss_parts"]["ce"] == pytest.approx(first["train_loss"], rel=1e-6)
    assert set(second["loss_parts"]) == {"ce", "con"}
    assert second["loss_parts"]["ce"] + 2 * second["loss_parts"]["con"] == pytest.approx(second["train_loss"], rel=1e-5)
    ssl = run(tmp_path, "fedu2", "algorithm=fedu2", "algorithm.predictor_hidden=32", "batch_size=32")
    parts = ssl.history[-1]["loss_parts"]
    assert set(parts) == {"align", "uniformity"}
    assert parts["align"] + ssl.algorithm.params.lam_u * parts["uniformity"] == pytest.approx(ssl.history[-1]["train_loss"], rel=1e-5)


def test_report_lists_self_supervised_failed_and_stopped_runs(tmp_path, capsys):
    run(tmp_path, "ssl", "algorithm=fedsimclr")
    run(tmp_path, "avg", "algorithm=fedavg")
    # a run that failed in its first round: no metrics.jsonl, a summary with the error
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.yaml").write_text((tmp_path / "avg" / "config.yaml").read_text())
    (bad / "summary.json").write_text(json.dumps({"status": "failed", "error": "RuntimeError: boom", "rounds_completed": 0}))
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "summary.json").write_text(json.dumps({"status": "interrupted", "error": "stopped by SIGTERM"}))
    rows = [strict_json(line) for line in (tmp_path / "ssl" / "metrics.jsonl").read_text().splitlines()]
    knn = rows[-1]["knn_acc"]
    assert main(["report", str(tmp_path), "--target", f"{knn - 0.01:.4f}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_name = {line.split()[0]: line.split() for line in lines[1:] if line and ":" not in line.split()[0]}
    assert set(by_name) == {"avg", "bad", "ssl", "stopped"}
    assert by_name["bad"][1] == "failed" and by_name["stopped"][1] == "interrupted"
    ssl = by_name["ssl"]
    assert ssl[4:6] == ["kNN", "acc"] and ssl[6] == f"{knn:.4f}" and ssl[-1] != "not"  # reached its own target
    assert int(ssl[-1]) <= 2
    assert "bad: failed: RuntimeError: boom" in lines and "stopped: interrupted: stopped by SIGTERM" in lines
    # named one by one, a failed run is reported too
    assert main(["report", str(bad), str(tmp_path / "avg")]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["bad", "failed"]


def test_eval_repr_of_a_run_without_a_global_encoder(tmp_path, capsys):
    """FedProto never trains a global model: kNN evaluates the clients' local models and
    says the global encoder was not evaluated; the linear probe stops with one line;
    --clients selects the local models for kNN of any run."""
    run(tmp_path, "proto", "algorithm=fedproto", "test_fraction=0.25")
    assert main(["eval-repr", str(tmp_path / "proto"), "--protocol", "knn", "--clients", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "local models of 2 clients" in out and "global encoder is still its initialisation and was not evaluated" in out
    result = strict_json((tmp_path / "proto" / "representation" / "knn.json").read_text())
    assert result["global_trained"] is False and "acc" not in result and set(result["local"]) == {"1", "2"}
    assert main(["eval-repr", str(tmp_path / "proto"), "--protocol", "linear"]) == 2
    assert "still its initialisation (fedproto trains no global encoder)" in capsys.readouterr().err
    run(tmp_path, "avg", "algorithm=fedavg")
    assert main(["eval-repr", str(tmp_path / "avg"), "--protocol", "knn", "--clients", "0"]) == 0
    result = strict_json((tmp_path / "avg" / "representation" / "knn.json").read_text())
    assert result["global_trained"] is True and 0 <= result["acc"] <= 1 and set(result["local"]) == {"0"}
    assert main(["eval-repr", str(tmp_path / "avg"), "--protocol", "linear", "--clients", "0"]) == 2


def test_spectrum_marks_numerically_zero_singular_values():
    """A rank-3 representation: the other singular values are rounding noise (log -80 or
    so), not part of the curve; the record says how many are significant."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(200, 3, generator=g) @ torch.randn(3, 16, generator=g)
    record = _spectrum_record(features)
    assert record["numerical_rank"] == 3
    logs = record["log_singular_values"]
    assert logs[2] > record["log_tolerance"] > logs[3]


def test_options_that_do_not_apply(capsys):
    """`contrafl list` leaves out the options an algorithm does not use, or names the
    setting under which they apply; a run that sets one gets a warning."""
    assert main(["list", "algorithms"]) == 0
    out = capsys.readouterr().out
    block = out.split("  fedsimclr")[1].split("\n  fedbyol")[0]
    assert "algorithm.temperature" in block and "algorithm.ema" not in block and "predictor_hidden" not in block
    assert "share_target" not in block
    byol = out.split("\n  fedbyol")[1].split("\n  fedsimsiam")[0]
    assert "algorithm.ema" in byol and "temperature" not in byol
    fedu2 = out.split("\n  fedu2")[1].split("\n  ldawa")[0]
    assert "algorithm.temperature=0.07" in fedu2 and "(with algorithm.method=simclr)" in fedu2
    # setting one is a warning (a sweep may set an option for several methods)
    warnings = prepare(load_config(None, ["algorithm=fedsimclr", "algorithm.ema=0.9"])).warnings
    assert any("algorithm.ema=0.9 has no effect on fedsimclr: it applies only with method=byol" in w for w in warnings)
    warnings = prepare(load_config(None, ["algorithm=fedu2", "algorithm.temperature=0.5"])).warnings
    assert any("it applies only with algorithm.method=simclr" in w for w in warnings)
    assert not any("no effect" in w for w in prepare(load_config(None, ["algorithm=fedbyol", "algorithm.ema=0.9"])).warnings)


def test_run_takes_options_named_by_the_algorithm_as_compare_does():
    cfg = load_config(None, ["algorithm=fedcrl", "fedcrl.lam=2", "FedCRL.temperature=0.2"])
    assert cfg.algorithm.options == {"lam": "2", "temperature": "0.2"}
    with pytest.raises(Exception, match="the run's algorithm NAME, here fedavg .to run fedcrl: algorithm=fedcrl fedcrl.lam=2"):
        load_config(None, ["fedcrl.lam=2"])


def test_suite_methods_are_case_insensitive(tmp_path):
    from contrafl.experiments.suite import load_suite, run_suite

    path = tmp_path / "s.yaml"
    path.write_text("name: s\nmethods: {FedAvg: {algorithm: fedavg}, MOON: {algorithm: moon}}\nseeds: [0]\n")
    results = run_suite(load_suite(path), tmp_path / "out", FAST, ["moon"], log=lambda _: None)
    assert (tmp_path / "out" / "MOON" / "seed0" / "summary.json").is_file()
    assert not (tmp_path / "out" / "FedAvg").exists() and results["methods"]["MOON"]["seeds"] == 1
    with pytest.raises(Exception, match="unknown method 'mooon' in s .did you mean 'MOON'"):
        run_suite(load_suite(path), tmp_path / "out", FAST, ["mooon"], log=lambda _: None)


def test_a_copy_inside_a_run_is_not_a_run(tmp_path, capsys):
    """#35: MLflow's artifact copy of a tracked run (RUN/mlflow/artifacts/ID/artifacts)
    holds the run's files; `contrafl report` lists the run once, and a directory of runs
    beside it are all listed."""
    from contrafl.experiments.report import find_runs

    run(tmp_path / "runs", "avg", "algorithm=fedavg")
    avg = tmp_path / "runs" / "avg"
    copy = avg / "mlflow" / "artifacts" / "1" / "0123abcd" / "artifacts"
    copy.mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        (copy / name).write_bytes((avg / name).read_bytes())
    other = tmp_path / "runs" / "later" / "seed0"  # a run whose parent is not a run
    other.mkdir(parents=True)
    (other / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    assert [name for _, name in find_runs([tmp_path / "runs"])] == ["avg", "later/seed0"]
    assert main(["report", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["avg", "later/seed0"]
    # named itself, the copy is still a run directory
    assert [name for _, name in find_runs([copy])] == ["artifacts"]


def test_single_seed_numbers_have_no_std():
    """#35: one seed is `61.78`, not `61.78 ± 0.00`, in suite and sweep tables."""
    from contrafl.experiments.report import mean_pm, pm
    from contrafl.experiments.suite import Suite, format_table
    from contrafl.experiments.sweep import Sweep, format_table as sweep_table

    assert pm(0.6178, 0.0, 1) == "61.78" and pm(0.6178, 0.0042, 2) == "61.78 ± 0.42" and mean_pm([0.5, 0.7]) == "60.00 ± 10.00"
    suite = Suite(name="s", base={}, methods={"fedavg": {}})
    one = {"seeds": 1, "seed_list": [3], "test_acc": [0.6178], "test_acc_mean": 0.6178, "test_acc_std": 0.0,
           "test_acc_last_mean": 0.6, "test_acc_last_rounds": 3}
    table = format_table(suite, {"methods": {"fedavg": one}, "target": None}, detailed=True)
    assert "| fedavg | 61.78 | 3 | 61.78 | 60.00 |" in table and "±" not in table
    assert "| mean of last 3 rounds |" in table
    best = Suite(name="s", base={}, methods={"ditto": {}}, metric="best")
    entry = {"seed_list": [0], "best_acc": [0.5], "best_acc_mean": 0.5, "best_acc_seed_std": 0.0, "best_client_std": 0.1, "best_round": [2]}
    assert "| ditto | 50.00 | 10.00 |" in format_table(best, {"methods": {"ditto": entry}})
    sweep = Sweep(name="w", base={}, grid={"lr": [0.1]})
    cell = {"settings": {"lr": 0.1}, "seeds": [0], "status": {"0": "completed"}, "metric": "test_acc", "final": [0.5],
            "best": [0.6], "best_round": [2], "final_mean": 0.5, "final_std": 0.0, "best_mean": 0.6, "best_std": 0.0}
    row = sweep_table(sweep, {"axes": ["lr"], "cells": {"lr=0.1": cell}}).splitlines()[2]
    assert "| 50.00 | 60.00 |" in row and "±" not in row
