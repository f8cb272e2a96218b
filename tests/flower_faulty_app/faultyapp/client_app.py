"""contrafl's ClientApp whose train replies a Flower mod corrupts when the SuperNode's
node config has ``fault``: ``"nan"`` puts a NaN into the first floating tensor of the
payload, ``"shape"`` drops the last row of that tensor; with ``pace`` (a file's path) it
sleeps the seconds the file holds, if it is there, before it trains: the rounds last
at least that long on any machine, for as long as the test wants."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from flwr.app import Context, Message, MessageType
from flwr.clientapp import ClientApp
from torch.utils import _pytree as pytree

from contrafl.flower import client_app
from contrafl.flower.codec import decode, encode


def corrupt(payload, fault: str):
    leaves, spec = pytree.tree_flatten(payload)
    i = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point())
    if fault == "nan":
        leaves[i] = leaves[i].clone()
        leaves[i].view(-1)[0] = float("nan")
    else:
        leaves[i] = leaves[i][:-1]
    return pytree.tree_unflatten(leaves, spec)


def fault_mod(msg: Message, context: Context, call_next) -> Message:
    pace = Path(str(context.node_config.get("pace", "")))
    if msg.metadata.message_type == MessageType.TRAIN and pace.is_file():
        time.sleep(float(pace.read_text() or 0))
    reply = call_next(msg, context)
    fault = context.node_config.get("fault")
    if fault and msg.metadata.message_type == MessageType.TRAIN and not reply.has_error():
        tree = decode(reply.content)
        tree["payload"] = corrupt(tree["payload"], str(fault))
        reply = Message(encode(tree), reply_to=msg)
    return reply


app = ClientApp(mods=[fault_mod])
app.train()(client_app.train)
app.evaluate()(client_app.evaluate)
app.query()(client_app.query)
