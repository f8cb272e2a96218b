"""contrafl's Flower ClientApp: a SuperNode serves the client ``partition-id`` of its node
config (``--node-config "partition-id=K"``) for the run in the run config's ``run-dir``.

Other node config keys, for SuperNodes on other machines than the server:

* ``run-dir``: this machine's copy of the run directory (its ``config.yaml`` and
  ``partition.json`` are all a client reads); default: the run config's;
* ``data-dir``: where this machine has the dataset; default: the config's ``data_dir``;
* ``state-dir``: where the client keeps its state; default: ``<run-dir>/flower-clients``;
* ``threads``: torch's intra-op threads for the client (several SuperNodes on one
  machine share its cores); default: torch's (all cores).

A node config that does not fit the run (no ``partition-id``, one that is not a client
of the run, a ``run-dir`` without the run's files) is reported as one line, in the
SuperNode's log and to the server: in the answer to the server's first message, the
query of which partition the SuperNode serves, and in the error reply of a train or
evaluate message (:data:`~contrafl.flower.server.USER_ERROR`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .codec import decode, encode  # first: a clear error when flwr is missing
from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp

from ..config import load_config
from ..errors import ConfigError, ContraflError
from .client import FlowerClient
from .server import USER_ERROR, info_record

app = ClientApp()


def number(context: Context, key: str) -> int | None:
    """The whole number ``key`` of the node config (None when it is not there)."""
    value = context.node_config.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not str(value).lstrip("-").isdigit():
        raise ConfigError(f"node config {key}={value!r} is not a whole number; restart the SuperNode with --node-config \"{key}=N ...\"")
    return int(value)


@dataclass(frozen=True)
class NodeSettings:
    """What a SuperNode's node config (and the run config) say about its client."""

    partition_id: int
    run_dir: Path
    run_dir_setting: str
    """Where ``run_dir`` comes from, for messages: the node config's key, or the server's."""
    state_dir: Path | None
    data_dir: Path | None
    threads: int | None

    @classmethod
    def of(cls, context: Context) -> NodeSettings:
        """The settings of the SuperNode running ``context``; :class:`ConfigError` when
        its node config lacks ``partition-id`` or gives a value of the wrong kind."""
        node = context.node_config

        def path(key: str) -> Path | None:
            return Path(str(node[key])) if node.get(key) else None

        cid = number(context, "partition-id")
        if cid is None:
            raise ConfigError("the node config has no partition-id: restart the SuperNode with --node-config \"partition-id=K ...\", K the client it serves")
        threads = number(context, "threads")
        if threads is not None and threads < 1:
            raise ConfigError(f"node config threads={threads} must be at least 1 (torch's threads for the client)")
        if path("run-dir") is not None:
            run_dir, setting = path("run-dir"), f"node config run-dir='{node['run-dir']}'"
        else:
            run_dir = Path(str(context.run_config["run-dir"]))
            setting = f"run-dir='{run_dir}' (the server's; the node config sets no run-dir)"
        return cls(cid, run_dir, setting, path("state-dir"), path("data-dir"), threads)

    def check(self) -> None:
        """:class:`ConfigError` unless the run directory has the run's files, the
        partition is one of its clients and a ``data-dir`` given exists (what a SuperNode
        can tell without loading the data)."""
        if self.data_dir is not None and not self.data_dir.is_dir():
            raise ConfigError(
                f"node config data-dir='{self.data_dir}' is not a folder; copy the dataset files to this machine "
                "and restart the SuperNode with --node-config data-dir set to their folder"
            )
        missing = [name for name in ("config.yaml", "partition.json") if not (self.run_dir / name).is_file()]
        if missing:
            raise ConfigError(
                f"{self.run_dir_setting}: no {' and no '.join(missing)} there; copy config.yaml and partition.json "
                "of the server's run directory to this machine and restart the SuperNode with --node-config run-dir set to their folder"
            )
        clients = load_config(self.run_dir / "config.yaml").num_clients
        if not 0 <= self.partition_id < clients:
            raise ConfigError(
                f"node config partition-id={self.partition_id} is not a client of the run (0..{clients - 1}); "
                "restart the SuperNode with the partition-id of the client it serves"
            )

    def client(self) -> FlowerClient:
        """The SuperNode's client, with torch's threads set as the node config says."""
        self.check()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        return FlowerClient(self.run_dir, self.partition_id, self.state_dir, self.data_dir)


def reported(exc: ContraflError) -> str:
    """``exc``'s message, also written to the SuperNode's log (one line)."""
    print(f"contrafl: {exc}", file=sys.stderr, flush=True)
    return str(exc)


def serve(msg: Message, context: Context, work: Callable[[FlowerClient, dict], dict]) -> Message:
    """The reply to a train or evaluate message: ``work`` on the SuperNode's client and the
    decoded request (checked to be meant for it); a user error (a node config or data that
    do not fit the run) becomes an error reply with its one-line message."""
    try:
        client = NodeSettings.of(context).client()
        request = decode(msg.content)
        if int(request["client"]) != client.cid:
            raise ContraflError(f"a message for client {request['client']} reached the SuperNode of partition {client.cid}")
        return Message(encode(work(client, request)), reply_to=msg)
    except ContraflError as exc:
        return Message(Error(USER_ERROR, reported(exc)), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of the client's local training on the received message."""
    return serve(msg, context, lambda client, r: client.train(int(r["round"]), r["message"], int(r["checkpointed"])))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The client's personal model on its test data (``{}`` when it has none)."""
    return serve(msg, context, lambda client, r: client.evaluate(int(r["round"]), r["message"]) or {})


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The partition this SuperNode serves, and why it cannot serve it, if its node config
    does not fit the run."""
    try:
        NodeSettings.of(context).check()
        problem = None
    except ContraflError as exc:
        problem = reported(exc)
    try:
        partition = number(context, "partition-id")
    except ConfigError:
        partition = None
    return Message(info_record(partition, problem), reply_to=msg)
