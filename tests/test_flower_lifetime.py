"""No process outlives its deployment (contrafl.flower.lifetime): zombies count as dead,
the mark finds a deployment's processes whoever their parents are now, and a child
started to die with its parent does, however the parent ends. Real processes, no flwr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from contrafl.flower.lifetime import MARK, alive, end, marked, program, proc_stat

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (Linux)")


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_zombie_is_dead_though_kill_0_still_finds_it():
    """A killed SuperNode that nobody reaped stays in the process table: flwr's parent
    monitor (kill(pid, 0)) took it for alive, and its runner lived on for 30 minutes."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_until(lambda: proc_stat(child.pid)[1] == "Z")
    os.kill(child.pid, 0)  # no error: the pid is still there
    assert not alive(child.pid)
    child.wait()
    assert not alive(child.pid) and alive(os.getpid())


def test_the_mark_finds_an_orphan_and_end_stops_it(tmp_path):
    """A process whose parent died is adopted by init, out of reach of its old group;
    the mark in its environment still finds it, and end() stops it (SIGKILL after the
    grace for one that ignores SIGTERM, as flwr-serverapp did)."""
    mark = f"{tmp_path}|test"
    script = textwrap.dedent("""
        import signal, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        child.stdout.readline()
        print(child.pid, flush=True)
    """)
    parent = subprocess.run([sys.executable, "-c", script], env={**os.environ, MARK: mark}, capture_output=True, text=True, timeout=60)
    orphan = int(parent.stdout.split()[-1])
    assert alive(orphan) and proc_stat(orphan)[0] != os.getpid()
    found = marked(f"{tmp_path}|")
    assert [pid for pid, _ in found] == [orphan] and program(found[orphan, proc_stat(orphan)[2]]).startswith("python")
    assert marked(f"{tmp_path}x|") == {}  # another workdir's deployment
    began = time.monotonic()
    end(found, grace=0.5)
    assert not alive(orphan) and time.monotonic() - began < 5
    assert marked(f"{tmp_path}|") == {}


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_started_to_die_with_its_parent_does(how):
    """`contrafl deploy` starts its SuperLink and SuperNodes with dying_with: killed in
    any way, it takes them with it."""
    script = textwrap.dedent("""
        import os, subprocess, sys, time
        from contrafl.flower.lifetime import dying_with
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=dying_with(os.getpid()))
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert alive(child)
    parent.send_signal(how)
    parent.wait()
    wait_until(lambda: not alive(child))


def test_program_names_what_a_command_line_runs():
    assert program(["/venv/bin/python3", "/venv/bin/flwr-serverapp", "--token", "x"]) == "flwr-serverapp"
    assert program(["/venv/bin/python3", "-m", "contrafl.flower.runner", "--insecure"]) == "contrafl.flower.runner"
    assert program(["/usr/bin/sleep", "5"]) == "sleep" and program(["python3", "-c", "pass"]) == "python3"
