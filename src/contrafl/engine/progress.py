"""Console progress: one line per round with loss, accuracy and ETA, and the clients
done within a long round."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def clock_text(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Prints a bar per round. On a terminal the current round's line updates live as
    clients finish; elsewhere (a log file, a suite's output) a round that takes longer
    than ``every`` seconds gets a line with the clients done every ``every`` seconds.
    ``clock`` gives the time in seconds (a test passes a fake one)."""

    def __init__(
        self,
        rounds: int,
        stream: TextIO | None = None,
        width: int = 20,
        prefix: str = "",
        every: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.rounds = rounds
        self.stream = stream or sys.stdout
        self.width = width
        self.prefix = prefix
        self.live = self.stream.isatty()
        self.every = every
        self.now = clock
        self.start = self.round_start = self.noted = clock()
        self.done = 0  # rounds done by this process
        self.before = 0  # rounds done before a resume

    def resume_at(self, rounds_done: int) -> None:
        """The run continues after ``rounds_done`` rounds done earlier."""
        self.before = rounds_done
        self.start = self.round_start = self.noted = self.now()

    def eta(self) -> float:
        """Seconds left at this process's pace (0 before the first round)."""
        if not self.done:
            return 0.0
        return (self.now() - self.start) / self.done * (self.rounds - self.before - self.done)

    def _bar(self, fraction: float) -> str:
        full = int(fraction * self.width)
        return "#" * full + "." * (self.width - full)

    def clients(self, round: int, done: int, total: int) -> None:
        """Clients finished within the current round: the live line on a terminal, else
        a line at most every ``every`` seconds (none in a shorter round, nor for the
        round's last client: the round's own line follows)."""
        if self.live:
            msg = f"\r{self.prefix}round {round:>{len(str(self.rounds))}}/{self.rounds} |{self._bar(done / max(total, 1))}| clients {done}/{total}"
            self.stream.write(msg.ljust(78))
            self.stream.flush()
            return
        now = self.now()
        if done < total and now - max(self.round_start, self.noted) >= self.every:
            self.noted = now
            self.stream.write(
                f"{self.prefix}round {round}/{self.rounds}: clients {done}/{total} done, "
                f"{clock_text(now - self.round_start)} into the round\n"
            )
            self.stream.flush()

    def round_done(self, row: dict) -> None:
        self.done += 1
        self.round_start = self.now()
        per_round = (self.round_start - self.start) / self.done
        eta = self.eta()
        parts = [
            f"{self.prefix}round {row['round']:>{len(str(self.rounds))}}/{self.rounds}",
            f"|{self._bar((self.before + self.done) / self.rounds)}|",
        ]
        if row.get("train_loss") is not None:
            parts.append(f"loss {row['train_loss']:.4f}")
        if row.get("test_acc") is not None:
            parts.append(f"acc {row['test_acc']:.4f}")
        if row.get("knn_acc") is not None:
            parts.append(f"kNN {row['knn_acc']:.4f}")
        if row.get("personal_acc") is not None:
            parts.append(f"personal {row['personal_acc']:.4f}±{row['personal_acc_std']:.4f}")
        if "dp_epsilon" in row:
            parts.append("eps " + ("inf" if row["dp_epsilon"] is None else f"{row['dp_epsilon']:.3g}"))
        parts.append(f"{per_round:.1f}s/round ETA {clock_text(eta)}{self.suffix()}")
        self.stream.write(("\r" if self.live else "") + "  ".join(parts) + "\n")
        for item in row.get("rejected", []):  # sampling=secret names no client
            who = f"client {item['client']}'s" if "client" in item else "an"
            self.stream.write(f"{self.prefix}  {who} update rejected: {item['reason']}\n")
        by_reason: dict[str, list[int | None]] = {}
        for item in row.get("lost", []):
            by_reason.setdefault(item["reason"], []).append(item.get("client"))
        for reason, cids in by_reason.items():  # one line per reason (client_dropout loses many)
            if None in cids:
                who = "a client" if len(cids) == 1 else f"{len(cids)} clients"
            else:
                who = f"client {cids[0]}" if len(cids) == 1 else f"clients {', '.join(map(str, cids))}"
            self.stream.write(f"{self.prefix}  {who} lost: {reason}\n")
        partial = [item for item in row.get("stragglers", []) if item["done"]]
        if partial:  # stragglers=partial: their replies count, with the steps they finished
            if all("client" in item for item in partial):
                who = ", ".join(f"client {item['client']} {item['done']}/{item['planned']}" for item in partial)
            else:
                who = f"{len(partial)} {'client' if len(partial) == 1 else 'clients'}"
            self.stream.write(f"{self.prefix}  partial work (steps done/planned by the deadline): {who}\n")
        self.stream.flush()

    def suffix(self) -> str:
        """Appended to each round's line (a suite adds its own ETA)."""
        return ""
