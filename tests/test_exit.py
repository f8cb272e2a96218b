"""How the ``contrafl`` command ends (contrafl.cli.end_process)."""

import subprocess
import sys

HANDLER = """
import atexit, sys
from contrafl.cli import end_process
atexit.register(lambda: print("handler ran"))
print("output", end="|")
print("error", end="|", file=sys.stderr)
end_process(3)
"""

THREAD = """
import threading, time
from contrafl.cli import end_process
threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
end_process(4)
"""


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_the_exit_runs_the_handlers_and_flushes_the_streams():
    """Skipping the interpreter's teardown loses nothing a user sees: the exit status,
    buffered output on both streams (pipes, not terminals), and the exit handlers."""
    done = python(HANDLER)
    assert (done.returncode, done.stdout, done.stderr) == (3, "output|handler ran\n", "error|")


def test_a_running_thread_is_waited_for():
    """A thread that is not a daemon finishes first, as at an ordinary exit."""
    done = python(THREAD)
    assert (done.returncode, done.stdout) == (4, "thread done\n")


def test_the_command_ends_with_its_status():
    """``python -m contrafl`` and its errors: the status and the one line."""
    ok = subprocess.run([sys.executable, "-m", "contrafl", "--version"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("contrafl ")
    bad = subprocess.run([sys.executable, "-m", "contrafl", "run", "rounds=0"], capture_output=True, text=True, timeout=60)
    assert (bad.returncode, bad.stderr) == (2, "contrafl: error: rounds='0' is invalid: expected >= 1; set it with rounds=VALUE\n")
