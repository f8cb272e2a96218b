"""What a SuperNode's node config says about the client it serves, read without torch
(the ClientApp process of every message reads it; :mod:`contrafl.flower.worker` does the
work).

Node config keys, for SuperNodes on other machines than the server:

* ``partition-id``: the client the SuperNode serves (required);
* ``run-dir``: this machine's copy of the run directory (its ``config.yaml`` and
  ``partition.json`` are all a client reads); default: the run config's;
* ``data-dir``: where this machine has the dataset (``node_data=shared``); default: the
  config's ``data_dir``;
* ``data``: this node's own data, in the run's dataset format (``node_data=own``: each
  node holds only its own data and needs no ``partition.json``; required there);
* ``state-dir``: where the client keeps its state; default: ``<run-dir>/flower-clients``;
* ``threads``: torch's intra-op threads for the client (several SuperNodes on one
  machine share its cores); default: torch's (all cores);
* ``worker``: ``true`` (default) serves the messages in a worker process that stays
  alive between them (:mod:`contrafl.flower.worker`), ``false`` in the ClientApp process
  of each message, as Flower runs ClientApps;
* ``attack``: the attack this SuperNode makes as a Byzantine client (``attack='scaling'``,
  a name of ``contrafl list attacks``), with its options as ``attack-OPTION`` keys
  (``attack-scale=5``, ``attack-rounds='[2,3]'``): the node poisons its own data (data
  attacks) and crafts its own reply from its update alone (:mod:`contrafl.flower.byzantine`);
  the server's config knows nothing of it.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import require_flwr

require_flwr()
from flwr.app import ConfigRecord, Context, RecordDict  # noqa: E402

from ..config import load_config  # noqa: E402
from ..errors import ConfigError, ContraflError  # noqa: E402

USER_ERROR = 100
"""The code of the error reply of a ClientApp that cannot serve a message because of the
user's setup (a node config or data that do not fit the run); its reason is the one-line
message (Flower's own codes are below 100)."""


def number(node_config: dict[str, Any], key: str) -> int | None:
    """The whole number ``key`` of a node config (None when it is not there)."""
    value = node_config.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not str(value).lstrip("-").isdigit():
        raise ConfigError(f"node config {key}={value!r} is not a whole number; restart the SuperNode with --node-config \"{key}=N ...\"")
    return int(value)


def flag(node_config: dict[str, Any], key: str, default: bool) -> bool:
    """The true/false value ``key`` of a node config (``default`` when it is not there)."""
    value = node_config.get(key)
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ConfigError(f"node config {key}={value!r} is not true or false; restart the SuperNode with --node-config \"{key}=true\" or \"{key}=false\"")


ATTACK = "attack"
"""The node config key of a Byzantine SuperNode's attack; its options are ``attack-OPTION``."""
CHOSEN_BY_SERVER = ("clients", "fraction", "choice")
"""Attack options that choose the attackers: a SuperNode attacks as its own client, alone."""


def attack_settings(node_config: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The attack of a node config (``attack``, None when it has none or ``'none'``) and its
    options (``attack-OPTION`` keys, by option name, lists as text); :class:`ConfigError`
    for an option without an attack, one that chooses the attackers, ``attack-omniscient=true``
    or a dotted ``attack.OPTION`` key. The attack's name and the options' values are checked
    where the client is loaded (:func:`contrafl.flower.byzantine.node_attack`)."""
    dotted = sorted(k for k in node_config if str(k).startswith(ATTACK + "."))
    if dotted:
        raise ConfigError(
            f"node config key {dotted[0]!r} is not read: a SuperNode's attack options are written attack-OPTION, "
            f"e.g. --node-config \"attack='scaling' {dotted[0].replace('.', '-', 1)}=5\""
        )
    options = {str(k)[len(ATTACK) + 1:].replace("-", "_"): v for k, v in node_config.items() if str(k).startswith(ATTACK + "-")}
    options = {k: str(v).replace(" ", "") if isinstance(v, list) else v for k, v in options.items()}
    name = node_config.get(ATTACK)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"node config attack={name!r} is not an attack's name; restart the SuperNode with --node-config \"attack='NAME' ...\" (`contrafl list attacks`)")
    if name is not None and name.strip().lower() == "none":
        name = None
    first = next(iter(options), None)
    if name is None and first is not None:
        raise ConfigError(
            f"node config attack-{first.replace('_', '-')}={options[first]!r} sets an option of no attack; "
            "add attack='NAME' (docs/flower.md, \"Byzantine SuperNodes\") or remove it"
        )
    chooser = next((k for k in CHOSEN_BY_SERVER if k in options), None)
    if chooser is not None:
        raise ConfigError(
            f"node config attack-{chooser}={options[chooser]!r}: a Byzantine SuperNode attacks as the client it serves "
            f"(partition-id), and it alone; remove attack-{chooser}"
        )
    if "omniscient" in options:
        if flag(node_config, "attack-omniscient", False):
            raise ConfigError(
                "node config attack-omniscient=true: a SuperNode sees only its own update, not the round's honest ones; "
                "remove attack-omniscient (omniscient attackers are simulated by the server: attack=NAME in the run's config)"
            )
        del options["omniscient"]
    return name, options


@dataclass(frozen=True)
class NodeSettings:
    """What a SuperNode's node config (and the run config) say about its client."""

    partition_id: int
    run_dir: str
    run_dir_setting: str
    """Where ``run_dir`` comes from, for messages: the node config's key, or the server's."""
    state_dir: str | None
    data_dir: str | None
    threads: int | None
    worker: bool = True
    data: str | None = None
    """The node's own data (``node_data=own``)."""
    attack: str | None = None
    """The attack this SuperNode makes (node config ``attack``), or None: an honest client."""
    attack_options: dict[str, Any] = field(default_factory=dict)
    """Its options (node config ``attack-OPTION``), by option name."""

    @classmethod
    def of(cls, context: Context) -> NodeSettings:
        """The settings of the SuperNode running ``context``; :class:`ConfigError` when
        its node config lacks ``partition-id`` or gives a value of the wrong kind."""
        node = context.node_config

        def path(key: str) -> str | None:
            return str(node[key]) if node.get(key) else None

        cid = number(node, "partition-id")
        if cid is None:
            raise ConfigError("the node config has no partition-id: restart the SuperNode with --node-config \"partition-id=K ...\", K the client it serves")
        threads = number(node, "threads")
        if threads is not None and threads < 1:
            raise ConfigError(f"node config threads={threads} must be at least 1 (torch's threads for the client)")
        if path("run-dir") is not None:
            run_dir, setting = str(node["run-dir"]), f"node config run-dir='{node['run-dir']}'"
        else:
            run_dir = str(context.run_config["run-dir"])
            setting = f"run-dir='{run_dir}' (the server's; the node config sets no run-dir)"
        attack, options = attack_settings(node)
        return cls(
            cid, run_dir, setting, path("state-dir"), path("data-dir"), threads, flag(node, "worker", True), path("data"),
            attack, options,
        )

    def check(self) -> bool:
        """Whether the run's nodes hold their own data (``node_data=own``);
        :class:`ConfigError` unless the run directory has the run's files, the partition
        is one of its clients and the data the node config names exist (what a
        SuperNode can tell without loading the data)."""
        run_dir = Path(self.run_dir)
        if not (run_dir / "config.yaml").is_file():
            missing = [name for name in ("config.yaml", "partition.json") if not (run_dir / name).is_file()]
            raise ConfigError(
                f"{self.run_dir_setting}: no {' and no '.join(missing)} there; copy config.yaml and partition.json "
                "of the server's run directory (config.yaml alone where each node holds its own data) to this machine and "
                "restart the SuperNode with --node-config run-dir set to their folder"
            )
        cfg = load_config(run_dir / "config.yaml")
        if self.attack is not None and cfg.attack.name != "none":
            raise ConfigError(
                f"node config attack='{self.attack}', and the run's config.yaml has attack={cfg.attack.name}, whose attackers the server "
                "simulates; run the server with attack=none (contrafl deploy --byzantine-nodes does) or remove the node config's attack"
            )
        own = cfg.node_data == "own"
        restart = "restart the SuperNode with --node-config \"partition-id=K data='PATH' ...\""
        if own and self.data is None:
            raise ConfigError(f"this run's clients hold their own data (node_data=own), and the node config names none; {restart}, PATH this client's data")
        if own and not Path(self.data).exists():
            raise ConfigError(f"node config data='{self.data}' does not exist on this machine; {restart}, PATH this client's data")
        if not own and self.data is not None:
            raise ConfigError(
                f"node config data='{self.data}' names a node's own data, but this run shares one dataset (node_data=shared); "
                "restart the SuperNode with data-dir='DIR' (the dataset's folder) instead"
            )
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            raise ConfigError(
                f"node config data-dir='{self.data_dir}' is not a folder; copy the dataset files to this machine "
                "and restart the SuperNode with --node-config data-dir set to their folder"
            )
        if not own and not (run_dir / "partition.json").is_file():
            raise ConfigError(
                f"{self.run_dir_setting}: no partition.json there; copy config.yaml and partition.json "
                "of the server's run directory to this machine and restart the SuperNode with --node-config run-dir set to their folder"
            )
        if not 0 <= self.partition_id < cfg.num_clients:
            raise ConfigError(
                f"node config partition-id={self.partition_id} is not a client of the run (0..{cfg.num_clients - 1}); "
                "restart the SuperNode with the partition-id of the client it serves"
            )
        return own

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON values (:meth:`from_dict` reads them back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> NodeSettings:
        return cls(**values)


REPRODUCIBLE_WARNING = (
    "dp.noise=reproducible: the DP noise comes from config.yaml's seed, which the server and every SuperNode hold, "
    "so it protects nothing against them (for comparing a deployment with the simulator only)"
)


def reproducible_noise(cfg: Any) -> bool:
    """Whether run config ``cfg`` draws its DP noise from its seed (``dp.noise=reproducible``),
    which the ServerApp and every client say in their logs."""
    return cfg.dp.name != "none" and cfg.dp.options.get("noise") == "reproducible"


STATE_DIR = "flower-clients"
"""The folder of the clients' state files in a run directory (node config ``state-dir``
replaces it)."""


def client_state_dir(run_dir: str | Path, cid: int, state_dir: str | Path | None = None) -> Path:
    """Client ``cid``'s folder of state files: ``client-<cid>/`` in ``state_dir``
    (default: ``<run_dir>/flower-clients``)."""
    return Path(state_dir or Path(run_dir) / STATE_DIR) / f"client-{cid}"


PRIVATE_PATHS = ("data", "data-dir", "state-dir", "run-dir")
"""The node config keys that name this machine's paths, which the server is not told."""


def reported(exc: ContraflError, context: Context | None = None) -> str:
    """``exc``'s message, written to the SuperNode's log (one line), and what the server
    is told: the same with each path of ``context``'s node config (:data:`PRIVATE_PATHS`)
    replaced by its key (``<data>/train/x.png``), so that a refusal does not tell the
    server where a site keeps its data."""
    print(f"contrafl: {exc}", file=sys.stderr, flush=True)
    text = str(exc)
    node = context.node_config if context is not None else {}
    paths = {}
    for key in PRIVATE_PATHS:
        if node.get(key):
            raw = str(node[key])
            for form in {raw, str(Path(raw).expanduser()), str(Path(raw).expanduser().resolve())}:
                paths[form.rstrip("/") or form] = f"<{key}>"
    for path in sorted(paths, key=len, reverse=True):  # the longest first: a folder inside another
        text = text.replace(path, paths[path])
    return text


def info_record(partition_id: int | None, problem: str | None = None) -> RecordDict:
    """A query's answer: the partition a SuperNode serves (None: its node config does not
    say), and why it cannot serve it, if it cannot."""
    info: dict[str, int | str] = {} if partition_id is None else {"partition-id": partition_id}
    if problem is not None:
        info["problem"] = problem
    return RecordDict({"info": ConfigRecord(info)})
