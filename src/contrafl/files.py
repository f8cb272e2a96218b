"""Crash-safe file writes, without torch or the engine (a Flower ClientApp imports this
module: each message starts a new process)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def write_atomic(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Replace ``path`` with what ``write`` writes to a binary file, surviving a crash
    at any point: a temporary file in the same directory, fsync, rename, fsync of the
    directory. A reader sees the old file or the new one, never a torn one; a write
    that fails (a full disk) leaves no temporary file behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_output(path: Path, option: str, folder: bool = True) -> Path:
    """``path``, an output folder (``folder``) or file named by the command-line
    ``option``, checked before anything is computed, and without creating anything:
    a :class:`~contrafl.errors.ConfigError` of one line when it is a file where a folder
    is wanted (or the reverse), or when the nearest folder that exists on its way
    cannot take a new entry (a read-only or virtual file system, no permission)."""
    from .errors import ConfigError

    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is a file, not a folder; choose another {option}")
    if not folder and path.is_dir():
        raise ConfigError(f"{option} {path} is a folder; give a file name, e.g. {option} {path / 'out'}")
    existing = path if folder and path.is_dir() else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option} {path}: {existing} is a file, not a folder; choose another {option}")
    try:
        probe = existing / f".contrafl-write-test-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise ConfigError(
            f"{option} {path}: cannot write in {existing} ({exc.strerror or type(exc).__name__}); choose a folder you can write"
        ) from None
    return path
