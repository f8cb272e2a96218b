"""The distributed executor: persistent worker processes on ``torch.distributed``.

A run with ``executor=distributed`` has ``W`` processes (ranks). Rank 0 is the server:
it runs the round loop, aggregates, evaluates, writes the run directory and its
checkpoints, and trains a share of every round's clients itself. Ranks ``1 .. W-1``
are workers that live for the whole run and keep the data, the model and the
algorithm (no process is started per round, nothing is pickled but messages and
replies). Each round rank 0

1. sets aside the round's *tail* (:func:`split_tail`): clients that hold no state, with
   the fewest planned steps, about :data:`TAIL` of the round's steps, where the ranks
   train one client at a time (``rank_executor=sequential``);
2. splits the other clients into ``W`` shares balanced by their planned local steps,
   keeping a client on the worker that holds its newest state where the balance
   allows (:func:`assign`);
3. sends each worker one packet: its clients' messages and the tail's (a message shared
   by several clients, the broadcast, travels once per worker) and the states of those
   of its clients whose newest state it does not hold;
4. trains its own share, then takes the tail's clients one at a time, as every worker
   does once its share is done (:func:`taken`: a counter in shared memory, or in the
   process group's store for ranks that ``torchrun`` started),
   so that the ranks finish together whatever their speed on the day; and receives each
   worker's outcomes (the replies, the loss, the steps) with its clients' next states.
   Where the server needs no more than the sample-weighted mean of the replies
   (:attr:`~contrafl.execution.replies.ReplyChecks.sums_replies`), a worker checks its
   share's replies as the server would and sends the valid ones as one mean
   (:mod:`contrafl.execution.partial`), before it takes tail clients: one model's worth
   of bytes a worker instead of one a client, checked on the workers in parallel. A tail
   client's reply travels as it is, so the sums do not depend on which rank trained it.

Rank 0 keeps every client's newest state (its store is the one the checkpoints save),
so a client can train on any rank, its state moving exactly, and a resumed run starts
its workers empty. A rank trains its share with the executor of ``rank_executor`` (the
sequential one on a CPU, the vectorized one on a GPU), exactly as
:meth:`~contrafl.execution.clients.LocalClients.train_locally` trains clients in one
process (a worker serves its clients with a :class:`~contrafl.execution.clients.
LocalClients` of its own, never a round loop): for a given world size the run is
reproducible bit for bit (the shares, and so the sums, are fixed by the plan; the tail's
replies are summed by the server alone), and equal to the other executors to float
tolerance (the ranks' thread counts and the order in which the replies arrive differ).

Starting: ``contrafl run executor=distributed workers=W`` forks the ``W - 1`` workers
itself (on Linux; elsewhere, and on GPUs, it spawns them, and they load the data anew)
and connects them over 127.0.0.1. Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) every process runs ``contrafl run`` with the same config: rank 0 the
run, the others :func:`serve` (:func:`launched`). Before round 1 rank 0 checks that
every worker trains its run (:func:`checked`: the same settings, training data and
contrafl). The packets travel over Gloo (on GPUs
too: each rank loads them onto its own device) as pickles (:mod:`~contrafl.execution.
frames`): every rank must be the user's own process (torch.distributed's own trust model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..algorithms.base import Phase
from ..allocator import keep_freed_memory
from ..cores import cores_each
from ..errors import ContraflError, one_line
from . import frames
from .partial import restore, summed
from .work import RoundWork
from .same_run import Refused, disagreement, identity
from .signals import POLL_S, detach_from_signals, interrupts, signal_name, stop_point

if TYPE_CHECKING:
    from ..algorithms.base import StateDict
    from .clients import LocalClients
    from .outcomes import ClientOutcome, Scores

REPORT_S = 0.5  # how often a worker adds its local steps to rank 0's counter
TIMEOUT = datetime.timedelta(minutes=30)  # for joining the process group: the ranks wait this long for the others
PATIENCE = datetime.timedelta(days=365)  # a send or receive waits this long for a rank still heard from (its work)
BEAT_S = 1.0  # how often a rank adds to its counter in the store, and reads the counters of the ranks it waits for
SILENCE_S = 120.0  # a rank whose counter has not moved for this long is gone (its process stopped, its machine down)
SLACK = 0.1  # a client stays on the worker that holds its state while that worker's load stays within 1.1x the mean
TAIL = 0.25
"""The part of a round's planned local steps that the ranks take one client at a time
(:func:`split_tail`). On the peer benchmark's device shape (50 clients of 5-6 steps a
round, two ranks) the ranks' training times differed by about a tenth of a round on
average, in either direction, which a split made in advance cannot foresee: a quarter
of the steps absorbs it."""


class WorkerError(RuntimeError):
    """A worker failed: its exception (first line) and traceback."""


class RankLost(WorkerError):
    """Rank ``rank`` is gone (its process killed or out of memory, its machine or the
    network down): ``reason`` is how the connection ended, and what else is known of it.
    A run cannot go on without it; it resumes from its last checkpoint."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} is gone ({reason})")
        self.rank, self.reason = rank, reason


def _connection(exc: BaseException) -> str:
    """How Gloo or the store says a connection ended, without source locations and
    advice: ``Connection closed by peer [127.0.0.1]:28587``."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", lines[0]).split(". ")[0].rstrip(".")


def launched() -> tuple[int, int] | None:
    """``(rank, world size)`` of a process that ``torchrun`` (or another launcher
    that sets ``RANK`` and ``WORLD_SIZE``) started as one of several; None otherwise."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (rank, world) if world > 1 else None


def can_fork() -> bool:
    """Whether workers may be forked from this process, which has loaded torch: on Linux
    only. macOS's system libraries may start threads that a fork leaves broken (Python's
    own default there is spawn), and Windows has no fork."""
    return sys.platform.startswith("linux")


def bind_device() -> None:
    """Under ``torchrun`` on a machine with GPUs: this process's GPU is the
    ``LOCAL_RANK``-th (modulo the GPUs it sees), before anything is put on one."""
    if launched() is not None and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def assign(steps: dict[int, int], holders: dict[int, int], world: int) -> list[list[int]]:
    """The clients of a round (``{cid: planned steps}``) shared among ``world`` ranks:
    the longest first, each to the rank that holds its newest state
    (``holders[cid]``, a worker) while that rank's load stays within ``1 + SLACK``
    times the mean, else to the least loaded rank (the lowest on ties). Every rank
    computes the same shares; each share is sorted."""
    mean = sum(steps.values()) / world
    loads = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for cid in sorted(steps, key=lambda c: (-steps[c], c)):
        rank = holders.get(cid)
        if rank is None or loads[rank] + steps[cid] > (1 + SLACK) * mean:
            rank = loads.index(min(loads))
        shares[rank].append(cid)
        loads[rank] += steps[cid]
    return [sorted(share) for share in shares]


def split_tail(steps: dict[int, int], movable: Iterable[int], fraction: float) -> list[int]:
    """The tail of a round whose clients plan ``steps`` (``{cid: planned steps}``): the
    clients of ``movable`` (those that hold no state: any rank can train them) with the
    fewest steps, as many as fit in ``fraction`` of the round's steps, in the order the
    ranks take them (the longest first, then by client). Every rank computes the same tail."""
    budget, tail = fraction * sum(steps.values()), []
    for cid in sorted(movable, key=lambda c: (steps[c], -c)):
        if steps[cid] > budget:
            break
        tail.append(cid)
        budget -= steps[cid]
    return tail[::-1]


def taken(claim: Callable[[], int], tail: list[int]) -> Iterator[int]:
    """The clients of ``tail`` this rank trains: each time the next one that no rank has
    taken (``claim()``: the next index of the round's counter, :func:`claims`), until none
    is left."""
    while (i := claim()) < len(tail):
        yield tail[i]


def claims(counter: Any, store: dist.Store | None, key: str) -> Callable[[], int]:
    """The claims of a round's tail clients: on ``counter``, in shared memory, where
    ``contrafl run`` started the ranks on this machine and they inherit it (no thread of
    another rank has to wake up to answer, as the store's server must while both cores
    train); else on the counter ``key`` of the process group's ``store`` (ranks that
    ``torchrun`` started)."""
    if counter is None:
        assert store is not None
        return lambda: store.add(key, 1) - 1

    def claim() -> int:
        with counter.get_lock():
            counter.value += 1
            return counter.value - 1

    return claim


def tail_key(run: str, t: int) -> str:
    """The process group store's counter of the tail clients taken in round ``t`` of the run ``run``."""
    return f"contrafl/tail/{run}/{t}"


# -- the process group: joining, leaving, and knowing the others alive ------------------
class Pulse:
    """This rank's sign of life, and what it hears of the ``peers`` it waits for: a
    thread adds 1 to this rank's counter in the process group's ``store`` every
    :data:`BEAT_S` seconds and reads the peers' counters. It alone talks to the store
    for this, so that a store which stops answering (its host, rank 0's machine, gone)
    silences the peers rather than blocking a wait. A wait for a peer that has been
    silent for :data:`SILENCE_S` seconds gives up (:func:`_wait`); a peer that is only
    busy (a long round, a long evaluation) is waited for as long as it works."""

    def __init__(self, store: dist.Store, rank: int, peers: Iterable[int]) -> None:
        self.store, self.key = store, beat_key(rank)
        self.heard = {peer: (-1, time.monotonic()) for peer in peers}  # peer -> (its counter, when it last moved)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="contrafl-pulse", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        try:
            while True:
                self.store.add(self.key, 1)
                for peer, (count, _) in list(self.heard.items()):
                    if (now := self.store.add(beat_key(peer), 0)) != count:
                        self.heard[peer] = (now, time.monotonic())
                if self.stopped.wait(BEAT_S):
                    return
        except Exception:  # noqa: BLE001 - the store is gone: the peers fall silent, and the waits say so
            return

    def silence(self, peer: int) -> float:
        """Seconds since ``peer``'s counter last moved (0 for a rank this one does not wait for)."""
        heard = self.heard.get(peer)
        return 0.0 if heard is None else time.monotonic() - heard[1]

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(BEAT_S)


def beat_key(rank: int) -> str:
    """The process group store's counter of rank ``rank``'s signs of life (:class:`Pulse`)."""
    return f"contrafl/beat/{rank}"


_pulse: Pulse | None = None  # this process's, while it is in the process group (torch.distributed's is per process too)


def _join(rank: int, world: int, store: dist.Store | None = None) -> None:
    """Join the process group as rank ``rank`` of ``world``, over ``store`` (by default
    the launcher's, from the environment), unless joined already (by contrafl, or by the
    program that calls it), and start this rank's :class:`Pulse` unless it beats
    already: rank 0 listens to every worker, a worker to rank 0."""
    global _pulse
    if not dist.is_initialized():
        if store is None:
            dist.init_process_group("gloo", timeout=TIMEOUT)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    if _pulse is None:
        _pulse = Pulse(dist.distributed_c10d._get_default_store(), rank, range(1, world) if rank == 0 else [0])


def _leave() -> None:
    """Leave the process group, this rank's :class:`Pulse` first."""
    global _pulse
    if _pulse is not None:
        _pulse.stop()
        _pulse = None
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the wire ------------------------------------------------------------------------
def _wait(work: Any, peer: int, waiting: Callable[[], object] | None = None, stoppable: bool = True) -> None:
    """Wait for ``work`` (a send or receive with ``peer``) while ``peer`` is heard from
    (:class:`Pulse`; :class:`RankLost` once it has been silent for :data:`SILENCE_S`
    seconds), looking for a stop request (where ``stoppable``) and calling ``waiting``
    every :data:`POLL_S` seconds: a thread waits (Gloo's waits cannot be polled)."""
    done = threading.Event()
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            work.wait(PATIENCE)  # not the process group's timeout: a busy peer is no lost one
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait, daemon=True).start()
    while not done.wait(POLL_S):
        if stoppable:
            stop_point()
        if waiting is not None:
            waiting()
        if _pulse is not None and (silence := _pulse.silence(peer)) >= SILENCE_S:
            raise RankLost(peer, f"not heard from for {silence:.0f} s: its process stopped, or its machine or the network down")
    if failed:
        raise RankLost(peer, _connection(failed[0]))


def _post(op: Callable[[torch.Tensor, int], Any], tensor: torch.Tensor, peer: int) -> Any:
    """``op(tensor, peer)`` (``dist.isend``, ``dist.irecv``): :class:`RankLost` where
    Gloo finds the connection to ``peer`` closed already."""
    try:
        return op(tensor, peer)
    except RuntimeError as exc:
        raise RankLost(peer, _connection(exc)) from None


def send(obj: Any, peer: int) -> None:
    """Send ``obj`` to rank ``peer``: its size, then its bytes (a :mod:`~contrafl.execution.
    frames` frame: a tensor shared by several clients' messages travels once). A stop
    request waits until the message is sent whole: one cut after its size would leave the
    peer reading the next message as this one's bytes."""
    data = frames.encode(obj)
    _wait(_post(dist.isend, torch.tensor([data.numel()], dtype=torch.int64), peer), peer, stoppable=False)
    _wait(_post(dist.isend, data, peer), peer, stoppable=False)


def receive(
    peer: int, device: torch.device | str = "cpu", waiting: Callable[[], object] | None = None, stoppable: bool = True
) -> Any:
    """The next object rank ``peer`` sends, its tensors on ``device`` (``waiting``: called
    every :data:`POLL_S` seconds until it starts to come; ``stoppable``: a stop request
    raises while it waits for the message to start; once begun, it is read whole)."""
    size = torch.zeros(1, dtype=torch.int64)
    _wait(_post(dist.irecv, size, peer), peer, waiting, stoppable)
    data = torch.empty(int(size), dtype=torch.uint8)
    _wait(_post(dist.irecv, data, peer), peer, stoppable=False)
    return frames.decode(data, device)


# -- the workers' local steps, for rank 0's progress ---------------------------------
def steps_key(t: int) -> str:
    """The process group store's counter of the workers' local steps in round ``t``."""
    return f"contrafl/steps/{t}"


class WorkerSteps:
    """Rank 0's view of the local steps the workers have done in round ``t``
    (:attr:`RoundWork.remote`): their counter in the process group's store, read at most
    every :data:`POLL_S` seconds (:meth:`refresh` reads it now)."""

    def __init__(self, store: dist.Store, t: int) -> None:
        self.store, self.key = store, steps_key(t)
        self.value, self.read_at = 0, float("-inf")

    def __call__(self) -> int:
        if time.monotonic() - self.read_at >= POLL_S:
            self.refresh()
        return self.value

    def refresh(self) -> None:
        self.value, self.read_at = self.store.add(self.key, 0), time.monotonic()


class StepsReport:
    """A worker's progress (its :attr:`~contrafl.execution.clients.LocalClients.progress`): adds its local steps of
    round ``t`` to rank 0's counter (:class:`WorkerSteps`) at most every
    :data:`REPORT_S` seconds, and the rest at :meth:`flush`."""

    def __init__(self, store: dist.Store, t: int) -> None:
        self.store, self.key = store, steps_key(t)
        self.sent, self.sent_at = 0, time.monotonic()

    def working(self, work: RoundWork) -> None:
        if time.monotonic() - self.sent_at >= REPORT_S:
            self.flush(work)

    def flush(self, work: RoundWork) -> None:
        if work.steps_done > self.sent:
            self.store.add(self.key, work.steps_done - self.sent)
            self.sent = work.steps_done
        self.sent_at = time.monotonic()


# -- rank 0 --------------------------------------------------------------------------
class DistributedTransport:
    """Rank 0's side: trains each round's clients on all ranks
    (:class:`~contrafl.execution.outcomes.Transport`); evaluates in this process, which
    holds every client's state. ``clients``: rank 0's own; ``placement``: client -> the
    worker that keeps its state, kept up to date here (the round loop saves it with its
    checkpoints)."""

    runtime = "distributed"

    def __init__(
        self,
        clients: LocalClients,
        world: int,
        placement: dict[int, int],
        store: dist.Store | None = None,
        rank_threads: int | None = None,
    ) -> None:
        self.clients = clients
        self.world = world
        self.placement = placement
        self.store = store  # the process group's, where the workers count their steps
        self.workers: list[Any] = []  # the processes this one started (none under torchrun)
        for cid in [c for c, rank in placement.items() if rank >= world]:  # a run resumed on fewer ranks
            del placement[cid]
        self.copies: dict[int, int] = {}  # client -> the worker process holding its newest state (none at the start)
        self.pending: set[int] = set()  # the workers that are not waiting for a packet: training, or not yet checked
        self.threads = torch.get_num_threads()  # this process's, outside its training and at the end
        self.rank_threads = rank_threads or self.threads  # while its share trains and the workers train theirs
        self.run_id = uuid.uuid4().hex[:12]  # names this run's tail counters in the store (tail_key)
        self.counter: Any = None  # the tail's counter in shared memory, where this process started the workers

    def train(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], phases: list[Phase]
    ) -> Iterator[ClientOutcome]:
        torch.set_num_threads(self.rank_threads)
        try:
            yield from self._train(t, cids, message_for, phases)
        finally:
            torch.set_num_threads(self.threads)

    def _train(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], phases: list[Phase]
    ) -> Iterator[ClientOutcome]:
        try:
            yield from self._train_on_ranks(t, cids, message_for, phases)
        except RankLost as lost:
            raise self.known_end(lost) from None

    def known_end(self, lost: RankLost) -> RankLost:
        """``lost`` with how the worker process ended where this process forked it:
        its exit code, or the signal that killed it."""
        if not self.workers:
            return lost
        process = self.workers[lost.rank - 1]
        process.join(1)
        code = process.exitcode
        if code is None:
            return lost
        how = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
        if code == -signal.SIGKILL:
            how += ", SIGKILL: out of memory?"
        return RankLost(lost.rank, f"{lost.reason}; its process {process.pid}: {how}")

    def _train_on_ranks(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], phases: list[Phase]
    ) -> Iterator[ClientOutcome]:
        sim = self.clients
        work = sim.round_work
        messages = {cid: message_for(cid) for cid in cids}
        planned = {cid: sim.planned_steps(cid, phases) for cid in cids}
        tail: list[int] = []
        if self.store is not None and self.world > 1 and sim.local_executor == "sequential":
            tail = split_tail(planned, [cid for cid in cids if cid not in sim.store], TAIL)
        shares = assign({cid: n for cid, n in planned.items() if cid not in tail}, self.placement, self.world)
        key = tail_key(self.run_id, t)
        if self.counter is not None:
            self.counter.value = 0  # every rank is idle: their last claims were made before they answered
        workers = None
        if work is not None and self.store is not None:  # the round's steps, the workers' counted in the store
            work.steps, work.remote = sum(planned.values()), (workers := WorkerSteps(self.store, t))
        for rank, share in enumerate(shares[1:], start=1):
            states = {cid: sim.store.get(cid) for cid in share if self.copies.get(cid) != rank}
            packet = {"t": t, "messages": {cid: messages[cid] for cid in share + tail}, "states": states}
            send(packet | ({"tail": tail, "tail_key": key} if tail else {}), rank)
            self.pending.add(rank)
        for cid in shares[0]:  # trained here: the workers' copies grow old
            self.placement.pop(cid, None)
            self.copies.pop(cid, None)
        yield from sim.train_locally(t, shares[0], messages.__getitem__, phases, work)
        if tail:
            for cid in taken(claims(self.counter, self.store, key), tail):
                self.copies.pop(cid, None)
                yield from sim.train_locally(t, [cid], messages.__getitem__, phases, work)
        progress = sim.progress

        def waiting() -> None:
            if progress is not None and work is not None:
                progress.working(work)

        for rank in range(1, self.world):
            answer = receive(rank, sim.device, waiting)
            if workers is not None:
                workers.refresh()  # exact: a worker counts all its steps before it answers
            self.pending.discard(rank)
            if isinstance(answer, BaseException):
                raise answer
            if isinstance(answer, str):
                raise WorkerError(answer)
            outcomes, mean = answer
            for outcome, state in outcomes:
                if state is not None:
                    sim.store.put(outcome.cid, state)
                    self.copies[outcome.cid] = rank
                    if outcome.cid not in tail:  # where the tail's clients trained is luck: the shares must not follow it
                        self.placement[outcome.cid] = rank
                yield dataclasses.replace(outcome, reply=restore(outcome.reply, mean)) if outcome.checked else outcome

    def evaluate(self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]]) -> Iterator[tuple[int, Scores | None]]:
        return self.clients.evaluate_locally(t, cids, message_for)

    def evaluate_model(self, t: int, cids: list[int], state: StateDict) -> Iterator[tuple[int, Scores | None]]:
        return self.clients.evaluate_model_locally(t, cids, state)

    def close(self) -> None:
        """End the workers: idle ones (the run completed, or stopped between rounds) get
        a stop packet; busy or failed ones (a stop within a round, a failure) are killed
        where this process forked them, and otherwise lose rank 0 and end. Then leave the
        process group and give this process its threads back."""
        idle = not self.pending
        if idle:
            try:
                for rank in range(1, self.world):
                    send(None, rank)
            except (WorkerError, RuntimeError):
                idle = False
        for p in self.workers:
            if not idle:
                p.kill()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        _leave()
        torch.set_num_threads(self.threads)


def start(
    sim: LocalClients,
    placement: dict[int, int],
    forked: Callable[[], LocalClients],
    spawned: Callable[[], LocalClients],
) -> DistributedTransport:
    """The transport of the run of ``sim`` (rank 0's clients): over the process group
    ``torchrun`` made (this process is rank 0), or over ``workers`` processes
    (:func:`~contrafl.engine.setup.default_workers`) started now on 127.0.0.1, each with
    ``cores // workers`` threads, as this process while it trains its share (it takes all
    the cores again for the rest: aggregation, evaluation). A worker serves the clients
    ``forked()`` makes where it is forked (:func:`can_fork`: it inherits the data and the
    model), else ``spawned()`` (pickled: it loads the data anew). ``placement``: client ->
    the worker that keeps its state (:class:`DistributedTransport`)."""
    env = launched()
    if env is not None:
        if env[0] != 0:  # contrafl run serves these ranks before it builds a run (cli.serve_rank)
            raise ContraflError(
                f"rank {env[0]} of torchrun was asked to run a simulation of its own; under torchrun only "
                "`contrafl run` (and `contrafl run --resume`) runs one simulation on all ranks"
            )
        _join(*env)
        return checked(DistributedTransport(sim, env[1], placement, dist.distributed_c10d._get_default_store()))
    world = sim.cfg.workers or 1
    transport = DistributedTransport(sim, world, placement, rank_threads=cores_each(world))
    if world == 1:
        return transport
    store = transport.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    if sim.device.type == "cpu" and can_fork():  # the workers inherit the data and the model
        ctx, target, what = mp.get_context("fork"), _worker, forked
    else:  # CUDA cannot be used in a forked process (nor fork elsewhere): the workers load the data anew
        ctx, target, what = mp.get_context("spawn"), _worker, spawned
    transport.counter = ctx.Value("q", 0)
    transport.workers = [
        ctx.Process(target=target, args=(what, store.port, rank, world, transport.counter), daemon=True)
        for rank in range(1, world)
    ]
    for p in transport.workers:
        p.start()
    try:
        for rank, p in enumerate(transport.workers, start=1):
            await_worker(store, rank, p)
    except BaseException:  # a worker that failed to start, or a stop request: end the others
        for p in transport.workers:
            p.kill()
            p.join()
        raise
    _join(0, world, store)
    return checked(transport)


def checked(transport: DistributedTransport) -> DistributedTransport:
    """``transport`` once every worker has shown that it trains rank 0's run
    (:mod:`~contrafl.execution.same_run`: settings, training data, contrafl's version);
    other versions of torch or Python are printed as warnings. A worker that differs,
    or that could not start the run (its first message is then its error), ends the
    run: the waiting workers are told why (and end with that error), and it is raised
    here (:class:`~contrafl.execution.same_run.Refused` where a rank differs)."""
    world = transport.world
    transport.pending = set(range(1, world))  # each is sending its identity
    try:
        ours = identity(transport.clients.setup)
        failure: BaseException | None = None
        waiting = []  # the workers that sent their identity, and wait for a packet
        for rank in range(1, world):
            answer = receive(rank)
            if isinstance(answer, dict):
                waiting.append(rank)
                error, warning = disagreement(rank, ours, answer)
                if warning is not None:
                    print(f"contrafl: warning: {warning}", file=sys.stderr)
                answer = None if error is None else Refused(error)
            elif isinstance(answer, str):
                answer = WorkerError(answer)
            failure = failure or answer
        if failure is not None:
            for rank in waiting:
                send(Refused(str(failure).splitlines()[0]), rank)
            raise failure
    except BaseException:
        transport.close()  # the workers are not idle: forked ones are killed, launched ones lose rank 0
        raise
    transport.pending.clear()
    return transport


@contextlib.contextmanager
def launched_run() -> Iterator[None]:
    """The body of ``contrafl run`` on a rank that ``torchrun`` started, in the process
    group it joins first, so that a rank that cannot start the run (a configuration
    error, missing data, a stop request) tells the others instead of leaving them
    waiting for it for :data:`TIMEOUT`. A worker sends its error to rank 0 in place of
    its identity (:func:`checked` raises it); rank 0, where it ends before it has
    checked the workers, takes each worker's first message and answers it with its own
    error (:class:`~contrafl.execution.same_run.Refused`). Outside torchrun: the body alone."""
    env = launched()
    if env is None:
        yield
        return
    if not dist.is_initialized():
        try:
            _join(*env)
        except ValueError as exc:  # RANK and WORLD_SIZE set, but not by a launcher
            raise ContraflError(
                f"RANK={env[0]} and WORLD_SIZE={env[1]} are set, but not the rest of a launcher's environment "
                f"({str(exc).split('rendezvous: ')[-1]}); start contrafl under torchrun, or unset RANK and WORLD_SIZE"
            ) from None
        except RuntimeError as exc:  # the store, or another rank, out of reach (DistNetworkError, Gloo's connectFullMesh)
            raise ContraflError(
                f"rank {env[0]} could not join the other ranks ({_connection(exc)}); every machine must reach the "
                "rendezvous address and port and each other: check the firewall, and set GLOO_SOCKET_IFNAME to the "
                "network interface that joins the machines where they have several"
            ) from None
    try:
        yield
    except BaseException as exc:
        if dist.is_initialized():  # it ended before it met the other ranks (serve and the run end the group)
            _tell_the_ranks(env, _why(exc))
        raise
    if dist.is_initialized():
        _tell_the_ranks(env, "ended before round 1")


def _why(exc: BaseException) -> str:
    """What a rank that ended with ``exc`` before it met the others did, for them."""
    if isinstance(exc, KeyboardInterrupt):
        return f"was stopped by {signal_name(exc)} before round 1"
    lines = str(exc).strip().splitlines()
    return f"could not start the run: {lines[0] if isinstance(exc, ContraflError) and lines else one_line(exc)}"


def _tell_the_ranks(env: tuple[int, int], what: str) -> None:
    """Rank ``env[0]`` of ``env[1]`` has ended before it met the others: ``what`` it
    did, as :class:`~contrafl.execution.same_run.Refused`, to rank 0 (a worker) or to every
    worker that sent its first message (rank 0); then it leaves the process group."""
    rank, world = env
    reason = Refused(f"rank {rank} (on {socket.gethostname()}) {what}")
    try:
        if rank != 0:
            send(reason, 0)
        else:
            for peer in range(1, world):
                if isinstance(receive(peer), dict):
                    send(reason, peer)
    except WorkerError:  # a rank gone already
        pass
    finally:
        _leave()


def joined_key(rank: int) -> str:
    """The process group store's key a worker sets when it has reached rank 0's store."""
    return f"contrafl/joined/{rank}"


def await_worker(store: dist.Store, rank: int, process: Any) -> None:
    """Wait until the worker ``process`` (rank ``rank``) has reached ``store``, looking
    for a stop request every :data:`POLL_S` seconds; a worker that ends before (a spawned
    worker whose start fails: its error is printed above) raises :class:`WorkerError`
    at once, where the process group would wait for it for :data:`TIMEOUT`."""
    while not store.check([joined_key(rank)]):
        process.join(POLL_S)
        if not process.is_alive():
            raise WorkerError(f"worker {rank} ended (exit code {process.exitcode}) before it joined the run (its error is above){_guard_hint()}")
        stop_point()


def _guard_hint() -> str:
    """What a script of the user's that started the run must do where workers are
    spawned (a spawned worker imports the main module again); nothing under contrafl's
    own command line."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if name.startswith("contrafl") or os.path.basename(getattr(main, "__file__", None) or "").startswith("contrafl"):
        return ""
    return ("; where workers are spawned (macOS, Windows, GPUs), a script that starts contrafl must do so under "
            "`if __name__ == \"__main__\":`, since each worker imports the script again")


# -- ranks 1 .. W-1 ------------------------------------------------------------------
def summed_outcomes(
    sim: LocalClients, outcomes: list[ClientOutcome], messages: dict[int, dict[str, Any]]
) -> tuple[list[ClientOutcome], list[torch.Tensor]]:
    """A worker's ``outcomes`` with the replies that pass the server's checks
    (:meth:`~contrafl.execution.replies.ReplyChecks.reply_problems`) summed
    (:func:`~contrafl.execution.partial.summed`: marked ``checked``, their floating-point
    tensors in the returned mean); the others as they are, for rank 0 to check and
    reject as it would any reply. Unchanged when the valid replies have no mean to take."""
    specs: dict[int, Any] = {}
    replied = [o for o in outcomes if o.reply is not None]
    checks = {o.cid: (sim.begin_reply_check(o.cid, o.reply, messages[o.cid], specs), o.reply) for o in replied}
    problems = sim.reply_problems(checks, messages.__getitem__)
    valid = [o for o in replied if o.cid not in problems]
    made = summed([o.reply for o in valid])
    if made is None:
        return outcomes, []
    bare, mean = made
    by_cid = {o.cid: dataclasses.replace(o, reply=reply, checked=True) for o, reply in zip(valid, bare)}
    return [by_cid.get(o.cid, o) for o in outcomes], mean


def _worker(clients: Callable[[], LocalClients], port: int, rank: int, world: int, counter: Any = None) -> None:
    """A worker that ``contrafl run`` started (forked, or spawned where it cannot fork,
    :func:`can_fork`): its rank of the process group on 127.0.0.1, then :func:`serve`
    with the clients ``clients()`` makes (before it joins: a spawned worker that cannot
    load the run's data ends before rank 0 waits for it, :func:`await_worker`)."""
    detach_from_signals()
    keep_freed_memory()  # a spawned worker's own allocator (a forked one has rank 0's settings)
    torch.set_num_threads(cores_each(world))
    served = clients()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
    store.set(joined_key(rank), "1")
    _join(rank, world, store)
    try:
        serve(served, store, counter)
    except Refused:  # rank 0 reports it
        pass


def serve_launched(clients: Callable[[], LocalClients], rank: int, world: int) -> None:
    """Rank ``rank`` (above 0) of ``world`` that ``torchrun`` started: join the process
    group (unless ``contrafl run`` has joined it first: :func:`launched_run`), then
    :func:`serve` with the clients ``clients()`` makes."""
    _join(rank, world)
    serve(clients(), dist.distributed_c10d._get_default_store())


def serve(sim: LocalClients, store: dist.Store, counter: Any = None) -> None:
    """A worker's life: send rank 0 this process's :func:`~contrafl.execution.same_run.
    identity` (raising :class:`~contrafl.execution.same_run.Refused` where rank 0 refuses
    it), then train the clients of each packet rank 0 sends, with the states
    it sends, counting the local steps in the process group's ``store`` for rank 0's
    progress (:class:`StepsReport`), and answer with their outcomes and next states,
    until a stop packet (or the loss of rank 0, which raises). ``sim`` has no run
    directory: nothing of the run is written here. ``counter``: the tail's counter in shared
    memory where rank 0 started this worker, else the store's is used (:func:`claims`).

    A worker speaks only when rank 0 listens: its identity, then one answer to each
    packet (a send waits for the peer's receive, so a word of its own while rank 0
    sends it a packet would leave both waiting). An error, or a stop request (SIGINT,
    SIGTERM, SIGHUP, where a launcher started it; rank 0 stops forked workers itself),
    is the answer to the packet it has, or to the next one: rank 0 raises it, so a
    stopped worker stops the run as a stop of rank 0 would (:class:`~contrafl.engine.
    signals.Interrupted`), and the worker ends with it too."""
    answer_due = True  # rank 0 waits for this rank's identity first
    try:
        with interrupts():  # a stop request waits for the next safe point, stop_point()
            try:
                send(identity(sim.setup), 0)  # for rank 0's check that this rank trains its run (checked)
                answer_due = False
                while (packet := receive(0, sim.device, stoppable=False)) is not None:
                    answer_due = True
                    if isinstance(packet, Refused):
                        raise packet
                    stop_point()
                    send(_answer(sim, store, packet, counter), 0)
                    answer_due = False
            except Refused:  # rank 0 has ended the run with this error
                raise
            except WorkerError:  # rank 0 is gone: nobody to tell (a stop requested here ends this rank as stopped)
                stop_point()
                raise
            except ContraflError as exc:  # a user error: rank 0 raises it as it is
                if answer_due:
                    _tell_rank_0(exc, exc)
            except KeyboardInterrupt as exc:  # a stop request: rank 0 stops the run, and this rank ends
                if answer_due:
                    _tell_rank_0(exc, exc)
                raise
            except BaseException as exc:  # reported to rank 0, which raises it
                if answer_due:
                    _tell_rank_0(f"a worker failed with {one_line(exc)}\n{traceback.format_exc()}", exc)
                else:
                    raise
    finally:
        sim.store.close()
        _leave()


def _tell_rank_0(answer: Any, exc: BaseException) -> None:
    """Send rank 0 ``answer``, this worker's last word on ``exc`` (its error or its
    stop). Where rank 0 is gone (a Ctrl-C reaches every rank of a launcher at once, and
    rank 0 may end first), ``exc`` is raised here, for this rank to end with it: a stopped
    rank ends as stopped, a failed one with its own error, not as having lost rank 0."""
    try:
        send(answer, 0)
    except WorkerError:
        raise exc from None


def _answer(sim: LocalClients, store: dist.Store, packet: dict[str, Any], counter: Any = None) -> tuple[list[tuple[ClientOutcome, Any]], list[torch.Tensor]]:
    """A worker's answer to ``packet``: its share's clients trained with the states it
    brings (the local steps counted in ``store`` for rank 0's progress), then the tail
    clients it takes (:func:`taken`); their outcomes with their next states, and the
    mean of the share's valid replies where the server sums them (:func:`summed_outcomes`,
    taken before the tail: the tail's replies travel one by one)."""
    t, messages, tail = packet["t"], packet["messages"], packet.get("tail", [])
    for cid, state in packet["states"].items():
        if state is not None:
            sim.store.put(cid, state)
    work, sim.progress = RoundWork(t + 1, len(messages)), (report := StepsReport(store, t))
    phases = sim.algorithm.phases(t)
    share = [cid for cid in messages if cid not in tail]
    outcomes = _read(list(sim.train_locally(t, share, messages.__getitem__, phases, work)))
    report.flush(work)
    stop_point()  # a stop requested while the clients trained: the answer is the stop
    outcomes, mean = summed_outcomes(sim, outcomes, messages) if sim.sums_replies else (outcomes, [])
    if tail:
        for cid in taken(claims(counter, store, packet["tail_key"]), tail):
            outcomes += _read(list(sim.train_locally(t, [cid], messages.__getitem__, phases, work)))
        report.flush(work)
        stop_point()
    return [(outcome, sim.store.get(outcome.cid)) for outcome in outcomes], mean


def _read(trained: list[ClientOutcome]) -> list[ClientOutcome]:
    """``trained`` with their losses read as floats (with one transfer from a GPU)."""
    from .outcomes import as_floats

    scalars = as_floats([(o.loss, o.parts) for o in trained])
    return [dataclasses.replace(o, loss=loss, parts=parts) for o, (loss, parts) in zip(trained, scalars)]
