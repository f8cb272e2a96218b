"""The server side of a contrafl run on Flower: the simulator's round loop with its
clients reached through a Flower grid.

:class:`GridTransport` is a :class:`contrafl.engine.simulation.Transport`: it sends each
sampled client its message (the algorithm's broadcast or per-client message) as a train
message to the SuperNode serving that client's partition, and turns the replies into
:class:`~contrafl.engine.simulation.ClientOutcome` s; with ``eval_personal``, every
client gets an evaluate message and answers with its personal model's scores.
Everything else (sampling, validation of the replies, aggregation, the server
optimiser, evaluation of the global model, metrics and checkpoints) is the simulator's
own code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from ..algorithms.base import Phase, Reply
from ..engine.simulation import ClientOutcome, Scores
from ..errors import ContraflError
from .codec import decode, encode  # first: a clear error when flwr is missing
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

POLL_S = 0.2


class GridTransport:
    """The server's clients on a Flower grid (a :class:`~contrafl.engine.simulation.Transport`).

    Args:
        grid: the ServerApp's grid.
        round_timeout: seconds a round (or an evaluation) waits for replies.
        min_replies: the fewest replies a round needs: after ``round_timeout`` the
            clients that have not answered are recorded as lost if at least this many
            did, else the run stops (resumable from its last checkpoint).
        wait_nodes: seconds to wait for a node of every client to come online.
        checkpointed: the round of the server's last checkpoint, sent with each train
            message (the clients keep the state a server resuming from it needs).
    """

    def __init__(
        self, grid: Grid, round_timeout: float, min_replies: int, wait_nodes: float = 120.0,
        checkpointed: Callable[[], int] = lambda: 0,
    ) -> None:
        self.grid = grid
        self.round_timeout = round_timeout
        self.min_replies = min_replies
        self.wait_nodes = wait_nodes
        self.checkpointed = checkpointed
        self.partition_of: dict[int, int] = {}  # node id -> client id
        self.queries: dict[str, int] = {}  # message id of an unanswered query -> node id

    def train(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], phases: list[Phase]
    ) -> Iterator[ClientOutcome]:
        """Train messages to the nodes of ``cids``; their outcomes as the replies arrive,
        then the clients lost (no node, an error, or no reply within ``round_timeout``)."""
        cid_of, absent = self.send(t, cids, message_for, MessageType.TRAIN, {"checkpointed": self.checkpointed()})
        for cid in absent:
            yield ClientOutcome(cid, None, lost=f"no SuperNode serves partition {cid}")
        answered: set[str] = set()
        ok = 0
        for reply in self.replies(list(cid_of), self.round_timeout):
            message_id = reply.metadata.reply_to_message_id
            answered.add(message_id)
            cid = cid_of[message_id]
            if reply.has_error():
                self.forget(cid)
                yield ClientOutcome(cid, None, lost=f"error {reply.error.code}: {reply.error.reason}")
            else:
                ok += 1
                yield outcome_of(cid, decode(reply.content))
        missing = sorted(set(cid_of) - answered)
        if missing and ok < self.min_replies:
            raise ContraflError(
                f"round {t + 1}: {ok} of {len(cids)} clients replied within round_timeout="
                f"{self.round_timeout:g}s, fewer than min_replies={self.min_replies}; resume the run once the SuperNodes are up"
            )
        for message_id in missing:
            self.forget(cid_of[message_id])
            yield ClientOutcome(cid_of[message_id], None, lost=f"no reply within {self.round_timeout:g}s")

    def evaluate(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]]
    ) -> Iterator[tuple[int, Scores | None]]:
        """Evaluate messages to the nodes of ``cids``; the scores of those that reply
        within ``round_timeout``."""
        cid_of, _ = self.send(t, cids, message_for, MessageType.EVALUATE, {})
        for reply in self.replies(list(cid_of), self.round_timeout):
            cid = cid_of[reply.metadata.reply_to_message_id]
            if reply.has_error():
                self.forget(cid)
            else:
                yield cid, decode(reply.content) or None

    def send(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], kind: str, extra: dict[str, Any]
    ) -> tuple[dict[str, int], list[int]]:
        """Push a ``kind`` message for round ``t`` to the node of each of ``cids``:
        ``({message id: cid}, clients without a node)``."""
        node_of = self.nodes(cids)
        sent = [
            (cid, Message(encode({"round": t, "client": cid, "message": message_for(cid), **extra}), dst_node_id=node_of[cid], message_type=kind, group_id=str(t)))
            for cid in cids
            if cid in node_of
        ]
        cid_of = dict(zip(self.grid.push_messages([m for _, m in sent]), (cid for cid, _ in sent)))
        return cid_of, [cid for cid in cids if cid not in node_of]

    def replies(self, message_ids: list[str], timeout: float) -> Iterator[Message]:
        """The replies to ``message_ids`` as they arrive (polled every ``POLL_S``), until
        all are in or ``timeout`` seconds have passed."""
        pending = set(message_ids)
        deadline = time.monotonic() + timeout
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                if reply.metadata.reply_to_message_id in pending:
                    pending.discard(reply.metadata.reply_to_message_id)
                    yield reply
            if pending:
                if time.monotonic() > deadline:
                    return
                time.sleep(POLL_S)

    def nodes(self, cids: list[int]) -> dict[int, int]:
        """``{client id: node id}`` of the online SuperNodes the server knows, waiting
        up to ``wait_nodes`` seconds for a node of each. Nodes not seen before are asked
        which partition they serve (a query message); their answers are collected as
        they come, so a node that never answers (it died) delays nothing."""
        deadline = time.monotonic() + self.wait_nodes
        while True:
            online = {int(n) for n in self.grid.get_node_ids()}
            node_of = {cid: node for node, cid in self.partition_of.items() if node in online}
            if all(cid in node_of for cid in cids) or time.monotonic() > deadline:
                return node_of
            asked = set(self.queries.values())
            new = sorted(n for n in online if n not in self.partition_of and n not in asked)
            if new:
                messages = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in new]
                self.queries.update(zip(self.grid.push_messages(messages), new))
            for reply in self.grid.pull_messages(list(self.queries)) if self.queries else []:
                node = self.queries.pop(reply.metadata.reply_to_message_id, None)
                if node is not None and not reply.has_error():
                    self.partition_of[node] = int(reply.content["info"]["partition-id"])
            time.sleep(POLL_S)

    def forget(self, cid: int) -> None:
        """Drop the node of client ``cid``: a restarted SuperNode comes back with a new id."""
        self.partition_of = {node: c for node, c in self.partition_of.items() if c != cid}


def outcome_of(cid: int, tree: dict[str, Any]) -> ClientOutcome:
    """A decoded reply (``payload``, ``num_samples``, ``loss``, ``steps``) as the client's
    outcome; the reply names the client it came from, for the engine's validation."""
    reply = Reply(cid, tree["num_samples"], tree["payload"])
    return ClientOutcome(cid, reply, tree["loss"], int(tree["steps"]))


def info_record(partition_id: int) -> RecordDict:
    """A query's answer: the partition a SuperNode serves."""
    return RecordDict({"info": ConfigRecord({"partition-id": partition_id})})
