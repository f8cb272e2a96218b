"""ServerApp: send one train message to every node in each round and write the replies as
JSON to the file named by run-config ``out``.

It polls for replies every 0.2 s with ``push_messages``/``pull_messages`` instead of
``Grid.send_and_receive``, which sleeps 3 s between polls.
"""

import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


def wait_for_nodes(grid: Grid, count: int, timeout: float) -> list[int]:
    """Sorted ids of the online nodes once there are ``count`` of them."""
    deadline = time.monotonic() + timeout
    while len(ids := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(ids)} of {count} nodes after {timeout} s")
        time.sleep(0.2)
    return ids


def send_and_receive(grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
    """Push ``messages`` and pull their replies every 0.2 s until all are in."""
    pending = set(grid.push_messages(messages))
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        got = list(grid.pull_messages(pending))
        replies += got
        pending -= {r.metadata.reply_to_message_id for r in got}
        time.sleep(0.2)
    return replies


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-rounds`` echo rounds and write ``{"message", "replies"}`` to ``out``."""
    cfg = context.run_config
    message = str(cfg["message"])
    node_ids = wait_for_nodes(grid, int(cfg["num-nodes"]), float(cfg["round-timeout"]))
    replies = []
    for rnd in range(1, int(cfg["num-rounds"]) + 1):
        started = time.monotonic()
        messages = [
            Message(RecordDict({"config": ConfigRecord({"round": rnd, "message": message})}),
                    dst_node_id=nid, message_type=MessageType.TRAIN, group_id=str(rnd))
            for nid in node_ids
        ]
        for reply in send_and_receive(grid, messages, float(cfg["round-timeout"])):
            if reply.has_error():
                raise RuntimeError(f"round {rnd}: error reply {reply.error.code} {reply.error.reason}")
            replies.append({"round": rnd, **dict(reply.content["metrics"]), **dict(reply.content["echo"])})
        print(f"[echo] round {rnd} took {time.monotonic() - started:.1f} s")
    Path(str(cfg["out"])).write_text(json.dumps({"message": message, "replies": replies}, indent=1))
