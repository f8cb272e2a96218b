"""contrafl's ServerApp as an honest-but-curious server: it follows the protocol and
writes every train reply it receives, as decoded, to
``<run-dir>/received/round-<T>-client-<K>.pt`` for an attacker to study."""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.serverapp import ServerApp

from contrafl.flower import server_app
from contrafl.flower.server import GridTransport


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
    server_app.main(grid, context)


app = ServerApp()
app.main()(main)
