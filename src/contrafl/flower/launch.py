"""Start and stop a local Flower (flwr 1.41) deployment and run an app on it.

:class:`LocalDeployment` starts one ``flower-superlink`` and N ``flower-supernode``
processes on this machine, waits until every SuperNode is registered with the SuperLink, runs
Flower apps on them with ``flwr run … --stream`` and stops everything again::

    with LocalDeployment(Path("work"), num_nodes=2) as dep:
        result = dep.run(Path("my_app"), {"num-rounds": 3})

Layout of ``workdir``:

* ``flwr_home/``: ``FLWR_HOME`` of the ``flwr`` CLI and of the SuperLink (``config.toml``
  holds the connection :data:`CONNECTION`; the SuperLink unpacks app bundles here);
* ``nodes/supernode-<i>/``: ``FLWR_HOME`` of SuperNode ``i``. Every SuperNode and the
  SuperLink unpack the same app bundle on the first message of a run; flwr checks "already
  installed?" before copying, so processes sharing one home could import a half-copied app;
* ``config/``: ``node-<i>.toml`` and ``run-<n>.toml``, the node and run configurations;
* ``logs/``: ``superlink.log``, ``supernode-<i>.log`` (stdout and stderr, appended to across
  restarts) and ``run-<n>.log`` (the streamed ServerApp output of run ``n``, numbered on
  from the logs already there, so that a deployment started again on the same ``workdir``
  keeps the earlier ones).

Node and run configurations are passed to flwr as TOML *files* (``--node-config x.toml``,
``--run-config x.toml``, both accepted by flwr's ``parse_config_args``), not as inline
``'k=v k2="s"'`` strings: flwr splits those with the regular expression
``(\\S+?)=('[^']*'|"[^"]*"|\\S+)``, so an inline string value can never contain a double quote
together with a single quote (nor an escaped ``\\"``). A file takes any TOML value.

Latency: the SuperNode polls the SuperLink every 3 s when idle and ``Grid.send_and_receive``
sleeps 3 s between pulls; both are hard-coded in flwr 1.41 (``supernode_poll`` starts the
SuperNodes as ``contrafl-supernode``, which polls faster). The only setting flwr has is the SuperExec
task poll interval (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, default 1 s, range 0.01-60 s),
which delays the start of every ServerApp and ClientApp process; it is set to
:data:`SUPEREXEC_POLL_INTERVAL` here. A ServerApp can avoid the 3 s of
``send_and_receive`` with its own ``push_messages``/``pull_messages`` loop.

Processes are started in their own sessions (``start_new_session=True``) and signalled as a
group. flwr starts the SuperLink's ``flower-superexec`` in a session of its own, so the
children of every process are also collected from ``/proc`` before it is signalled, and
:meth:`LocalDeployment.stop` ends every one of them (SIGTERM, then SIGKILL after a grace
period), and then whatever still carries the deployment's mark in its environment
(:mod:`contrafl.flower.lifetime`: a ServerApp whose SuperLink was killed is no longer
anybody's child). The processes it starts die with the thread that started them
(``PR_SET_PDEATHSIG``), so a deployment is started, used and stopped from one thread
that outlives it. While a run goes on, :meth:`LocalDeployment.run` watches the
SuperLink and the run's ServerApp, and raises :class:`DeploymentDied` when one dies.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from contrafl.cores import cpu_cores
from contrafl.errors import ConfigError, ContraflError
from contrafl.flower.lifetime import MARK, alive, descendants, dying_with, end, ended, marked, program

if TYPE_CHECKING:
    from contrafl.flower.auth import NodeKey

#: Name of the SuperLink connection written to ``$FLWR_HOME/config.toml``.
CONNECTION = "contrafl-local"
#: Seconds between SuperExec polls for new ServerApp/ClientApp tasks (flwr's default is 1 s).
SUPEREXEC_POLL_INTERVAL = 0.1
#: Executables of the flwr package that a deployment needs on ``PATH`` (SuperExec starts
#: ``flower-superexec``, ``flwr-serverapp`` and ``flwr-clientapp`` by name).
FLWR_EXECUTABLES = (
    "flwr", "flower-superlink", "flower-supernode", "flower-superexec",
    "flwr-serverapp", "flwr-clientapp",
)

_NODE_ID = re.compile(r"SuperNode ID: (\d+)")
_RUN_ID = re.compile(r"Successfully started run (\d+)")
_RUN_LOG = re.compile(r"run-(\d+)\.log")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
ConfigValue = str | int | float | bool


class FlowerLaunchError(ContraflError):
    """flwr is missing, or a process of the local deployment failed or did not come up."""


class DeploymentDied(FlowerLaunchError):
    """A process that a run cannot do without (the SuperLink, the ServerApp) died while
    the run was under way; ``what`` says which and how."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


#: Seconds that ``flwr run`` may go on after its ServerApp process is gone before the
#: ServerApp counts as dead (a ServerApp that ends its run exits a moment before).
SERVERAPP_GRACE_S = 5.0


@dataclass(frozen=True)
class RunResult:
    """Outcome of :meth:`LocalDeployment.run`."""

    run_id: int
    """The run id the SuperLink assigned."""
    returncode: int
    """Exit status of ``flwr run`` (always 0: other values raise)."""
    status: str
    """Final run status from ``flwr ls`` (always ``finished:completed``: others raise)."""
    log_path: Path
    """The streamed ServerApp output (``workdir/logs/run-<n>.log``)."""
    seconds: float
    """Wall-clock time of ``flwr run``."""


# --------------------------------------------------------------------------- TOML


def toml_key(key: str) -> str:
    """``key`` as a TOML key: bare if it only has letters, digits, ``_`` and ``-``, else a
    quoted string. Dots are quoted too: flwr would otherwise unflatten them into tables."""
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (double quotes; ``"``, ``\\`` and control characters
    escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: ConfigValue) -> str:
    """A flwr config value (str, int, float or bool) as a TOML literal: strings quoted,
    numbers and booleans bare (a float always keeps a ``.`` or exponent, so that it stays a
    float)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    raise ConfigError(
        f"flwr config values must be str, int, float or bool, got {type(value).__name__} "
        f"{value!r}"
    )


def toml_document(values: Mapping[str, ConfigValue]) -> str:
    """``key = value`` lines of a flat TOML document (what ``--node-config`` and
    ``--run-config`` files contain)."""
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in values.items())


# --------------------------------------------------------------------------- processes


def _signal(pid: int, sig: int, *, group: bool = False) -> None:
    """Send ``sig`` to a process (or its process group); a vanished one is ignored."""
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, offset: int = 0, lines: int = 25) -> str:
    """The last ``lines`` lines of ``path`` after byte ``offset``."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on at ``host`` right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise FlowerLaunchError(
                f"cannot use {host}:{port} for the Flower SuperLink: {exc.strerror}; "
                "choose another port or leave it out to pick a free one"
            ) from None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class _Process:
    """One long-running process of the deployment, restartable, with its log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    log_offset: int = 0
    """Size of the log file when the current process started (its output follows)."""
    family: set[tuple[int, int]] = field(default_factory=set)
    """Descendants seen when the process was last signalled."""

    def start(self) -> None:
        """Start a new process, appending its output to the log file."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            self.log_offset = log.tell()
            self.popen = subprocess.Popen(  # noqa: S603 - argv built from our own paths
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=dying_with(os.getpid()),
            )

    def running(self) -> bool:
        """Whether the current process (not its descendants) still runs (a dead one is
        reaped)."""
        return self.popen is not None and self.popen.poll() is None

    def death(self) -> str:
        """How the current process ended (:func:`~contrafl.flower.lifetime.ended`)."""
        return ended(self.popen.returncode if self.popen is not None else None)

    def log_text(self) -> str:
        """What the current process wrote to its log so far."""
        with self.log_path.open("rb") as fh:
            fh.seek(self.log_offset)
            return fh.read().decode(errors="replace")

    def failure(self, what: str) -> FlowerLaunchError:
        """An error saying ``what`` went wrong, with the tail of the log."""
        return FlowerLaunchError(
            f"{self.name} {what} (log {self.log_path}):\n{_tail(self.log_path, self.log_offset)}"
        )

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group and to every descendant (some of which flwr
        starts in sessions of their own)."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.family |= descendants(self.popen.pid)
            _signal(self.popen.pid, sig, group=True)
        for pid, start in self.family:
            if alive(pid, start):
                _signal(pid, sig)

    def gone(self) -> bool:
        """Whether the process and every descendant seen so far have exited."""
        if self.running():
            return False
        self.family = {p for p in self.family if alive(*p)}
        return not self.family

    def pids(self) -> set[int]:
        """Pids of the process and its live descendants."""
        if self.popen is None:
            return set()
        live = {pid for pid, start in self.family if alive(pid, start)}
        if self.running():
            live |= {self.popen.pid} | {p for p, _ in descendants(self.popen.pid)}
        return live


def _terminate(processes: list[_Process], grace: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to ``processes`` (and their descendants), SIGKILL what is left after
    ``grace`` seconds, and reap them."""
    for proc in processes:
        proc.signal(sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not all(p.gone() for p in processes):
        time.sleep(0.1)
    for proc in processes:
        if not proc.gone():
            proc.signal(signal.SIGKILL)
        if proc.popen is not None:
            proc.popen.wait()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not all(p.gone() for p in processes):
        time.sleep(0.05)


def oversubscribed(node_configs: list[dict[str, ConfigValue]]) -> bool:
    """Whether SuperNodes with ``node_configs`` on this machine run more torch threads
    than it has cores (each one's node config ``threads``, else torch's default of one
    per core).

    :class:`LocalDeployment` then starts its SuperNodes with ``OMP_WAIT_POLICY=PASSIVE``
    (unless the environment sets it): by default a thread that has done its share of an
    OpenMP region spins while it waits for the next one, on a core that another
    client's threads need. How threads wait changes nothing that is computed; on 2
    cores, with 3 SuperNodes of 2 threads each, the 2-round deployments of
    tests/test_flower_deploy.py took 15% less time (docs/performance.md)."""
    cores = cpu_cores()
    threads = (config.get("threads") for config in node_configs)
    return sum(int(t) if isinstance(t, int | str) and str(t).isdigit() else cores for t in threads) > cores


# --------------------------------------------------------------------------- deployment


_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_BARE_LEVEL = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s*")


_EXIT_NOTICE = re.compile(
    r"((DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s*)?(Exit Code: \d+|An unhandled exception occurred in the ServerApp\.|"
    r"For more information, visit: <https://flower\.ai/docs/framework/.*ref-exit-codes/.*>)\s*"
)


def echoed(line: str, terminal: bool) -> str | None:
    """A line of ``flwr run``'s output as :func:`_wait` echoes it: without flwr's colour
    codes unless it goes to a ``terminal``; None for an empty line, a log line without a
    message (flwr logs one after the ServerApp's output) and flwr's exit-code notice
    after a ServerApp's error (which contrafl's ServerApp said in one line before)."""
    plain = _COLOUR.sub("", line)
    if _BARE_LEVEL.fullmatch(plain.rstrip("\n")) or _EXIT_NOTICE.fullmatch(plain.rstrip("\n")) or not plain.strip():
        return None
    return line if terminal else plain


class _Box:
    """flwr's error boxes (``╭─ Error ─╮`` ... ``╰─╯``) in a stream of lines: kept out of
    the echo, their text kept for the one-line error that takes their place."""

    def __init__(self) -> None:
        self.inside = False
        self.text: list[str] = []

    def hides(self, line: str) -> bool:
        """Whether ``line`` is part of a box (its text is kept)."""
        plain = _COLOUR.sub("", line).strip()
        if plain.startswith("╭─"):
            self.inside, self.text = True, []
        elif self.inside and plain.startswith("╰─"):
            self.inside = False
        elif self.inside:
            self.text.append(plain.strip("│ "))
        else:
            return False
        return True

    def message(self) -> str:
        """The last box's text in one line."""
        return " ".join(t for t in self.text if t)


def _wait(
    proc: subprocess.Popen, timeout: float | None, log_path: Path, echo: TextIO | None, check: Callable[[], None], box: _Box,
) -> int:
    """Wait for ``proc`` (at most ``timeout`` seconds), calling ``check`` every 0.2 s (it
    raises to end the wait) and copying what ``proc`` writes to ``log_path`` to ``echo``
    as it comes, line by line (:func:`echoed`), without flwr's error boxes (``box``
    keeps them)."""
    terminal = echo is not None and hasattr(echo, "isatty") and echo.isatty()
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = ""
    with log_path.open(errors="replace") as follow:
        while True:
            try:
                returncode: int | None = proc.wait(0.2)
            except subprocess.TimeoutExpired:
                returncode = None
            pending += follow.read()
            *lines, pending = pending.split("\n")
            if returncode is not None and pending:
                lines, pending = [*lines, pending], ""
            for line in lines:
                shown = None if box.hides(line) else echoed(line + "\n", terminal)
                if shown is not None and echo is not None:
                    echo.write(shown)
            if echo is not None:
                echo.flush()
            if returncode is not None:
                return returncode
            check()
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(proc.args, timeout or 0.0)


class LocalDeployment:
    """A SuperLink and ``num_nodes`` SuperNodes on this machine (a context manager).

    Args:
        workdir: folder for Flower homes, configuration files and logs (see module doc).
        num_nodes: number of SuperNodes; node ``i`` gets ``partition-id = i`` and
            ``num-partitions = num_nodes`` in its node config.
        tls: serve the SuperLink over HTTPS with certificates made by
            :func:`contrafl.flower.tls.make_certificates` in ``workdir/certs``.
        host: address the SuperLink listens on and the SuperNodes and the CLI dial.
        port: SuperLink port; None picks a free one.
        node_configs: one dict per node, merged over the default node config (str, int,
            float or bool values).
        python_bin_dir: folder with flwr's executables; default: that of this Python.
        auth: SuperNode authentication (needs ``tls``): the SuperLink runs with
            ``--enable-supernode-auth``, a key pair per SuperNode is made in
            ``workdir/keys`` (:mod:`contrafl.flower.auth`) and its public key registered
            (``flwr supernode register``) before the SuperNode starts with its private
            key; a SuperNode with any other key is refused.
        supernode_poll: the SuperNodes' longest wait between pulls of messages, in
            seconds: they run as ``contrafl-supernode`` (:mod:`contrafl.flower.supernode`);
            None runs ``flower-supernode``, which waits 3 s.
        start_timeout: seconds to wait for the SuperLink and for every SuperNode to come up.
        stop_grace: seconds between SIGTERM and SIGKILL in :meth:`stop`.
    """

    def __init__(
        self,
        workdir: Path,
        num_nodes: int,
        *,
        tls: bool = False,
        auth: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
        node_configs: list[dict[str, ConfigValue]] | None = None,
        python_bin_dir: Path | None = None,
        supernode_poll: float | None = None,
        start_timeout: float = 60.0,
        stop_grace: float = 10.0,
    ) -> None:
        if num_nodes < 1:
            raise ConfigError(f"num_nodes must be at least 1, got {num_nodes}")
        if node_configs is not None and len(node_configs) != num_nodes:
            raise ConfigError(
                f"node_configs has {len(node_configs)} entries, expected one per node ({num_nodes})"
            )
        if auth and not tls:
            raise ConfigError("SuperNode authentication needs TLS: flwr 1.41 refuses --enable-supernode-auth with --insecure; set tls as well")
        self.workdir = Path(workdir).resolve()
        self.num_nodes = num_nodes
        self.tls = tls
        self.auth = auth
        self.host = host
        self.port = port
        if supernode_poll is not None and not supernode_poll > 0:
            raise ConfigError(f"supernode_poll={supernode_poll} must be a positive number of seconds (None: flwr's 3 s)")
        self.bin_dir = Path(python_bin_dir or Path(sys.executable).parent).resolve()
        self.supernode_poll = supernode_poll
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.node_configs: list[dict[str, ConfigValue]] = [
            {"partition-id": i, "num-partitions": num_nodes, **(node_configs or [{}] * num_nodes)[i]}
            for i in range(num_nodes)
        ]
        for config in self.node_configs:
            toml_document(config)  # reject unsupported values before anything starts
        self.flwr_home = self.workdir / "flwr_home"
        self.log_dir = self.workdir / "logs"
        self.config_dir = self.workdir / "config"
        self.node_ids: list[int | None] = [None] * num_nodes
        """SuperLink node id of every SuperNode's current process (None while down)."""
        self.keys: list[NodeKey] = []
        """With ``auth``: each SuperNode's key pair."""
        self.mark: str | None = None
        """:data:`~contrafl.flower.lifetime.MARK` of the processes of this start."""
        self.leftovers: list[str] = []
        """The processes an earlier deployment of ``workdir`` left running, which
        :meth:`start` ended (``program (pid N)``)."""
        self._superlink: _Process | None = None
        self._nodes: list[_Process] = []
        self._runs = 0
        self._superlink_up = False  # the SuperLink of this start accepted connections
        self._serverapp: tuple[int, int] | None = None  # (pid, start) of the running run's ServerApp
        self._serverapp_gone: float | None = None  # when it was first seen gone
        self._next_scan = 0.0

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> LocalDeployment:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``host:port`` of the SuperLink."""
        if self.port is None:
            raise FlowerLaunchError("the deployment has not been started")
        return _address(self.host, self.port)

    def start(self) -> None:
        """Start the SuperLink and the SuperNodes and wait until all nodes are registered.
        On failure everything started so far is stopped again."""
        self._check_flwr()
        try:
            self._start()
        except BaseException as exc:
            died = None
            if isinstance(exc, FlowerLaunchError | subprocess.TimeoutExpired) and not isinstance(exc, DeploymentDied) and self._superlink_up:
                try:  # a flwr command or a SuperNode failed because the SuperLink had died: that is what to say
                    self._check_superlink()
                except DeploymentDied as dead:
                    died = dead
            self.stop()
            if died is not None:
                raise died from None
            raise

    def _check_flwr(self) -> None:
        needed = [*FLWR_EXECUTABLES, *(["contrafl-supernode"] if self.supernode_poll is not None else [])]
        missing = [e for e in needed if not (self.bin_dir / e).is_file()]
        if missing:
            raise FlowerLaunchError(
                f"Flower is not installed ({', '.join(missing)} not in {self.bin_dir}): "
                'pip install "contrafl[flower]"'
            )

    def _start(self) -> None:
        if self._superlink is not None:
            raise FlowerLaunchError("the deployment is already started")
        left = marked(f"{self.workdir}|")
        if left:  # an earlier deployment of workdir, killed with its parent before it could stop them
            end(left, self.stop_grace)
            self.leftovers = [f"{program(argv)} (pid {pid})" for (pid, _), argv in sorted(left.items())]
        self.mark = f"{self.workdir}|{secrets.token_hex(8)}"
        if self.port is None:
            self.port = free_port(self.host)
        else:
            _check_port_free(self.host, self.port)
        for folder in (self.flwr_home, self.log_dir, self.config_dir):
            folder.mkdir(parents=True, exist_ok=True)
        if self.tls:
            from contrafl.flower.tls import make_certificates

            certs = make_certificates(self.workdir / "certs")
            security = ["--ssl-ca-certfile", str(certs.ca_cert), "--ssl-certfile",
                        str(certs.server_cert), "--ssl-keyfile", str(certs.server_key)]
            node_security = ["--root-certificates", str(certs.ca_cert)]
            connection = f"root-certificates = {toml_string(str(certs.ca_cert))}\n"
        else:
            security = node_security = ["--insecure"]
            connection = "insecure = true\n"
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f"address = {toml_string(self.address)}\n{connection}"
        )

        if self.auth:
            security.append("--enable-supernode-auth")
        self._superlink = _Process(
            "superlink",
            [str(self.bin_dir / "flower-superlink"), *security,
             "--disable-runtime-dependency-installation", "--host", self.host,
             "--port", str(self.port)],
            self._env(self.flwr_home),
            self.log_dir / "superlink.log",
        )
        self._superlink.start()
        self._wait_for_superlink()
        self._superlink_up = True
        if self.auth:
            from contrafl.flower.auth import make_node_keys

            self.keys = make_node_keys(self.workdir / "keys", self.num_nodes)
            self._register_keys()

        node_ports = self._free_node_ports()
        passive = oversubscribed(self.node_configs)
        for i, config in enumerate(self.node_configs):
            config_file = self.config_dir / f"node-{i}.toml"
            config_file.write_text(toml_document(config))
            home = self.workdir / "nodes" / f"supernode-{i}"
            home.mkdir(parents=True, exist_ok=True)
            env = self._env(home)
            if passive:
                env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            if self.supernode_poll is not None:
                env["CONTRAFL_SUPERNODE_POLL_S"] = str(self.supernode_poll)
            self._nodes.append(_Process(
                f"supernode-{i}",
                [str(self.bin_dir / ("flower-supernode" if self.supernode_poll is None else "contrafl-supernode")),
                 *node_security, "--superlink", self.address, "--port", str(node_ports[i]),
                 "--node-config", str(config_file),
                 *(["--auth-supernode-private-key", str(self.keys[i].private)] if self.auth else [])],
                env,
                self.log_dir / f"supernode-{i}.log",
            ))
            self._nodes[i].start()
        self._wait_for_nodes(range(self.num_nodes))

    def _env(self, flwr_home: Path) -> dict[str, str]:
        return {
            **os.environ,
            "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(SUPEREXEC_POLL_INTERVAL),
            "PATH": os.pathsep.join([str(self.bin_dir), os.environ.get("PATH", "")]),
            MARK: str(self.mark),
        }

    def _free_node_ports(self) -> list[int]:
        """Distinct free ports for the SuperNodes' runtime APIs (all held while picking)."""
        socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(self.num_nodes)]
        try:
            for sock in socks:
                sock.bind(("127.0.0.1", 0))
            return [int(sock.getsockname()[1]) for sock in socks]
        finally:
            for sock in socks:
                sock.close()

    def _wait_for_superlink(self) -> None:
        """Wait until the SuperLink process accepts TCP connections on its port."""
        assert self._superlink is not None and self.port is not None
        deadline = time.monotonic() + self.start_timeout
        while True:
            if not self._superlink.running():
                raise self._superlink.failure(f"{self._superlink.death()} while starting")
            try:
                with socket.create_connection((self.host, self.port), timeout=1.0):
                    pass
            except OSError:
                if time.monotonic() > deadline:
                    raise self._superlink.failure(
                        f"does not accept connections on {self.address} after "
                        f"{self.start_timeout:.0f} s"
                    ) from None
                time.sleep(0.1)
                continue
            if self._superlink.running():  # not somebody else's server on a port we lost
                return

    def _wait_for_nodes(self, indices: range | list[int]) -> None:
        """Wait until each of the given SuperNodes logged its node id: flwr 1.41's
        SuperNode logs it once the SuperLink has activated the node (lists it online),
        so no ``flwr supernode ls`` (1.4 s of CLI start-up) needs to confirm it."""
        deadline = time.monotonic() + self.start_timeout
        pending = list(indices)
        while pending:
            self._check_superlink()
            for i in list(pending):
                node = self._nodes[i]
                if match := _NODE_ID.search(node.log_text()):
                    self.node_ids[i] = int(match.group(1))
                    pending.remove(i)
                elif not node.running():
                    raise node.failure(f"{node.death()} while starting")
            if pending and time.monotonic() > deadline:
                raise self._nodes[pending[0]].failure(
                    f"did not register with the SuperLink at {self.address} within "
                    f"{self.start_timeout:.0f} s"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop every process of the deployment: SIGTERM, then SIGKILL after
        ``stop_grace`` seconds; the SuperNodes first, then the SuperLink (a SuperNode
        that gets SIGTERM says goodbye to its SuperLink, and waits for it up to the
        grace when the SuperLink is gone already). Idempotent; :meth:`start` may be
        called again afterwards."""
        _terminate([p for p in self._nodes if p is not None], self.stop_grace)
        _terminate([self._superlink] if self._superlink is not None else [], self.stop_grace)
        if self.mark is not None:  # what their deaths orphaned (a ServerApp whose SuperLink was killed)
            end(marked(self.mark), min(self.stop_grace, 2.0))
        self._superlink, self._nodes, self._superlink_up = None, [], False
        self.node_ids = [None] * self.num_nodes

    def pids(self) -> set[int]:
        """Pids of every live process started by the deployment (including flwr's
        SuperExec, ServerApp and ClientApp children, and contrafl's runners and workers,
        whoever their parents are now)."""
        own = {pid for p in [*self._nodes, self._superlink] if p is not None for pid in p.pids()}
        return own | ({pid for pid, _ in marked(self.mark)} if self.mark is not None else set())

    # ------------------------------------------------------------------ faults

    def _node(self, i: int) -> _Process:
        if not 0 <= i < len(self._nodes):
            raise FlowerLaunchError(f"no SuperNode {i} (the deployment has {len(self._nodes)})")
        return self._nodes[i]

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to SuperNode ``i`` and its children and wait until they have exited.

        SIGKILL simulates a crash: the SuperLink keeps listing the node as online until its
        heartbeat expires (about 60 s). SIGTERM makes the node unregister itself at once.
        """
        _terminate([self._node(i)], self.stop_grace, sig)
        self.node_ids[i] = None

    def restart_node(self, i: int) -> int:
        """Start SuperNode ``i`` again (stopping it first if it still runs) with the same
        node config; wait until it is registered and return its new node id (flwr gives a
        restarted SuperNode a new id, and its ``context.state`` starts empty)."""
        node = self._node(i)
        if not node.gone():
            _terminate([node], self.stop_grace)
        node.start()
        self._wait_for_nodes([i])
        node_id = self.node_ids[i]
        assert node_id is not None
        return node_id

    def kill_superlink(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the SuperLink and its children and wait until they have exited."""
        if self._superlink is None:
            raise FlowerLaunchError("the deployment has not been started")
        _terminate([self._superlink], self.stop_grace, sig)

    def restart_superlink(self) -> None:
        """Start the SuperLink again on the same port (stopping it first if it still runs)
        and restart every SuperNode.

        The SuperLink keeps its state in memory, so runs, node registrations and (with
        ``auth``) the registered keys are lost, and the keys are registered again;
        flwr 1.41 SuperNodes then get HTTP 401 for their unknown node id and exit by
        themselves. They are stopped first and started again here, with new node ids.
        """
        if self._superlink is None:
            raise FlowerLaunchError("the deployment has not been started")
        _terminate([*self._nodes, self._superlink], self.stop_grace)
        self.node_ids = [None] * self.num_nodes
        self._superlink.start()
        self._wait_for_superlink()
        if self.auth:
            self._register_keys()
        for node in self._nodes:
            node.start()
        self._wait_for_nodes(range(self.num_nodes))

    # ------------------------------------------------------------------ CLI

    def _flwr(self, *args: str, timeout: float = 60.0) -> str:
        """Run a ``flwr`` CLI command against the deployment and return its stdout."""
        proc = subprocess.run(  # noqa: S603
            [str(self.bin_dir / "flwr"), *args], env=self._env(self.flwr_home),
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise FlowerLaunchError(
                f"flwr {' '.join(args)} failed with exit status {proc.returncode}:\n"
                f"{(proc.stdout + proc.stderr).strip()[-2000:]}"
            )
        return proc.stdout

    def _flwr_json(self, *args: str) -> dict:
        """Run ``flwr … --format json`` and parse the JSON object it prints."""
        out = self._flwr(*args, "--format", "json")
        try:
            data = json.loads(out[out.index("{"):])
        except ValueError:
            raise FlowerLaunchError(f"flwr {' '.join(args)} printed no JSON:\n{out[-2000:]}") from None
        if not data.get("success", False):
            raise FlowerLaunchError(f"flwr {' '.join(args)} failed: {data}")
        return data

    def register(self, public_key: Path) -> int:
        """Register a SuperNode's public key with the SuperLink (``flwr supernode
        register``): a SuperNode holding the private key may then join; its node id."""
        return int(self._flwr_json("supernode", "register", str(public_key), CONNECTION)["node-id"])

    def _register_keys(self) -> None:
        """Register every SuperNode's public key, all at once (each ``flwr`` command
        spends a second importing flwr)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(len(self.keys), 8) or 1) as pool:
            list(pool.map(self.register, [key.public for key in self.keys]))

    def list_nodes(self) -> list[dict]:
        """The SuperLink's node list (``flwr supernode ls --format json``): dicts with
        ``node-id`` and ``status`` (``online``, ``offline``, …) among others."""
        return list(self._flwr_json("supernode", "ls", CONNECTION)["nodes"])

    def run_status(self, run_id: int) -> dict:
        """The SuperLink's record of a run (``flwr ls --run-id --format json``): ``status``
        (e.g. ``finished:completed``), ``elapsed`` and more."""
        return dict(self._flwr_json("ls", CONNECTION, "--run-id", str(run_id))["runs"][0])

    def run(
        self,
        app_dir: Path,
        run_config: Mapping[str, ConfigValue] | None = None,
        timeout: float | None = None,
        echo: TextIO | None = None,
    ) -> RunResult:
        """Run the Flower app in ``app_dir`` with ``flwr run --stream`` and wait until it
        finishes.

        ``run_config`` overrides keys of the app's ``[tool.flwr.app.config]`` (flwr rejects
        other keys). The streamed ServerApp output goes to ``workdir/logs/run-<n>.log``,
        and also to ``echo`` as it comes when given.
        Raises :class:`FlowerLaunchError` if ``flwr run`` fails, if the run does not finish
        as ``finished:completed`` or if it takes longer than ``timeout`` seconds (then the
        run is stopped on the SuperLink).
        """
        if self._superlink is None:
            raise FlowerLaunchError("the deployment has not been started")
        self._runs = 1 + max(
            [self._runs, *(int(m.group(1)) for p in self.log_dir.iterdir() if (m := _RUN_LOG.fullmatch(p.name)))]
        )
        log_path = self.log_dir / f"run-{self._runs}.log"
        argv = [str(self.bin_dir / "flwr"), "run", str(Path(app_dir).resolve()), CONNECTION, "--stream"]
        if run_config:
            config_file = self.config_dir / f"run-{self._runs}.toml"
            config_file.write_text(toml_document(run_config))
            argv += ["--run-config", str(config_file)]
        began = time.monotonic()
        box = _Box()
        self._serverapp, self._serverapp_gone = None, None
        with log_path.open("wb") as log:
            proc = subprocess.Popen(  # noqa: S603
                argv, env=self._env(self.flwr_home), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=dying_with(os.getpid()),
            )
            try:
                returncode = _wait(proc, timeout, log_path, echo, self._check_run, box)
            except (subprocess.TimeoutExpired, DeploymentDied) as exc:
                _signal(proc.pid, signal.SIGKILL, group=True)
                proc.wait()
                if isinstance(exc, DeploymentDied):
                    raise
                if match := _RUN_ID.search(log_path.read_text(errors="replace")):
                    self._flwr("stop", match.group(1), CONNECTION)
                raise FlowerLaunchError(f"flwr run {app_dir} did not finish within {timeout} s (log {log_path})") from None
        seconds = time.monotonic() - began
        match = _RUN_ID.search(log_path.read_text(errors="replace"))
        if returncode != 0 or match is None:
            self._check_run(superlink_only=True)
            why = box.message() or _tail(log_path, lines=1)
            raise FlowerLaunchError(f"flwr run {app_dir} failed with exit status {returncode}: {why} (log {log_path})")
        run_id = int(match.group(1))
        status = self.run_status(run_id)
        if status["status"] != "finished:completed":
            details = " ".join(str(status.get("status-details", "")).split())
            raise FlowerLaunchError(f"run {run_id} of {app_dir} ended as {status['status']}{f' ({details})' if details else ''} (log {log_path})")
        return RunResult(run_id, returncode, status["status"], log_path, seconds)

    def _check_superlink(self) -> None:
        """Raise :class:`DeploymentDied` when the SuperLink died."""
        if self._superlink is not None and self._superlink.popen is not None and not self._superlink.running():
            raise DeploymentDied(f"the SuperLink (pid {self._superlink.popen.pid}) {self._superlink.death()}")

    def _check_run(self, superlink_only: bool = False) -> None:
        """Raise :class:`DeploymentDied` when the SuperLink died, or (unless
        ``superlink_only``) when the run's ServerApp process (seen before) has been gone
        for :data:`SERVERAPP_GRACE_S` while ``flwr run`` goes on. Reaps the SuperNodes
        that died."""
        self._check_superlink()
        for node in self._nodes:
            node.running()  # a dead SuperNode is no zombie that its worker takes for alive
        now = time.monotonic()
        if now < self._next_scan or superlink_only:
            return
        self._next_scan = now + 0.5
        if self._serverapp is None:
            apps = [p for p, argv in marked(str(self.mark)).items() if program(argv) == "flwr-serverapp"]
            self._serverapp = apps[0] if apps else None
        elif not alive(*self._serverapp):
            self._serverapp_gone = self._serverapp_gone or now
            if now - self._serverapp_gone > SERVERAPP_GRACE_S:
                raise DeploymentDied(f"the ServerApp (flwr-serverapp, pid {self._serverapp[0]}) died")
