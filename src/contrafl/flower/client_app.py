"""contrafl's Flower ClientApp: a SuperNode serves the client ``partition-id`` of its node
config (``--node-config "partition-id=K"``) for the run in the run config's ``run-dir``.

Other node config keys, for SuperNodes on other machines than the server:

* ``run-dir``: this machine's copy of the run directory (its ``config.yaml`` and
  ``partition.json`` are all a client reads); default: the run config's;
* ``data-dir``: where this machine has the dataset; default: the config's ``data_dir``;
* ``state-dir``: where the client keeps its state; default: ``<run-dir>/flower-clients``;
* ``threads``: torch's intra-op threads for the client (several SuperNodes on one
  machine share its cores); default: torch's (all cores).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .codec import decode, encode  # first: a clear error when flwr is missing
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .client import FlowerClient
from .server import info_record

app = ClientApp()


def partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


def open_client(msg: Message, context: Context) -> tuple[FlowerClient, dict]:
    """The SuperNode's client and the decoded request (checked to be meant for it)."""
    request = decode(msg.content)
    node = context.node_config

    def path(key: str) -> Path | None:
        return Path(str(node[key])) if node.get(key) else None

    if node.get("threads"):
        torch.set_num_threads(int(node["threads"]))
    run_dir = path("run-dir") or Path(str(context.run_config["run-dir"]))
    client = FlowerClient(run_dir, partition_id(context), path("state-dir"), path("data-dir"))
    if int(request["client"]) != client.cid:
        raise ValueError(f"a message for client {request['client']} reached the SuperNode of partition {client.cid}")
    return client, request


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of the client's local training on the received message."""
    client, request = open_client(msg, context)
    reply = client.train(int(request["round"]), request["message"], int(request["checkpointed"]))
    return Message(encode(reply), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The client's personal model on its test data (``{}`` when it has none)."""
    client, request = open_client(msg, context)
    return Message(encode(client.evaluate(int(request["round"]), request["message"]) or {}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The partition this SuperNode serves."""
    return Message(info_record(partition_id(context)), reply_to=msg)
