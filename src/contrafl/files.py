"""Crash-safe file writes, without torch or the engine (a Flower ClientApp imports this
module: each message starts a new process)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a link in the last place is an error (ELOOP) where the OS has the flag


def write_atomic(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Replace ``path`` with what ``write`` writes to a binary file, surviving a crash
    at any point: a temporary file in the same directory, fsync, rename, fsync of the
    directory. A reader sees the old file or the new one, never a torn one; a write
    that fails (a full disk) leaves no temporary file behind. Nothing is written through
    a symbolic link: the temporary file is made new, and a link at ``path`` is replaced,
    not followed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a file or a link left there: never written through
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def append_line(path: Path, line: str, sync: bool = False) -> None:
    """Append ``line`` and a newline to ``path`` (made if missing), never through a
    symbolic link; with ``sync``, durably (fsync) before returning."""
    path = Path(path)
    refuse_link(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | _NOFOLLOW, 0o666)
    with os.fdopen(fd, "a") as f:
        f.write(line + "\n")
        if sync:
            f.flush()
            os.fsync(f.fileno())


def refuse_link(path: Path) -> None:
    """A one-line :class:`~contrafl.errors.ConfigError` when ``path`` is a symbolic link:
    contrafl writes no file of a run through one, which could lead out of the run
    directory."""
    if Path(path).is_symlink():
        from .errors import ConfigError

        raise ConfigError(
            f"{path} is a symbolic link (to {os.readlink(path)}); contrafl writes no file of a run through a link, "
            "which could lead out of the run directory: replace it with the file itself"
        )


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
