"""contrafl's ServerApp as an honest-but-curious server: it follows the protocol and
writes every train reply it receives, as decoded, to
``<run-dir>/received/round-<T>-client-<K>.pt`` for an attacker to study; with the run
config ``record`` set to a folder, it also writes there every message it receives, as
it arrives (one file per message: its content packed by
:func:`contrafl.flower.wire.pack`, or its error's reason), secure aggregation's
included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from flwr.serverapp import ServerApp

from contrafl.flower import server_app
from contrafl.flower.server import GridTransport
from contrafl.flower.wire import pack


class Recording:
    """``grid``, writing every reply it hands out to ``folder``."""

    def __init__(self, grid: Any, folder: Path) -> None:
        self.grid, self.folder, self.count = grid, folder, 0
        folder.mkdir(parents=True, exist_ok=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def record(self, replies: Any) -> list:
        replies = list(replies)
        for reply in replies:
            self.count += 1
            kind = reply.metadata.message_type.replace(".", "-")
            data = reply.error.reason.encode() if reply.has_error() else pack(reply.content)
            (self.folder / f"{self.count:05d}-{reply.metadata.src_node_id}-{kind}.bin").write_bytes(data)
        return replies

    def pull_messages(self, message_ids: Any) -> list:
        return self.record(self.grid.pull_messages(message_ids))

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list:
        return self.record(self.grid.send_and_receive(messages, timeout=timeout))


def main(grid, context) -> None:
    folder = Path(str(context.run_config["run-dir"])) / "received"

    class KeepingTransport(GridTransport):
        def train(self, t, cids, message_for, phases):
            folder.mkdir(exist_ok=True)
            for outcome in super().train(t, cids, message_for, phases):
                if outcome.reply is not None:
                    kept = {"payload": outcome.reply.payload, "num_samples": outcome.reply.num_samples}
                    torch.save(kept, folder / f"round-{t + 1}-client-{outcome.cid}.pt")
                yield outcome

    server_app.GridTransport = KeepingTransport
    record = str(context.run_config.get("record", ""))
    server_app.main(Recording(grid, Path(record)) if record else grid, context)


app = ServerApp()
app.main()(main)
