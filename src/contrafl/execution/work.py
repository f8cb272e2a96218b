"""A round's work as it proceeds: its clients and local steps, done and planned (what
the progress line and the distributed executor's step counters report)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RoundWork:
    """What the current round has done: its clients and, where they train in this
    process or in processes that report to it, their local steps (``steps`` planned:
    known when the round's jobs are made; ``None`` for clients that train elsewhere).
    ``steps_done`` counts this process's steps, ``remote`` (when set) reads those done
    elsewhere (the workers of a distributed run)."""

    round: int
    clients: int
    clients_done: int = 0
    steps: int | None = None
    steps_done: int = 0
    remote: Callable[[], int] | None = None

    def all_steps_done(self) -> int:
        return self.steps_done + (self.remote() if self.remote is not None else 0)

    def fraction(self) -> float:
        if self.steps:
            return min(self.all_steps_done() / self.steps, 1.0)
        return self.clients_done / max(self.clients, 1)

    def text(self) -> str:
        steps = f"local steps {self.all_steps_done()}/{self.steps}, " if self.steps else ""
        return f"{steps}clients {self.clients_done}/{self.clients} done"
