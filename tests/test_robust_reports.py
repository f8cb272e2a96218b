"""#56: what robustness runs measure in the reports (the backdoor's success rate as a
family of its own, lower is better; the aggregators' precision and recall in finding the
attackers, with intervals over seeds), and the shipped robustness sweeps are valid."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import check_screenshot, chromium_screenshot
from contrafl.cli import main
from contrafl.experiments.report import read_run, report
from contrafl.experiments.stats import interval
from contrafl.metrics.history import mean_std

pytestmark = pytest.mark.usefixtures("one_thread")

ROBUST = Path(__file__).resolve().parents[1] / "experiments" / "robust"
REPLACEMENT = {"name": "model_replacement", "rounds": [3]}


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    """A sweep's output directory: FedAvg on digits under the mean and norm bounding,
    without attack and with model replacement in the last round, seeds 0 and 1 (run in
    this process as the sweep's suite, then recorded as the sweep)."""
    from contrafl.experiments.spec import SUITE_RECORD, Sweep
    from contrafl.experiments.suite import run_suite
    from contrafl.experiments.sweep import _record

    sweep = Sweep(
        name="robust digits",
        base={"dataset": "digits", "rounds": 3, "num_clients": 5, "local_epochs": 1, "optimizer": "adam", "lr": 0.003,
              "executor": "sequential"},
        grid={"aggregator": ["mean", "norm_bound"], "attack": ["none", REPLACEMENT]},
        seeds=[0, 1],
    )
    out = tmp_path_factory.mktemp("robust") / "sweep"
    run_suite(sweep.suite(), out, log=lambda _: None)
    (out / SUITE_RECORD).unlink()
    _record(sweep, out, [])
    return out


CELLS = {
    ("mean", "none"): "aggregator=mean attack=none",
    ("mean", "replace"): "aggregator=mean attack=model_replacement(rounds=[3])",
    ("norm_bound", "none"): "aggregator=norm_bound attack=none",
    ("norm_bound", "replace"): "aggregator=norm_bound attack=model_replacement(rounds=[3])",
}


def _run(sweep_dir: Path, cell: tuple[str, str], seed: int) -> Path:
    from contrafl.experiments.spec import run_path

    return run_path(sweep_dir, CELLS[cell], seed)


def _rows(sweep_dir: Path, cell: tuple[str, str], seed: int) -> list[dict]:
    return read_run(_run(sweep_dir, cell, seed))[1]


def _detection(rows: list[dict], key: str) -> float | None:
    """A run's mean over its rounds of the aggregator's ``key`` (precision or recall)."""
    values = [r["aggregator"][key] for r in rows if r.get("aggregator", {}).get(key) is not None]
    return sum(values) / len(values) if values else None


def _table(text: str, title: str) -> list[list[str]]:
    """The cells of the markdown table under the bold title starting with ``title``."""
    match = re.search(rf"\*\*{re.escape(title)}[^\n]*\*\*\n\n((?:\|.*\n?)+)", text)
    assert match, f"no table {title!r} in {text}"
    lines = [line for line in match.group(1).strip().splitlines() if not line.startswith("|---")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_the_sweep_table_shows_backdoor_success_precision_and_recall(sweep_dir, capsys):
    assert main(["report", str(sweep_dir), "--markdown"]) == 0
    text = capsys.readouterr().out
    header, *body = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[:6] if not line.startswith("|---")]
    assert header == ["aggregator", "attack", "metric", "final (%)", "best (%)", "best rounds", "client std (%)",
                      "backdoor success (%)", "precision (%)", "recall (%)", "seeds", "runs"]
    rows = {(r[0], r[1]): dict(zip(header, r)) for r in body}

    def cell(values: list[float]) -> str:
        mean, std = mean_std(values)
        return f"{100 * mean:.2f} ± {100 * std:.2f}"

    clean = rows["mean", "none"]
    assert [clean[k] for k in ("backdoor success (%)", "precision (%)", "recall (%)")] == ["-", "-", "-"]
    replaced = rows["mean", "model_replacement(rounds=[3])"]
    assert replaced["backdoor success (%)"] == cell([_rows(sweep_dir, ("mean", "replace"), s)[-1]["backdoor_success"] for s in (0, 1)])
    assert replaced["precision (%)"] == "-"  # the mean flags no client
    bounded = rows["norm_bound", "model_replacement(rounds=[3])"]
    runs = [_rows(sweep_dir, ("norm_bound", "replace"), s) for s in (0, 1)]
    assert bounded["backdoor success (%)"] == cell([r[-1]["backdoor_success"] for r in runs])
    assert bounded["recall (%)"] == cell([_detection(r, "recall") for r in runs])


def test_backdoor_success_is_a_family_of_its_own_where_lower_is_better(sweep_dir, capsys):
    assert main(["report", str(sweep_dir), "--markdown"]) == 0
    text = capsys.readouterr().out
    accuracy = _table(text, "Global model: test accuracy")
    assert len(accuracy) == 5 and "rounds to target" in accuracy[0]  # every cell, as before
    backdoor = _table(text, "Backdoor: the global model's attack success rate (lower is better for the defender)")
    header, *rows = backdoor
    assert header == ["configuration", "seeds", "final (%) [95% CI]", "lowest (%) [95% CI]",
                      f"Δ final vs {CELLS['mean', 'replace']} (pp) [95% CI]", "excludes 0"]  # no target to reach
    assert [r[0] for r in rows] == [CELLS["mean", "replace"], CELLS["norm_bound", "replace"]]
    runs = {s: _rows(sweep_dir, ("norm_bound", "replace"), s) for s in (0, 1)}
    base = {s: _rows(sweep_dir, ("mean", "replace"), s) for s in (0, 1)}
    lowest = [min(r["backdoor_success"] for r in rows_ if "backdoor_success" in r) for rows_ in runs.values()]
    assert rows[1][1] == "0, 1" and rows[1][3] == interval(lowest).text()
    diff = interval([runs[s][-1]["backdoor_success"] - base[s][-1]["backdoor_success"] for s in (0, 1)])
    assert rows[1][4] == diff.text(signed=True) and rows[0][4] == "(baseline)"


def test_the_detection_table_has_intervals_over_seeds(sweep_dir, capsys):
    assert main(["report", str(sweep_dir), "--markdown"]) == 0
    header, *rows = _table(capsys.readouterr().out, "Attackers found by the aggregator")
    assert header == ["configuration", "seeds", "aggregator", "attack", "flagged a round", "precision (%) [95% CI]", "recall (%) [95% CI]"]
    by_label = {r[0]: r for r in rows}
    assert set(by_label) == {CELLS["norm_bound", "none"], CELLS["norm_bound", "replace"]}  # the mean flags no client
    runs = [_rows(sweep_dir, ("norm_bound", "replace"), s) for s in (0, 1)]
    bounded = by_label[CELLS["norm_bound", "replace"]]
    assert bounded[:4] == [CELLS["norm_bound", "replace"], "0, 1", "norm_bound", "model_replacement"]
    precision = [p for p in (_detection(r, "precision") for r in runs) if p is not None]
    assert precision and bounded[5] == interval(precision).text()
    assert bounded[6] == interval([_detection(r, "recall") for r in runs]).text()
    assert by_label[CELLS["norm_bound", "none"]][6] == "-"  # no attacker to find


def test_the_run_table_adds_robustness_columns_only_for_attacked_runs(sweep_dir):
    clean = _run(sweep_dir, ("mean", "none"), 0)
    plain = report([clean])
    assert plain.splitlines()[0].split() == ["run", "status", "algorithm", "rounds", "metric", "final", "best", "executor"]
    attacked = _run(sweep_dir, ("norm_bound", "replace"), 1)
    text = report([clean, attacked], markdown=True)
    header, _, first, second = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    assert header == ["run", "status", "algorithm", "rounds", "metric", "final", "best", "aggregator", "attack",
                      "precision", "recall", "backdoor success", "executor"]
    assert first[7:12] == ["mean", "none", "-", "-", "-"]
    rows = read_run(attacked)[1]
    assert second[7:12] == ["norm_bound", "model_replacement", f"{_detection(rows, 'precision'):.4f}",
                            f"{_detection(rows, 'recall'):.4f}", f"{rows[-1]['backdoor_success']:.4f}"]


def test_runs_without_attack_get_no_robustness_tables(sweep_dir):
    from contrafl.experiments.comparison import detection_table, family_tables
    from contrafl.experiments.groups import group_runs

    groups = group_runs([_run(sweep_dir, ("mean", "none"), s) for s in (0, 1)])
    assert [t.metric.key for t in family_tables(groups)] == ["test_acc"] and detection_table(groups) is None


def test_rows_that_name_no_client_still_give_precision_and_recall():
    """``sampling=secret``: rows without ``attackers`` and ``flagged``."""
    from contrafl.experiments.report import robustness

    rows = [{"round": 1, "aggregator": {"precision": 1.0, "recall": 0.5}},
            {"round": 2, "aggregator": {"precision": None, "recall": 0.0}}, {"round": 3}]
    found = robustness({"aggregator": {"name": "krum", "f": 1}, "attack": {"name": "alie", "fraction": 0.2}}, rows)
    assert (found.aggregator, found.attack, found.precision, found.recall) == ("krum", "alie", 1.0, 0.25)
    assert found.flagged is None and found.backdoor_success is None
    assert robustness({"aggregator": "mean", "attack": "none"}, rows) is None and robustness({}, []) is None


def test_update_blocks_carry_the_robustness_tables(sweep_dir, tmp_path):
    page = tmp_path / "results.md"
    page.write_text(f"# Robustness\n\n<!-- report {sweep_dir} -->\nold\n<!-- end report -->\n")
    assert main(["report", "--update", str(page)]) == 0
    text = page.read_text()
    assert "old" not in text and "| backdoor success (%) | precision (%) | recall (%) |" in text
    assert "**Backdoor: the global model's attack success rate" in text and "**Attackers found by the aggregator" in text


def test_the_html_page_shows_robustness_in_headless_chromium(sweep_dir, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(sweep_dir), "--html", str(out)]) == 0
    page = out.read_text()
    assert re.findall(r'alt="([^"]*) per round"', page) == ["test acc", "backdoor success"]  # never on one axis
    assert page.index("<h2>Accuracy per round</h2>") < page.index("<h2>Attack success per round</h2>")
    assert "Attackers found by the aggregator" in page and "lower is better for the defender" in page
    assert "<th>precision (%)</th><th>recall (%)</th><th>backdoor success (%)</th>" in page  # the runs' table
    png = tmp_path / "shot.png"
    dom = chromium_screenshot(out, png, tmp_path, size=(1200, 2400))
    assert "Backdoor: the global model" in dom and "Attackers found by the aggregator" in dom
    check_screenshot(png, size=(1200, 2400))


# -- the shipped configurations --------------------------------------------------------


@pytest.mark.parametrize("path", sorted(ROBUST.glob("*.yaml")), ids=lambda p: p.name)
def test_every_robustness_sweep_is_valid(path):
    """Every cell resolves (aggregators' f against the clients, attacks' options), and
    each algorithm x attack is prepared (an attack an algorithm refuses, such as a label
    attack on a self-supervised one, is an error there) where the data are here."""
    from contrafl.engine.setup import check_data_dir, prepare, resolve
    from contrafl.errors import ConfigError
    from contrafl.experiments.sweep import load_sweep

    sweep = load_sweep(path)
    suite = sweep.suite()
    assert len(sweep.seeds) >= (2 if path.name.startswith("reduced_") else 3)  # the grids: 3 seeds; intervals need 2
    assert "aggregator" in sweep.grid and "attack" in sweep.grid
    setups = {}
    for cell in suite.methods:
        cfg = resolve(suite.config(cell, sweep.seeds[0]))
        assert cfg.attack.name == "none" or cfg.attack.options["fraction"] == 0.2
        setups.setdefault((cfg.algorithm.name, cfg.attack.name), cfg)
    try:
        check_data_dir(next(iter(setups.values())))
    except ConfigError:
        pytest.skip(f"{path.name}: its data are not on this machine")
    for cfg in setups.values():
        prepare(cfg)
