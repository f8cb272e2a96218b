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
- **Reconnecting.** When the SuperLink cannot be reached (the site's network is down,
  the SuperLink restarts), flwr retries with waits that double up to 20 s, so a site
  whose network came back stayed away up to 20 s longer; here they stop doubling at
  :data:`RETRY_S`.

Nothing else changes: the arguments, the node config, the SuperLink connection and the
messages are Flower's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import partial
from types import SimpleNamespace

POLL_S = 0.2
RETRY_S = 5.0
"""The longest wait between two attempts to reach the SuperLink (flwr's is 20 s)."""
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
    if os.environ.get("CONTRAFL_SUPERNODE_RUNNER", "1") != "0":
        loop.subprocess = SimpleNamespace(Popen=runner_popen)
    flower_supernode()


if __name__ == "__main__":
    main()
