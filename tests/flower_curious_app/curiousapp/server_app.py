"""contrafl's ServerApp, curious: every message it receives goes to the folder of the run
config's ``record`` (one file per message, its content packed by
:func:`contrafl.flower.wire.pack`, or its error's reason) before contrafl's server reads
it."""

from pathlib import Path
from typing import Any

from flwr.serverapp import ServerApp

from contrafl.flower import server_app as contrafl_server
from contrafl.flower.wire import pack

app = ServerApp()


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


@app.main()
def main(grid: Any, context: Any) -> None:
    contrafl_server.main(Recording(grid, Path(str(context.run_config["record"]))), context)
