"""``contrafl deploy``: a contrafl config on a local Flower deployment.

:func:`prepare_run` makes the run directory the ServerApp and the ClientApps read (the
resolved ``config.yaml`` and the ``partition.json`` every client takes its rows from);
:func:`deploy` starts a SuperLink and one SuperNode per client on this machine
(:class:`~contrafl.flower.launch.LocalDeployment`) and runs contrafl's Flower app on them,
which writes the same run directory as ``contrafl run``; :func:`commands` says how to run
a prepared run directory on a deployment of one's own (several machines).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

import torch

from .. import params as P
from ..config import Component, Config
from ..cores import cores_each, cpu_cores
from ..engine.run_dir import RunDir, read_summary
from ..engine.sampling import clients_per_round
from ..engine.setup import prepare, resolved_clients
from ..errors import ConfigError, ContraflError
from ..files import write_atomic
from .launch import DeploymentDied, FlowerLaunchError, LocalDeployment, RunResult, toml_document, toml_string
from .supernode import POLL_S
from .auth import make_node_keys
from .byzantine import node_config_text
from .tls import alt_name, make_certificates

APP_DIR = Path(str(resources.files("contrafl.flower") / "app"))
"""contrafl's Flower app directory (the argument of ``flwr run``)."""


def prepare_run(cfg: Config, path: Path, byzantine_nodes: bool = False) -> Config:
    """Write the run directory ``path`` (new or empty) of ``cfg``: the resolved config and
    the partition. Returns the resolved config. ``byzantine_nodes``: ``cfg``'s attack is
    made by the attackers' own SuperNodes (:mod:`contrafl.flower.byzantine`): it is checked
    here against the algorithm and the data, and left out of ``config.yaml``, the server's
    (``attack=none``), which is returned."""
    setup = prepare(cfg)
    resolved = dataclasses.replace(setup.config, attack=Component("none")) if byzantine_nodes else setup.config
    run_dir = RunDir(path)
    run_dir.write_config(resolved)
    run_dir.write_text("partition.json", json.dumps(setup.partition.to_json()))
    run_dir.close()
    return resolved


def run_config(
    path: Path, round_timeout: float, min_replies: int, wait_nodes: float = 120.0, secure_aggregation: bool = False,
    max_weight: int | None = None,
) -> dict[str, str | float | int | bool]:
    """The app's run config for the run directory ``path`` (``secure-aggregation`` and
    ``max-weight`` only when set: flwr refuses a key an app does not declare, and apps
    built on contrafl's ServerApp before them may not)."""
    rc: dict[str, str | float | int | bool] = {
        "run-dir": str(Path(path).resolve()), "round-timeout": round_timeout, "min-replies": min_replies, "wait-nodes": wait_nodes,
    }
    return rc | ({"secure-aggregation": True} if secure_aggregation else {}) | ({"max-weight": max_weight} if max_weight else {})


def check_settings(cfg: Config, round_timeout: float, min_replies: int, secure_aggregation: bool = False, max_weight: int | None = None) -> None:
    """:class:`ConfigError` unless ``round_timeout`` and ``min_replies`` fit ``cfg``, its
    DP noise (if any) is secret, and its algorithm and settings can take
    ``secure_aggregation`` (with ``node_data=own``, a public ``max_weight``, unless
    ``dp=local`` weighs every reply 1)."""
    if not 0 < round_timeout:
        raise ConfigError(f"round_timeout={round_timeout:g} must be positive (seconds a round waits for replies)")
    if cfg.dp.name != "none" and cfg.dp.options.get("noise") == "reproducible":
        raise ConfigError(
            "dp.noise=reproducible derives the noise from config.yaml's seed, which the server and every SuperNode hold, "
            "so it protects nothing in a deployment; leave dp.noise unset (secret: each party draws it from its OS's CSPRNG)"
        )
    num_clients = resolved_clients(cfg)
    if not 0 <= min_replies <= num_clients:
        raise ConfigError(f"min_replies={min_replies} must be between 0 and num_clients={num_clients}")
    if max_weight is not None and not secure_aggregation:
        raise ConfigError(f"--max-weight {max_weight} bounds the weights of secure sums; add --secure-aggregation, or leave it out")
    if max_weight is not None and max_weight < 1:
        raise ConfigError(f"--max-weight {max_weight} must be a whole number of samples, at least 1")
    hidden = cfg.dp.name == "local" and cfg.dp.options.get("labels", "hide") == "hide"
    if secure_aggregation and cfg.node_data == "own" and not hidden and max_weight is None:
        raise ConfigError(
            "secure aggregation with node_data=own needs --max-weight N, a public bound on every site's training samples "
            "(each update is weighted by its sample count over N inside the masks, and a site with more refuses); "
            "under dp=local (with dp.labels=hide) every reply weighs 1 and none is needed"
        )
    if secure_aggregation:
        from ..algorithms import ALGORITHMS
        from .secagg import refusal, round_refusal

        algo_cls = ALGORITHMS.get(cfg.algorithm.name)
        why = refusal(algo_cls, P.build(algo_cls.Params, cfg.algorithm.options, "algorithm"), cfg)
        if why is not None:
            raise ConfigError(f"secure aggregation shows the server only sums over the clients, but {why}; deploy without --secure-aggregation")
        why = round_refusal(clients_per_round(num_clients, cfg.sample_fraction), min_replies)
        if why is not None:
            raise ConfigError(f"secure aggregation (SecAgg+): {why}, or deploy without --secure-aggregation")


def check_hosts(server_hosts: Sequence[str], tls: bool) -> None:
    """:class:`ConfigError` unless each of ``server_hosts`` is a host name or an IP
    address, and unless there is one when ``tls`` (what the certificates name)."""
    if tls and not server_hosts:
        raise ConfigError(
            "--prepare-only serves the SuperLink over TLS (the default for several machines) and makes certificates for its host: "
            "give the names or addresses the SuperNodes dial with --server-host HOST (repeatable), or --insecure on a network you trust"
        )
    for host in server_hosts:
        alt_name(host)


def check_node_data(cfg: Config, node_data: Sequence[str], required: bool) -> None:
    """:class:`ConfigError` unless ``node_data`` (each client's own data, in client
    order) fits ``cfg``: one path per client with ``node_data=own``, none otherwise.
    ``required``: the SuperNodes run on this machine, which must have the paths;
    otherwise (``--prepare-only``) they are on the sites' machines, and may be left out
    (the commands then say ``DATA_K``)."""
    if cfg.node_data != "own":
        if node_data:
            raise ConfigError("--node-data gives each SuperNode its own data, which needs node_data=own in the config; add node_data=own")
        return
    num_clients = resolved_clients(cfg)
    if not node_data:
        if required:
            raise ConfigError(
                f"node_data=own: each of the {num_clients} SuperNodes needs its own data; give --node-data PATH once per client, in client order"
            )
        return
    if len(node_data) != num_clients:
        raise ConfigError(f"--node-data is given {len(node_data)} times but num_clients={num_clients}; give one PATH per client, in client order")
    for k, where in enumerate(node_data if required else ()):  # --prepare-only: paths on the sites' machines
        if not Path(where).expanduser().exists():
            raise ConfigError(f"--node-data {where} (client {k}) does not exist; give the path of that client's data")


LOCAL_WAIT_NODES_S = 30.0
"""``wait_nodes`` of a deployment on this machine: :func:`deploy` starts the run once
every SuperNode is up, so a client without a node after that long will not get one."""

SETTINGS = "deployment.json"
"""The file in a run directory's ``flower/`` folder that records its deployment's settings."""


@dataclass(frozen=True)
class Settings:
    """The settings of a run's deployment, recorded when it starts
    (``flower/deployment.json``) and kept by ``contrafl deploy --resume``: its security
    (TLS, SuperNode authentication, secure aggregation and its public ``max_weight``),
    each SuperNode's own data (``node_data=own``, this machine's paths), its Byzantine
    SuperNodes and their attack (``--byzantine-nodes``: not in the server's config) and
    its timeouts. DP is the run's config."""

    tls: bool = False
    auth: bool = False
    secure_aggregation: bool = False
    max_weight: int | None = None
    round_timeout: float = 600.0
    min_replies: int = 1
    wait_nodes: float = 120.0
    supernode_poll: float = POLL_S
    node_data: tuple[str, ...] = ()
    attackers: tuple[int, ...] = ()
    """The clients whose SuperNodes attack (``--byzantine-nodes``)."""
    node_attack: dict[str, str | int | float | bool] = dataclasses.field(default_factory=dict)
    """The node config keys of their attack (:func:`contrafl.flower.byzantine.split`)."""

    SECURITY = {"tls": ("TLS", "--insecure"), "auth": ("SuperNode authentication", "--no-auth"),
                "secure_aggregation": ("secure aggregation", "--no-secure-aggregation")}
    """Each security setting: its name, and the option that drops it."""

    def write(self, path: Path) -> None:
        """Record the settings in the run directory ``path``."""
        folder = Path(path) / "flower"
        folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps({**dataclasses.asdict(self), "node_data": list(self.node_data), "attackers": list(self.attackers)}, indent=2).encode()
        write_atomic(folder / SETTINGS, lambda f: f.write(text))

    @classmethod
    def read(cls, path: Path) -> Settings:
        """The settings recorded in the run directory ``path``. A run deployed before
        they were recorded: TLS and authentication where it has certificates and keys,
        its SuperNodes' data from ``flower/node-data.json``."""
        folder = Path(path) / "flower"
        file = folder / SETTINGS
        if not file.exists():
            legacy = folder / "node-data.json"
            return cls(tls=(folder / "certs").is_dir(), auth=(folder / "keys").is_dir(),
                       node_data=tuple(_paths(legacy)) if legacy.exists() else ())
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        try:
            data = json.loads(file.read_text())
            if not isinstance(data, dict) or set(data) - set(fields):
                raise ValueError(f"keys other than {', '.join(fields)}")
            data["node_data"] = tuple(_paths(file, data.get("node_data", [])))
            data["attackers"] = tuple(data.get("attackers", []))
            if not all(isinstance(c, int) and not isinstance(c, bool) for c in data["attackers"]) or not isinstance(data.get("node_attack", {}), dict):
                raise ValueError("attackers are not client ids, or node_attack is not node config keys")
            settings = cls(**data)
            for name in ("tls", "auth", "secure_aggregation"):
                if not isinstance(getattr(settings, name), bool):
                    raise ValueError(f"{name} is not true or false")
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"--resume {path}: {file} is not a deployment's settings ({exc}); resume with the settings given again, after removing it") from None
        return settings

    def overridden(self, path: Path, asked: dict[str, Any], weaker_allowed: bool) -> Settings:
        """These settings (the recorded ones of the run ``path``, or a new run's
        defaults) with ``asked`` over them (the options given, None where not).
        Dropping a security setting is refused (:class:`ConfigError`, one line naming
        it) unless ``weaker_allowed``."""
        for name, (what, option) in self.SECURITY.items():
            if getattr(self, name) and asked.get(name) is False and not weaker_allowed:
                raise ConfigError(
                    f"--resume {path}: the run was deployed with {what}, which {option} would drop; "
                    f"leave {option} out to keep it, or add --allow-weaker-security to resume without it"
                )
        return dataclasses.replace(self, **{k: v for k, v in asked.items() if v is not None})


def _paths(file: Path, paths: Any = None) -> list[str]:
    """A list of paths: ``paths``, or the JSON in ``file``; ValueError otherwise."""
    if paths is None:
        paths = json.loads(file.read_text())
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ConfigError(f"{file} does not list the SuperNodes' data as paths; start the run again with --node-data")
    return paths


def deploy(
    cfg: Config, path: Path, settings: Settings, *, prepared: bool = False, timeout: float | None = None,
    echo: TextIO | None = None,
) -> RunResult:
    """Run ``cfg`` on a SuperLink and ``num_clients`` SuperNodes on this machine with
    ``settings`` (recorded in ``path/flower`` for a resume: :class:`Settings`); the run
    directory is ``path``, the Flower processes' homes and logs are in ``path/flower``.
    ``prepared``: the run directory is already written (by :func:`prepare_run`, or by
    an earlier deployment: the run continues from its last checkpoint), ``cfg`` is its
    ``config.yaml``. The server's output (its progress) also goes to ``echo`` when given.

    The SuperNodes are ``contrafl-supernode`` s that wait at most ``supernode_poll``
    seconds between their pulls of messages (:mod:`contrafl.flower.supernode`); ``tls``
    and ``auth``: :class:`~contrafl.flower.launch.LocalDeployment`'s;
    ``secure_aggregation``: the training rounds run through SecAgg+
    (:mod:`contrafl.flower.secagg`); ``node_data``: with ``node_data=own``, each client's
    own data, in client order (node config ``data``); ``attackers``: the clients whose
    SuperNodes make the attack of the node config keys ``node_attack``
    (:mod:`contrafl.flower.byzantine`; ``cfg`` is then the server's, ``attack=none``).

    Processes that an earlier deployment of ``path`` left running (it was killed) are
    ended first, with a line on ``echo``. When the deployment ends before the run does,
    every process is stopped, ``summary.json`` says how the run ended (:func:`record_stop`)
    and a :class:`ContraflError` says it in one line: what died or what failed, the last
    round completed and the ``--resume`` command; the checkpoint is kept."""
    check_settings(cfg, settings.round_timeout, settings.min_replies, settings.secure_aggregation, settings.max_weight)
    check_node_data(cfg, settings.node_data, required=True)
    if not prepared:
        cfg = prepare_run(cfg, path)
    node_configs = shared_cores(cfg.num_clients)
    resolved = [str(Path(where).expanduser().resolve()) for where in settings.node_data]
    for config, where in zip(node_configs, resolved):
        config["data"] = where
    for cid in settings.attackers:
        node_configs[cid].update(settings.node_attack)
    settings = dataclasses.replace(settings, node_data=tuple(resolved))
    settings.write(path)
    deployment = LocalDeployment(
        Path(path) / "flower", cfg.num_clients, tls=settings.tls, auth=settings.auth, node_configs=node_configs,
        supernode_poll=settings.supernode_poll,
    )
    try:
        with deployment:
            if deployment.leftovers and echo is not None:
                print(f"contrafl: ended what the run's earlier deployment left running: {', '.join(deployment.leftovers)}", file=echo, flush=True)
            rc = run_config(path, settings.round_timeout, settings.min_replies, settings.wait_nodes, settings.secure_aggregation,
                            settings.max_weight)
            result = deployment.run(APP_DIR, rc, timeout=timeout, echo=echo)
    except (FlowerLaunchError, KeyboardInterrupt) as exc:
        raise record_stop(path, cfg.rounds, exc) from None
    ended = read_summary(path)
    if ended.get("status") != "completed":  # the ServerApp ended the run, and said why in summary.json
        raise ContraflError(ended.get("error") or f"the run ended as {ended.get('status')}; see {path / 'summary.json'}")
    return result


def rounds_done(path: Path) -> int:
    """The rounds the run in ``path`` has completed (its rows in ``metrics.jsonl``)."""
    try:
        return sum(1 for line in (Path(path) / "metrics.jsonl").read_text().splitlines() if line.strip())
    except OSError:
        return 0


def record_stop(path: Path, rounds: int, exc: BaseException) -> BaseException:
    """Record in ``summary.json`` how the run in ``path`` (of ``rounds`` rounds) ended
    when its deployment stopped because of ``exc``, once the deployment's processes are
    stopped; what to raise in its place: ``exc`` for a KeyboardInterrupt (recorded as
    ``interrupted``), else a :class:`ContraflError` whose one line says what died or
    failed, the last round completed and how to resume (recorded as ``failed``). A run
    its ServerApp ended as failed keeps the ServerApp's reason."""
    summary = read_summary(path)
    done = rounds_done(path)
    resume = f"`contrafl deploy --resume {path}`"
    when = f"after round {done} of {rounds}" if done else f"before round 1 of {rounds}"
    if isinstance(exc, KeyboardInterrupt):
        status, why = "interrupted", f"contrafl deploy was interrupted {when}; continue with {resume}"
    elif summary.get("status") == "failed" and not isinstance(exc, DeploymentDied) and summary.get("error"):
        why = re.sub(r"^\w+(Error|Gone): ", "", summary["error"])  # the summary's "Type: message"
        return ContraflError(f"{why} (round {done + 1} of {rounds}; once that is fixed, continue with {resume})")
    else:
        what = exc.what if isinstance(exc, DeploymentDied) else f"the Flower deployment stopped ({str(exc).splitlines()[0]})"
        status, why = "failed", f"{what} {when}; continue from its last checkpoint with {resume}"
    try:
        run_dir = RunDir(Path(path), resume=True)
    except ConfigError as locked:
        return ContraflError(f"{why} ({locked})")
    try:
        run_dir.write_json("summary.json", {"status": status, "error": why, **{k: v for k, v in summary.items() if k not in ("status", "error")}})
    finally:
        run_dir.close()
    return exc if isinstance(exc, KeyboardInterrupt) else ContraflError(why)


def shared_cores(num_nodes: int) -> list[dict[str, int | str]]:
    """Node configs for ``num_nodes`` SuperNodes on this machine: each client's torch
    gets an equal share of the cores (more threads than cores make every client wait
    for the others' spinning threads)."""
    return [{"threads": cores_each(num_nodes)} for _ in range(num_nodes)]


def simulator_threads(cfg: Config) -> int:
    """torch's threads for each client in ``contrafl run`` of the resolved config ``cfg``
    on this machine: what SuperNodes need (node config ``threads``) for the simulator's
    numbers bit for bit."""
    if cfg.executor in ("parallel", "distributed"):
        return cores_each(cfg.workers or cpu_cores())
    return torch.get_num_threads()


#: Port of the SuperLink in the commands of :func:`commands` (flwr's default).
SUPERLINK_PORT = 8000
#: Port of a SuperNode's ClientApp API in those commands (flwr's default).
SUPERNODE_PORT = 9094
#: How long the certificates of :func:`commands` are valid.
CERTIFICATES_VALID = dt.timedelta(days=365)
#: The address the SuperLink's own SuperExec (which starts the ServerApp) dials: flwr 1.41
#: turns ``--host 0.0.0.0`` into it, so the SuperLink's certificate must name it too.
SUPEREXEC_HOST = "127.0.0.1"


def commands(
    path: Path, cfg: Config, round_timeout: float = 600.0, min_replies: int = 1, wait_nodes: float = 120.0, *,
    server_hosts: Sequence[str] = (), tls: bool = False, auth: bool = False, secure_aggregation: bool = False,
    node_data: Sequence[str] = (), max_weight: int | None = None, attackers: Sequence[int] = (),
    node_attack: Mapping[str, str | int | float | bool] | None = None,
) -> str:
    """How to run the prepared run directory ``path`` of the resolved config ``cfg`` on a
    Flower deployment of one's own (SuperLink and SuperNodes on any machines): the
    commands, with the app's run config written to ``path/flower-run.toml``.

    ``server_hosts``: the SuperLink's host names or addresses that the SuperNodes and
    the ``flwr`` CLI dial (the first goes into the commands; default: ``SERVER``).
    ``tls``: certificates for ``server_hosts`` and :data:`SUPEREXEC_HOST` are made in
    ``path/flower/certs`` (:func:`contrafl.flower.tls.make_certificates`, valid for a
    year) and used. ``auth`` (needs ``tls``): SuperNode authentication, with a key pair
    per client in ``path/flower/keys`` (:func:`contrafl.flower.auth.make_node_keys`):
    the commands register the public keys with the SuperLink and give each SuperNode
    its private key. ``node_data`` (``node_data=own``): each client's own data on its
    machine, in client order (default: ``DATA_K``), named in its command; such a client's
    machine needs only ``config.yaml`` of the run directory. ``max_weight``: the public
    bound on a client's sample count of secure aggregation with ``node_data=own``.
    ``attackers``: the clients whose SuperNodes add the attack's node config keys
    ``node_attack`` to theirs (``--byzantine-nodes``)."""
    if auth and not tls:
        raise ConfigError("SuperNode authentication needs TLS (flwr 1.41 refuses --enable-supernode-auth with --insecure); drop --insecure, or add --no-auth")
    check_settings(cfg, round_timeout, min_replies, secure_aggregation, max_weight)
    check_hosts(server_hosts, tls)
    path = Path(path).resolve()
    rc = path / "flower-run.toml"
    rc.write_text(toml_document(run_config(path, round_timeout, min_replies, wait_nodes, secure_aggregation, max_weight)))
    server = server_hosts[0] if server_hosts else "SERVER"
    address = f"[{server}]:{SUPERLINK_PORT}" if ":" in server else f"{server}:{SUPERLINK_PORT}"
    check_node_data(cfg, node_data, required=False)
    own = cfg.node_data == "own"
    threads = simulator_threads(cfg)
    data_setting = " data='DATA_K'" if own else (" data-dir='DATA_DIR'" if cfg.data_dir else "")
    node_config = "partition-id=K run-dir='RUN_DIR'" + data_setting + f" threads={threads}"
    copies = "config.yaml" if own else "config.yaml and partition.json"
    if tls:
        named = list(dict.fromkeys([*server_hosts, SUPEREXEC_HOST]))
        certs = make_certificates(path / "flower" / "certs", named, valid_for=CERTIFICATES_VALID)
        link_security = " ".join(
            f"--ssl-{kind} {shlex.quote(str(file))}" for kind, file in
            (("ca-certfile", certs.ca_cert), ("certfile", certs.server_cert), ("keyfile", certs.server_key))
        )
        node_security = "--root-certificates RUN_DIR/flower/certs/ca.crt"
        cli_security = f"root-certificates = {toml_string(str(certs.ca_cert))}"
        copies = f"{copies.replace(' and ', ', ')} and flower/certs/ca.crt"
        secured = (
            f" (TLS: certificates for {', '.join(named)} in {certs.ca_cert.parent}, valid for {CERTIFICATES_VALID.days} days;"
            f" {SUPEREXEC_HOST} is where the SuperLink's own SuperExec dials it)"
        )
    else:
        link_security = node_security = "--insecure"
        cli_security, secured = "insecure = true", ""
    last = cfg.num_clients - 1
    register: list[str] = []
    if auth:
        make_node_keys(path / "flower" / "keys", cfg.num_clients)
        link_security += " --enable-supernode-auth"
        node_security += " --auth-supernode-private-key RUN_DIR/flower/keys/node-K"
        copies = copies.replace(" and flower/certs/ca.crt", ", flower/certs/ca.crt and its private key flower/keys/node-K (to that machine only)")
        secured += f"; SuperNode authentication: a key pair per client in {path / 'flower' / 'keys'}"
        register = [
            f"  2. once the SuperLink is up, register each client's public key (K = 0..{last}) from a machine whose $FLWR_HOME/config.toml names the SuperLink as CONNECTION"
            f" (address = \"{address}\", {cli_security}); only SuperNodes with these keys may join:",
            f"    flwr supernode register {shlex.quote(str(path / 'flower' / 'keys'))}/node-K.pub CONNECTION",
        ]
    step = 3 if auth else 2
    supernode = f"    FLWR_HOME=NODE_HOME flower-supernode {node_security} --superlink {address} --port {SUPERNODE_PORT} --node-config \"{node_config}\""
    if own and node_data:
        supernode = "\n".join(
            supernode.replace("DATA_K", str(where)).replace("node-K", f"node-{k}").replace("partition-id=K", f"partition-id={k}")
            for k, where in enumerate(node_data)
        )
    where_data = (
        f", its own data in {'the path its command names' if node_data else 'DATA_K'} (node_data=own: no other machine holds them, "
        "and it needs no partition.json)" if own
        else ", the dataset in DATA_DIR" if cfg.data_dir else ""
    )
    return "\n".join([
        f"The run directory {path} is ready. On a Flower deployment of your own (flwr 1.41; contrafl[flower] and the same torch on every machine):",
        f"  1. on the server machine, the SuperLink on port {SUPERLINK_PORT} of every interface{secured}:",
        f"    flower-superlink {link_security} --disable-runtime-dependency-installation --host 0.0.0.0 --port {SUPERLINK_PORT}",
        *register,
        f"  {step}. for each client K = 0..{last}, on its machine: {copies} of the run directory copied to RUN_DIR (same places)"
        + where_data
        + ", a FLWR_HOME of its own (NODE_HOME) and, for SuperNodes sharing a machine, a --port each:",
        supernode,
        f"     (threads={threads}: each client's torch threads in `contrafl run` of this config on this machine, executor={cfg.executor}; its metrics bit for bit need the same)",
        *byzantine_line(attackers, node_attack or {}),
        f"  {step + 1}. once every SuperNode is up, from a machine whose $FLWR_HOME/config.toml names the SuperLink as CONNECTION (address = \"{address}\", {cli_security}):",
        f"    flwr run {shlex.quote(str(APP_DIR))} CONNECTION --stream --run-config {shlex.quote(str(rc))}",
        "(docs/flower.md: several machines, TLS, SuperNode authentication, faults and restarts)",
    ])


def byzantine_line(attackers: Sequence[int], node_attack: Mapping[str, str | int | float | bool]) -> list[str]:
    """The line of :func:`commands` that makes ``attackers``' SuperNodes Byzantine (none without)."""
    if not attackers:
        return []
    ids = ", ".join(map(str, attackers))
    which = f"SuperNodes of clients {ids} add" if len(attackers) > 1 else f"SuperNode of client {ids} adds"
    return [f"     (Byzantine SuperNodes: the {which} {node_config_text(node_attack)} to its --node-config; "
            "the server's config.yaml says attack=none, docs/flower.md \"Byzantine SuperNodes\")"]
