"""No process outlives its deployment.

A Flower deployment is a tree of processes that is not one process group: flwr starts
the SuperLink's ``flower-superexec`` in a session of its own, which starts each
``flwr-serverapp``; a SuperNode starts contrafl's runner, which starts the client's
worker. A process whose parent dies is adopted by init, out of reach of a
``killpg`` of its former group. Three things keep the tree whole (Linux; elsewhere
only the first):

* **A mark.** :class:`~contrafl.flower.launch.LocalDeployment` starts every process
  with :data:`MARK` ``=<workdir>|<nonce>`` in its environment. flwr and contrafl pass
  their environment on to every process they start, so :func:`marked` finds the whole
  deployment in ``/proc`` whoever its parents are now: :meth:`LocalDeployment.stop`
  ends what is left, and a deployment of the same ``workdir`` started later (a resume)
  ends what an earlier one, killed with its parent, left behind.
* **Death with the parent.** :func:`die_with_parent` (``PR_SET_PDEATHSIG``) makes the
  kernel signal a process when its parent exits, however it exits (SIGKILL too): the
  SuperLink and the SuperNodes die with ``contrafl deploy``, the runner with its
  SuperNode, the ServerApp with its SuperExec (which flwr ends when its SuperLink dies).
* **Zombies are dead.** A killed process stays in the process table until its parent
  reaps it; ``kill(pid, 0)`` still finds it. :func:`alive` reads its state instead, so
  a worker watching its SuperNode ends with it even while nobody has reaped it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

MARK = "CONTRAFL_DEPLOYMENT"
"""The environment variable that marks every process of a local deployment."""

_PR_SET_PDEATHSIG = 1


def ended(returncode: int | None) -> str:
    """How a process with ``returncode`` ended: ``was killed by SIGKILL``, ``was killed by
    signal 40`` (a real-time signal has no name) or ``exited with status 1``."""
    if returncode is None or returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """``(parent pid, state, start time in clock ticks)`` of a process from ``/proc``, or
    None when it is gone (or there is no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[19])


def alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` runs: it exists and is no zombie (and, given ``start``, it
    is the process that started then, not a later one with its pid). Without ``/proc``,
    whether ``kill(pid, 0)`` finds it."""
    stat = proc_stat(pid)
    if stat is None and not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat is not None and stat[1] not in "ZX" and (start is None or stat[2] == start)


def descendants(pid: int) -> set[tuple[int, int]]:
    """``(pid, start time)`` of every live descendant of ``pid`` (empty without ``/proc``).
    The start time tells a process from a later one that reuses its pid."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = proc_stat(int(entry.name))
        if stat is not None and stat[1] != "Z":
            children.setdefault(stat[0], []).append((int(entry.name), stat[2]))
    found: set[tuple[int, int]] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child[0])
    return found


def marked(prefix: str) -> dict[tuple[int, int], list[str]]:
    """``{(pid, start time): argv}`` of every live process whose :data:`MARK` starts
    with ``prefix`` (this process excluded)."""
    wanted = f"{MARK}={prefix}".encode()
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        try:
            environ = (entry / "environ").read_bytes()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if pid == os.getpid() or not any(var.startswith(wanted) for var in environ.split(b"\0")):
            continue
        stat = proc_stat(pid)
        if stat is not None and stat[1] not in "ZX":
            found[pid, stat[2]] = [a.decode(errors="replace") for a in argv if a]
    return found


def program(argv: list[str]) -> str:
    """The program ``argv`` runs: ``flwr-serverapp`` for ``python .../flwr-serverapp ...``,
    the module for ``python -m contrafl.flower.runner ...``."""
    if len(argv) > 2 and os.path.basename(argv[0]).startswith("python") and argv[1] == "-m":
        return argv[2]
    if len(argv) > 1 and os.path.basename(argv[0]).startswith("python") and not argv[1].startswith("-"):
        return os.path.basename(argv[1])
    return os.path.basename(argv[0]) if argv else "?"


def end(processes: Iterable[tuple[int, int]], grace: float) -> None:
    """SIGTERM to each of ``processes`` (``(pid, start time)``), SIGKILL to those still
    alive after ``grace`` seconds; returns once all are gone (or 5 s later)."""
    pending = set(processes)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid, start in pending:
            if alive(pid, start):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait
        while pending and time.monotonic() < deadline:
            pending = {p for p in pending if alive(*p)}
            if pending:
                time.sleep(0.05)
        if not pending:
            return


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux's
    ``PR_SET_PDEATHSIG``; nothing elsewhere). ``parent``: the pid the parent had (the
    caller's ``os.getpid()`` before a fork), to catch a parent that exited before the
    request: then ``sig`` comes at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def dying_with(parent: int, sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that makes the child
    :func:`die_with_parent` ``parent`` (the caller's pid)."""
    return lambda: die_with_parent(sig, parent)
