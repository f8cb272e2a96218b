"""contrafl's Flower ClientApp: a SuperNode serves the client ``partition-id`` of its node
config (``--node-config "partition-id=K"``) for the run in the run config's ``run-dir``;
:mod:`contrafl.flower.node` lists the other node config keys.

Flower starts a new ClientApp process for every message. This module imports neither
torch nor the engine: it checks the node config and hands the message to the
SuperNode's worker (:mod:`contrafl.flower.worker`), a process that keeps torch, the
client's data and its model loaded between messages, or, with the node config
``worker=false``, answers in this process.

With the run config ``secure-aggregation=true`` a train message (and a federated
evaluation's) comes as a SecAgg+ ``FitIns`` (Flower's ``secaggplus_mod`` handles the
protocol's other stages, within contrafl's rules: :func:`~contrafl.flower.secagg.secure_mod`),
and the reply goes back as the ``FitRes`` it masks (:mod:`contrafl.flower.secagg`), or,
when the client's own check rejected its update, as an error reply of code
:data:`~contrafl.flower.secagg.REJECTED` with the reason.

A node config that does not fit the run (no ``partition-id``, one that is not a client
of the run, a ``run-dir`` without the run's files) is reported as one line, in the
SuperNode's log and to the server: in the answer to the server's first message, the
query of which partition the SuperNode serves, and in the error reply of a train or
evaluate message (:data:`~contrafl.flower.node.USER_ERROR`).
"""

from __future__ import annotations

import sys

from .node import USER_ERROR, NodeSettings, info_record, number, reported  # first: a clear error when flwr is missing
from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from ..errors import ConfigError, ContraflError
from . import worker
from .secagg import REJECTED, UpdateRejected, is_evaluation, is_secure_request, reply_fitres, secure_mod, unwrap_request

app = ClientApp(mods=[secure_mod])


def serve(msg: Message, context: Context) -> Message:
    """The reply to a train or evaluate message, by the SuperNode's worker or this
    process; a user error (a node config or data that do not fit the run) becomes an
    error reply with its one-line message."""
    try:
        settings = NodeSettings.of(context)
        settings.check()
        request, rounding_seed, spec = unwrap_request(msg.content) if is_secure_request(msg.content) else (msg.content, None, None)
        kind = MessageType.EVALUATE if spec is not None and is_evaluation(request) else msg.metadata.message_type  # a secure evaluation comes as SecAgg+'s train
        if settings.worker:
            content = worker.request(settings, kind, request)
        else:
            from .client import FlowerClient

            content = FlowerClient.of(settings).answer(kind, request)
        return Message(content if spec is None else reply_fitres(content, rounding_seed, spec), reply_to=msg)
    except UpdateRejected as exc:
        print(f"contrafl: this client's update is rejected before masking and enters no secure sum: {exc}", file=sys.stderr, flush=True)
        return Message(Error(REJECTED, str(exc)), reply_to=msg)
    except ContraflError as exc:
        return Message(Error(USER_ERROR, reported(exc, context)), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of the client's local training on the received message."""
    return serve(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The client's personal model on its test data (``{}`` when it has none)."""
    return serve(msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The partition this SuperNode serves, and why it cannot serve it, if its node config
    or its data do not fit the run. The answer comes once the client is loaded (by the
    SuperNode's worker, which keeps it): the data, checked against the run, and the
    model. So the server starts round 1 with clients that are ready, and no round's
    ``round-timeout`` counts a client's start-up."""
    try:
        settings = NodeSettings.of(context)
        own = settings.check()
        if settings.worker:
            worker.request(settings, msg.metadata.message_type, RecordDict())
        elif own or settings.attack is not None:  # without a worker, the node's own data and attack are still checked before they are used
            from .client import FlowerClient

            FlowerClient.of(settings)
        problem = None
    except ContraflError as exc:
        problem = reported(exc, context)
    try:
        partition = number(context.node_config, "partition-id")
    except ConfigError:
        partition = None
    return Message(info_record(partition, problem), reply_to=msg)
