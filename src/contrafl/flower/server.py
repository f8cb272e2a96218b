"""The server side of a contrafl run on Flower: the simulator's round loop with its
clients reached through a Flower grid.

:class:`GridTransport` is a :data:`contrafl.engine.simulation.Transport`: it sends each
sampled client its message (the algorithm's broadcast or per-client message) as a train
message to the SuperNode serving that client's partition, and turns the replies into
:class:`~contrafl.engine.simulation.ClientOutcome` s. Everything else (sampling,
validation of the replies, aggregation, the server optimiser, evaluation, metrics and
checkpoints) is the simulator's own code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from ..algorithms.base import Phase, Reply
from ..engine.simulation import ClientOutcome
from ..errors import ContraflError
from .codec import decode, encode  # first: a clear error when flwr is missing
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

POLL_S = 0.2
QUERY_TIMEOUT_S = 60.0


class GridTransport:
    """Rounds over a Flower grid.

    Args:
        grid: the ServerApp's grid.
        round_timeout: seconds a round waits for replies.
        min_replies: the fewest replies a round needs: after ``round_timeout`` the
            clients that have not answered are recorded as lost if at least this many
            did, else the run stops (resumable from its last checkpoint).
        wait_nodes: seconds to wait for a node of every sampled client to come online.
    """

    def __init__(self, grid: Grid, round_timeout: float, min_replies: int, wait_nodes: float = 120.0) -> None:
        self.grid = grid
        self.round_timeout = round_timeout
        self.min_replies = min_replies
        self.wait_nodes = wait_nodes
        self.partition_of: dict[int, int] = {}  # node id -> client id

    def __call__(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], phases: list[Phase]
    ) -> Iterator[ClientOutcome]:
        node_of = self.nodes(cids)
        sent: list[tuple[int, Message]] = []
        for cid in cids:
            if cid not in node_of:
                yield ClientOutcome(cid, None, lost=f"no SuperNode serves partition {cid}")
                continue
            content = encode({"round": t, "client": cid, "message": message_for(cid)})
            sent.append((cid, Message(content, dst_node_id=node_of[cid], message_type=MessageType.TRAIN, group_id=str(t))))
        cid_of = dict(zip(self.grid.push_messages([m for _, m in sent]), (cid for cid, _ in sent)))
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
        """``{client id: node id}`` of the online SuperNodes, asking nodes not seen before
        which partition they serve; waits up to ``wait_nodes`` seconds for the nodes of
        ``cids``."""
        deadline = time.monotonic() + self.wait_nodes
        while True:
            online = sorted(int(n) for n in self.grid.get_node_ids())
            unknown = [n for n in online if n not in self.partition_of]
            if unknown:
                self.partition_of.update(self.query(unknown))
            node_of = {cid: node for node, cid in self.partition_of.items() if node in online}
            if all(cid in node_of for cid in cids) or time.monotonic() > deadline:
                return node_of
            time.sleep(1.0)

    def query(self, nodes: list[int]) -> dict[int, int]:
        """``{node id: partition id}`` from a query message to each of ``nodes``."""
        messages = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in nodes]
        ids = list(self.grid.push_messages(messages))
        node_of_id = dict(zip(ids, nodes))
        return {
            node_of_id[r.metadata.reply_to_message_id]: int(r.content["info"]["partition-id"])
            for r in self.replies(ids, QUERY_TIMEOUT_S)
            if not r.has_error()
        }

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
