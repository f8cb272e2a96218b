"""The run directory: resolved config, partition, per-round metrics, summary, checkpoint
(``checkpoint.pt`` and the client states it names in ``client-state/``).

``metrics.jsonl`` holds only quantities that are a deterministic function of the
configuration (no wall-clock times), so two runs with the same seed and config produce
identical files on the CPU; timings go to ``timing.jsonl`` and ``summary.json``. Every
JSON file is strict JSON: a non-finite number (a diverged loss) is written as ``null``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..files import append_line, refuse_link, write_atomic


def default_run_dir(algorithm: str, dataset: str, root: Path = Path("runs")) -> Path:
    """``runs/<date>-<time>-<algorithm>-<dataset>``, made unique with a suffix."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = root / f"{stamp}-{algorithm}-{dataset}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


CHECKPOINT = "checkpoint.pt"
LOCK = ".lock"


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, infinities) replaced by ``None``, in
    nested dicts, lists and tuples: what strict JSON can hold (:func:`to_json`)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def to_json(obj: Any, indent: int | None = None) -> str:
    """Strict JSON of ``obj`` (RFC 8259: no NaN or Infinity, which many parsers reject):
    non-finite floats are written as ``null``."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def read_summary(path: Path) -> dict[str, Any]:
    """``summary.json`` of a run directory, or {} (none yet)."""
    try:
        return json.loads((Path(path) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _lock(path: Path) -> tuple[Any, str]:
    """An open file holding an exclusive lock on ``path`` (None where the OS has no
    flock), which names its holder (``pid program``) until :meth:`RunDir.close` empties
    it; and the holder it named before, if any: a process that ended without closing
    the run (killed), whose lock the OS released."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: no protection against a second process
        return None, ""
    handle = open(path, "a+")  # not "w": the holder's name stays until the lock is ours
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().split()
        handle.close()
        who = f" (pid {holder[0]}, {' '.join(holder[1:])})" if len(holder) > 1 else ""
        raise ConfigError(
            f"run directory {path.parent} is in use by another contrafl process{who}; "
            "wait for it to finish or stop it, then resume"
        ) from None
    handle.seek(0)
    before = handle.read().strip()
    if before and _running(before.split()[0]):  # this process (a run dir it dropped unclosed), or the pid reused
        before = ""
    handle.seek(0)
    handle.truncate()
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "python"
    handle.write(f"{os.getpid()} {program}\n")
    handle.flush()
    return handle, before


def _running(pid: str) -> bool:
    """Whether the process ``pid`` (a number as text) exists."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass
    return True


class RunDir:
    """Writes the files of one run; never overwrites a previous run, and writes nothing
    through a symbolic link (a writer refuses a run directory that holds one).

    ``resume=True`` opens the directory of an earlier run to continue it. While the
    object lives, the directory is locked (``.lock``, released when the process ends,
    however it ends), so that two processes never write the same run; ``lock=False``
    opens it to read (the ranks of torchrun above 0, which read the run's config while
    rank 0 resumes it).
    """

    def __init__(self, path: Path, resume: bool = False, lock: bool = True) -> None:
        self.path = Path(path)
        if resume:
            if not (self.path / "config.yaml").is_file():
                raise ConfigError(f"{self.path} is not a run directory (no config.yaml); give the directory of a `contrafl run`")
        elif self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"run directory {self.path} is a file, not a folder; choose another --out")
        elif self.path.exists() and any(p.name != LOCK for p in self.path.iterdir()):  # a lock alone: a run stopped before it wrote
            raise ConfigError(
                f"run directory {self.path} already exists and is not empty; "
                f"continue it with `contrafl run --resume {self.path}`, or choose another --out"
            )
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot make the run directory {self.path} ({exc.strerror or type(exc).__name__}); choose an --out you can write"
            ) from None
        if lock:  # a writer: nothing of the run written through a link (checkpoint.pt, client-state/, ...)
            for entry in self.path.iterdir():
                refuse_link(entry)
        self._lock, before = _lock(self.path / LOCK) if lock else (None, "")
        pid, _, program = before.partition(" ")
        self.taken_over = f"took over the run directory's lock from {program or 'a process'} (pid {pid}), which ended without releasing it" if before else None
        """Set when the lock's last holder ended without closing the run (it was killed):
        a line that says so."""

    def close(self) -> None:
        """Release the directory's lock (the run is over)."""
        if self._lock is not None:
            self._lock.truncate(0)
            self._lock.close()
            self._lock = None

    def write_config(self, config: Config) -> None:
        self.write_text("config.yaml", config.to_yaml())

    def write_text(self, name: str, text: str) -> None:
        """Replace file ``name`` atomically."""
        write_atomic(self.path / name, lambda f: f.write(text.encode()))

    def write_json(self, name: str, obj: Any) -> None:
        self.write_text(name, to_json(obj, indent=2) + "\n")

    def append(self, name: str, row: dict[str, Any]) -> None:
        append_line(self.path / name, to_json(row))

    def rows(self, name: str) -> list[dict[str, Any]]:
        """The rows of the JSON-lines file ``name`` up to its first torn or non-object
        line (a crash in a write), [] when it is missing."""
        path = self.path / name
        rows = []
        for line in (path.read_text().splitlines() if path.is_file() else []):
            try:
                row = json.loads(line)
            except ValueError:
                break
            if not isinstance(row, dict):
                break
            rows.append(row)
        return rows

    def truncate(self, rounds: int, metrics: list[dict[str, Any]]) -> None:
        """Cut the per-round files back to the first ``rounds`` rounds (a resumed run
        recomputes the later ones): ``metrics.jsonl`` is rewritten from ``metrics``,
        ``timing.jsonl`` keeps its rows of those rounds."""
        self.write_text("metrics.jsonl", "".join(to_json(row) + "\n" for row in metrics))
        timing = self.path / "timing.jsonl"
        if timing.is_file():
            kept = []
            for line in timing.read_text().splitlines():
                try:
                    if json.loads(line)["round"] <= rounds:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    break  # a line torn by a crash, and everything after it
            self.write_text("timing.jsonl", "".join(kept))

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT

    @property
    def client_dir(self) -> Path:
        """Client states of the checkpoints (and spilled states)."""
        return self.path / "client-state"
