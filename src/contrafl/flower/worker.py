"""A SuperNode's worker: one process that answers every train and evaluate message of the
SuperNode's client, with torch, the client's data and its model loaded once.

flwr 1.41 runs each message in a new ClientApp process (``flwr-clientapp`` handles one
task and exits), which would import torch (1.6-2.6 s) and read the config, the data and
the model again for every message. contrafl's ClientApp imports neither: it hands the
message to its SuperNode's worker over a Unix socket (:func:`request`) and relays the
reply. The worker is started by the SuperNode's first message (the server's query of
which partition it serves, :func:`start`) and loads the client before it answers it;
it answers every message with :meth:`FlowerClient.answer`, the code a ClientApp runs
itself with the node config ``worker=false``.

The client's state still goes to its files after every round and is read back from them
for every message (:meth:`FlowerClient.load_state`), so a worker that dies loses
nothing: the next message starts a new one, which answers as the old one would have.

A worker serves one SuperNode's settings (:class:`NodeSettings`) for one run directory
(the sizes and times of its ``config.yaml`` and ``partition.json`` are part of the
worker's address) and one process that starts the ClientApps (Flower's SuperExec, a
child of the SuperNode). It exits when that process is gone, after
``CONTRAFL_WORKER_IDLE_S`` seconds without a message (default 600), or on a ``stop``
request. It runs in the SuperNode's process group, so signalling the group stops it too,
and writes to the SuperNode's log. Its socket is in ``CONTRAFL_WORKER_DIR`` (default:
``contrafl-workers-<uid>`` in the temporary directory, open to its owner only).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ..errors import ContraflError
from .lifetime import alive
from .node import NodeSettings
from .wire import pack, recv_frame, send_frame, unpack
from flwr.app import RecordDict

IDLE_S = 600.0
"""Seconds a worker waits for a message before it exits (``CONTRAFL_WORKER_IDLE_S``)."""
START_S = 300.0
"""Seconds a ClientApp waits for a new worker to listen (it imports torch and loads the
client's data first; minutes on a loaded machine)."""


_children: dict[Path, subprocess.Popen] = {}
"""The workers this process started, by socket (so that one that died is seen as dead)."""


class WorkerError(RuntimeError):
    """A worker could not answer for a reason that is not the user's input (it died, or
    its code raised); Flower sends it to the server as the ClientApp's exception."""


SOCKET_PATH_MAX = 107
"""The longest path of a Unix socket (``sun_path``'s 108 bytes with the final NUL)."""
KEY_CHARS = 24
"""Hexadecimal digits of a worker's key in its socket's name (:func:`address`)."""


def worker_dir() -> Path:
    """The folder of the workers' sockets (made, open to its owner only). Raises
    :class:`ContraflError` when a socket's path there would be too long."""
    configured = os.environ.get("CONTRAFL_WORKER_DIR")
    folder = Path(configured or Path(tempfile.gettempdir()) / f"contrafl-workers-{os.getuid()}")
    longest = len(os.fsencode(folder)) + len("/.sock") + KEY_CHARS
    if longest > SOCKET_PATH_MAX:
        source = "CONTRAFL_WORKER_DIR" if configured else "the temporary directory (TMPDIR)"
        raise ContraflError(
            f"the SuperNode's worker sockets would be in {str(folder)!r}, whose socket paths are {longest} bytes long, "
            f"more than the {SOCKET_PATH_MAX} a Unix socket allows; set {source} to a shorter folder"
        )
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def address(settings: NodeSettings, owner: int) -> Path:
    """The socket of the worker for ``settings`` (checked: the run's files exist) whose
    ClientApps ``owner`` starts."""
    run = Path(settings.run_dir)
    files = [(s.st_size, s.st_mtime_ns) for s in ((run / name).stat() for name in ("config.yaml", "partition.json") if (run / name).is_file())]
    key = json.dumps([settings.as_dict(), owner, files, sys.executable], sort_keys=True)
    return worker_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:KEY_CHARS]}.sock"


def start(settings: NodeSettings) -> Path:
    """Start the worker of ``settings`` (for the process that starts this ClientApp),
    unless it runs or is starting; its socket, on which it listens soon."""
    path = address(settings, os.getppid())
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _listening(path) and _starting(path) is None:
            sweep(path.parent, keep=path)
            _spawn(path, settings, os.getppid())
    return path


def sweep(folder: Path, keep: Path) -> None:
    """Remove the files of workers that are gone (a worker killed by SIGKILL leaves its
    socket and pid file), except ``keep``'s: those whose pid file names no live process,
    or that have none, and whose lock no ClientApp holds."""
    for lock_file in folder.glob("*.lock"):
        sock = lock_file.with_suffix(".sock")
        if sock == keep or _starting(sock) is not None:
            continue
        with open(lock_file, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if _listening(sock):
                continue
            for leftover in (sock, lock_file.with_suffix(".pid"), lock_file):
                leftover.unlink(missing_ok=True)


def request(settings: NodeSettings, kind: str, content: RecordDict) -> RecordDict:
    """The worker's reply content to a ``kind`` message with ``content`` (the worker is
    started when it does not run). Raises :class:`ContraflError` with the worker's
    one-line message when the user's setup does not fit the run, and :class:`WorkerError`
    when the worker failed otherwise."""
    path = start(settings)
    sock = _wait_until_listening(path, settings)
    with sock:
        send_frame(sock, json.dumps({"kind": kind}).encode())
        send_frame(sock, pack(content))
        try:
            status = json.loads(recv_frame(sock))
            body = recv_frame(sock)
        except ConnectionError:
            raise WorkerError(
                f"the contrafl worker of partition {settings.partition_id} died while it answered a {kind} message "
                "(its output is in the SuperNode's log); the next message starts a new one"
            ) from None
    if "user_error" in status:
        raise ContraflError(status["user_error"])
    if "error" in status:
        raise WorkerError(status["error"])
    return unpack(body)


def stop(path: Path) -> bool:
    """Ask the worker listening on ``path`` to exit; whether one was listening."""
    sock = _connect(path)
    if sock is None:
        return False
    with sock:
        try:
            send_frame(sock, json.dumps({"kind": "stop"}).encode())
            send_frame(sock, b"")
            recv_frame(sock)
        except OSError:  # it exited meanwhile
            pass
    return True


def _connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        return sock
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None


def _listening(path: Path) -> bool:
    """Whether a worker listens on ``path`` (the probe's connection is closed at once)."""
    sock = _connect(path)
    if sock is not None:
        sock.close()
    return sock is not None


def _starting(path: Path) -> int | None:
    """The pid of the worker started for ``path`` if it still runs (it may not listen yet)."""
    try:
        pid = int(path.with_suffix(".pid").read_text())
    except (FileNotFoundError, ValueError):
        return None
    child = _children.get(path)
    if child is not None and child.pid == pid:
        return pid if child.poll() is None else None
    return pid if alive(pid) else None


def _spawn(path: Path, settings: NodeSettings, owner: int) -> None:
    path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "contrafl.flower.worker", str(path), str(owner), json.dumps(settings.as_dict())]
    _children[path] = subprocess.Popen(argv, stdin=subprocess.DEVNULL)  # noqa: S603 - our own module
    path.with_suffix(".pid").write_text(str(_children[path].pid))


def _wait_until_listening(path: Path, settings: NodeSettings) -> socket.socket:
    deadline = time.monotonic() + START_S
    while (sock := _connect(path)) is None:
        if _starting(path) is None:
            raise WorkerError(
                f"the contrafl worker of partition {settings.partition_id} exited before it listened "
                "(its output is in the SuperNode's log)"
            )
        if time.monotonic() > deadline:
            raise WorkerError(f"the contrafl worker of partition {settings.partition_id} did not listen within {START_S:g}s")
        time.sleep(0.02)
    return sock


class Worker:
    """The worker process for ``settings`` on the socket ``path``; ``owner``: the process
    whose end ends it; ``idle``: seconds without a message after which it exits."""

    def __init__(self, path: Path, owner: int, settings: NodeSettings, idle: float) -> None:
        self.path, self.owner, self.settings, self.idle = path, owner, settings, idle
        self.client = None
        self.retired = False

    def serve(self) -> None:
        """Listen, load the client, answer messages one at a time until it is time to
        exit; then stop listening and answer the messages already waiting."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(16)
        try:
            try:  # load the data and the model before the first message, which reports a failure
                self._client()
            except Exception:  # noqa: BLE001
                pass
            listener.settimeout(1.0)
            last = time.monotonic()
            while alive(self.owner) and time.monotonic() - last < self.idle:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                if not self._answer(conn):
                    break
                last = time.monotonic()
            self.retire()
            listener.setblocking(False)
            while True:
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    break
                self._answer(conn)
        finally:  # also when stopped by a signal (SIGTERM to the SuperNode's group)
            self.retire()
            listener.close()

    def retire(self) -> None:
        """Stop being the worker of the socket: new ClientApps start a new one from here on
        (once: the socket may be a new worker's afterwards)."""
        if self.retired:
            return
        self.retired = True
        pid_file = self.path.with_suffix(".pid")
        if pid_file.is_file() and pid_file.read_text() == str(os.getpid()):
            pid_file.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)

    def _client(self):
        from .client import FlowerClient

        if self.client is None:
            self.client = FlowerClient.of(self.settings)
        return self.client

    def _answer(self, conn: socket.socket) -> bool:
        """Answer the message on ``conn``; False when it asks the worker to exit."""
        with conn:
            conn.setblocking(True)
            try:
                kind = json.loads(recv_frame(conn))["kind"]
                content = recv_frame(conn)
            except (ConnectionError, ValueError, KeyError):
                return True
            status: dict[str, str] = {}
            body = b""
            if kind != "stop":
                try:
                    body = pack(self._client().answer(kind, unpack(content)))
                except ContraflError as exc:
                    status = {"user_error": str(exc)}
                except Exception:  # noqa: BLE001 - sent to the ClientApp, which raises it
                    status = {"error": traceback.format_exc()}
            try:
                send_frame(conn, json.dumps(status).encode())
                send_frame(conn, body)
            except OSError:
                pass  # the ClientApp is gone (Flower stopped it)
        return kind != "stop"


def main() -> None:
    """``python -m contrafl.flower.worker SOCKET OWNER SETTINGS`` (started by :func:`start`)."""
    path, owner, settings = Path(sys.argv[1]), int(sys.argv[2]), NodeSettings.from_dict(json.loads(sys.argv[3]))
    idle = float(os.environ.get("CONTRAFL_WORKER_IDLE_S") or IDLE_S)
    signal.signal(signal.SIGTERM, _exit)
    try:
        Worker(path, owner, settings, idle).serve()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # exiting already (see _exit)


def _exit(signum: int, frame: object) -> None:
    """SIGTERM (the SuperNode's group stopped): exit through ``serve``'s cleanup. Once
    the worker exits, a SIGTERM is ignored: raised in the interpreter's exit handlers
    (torch's among them) it printed ``Exception ignored in atexit callback`` and a
    traceback into the SuperNode's log, often, when a deployment stopped."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(0)


if __name__ == "__main__":
    main()
