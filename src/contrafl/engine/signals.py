"""Stopping a run cleanly on SIGTERM and SIGHUP, as on Ctrl-C.

Schedulers, ``timeout`` and closed terminals stop a process with SIGTERM or SIGHUP,
whose default action ends Python at once, without ``finally`` blocks: no summary, no
status. While a run is in progress they raise :class:`Interrupted` instead, a
``KeyboardInterrupt`` (which SIGINT raises), so one ``except KeyboardInterrupt`` path
records the run as interrupted and keeps what it computed.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
from collections.abc import Iterator

HANDLED = (signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by signal ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def signal_name(exc: KeyboardInterrupt) -> str:
    """``SIGTERM`` for an :class:`Interrupted`, ``SIGINT`` for a plain Ctrl-C."""
    return exc.name if isinstance(exc, Interrupted) else "SIGINT"


def exit_code(exc: KeyboardInterrupt) -> int:
    """The shell's convention: 128 + the signal's number (130 for Ctrl-C)."""
    return 128 + (exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)


@contextlib.contextmanager
def interrupts() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread
    (elsewhere the block runs unchanged: only the main thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in HANDLED}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def detach_from_signals() -> None:
    """In a worker process: leave SIGINT, SIGTERM and SIGHUP to the parent, which stops
    the workers itself, and (on Linux) die with the parent even when it is killed with
    SIGKILL, instead of training on as an orphan."""
    for s in (signal.SIGINT, *HANDLED):
        signal.signal(s, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
