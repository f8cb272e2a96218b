"""Stopping a run cleanly on SIGINT, SIGTERM and SIGHUP, at a safe point.

Ctrl-C (SIGINT), schedulers and ``timeout`` (SIGTERM) and closed terminals (SIGHUP) ask a
run to stop. A handler that raises where the signal lands can lose the request: Python
reports and swallows an exception raised in an at-fork hook, a finalizer or a callback.
Raised in logging's lock release while the parallel executor forked its workers, it
printed ``Exception ignored in: <function _releaseLock ...>`` and the run went on to its
last round. Schedulers send SIGTERM once, so a lost request is a run killed later with
no record of its stop.

Within :func:`interrupts` the handlers only record the request. The run acts on it at
its safe points, :func:`stop_point` (before each round; every fraction of a second
while the parallel executor waits for its workers), by raising :class:`Interrupted`, a
``KeyboardInterrupt``, so one ``except KeyboardInterrupt`` path records the run as
interrupted and keeps what it computed; a request still pending when the block ends is
raised there. A second Ctrl-C raises at once, wherever it lands, for a user who will not
wait for the next safe point (were that one swallowed, the recorded request still stops
the run at the next safe point). Signals that are ignored when the block starts (SIGHUP
under ``nohup``) stay ignored.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
from collections.abc import Iterator

POLL_S = 0.1  # how often a process waiting for its workers looks for a stop request (a stop's latency)
HANDLED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))  # no SIGHUP on Windows

_requested: int | None = None  # the signal of the first stop request not yet acted on
_depth = 0  # how many interrupts() blocks the main thread is in


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


def stop_point() -> None:
    """A safe point of the run: raise :class:`Interrupted` if a stop was requested."""
    if _requested is not None:
        raise Interrupted(_requested)


def _record(signum: int, frame: object) -> None:
    """The handler within :func:`interrupts`: record the first request; a second Ctrl-C
    raises at once (never while the outermost block restores the handlers)."""
    global _requested
    if _requested is None:
        _requested = signum
    elif signum == signal.SIGINT and _depth > 0:
        raise Interrupted(signum)


@contextlib.contextmanager
def interrupts() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP request a stop, which
    :func:`stop_point` and the end of the block raise as :class:`Interrupted` (in the main
    thread; elsewhere the block runs unchanged: only the main thread may set handlers).
    Blocks nest: a request made in an inner block stops the outer one too."""
    global _requested, _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _record) for s in HANDLED if signal.getsignal(s) is not signal.SIG_IGN}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for s, old in previous.items():
            signal.signal(s, old)  # first runs the handler of a signal that has just arrived
        requested = _requested
        if _depth == 0:
            _requested = None
    if requested is not None:
        raise Interrupted(requested)


def detach_from_signals() -> None:
    """In a worker process: leave SIGINT, SIGTERM and SIGHUP (and a stop requested before
    the fork) to the parent, which stops the workers itself, and (on Linux) die with the
    parent even when it is killed with SIGKILL, instead of training on as an orphan."""
    global _requested
    for s in HANDLED:
        signal.signal(s, signal.SIG_IGN)
    _requested = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
