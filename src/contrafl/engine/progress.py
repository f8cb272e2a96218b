"""Console progress: one line per round with loss, accuracy and ETA."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Prints a bar per round; on a terminal the current round's line updates live."""

    def __init__(self, rounds: int, stream: TextIO | None = None, width: int = 20) -> None:
        self.rounds = rounds
        self.stream = stream or sys.stdout
        self.width = width
        self.live = self.stream.isatty()
        self.start = time.perf_counter()
        self.done = 0

    def _bar(self, fraction: float) -> str:
        full = int(fraction * self.width)
        return "#" * full + "." * (self.width - full)

    def clients(self, round: int, done: int, total: int) -> None:
        """Clients finished within the current round (terminal only)."""
        if self.live:
            msg = f"\rround {round:>{len(str(self.rounds))}}/{self.rounds} |{self._bar(done / max(total, 1))}| clients {done}/{total}"
            self.stream.write(msg.ljust(78))
            self.stream.flush()

    def round_done(self, row: dict) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        per_round = elapsed / self.done
        eta = per_round * (self.rounds - self.done)
        parts = [f"round {row['round']:>{len(str(self.rounds))}}/{self.rounds}", f"|{self._bar(self.done / self.rounds)}|"]
        if row.get("train_loss") is not None:
            parts.append(f"loss {row['train_loss']:.4f}")
        if row.get("test_acc") is not None:
            parts.append(f"acc {row['test_acc']:.4f}")
        if row.get("personal_acc") is not None:
            parts.append(f"personal {row['personal_acc']:.4f}±{row['personal_acc_std']:.4f}")
        parts.append(f"{per_round:.1f}s/round ETA {_clock(eta)}")
        self.stream.write(("\r" if self.live else "") + "  ".join(parts) + "\n")
        self.stream.flush()
