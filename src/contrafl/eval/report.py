"""``contrafl report``: a table of finished runs from their run directories."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ..errors import ContraflError
from .metrics import last_row, last_value, rounds_to_reach


def read_run(path: Path) -> tuple[dict, list[dict], dict]:
    """``(config, metrics rows, summary)`` of a run directory."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ContraflError(f"{path} is not a run directory (no metrics.jsonl); give the --out directory of `contrafl run`")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    config = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    return config, rows, summary


def report(runs: list[Path], target: float | None = None, target_from: Path | None = None) -> str:
    """Final/best accuracy per run and the rounds each needs to reach ``target``.

    With ``target_from`` the target is that run's final accuracy, as in MOON's Table 2
    ("rounds to reach the accuracy of FedAvg after 100 rounds").
    """
    if target_from is not None:
        _, rows, _ = read_run(Path(target_from))
        target = last_value(rows)
        if target is None:
            raise ContraflError(f"{target_from} has no evaluated test accuracy to use as target")
    header = ["run", "algorithm", "rounds", "final acc", "best acc", "client acc"]
    if target is not None:
        header += [f"rounds to {target:.4f}"]
    table = [header]
    for path in runs:
        config, rows, _ = read_run(Path(path))
        algo = config.get("algorithm")
        algo = algo.get("name") if isinstance(algo, dict) else algo
        accs = [r["test_acc"] for r in rows if r.get("test_acc") is not None]
        personal = last_row(rows, "personal_acc")
        line = [
            Path(path).name,
            str(algo),
            str(rows[-1]["round"] if rows else 0),
            f"{accs[-1]:.4f}" if accs else "-",
            f"{max(accs):.4f}" if accs else "-",
            f"{personal['personal_acc']:.4f}±{personal['personal_acc_std']:.4f}" if personal else "-",
        ]
        if target is not None:
            reached = rounds_to_reach(rows, target)
            line.append(str(reached) if reached is not None else "not reached")
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in table)
