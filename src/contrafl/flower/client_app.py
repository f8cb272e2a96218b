"""contrafl's Flower ClientApp: a SuperNode serves the client ``partition-id`` of its node
config (``--node-config "partition-id=K"``) for the run in the run config's ``run-dir``."""

from __future__ import annotations

from pathlib import Path

from .codec import decode, encode  # first: a clear error when flwr is missing
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .client import FlowerClient
from .server import info_record

app = ClientApp()


def partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of the client's local training on the received message."""
    request = decode(msg.content)
    state_dir = context.node_config.get("state-dir")
    client = FlowerClient(Path(str(context.run_config["run-dir"])), partition_id(context), Path(str(state_dir)) if state_dir else None)
    if int(request["client"]) != client.cid:
        raise ValueError(f"a message for client {request['client']} reached the SuperNode of partition {client.cid}")
    return Message(encode(client.train(int(request["round"]), request["message"])), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The partition this SuperNode serves."""
    return Message(info_record(partition_id(context)), reply_to=msg)
