"""``contrafl-supernode``: Flower's ``flower-supernode`` (same arguments) with some of its
waits removed: ClientApps run in one process that stays alive, the SuperNode waits at
most ``CONTRAFL_SUPERNODE_POLL_S`` seconds (default :data:`POLL_S`) between its pulls of
messages from the SuperLink, and at most :data:`RETRY_S` between its attempts to reach a
SuperLink it lost.

- **Polling.** flwr 1.41's SuperNode sleeps 3 s whenever a pull finds no message (and
  0.5 s between its looks for a ClientApp's reply), both hard-coded in
  ``flwr.supernode.start_client_internal``, so a message waits 1.5 s on average, up to
  3 s, before a SuperNode sees it. This command replaces the ``time`` module of that loop
  by one whose ``sleep`` is capped at the poll interval. Every idle SuperNode then asks
  the SuperLink for messages every ``CONTRAFL_SUPERNODE_POLL_S`` seconds: right for a
  few nodes (``contrafl deploy`` starts its local SuperNodes with it); for many nodes on
  one SuperLink, a larger value.
- **A process per message.** The SuperNode starts ``flower-superexec``, which starts a
  new ``flwr-clientapp`` process for every message (about 1.3 s of CPU to import flwr,
  before contrafl's ClientApp runs). The SuperNode's start of ``flower-superexec`` is
  replaced by :mod:`contrafl.flower.runner`, which runs the ClientApp tasks in its own
  process, as ``flwr-clientapp`` does, one after another; Flower's ``flower-superexec``
  is kept for a runtime API with TLS certificates of its own
  (``--root-certificates``), and with ``CONTRAFL_SUPERNODE_RUNNER=0``.
- **A runner that dies is started again.** flwr's SuperNode starts its SuperExec once and
  never looks at it again: a SuperExec that died (killed, or ended by an error of the
  runtime API) left a SuperNode that is online, sends its heartbeats and receives its
  messages, but whose ClientApps never run: a dark site that nothing reported. Here the
  runner (or Flower's SuperExec) is watched (:func:`keep_running`) and started again,
  with one line in the SuperNode's log, unless the SuperNode itself is stopping
  (SIGINT or SIGTERM). A message under way when it died is lost (the server counts that
  client lost after ``round-timeout``); the next ones are answered.
- **Reconnecting.** When the SuperLink cannot be reached (the site's network is down,
  the SuperLink restarts), flwr retries with waits that double up to 20 s, so a site
  whose network came back stayed away up to 20 s longer; here they stop doubling at
  :data:`RETRY_S`.

Nothing else changes: the arguments, the node config, the SuperLink connection and the
messages are Flower's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

from .lifetime import ended

POLL_S = 0.2
RETRY_S = 5.0
"""The longest wait between two attempts to reach the SuperLink (flwr's is 20 s)."""
RESTART_S = (0.5, 10.0)
"""The first and the longest wait before a runner that exited is started again."""
STEADY_S = 30.0
"""A runner that ran this long before it exited is started again after the first wait."""
GROUP_STOP_S = 5.0
"""How long a runner ended by SIGTERM or SIGINT waits for its SuperNode's stop before it
is started again."""
PULL_BACKOFF_S = (0.02, 0.5)
"""The first and the longest wait before asking again for a part of a message that is
not there yet (flwr's are 1 s and 10 s): the SuperNode sees a message while the server
still sends its arrays, and its ClientApp sees it while the SuperNode still pulls them,
so each wait cost a second per message."""


def capped_time(poll_s: float) -> SimpleNamespace:
    """The ``time`` module with ``sleep(s)`` sleeping ``min(s, poll_s)`` seconds."""
    module = SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("__")})
    module.sleep = lambda seconds: time.sleep(min(seconds, poll_s))
    return module


def runner_popen(*args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` that starts :mod:`contrafl.flower.runner` in place of a plain
    (``--insecure``) ``flower-superexec`` (with its arguments)."""
    argv = list(args[0] if args else kwargs.pop("args"))
    if argv and os.path.basename(str(argv[0])) == "flower-superexec" and "--insecure" in argv:
        argv = [sys.executable, "-m", "contrafl.flower.runner", *argv[1:]]
    return subprocess.Popen(argv, *args[1:], **kwargs)


def stopping_flag() -> threading.Event:
    """An event set when this process gets SIGINT or SIGTERM; the handlers installed
    before (flwr's graceful exit) still run. Called from the main thread."""
    flag = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)

        def handler(number: int, frame: object, previous: object = previous) -> None:
            flag.set()
            if callable(previous):
                previous(number, frame)
            elif previous == signal.SIG_DFL:  # the default action: end the process with the signal
                signal.signal(number, signal.SIG_DFL)
                os.kill(os.getpid(), number)

        signal.signal(signum, handler)
    return flag


def keep_running(process: subprocess.Popen, start: Callable[[], subprocess.Popen], stopping: threading.Event) -> None:
    """Start ``process`` again (``start()``) each time it exits, unless ``stopping`` is set
    (a signal to the SuperNode's group reaches both processes: the decision waits for it
    the first of :data:`RESTART_S`, and :data:`GROUP_STOP_S` after a SIGTERM or SIGINT,
    which the SuperNode is likely to have got too). One that dies within
    :data:`STEADY_S` of its start is started after a wait that doubles, up to the
    second of :data:`RESTART_S`."""
    wait, began = RESTART_S[0], time.monotonic()
    while True:
        status = process.wait()
        lived = time.monotonic() - began
        wait = RESTART_S[0] if lived > STEADY_S else min(2 * wait, RESTART_S[1])
        if stopping.wait(max(wait, GROUP_STOP_S) if status in (-signal.SIGTERM, -signal.SIGINT) else wait):
            return
        print(f"contrafl-supernode: its ClientApp runner (pid {process.pid}) {ended(status)} after {lived:.0f} s; "
              "starting a new one (a message it was answering is lost)", file=sys.stderr, flush=True)
        process, began = start(), time.monotonic()


def kept_running(popen: Callable[..., subprocess.Popen]) -> Callable[..., subprocess.Popen]:
    """``popen`` whose process :func:`keep_running` starts again when it exits while the
    SuperNode is not stopping (the SuperNode starts its SuperExec with it once)."""

    def start(*args, **kwargs) -> subprocess.Popen:
        process = popen(*args, **kwargs)
        again = partial(popen, *args, **kwargs)
        threading.Thread(target=keep_running, args=(process, again, stopping_flag()), daemon=True, name="runner-keeper").start()
        return process

    return start


def poll_interval() -> float:
    """``CONTRAFL_SUPERNODE_POLL_S`` (:data:`POLL_S` when unset); SystemExit with one line
    when it is not a positive number."""
    text = os.environ.get("CONTRAFL_SUPERNODE_POLL_S") or str(POLL_S)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise SystemExit(f"contrafl-supernode: CONTRAFL_SUPERNODE_POLL_S={text!r} is not a positive number of seconds; set it to e.g. 0.2, or unset it")
    return value


def main() -> None:
    """Run ``flower-supernode`` with the SuperNode's waits capped at the poll interval and
    its ClientApps in :mod:`contrafl.flower.runner`."""
    poll_s = poll_interval()
    from . import require_flwr

    require_flwr()
    from flwr.supercore.retry import http_retry
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.cli import flower_supernode

    http_retry.MAX_RETRY_DELAY = RETRY_S
    loop.time = capped_time(poll_s)
    loop.pull_objects = partial(loop.pull_objects, initial_backoff=PULL_BACKOFF_S[0], backoff_cap=PULL_BACKOFF_S[1])
    use_runner = os.environ.get("CONTRAFL_SUPERNODE_RUNNER", "1") != "0"
    loop.subprocess = SimpleNamespace(Popen=kept_running(runner_popen if use_runner else subprocess.Popen))
    flower_supernode()


if __name__ == "__main__":
    main()
