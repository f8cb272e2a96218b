"""ServerApp: ``num-rounds`` rounds of ``exchanges`` exchanges each (a train round with
federated evaluation has two); an exchange sends the arrays of the ``.npz`` file
``arrays`` (their bytes packed into one Array, as contrafl sends a model) to every node
and waits for their replies, pulling every 0.2 s as contrafl's ServerApp does. The
seconds of each round go to ``out`` as JSON."""

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()
POLL_S = 0.2


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the rounds and write ``{"seconds": [...]}`` to ``out``."""
    cfg = context.run_config
    with np.load(str(cfg["arrays"])) as npz:
        packed = np.concatenate([npz[name].reshape(-1).view(np.uint8) for name in npz.files])
    deadline = time.monotonic() + float(cfg["round-timeout"])
    while len(nodes := sorted(grid.get_node_ids())) < int(cfg["num-nodes"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {cfg['num-nodes']} nodes")
        time.sleep(POLL_S)
    seconds = []
    for rnd in range(1, int(cfg["num-rounds"]) + 1):
        began = time.monotonic()
        for _ in range(int(cfg["exchanges"])):
            messages = [
                Message(RecordDict({"arrays": ArrayRecord({"packed": Array(packed)}),
                                    "config": ConfigRecord({"round": rnd})}),
                        dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(rnd))
                for node in nodes
            ]
            pending = set(grid.push_messages(messages))
            while pending:
                for reply in grid.pull_messages(pending):
                    if reply.has_error():
                        raise RuntimeError(f"round {rnd}: {reply.error.reason}")
                    pending.discard(reply.metadata.reply_to_message_id)
                if pending:
                    time.sleep(POLL_S)
        seconds.append(time.monotonic() - began)
        print(f"[floor] round {rnd}: {seconds[-1]:.2f} s", flush=True)
    Path(str(cfg["out"])).write_text(json.dumps({"seconds": seconds}))
