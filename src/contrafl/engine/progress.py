"""Console progress: one line per round with loss, accuracy and ETA, and the local steps
and clients done within a long round, with an ETA re-made from them."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

LIVE_S = 0.2  # the least time between two updates of a terminal's live line


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


def clock_text(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Prints a bar per round. On a terminal the current round's line updates live as
    local steps and clients finish; elsewhere (a log file, a suite's output) a round
    that takes longer than ``every`` seconds gets a line with the steps and clients done
    every ``every`` seconds. Both carry an ETA re-made from the round's own pace (see
    :meth:`eta_within`), which corrects a calibration made on a quieter machine.
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
        self.start = self.round_start = self.noted = self.drawn = clock()
        self.done = 0  # rounds done by this process
        self.before = 0  # rounds done before a resume
        self.lost: set[int] = set()  # the clients the last round lost (reported already)

    def resume_at(self, rounds_done: int) -> None:
        """The run continues after ``rounds_done`` rounds done earlier."""
        self.before = rounds_done
        self.start = self.round_start = self.noted = self.now()

    def waited(self, seconds: float) -> None:
        """``seconds`` of the current round went to waiting for its clients to come up (a
        deployment's SuperNodes start and load their clients): not the run's pace, so
        left out of the ETAs and the seconds per round."""
        self.start += seconds
        self.round_start += seconds

    def eta(self) -> float:
        """Seconds left at this process's pace (0 before the first round)."""
        if not self.done:
            return 0.0
        return (self.now() - self.start) / self.done * (self.rounds - self.before - self.done)

    def _bar(self, fraction: float) -> str:
        full = int(fraction * self.width)
        return "#" * full + "." * (self.width - full)

    def eta_within(self, work: RoundWork) -> float | None:
        """Seconds left in the run, from the current round's pace: the round ends when
        its remaining steps take as long as its done ones did, and each later round
        takes as long as the rounds done by this process did on average, or as this
        one, before any. Where its steps are not known (its clients train elsewhere, at
        the same time), the round takes as long as the rounds before it: a client done
        early says nothing of the others. None before any work, and before any round
        for clients that train elsewhere."""
        elapsed = self.now() - self.round_start
        per_round = (self.round_start - self.start) / self.done if self.done else None
        if not work.steps:
            if per_round is None or not work.clients_done:
                return None
            return max(per_round - elapsed, 0.0) + (self.rounds - self.before - self.done - 1) * per_round
        done, total = work.all_steps_done(), work.steps
        if not done:
            return None
        this_round = elapsed * total / done
        per_round = per_round if per_round is not None else this_round
        later = self.rounds - self.before - self.done - 1
        return max(this_round - elapsed, 0.0) + later * per_round

    def working(self, work: RoundWork) -> None:
        """The current round's progress: the live line on a terminal (at most every
        :data:`LIVE_S` seconds), else a line at most every ``every`` seconds (none in a
        shorter round, nor once all its clients are done: the round's own line follows)."""
        now = self.now()
        eta = self.eta_within(work)
        eta_text = "" if eta is None else f" ETA {clock_text(eta)}"
        if self.live:
            if now - self.drawn < LIVE_S and work.clients_done < work.clients:
                return
            self.drawn = now
            msg = f"\r{self.prefix}round {work.round:>{len(str(self.rounds))}}/{self.rounds} |{self._bar(work.fraction())}| {work.text()}{eta_text}"
            self.stream.write(msg.ljust(78))
            self.stream.flush()
            return
        if work.clients_done < work.clients and now - max(self.round_start, self.noted) >= self.every:
            self.noted = now
            self.stream.write(
                f"{self.prefix}round {work.round}/{self.rounds}: {work.text()}, "
                f"{clock_text(now - self.round_start)} into the round{eta_text.replace(' ETA', ', ETA')}\n"
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
        sampled, missing = len(row.get("clients", [])), len(row.get("lost", [])) + len(row.get("rejected", []))
        if missing and sampled:
            parts.append(f"trained {sampled - missing}/{sampled}")
        if row.get("train_loss") is not None:
            parts.append(f"loss {row['train_loss']:.4f}")
        if row.get("test_acc") is not None:
            parts.append(f"acc {row['test_acc']:.4f}" + (f" ({row['test_clients']} clients)" if "test_clients" in row else ""))
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
        for item in row.get("lost", []):  # a client lost round after round is reported once, then counted
            if item.get("client") not in self.lost or item.get("client") is None:
                by_reason.setdefault(item["reason"], []).append(item.get("client"))
        self.lost = {item["client"] for item in row.get("lost", []) if "client" in item}
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
