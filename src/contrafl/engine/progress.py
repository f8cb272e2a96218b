"""Console progress: one line per round with loss, accuracy and ETA, and the local steps
and clients done within a long round, with an ETA re-made from them."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from ..execution.work import RoundWork

LIVE_S = 0.2  # the least time between two updates of a terminal's live line


def pace_of(durations: list[float], warm_up: float = 0.0) -> float | None:
    """Seconds a later round takes, from the ``durations`` of the rounds a process ran:
    the mean of those after its first (a process's first round carries its warm-up, and
    some methods' first round differs from the others: MOON's has no contrastive term),
    or, after one, that round less its ``warm_up``; None before any."""
    if len(durations) > 1:
        return sum(durations[1:]) / (len(durations) - 1)
    return max(durations[0] - warm_up, 0.0) if durations else None


def clock_text(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Prints a bar per round. On a terminal the current round's line updates live as
    local steps and clients finish; elsewhere (a log file, a suite's output) a round
    that takes longer than ``every`` seconds gets a line with the steps and clients done
    every ``every`` seconds. Both carry an ETA re-made from the round's own pace (see
    :meth:`eta_within`), which corrects a calibration made on a quieter machine; a
    round's line carries the seconds a round left takes (:meth:`per_round`) and the ETA
    at that pace.
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
        self.durations: list[float] = []  # seconds of each round done by this process
        self.warm_up = 0.0  # of its first round (:meth:`steps_pace`)
        self.first_steps: tuple[float, int] | None = None  # the time and steps done of the round's first report of steps
        self.last_steps: tuple[float, int] | None = None  # and of its latest

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

    def per_round(self) -> float | None:
        """Seconds a round left takes: :func:`pace_of` the rounds done by this process,
        the first one's warm-up measured from its local steps (:meth:`steps_pace`);
        None before any."""
        return pace_of(self.durations, self.warm_up)

    def eta(self) -> float:
        """Seconds left at :meth:`per_round` (0 before the first round)."""
        per_round = self.per_round()
        return 0.0 if per_round is None else per_round * (self.rounds - self.before - self.done)

    def steps_pace(self) -> tuple[float, float] | None:
        """The current round's seconds per local step after its first reported steps,
        and the time before those beyond their share at that pace: a warm-up (a
        process's first steps allocate memory and pick kernels: a second where a step
        takes a hundredth). None before a second report of steps."""
        if self.first_steps is None or self.last_steps is None or self.last_steps[1] <= self.first_steps[1]:
            return None
        (first_at, first), (last_at, last) = self.first_steps, self.last_steps
        step = (last_at - first_at) / (last - first)
        return step, max(first_at - self.round_start - first * step, 0.0)

    def _bar(self, fraction: float) -> str:
        full = int(fraction * self.width)
        return "#" * full + "." * (self.width - full)

    def eta_within(self, work: RoundWork) -> float | None:
        """Seconds left in the run, from the current round's pace: its remaining steps
        take as long each as its steps after the first reported ones did
        (:meth:`steps_pace`; before a second report, as the done ones did), and each
        later round takes :meth:`per_round`, or before any round this one, less its
        warm-up. Where its steps are not known (its clients train elsewhere, at the same
        time), the round takes :meth:`per_round`: a client done early says nothing of
        the others. None before any work, and before any round for clients that train
        elsewhere."""
        elapsed = self.now() - self.round_start
        per_round = self.per_round()
        later = self.rounds - self.before - self.done - 1
        if not work.steps:
            if per_round is None or not work.clients_done:
                return None
            return max(per_round - elapsed, 0.0) + later * per_round
        done, total = work.all_steps_done(), work.steps
        if not done:
            return None
        paced = self.steps_pace()
        step, warm_up = paced if paced is not None else (elapsed / done, 0.0)
        left = max(total - done, 0) * step
        if per_round is None:
            per_round = elapsed + left - warm_up
        return left + later * per_round

    def note_steps(self, work: RoundWork) -> None:
        """Keep the time of the round's first and latest reports of local steps."""
        done = work.all_steps_done() if work.steps else 0
        if done:
            at = (self.now(), done)
            self.first_steps = self.first_steps or at
            self.last_steps = at

    def working(self, work: RoundWork) -> None:
        """The current round's progress: the live line on a terminal (at most every
        :data:`LIVE_S` seconds), else a line at most every ``every`` seconds (none in a
        shorter round, nor once all its clients are done: the round's own line follows)."""
        now = self.now()
        self.note_steps(work)
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
        now = self.now()
        if not self.done:
            paced = self.steps_pace()
            self.warm_up = paced[1] if paced is not None else 0.0
        self.durations.append(now - self.round_start)
        self.first_steps = self.last_steps = None
        self.done += 1
        self.round_start = now
        per_round = self.per_round() or 0.0
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
