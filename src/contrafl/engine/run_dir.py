"""The run directory: resolved config, partition, per-round metrics, summary, checkpoint.

``metrics.jsonl`` holds only quantities that are a deterministic function of the
configuration (no wall-clock times), so two runs with the same seed and config produce
identical files on the CPU; timings go to ``timing.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..errors import ConfigError


def default_run_dir(algorithm: str, dataset: str, root: Path = Path("runs")) -> Path:
    """``runs/<date>-<time>-<algorithm>-<dataset>``, made unique with a suffix."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = root / f"{stamp}-{algorithm}-{dataset}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


class RunDir:
    """Writes the files of one run; never overwrites a previous run."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if self.path.exists() and any(self.path.iterdir()):
            raise ConfigError(
                f"run directory {self.path} already exists and is not empty; "
                "choose another --out or remove it"
            )
        self.path.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: Config) -> None:
        (self.path / "config.yaml").write_text(config.to_yaml())

    def write_json(self, name: str, obj: Any) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, self.path / name)

    def append(self, name: str, row: dict[str, Any]) -> None:
        with open(self.path / name, "a") as f:
            f.write(json.dumps(row) + "\n")

    def save_checkpoint(self, payload: dict[str, Any]) -> None:
        tmp = self.path / ".checkpoint.pt.tmp"
        torch.save(payload, tmp)
        os.replace(tmp, self.path / "checkpoint.pt")

    @property
    def spill_dir(self) -> Path:
        return self.path / ".client-state"
