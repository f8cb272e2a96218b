"""The parallel executor: clients trained in worker processes on a multi-core CPU.

Small models gain little from spreading one client's small tensor operations over many
threads, and several processes each running many threads on few cores slow each other
down badly. On the CPU it is faster to train several clients at once, one per worker
process, each with few threads. Workers are forked when a round's jobs are ready, so they
inherit the data, the model and the algorithm's loss functions without pickling; each
trains its share of the jobs with the sequential executor (seeded per job, so a client's
result does not depend on which worker trains it) and sends the results back. Each worker
counts its finished local steps in shared memory, which the parent reads while it waits
(the progress of a long round). The workers leave stop requests (Ctrl-C, SIGTERM, :mod:`~contrafl.execution.signals`) to the parent: it
looks for one while it waits for their results, and then kills them.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Iterator
from queue import Empty
from typing import Any

import torch
import torch.multiprocessing as mp

from ..algorithms.base import TrainResult
from ..errors import ContraflError, one_line
from . import frames
from .executor import Job, SequentialExecutor, StepsDone, Workload
from .signals import POLL_S, detach_from_signals, stop_point


def balance(steps: list[int], workers: int) -> list[list[int]]:
    """Assign jobs (by their number of steps) to workers, longest first to the least loaded."""
    loads = [0] * workers
    shares: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(steps)), key=lambda i: -steps[i]):
        w = loads.index(min(loads))
        shares[w].append(i)
        loads[w] += steps[i] + 1
    return [sorted(s) for s in shares if s]


class WorkerError(RuntimeError):
    """A worker process failed: its exception (first line) and traceback."""


def _worker(workload: Workload, jobs: list[Job], share: list[int], threads: int, queue, steps, w: int) -> None:
    """Train ``jobs[i]`` for ``i`` in ``share``, each result put on ``queue``, the steps
    finished counted in ``steps[w]``."""
    detach_from_signals()

    def count(n: int) -> None:
        steps[w] += n

    try:
        torch.set_num_threads(threads)
        executor = SequentialExecutor(workload)
        for i in share:
            queue.put((i, pack(executor.train([jobs[i]], count)[0]), None))
    except ContraflError as exc:  # a user error: the parent raises it as it is
        queue.put((None, None, exc))
    except BaseException as exc:  # reported to the parent, which raises it
        queue.put((None, None, f"a worker process failed with {one_line(exc)}\n{traceback.format_exc()}"))


def _receive(
    queue, procs: list, shares: list[list[int]], results: list, poll: Callable[[], None]
) -> tuple[int | None, Any, Any]:
    """The workers' next message from ``queue``, ``poll()`` called every :data:`POLL_S`
    seconds meanwhile. A stop request made meanwhile (see
    :mod:`~contrafl.execution.signals`) raises within :data:`POLL_S` seconds, and so does
    the death of a worker that still owes results (killed, e.g. for memory), which
    would otherwise leave the wait without an end."""
    while True:
        stop_point()
        try:
            return queue.get(timeout=POLL_S)
        except Empty:
            poll()
        for p, share in zip(procs, shares):
            if p.exitcode not in (None, 0) and any(results[i] is None for i in share):
                raise WorkerError(
                    f"a worker process died with exit code {p.exitcode} before it sent its results"
                    + (f" (killed by signal {-p.exitcode}; out of memory?)" if p.exitcode < 0 else "")
                )


class ParallelExecutor:
    """Trains the jobs of a round in ``workers`` forked processes of ``threads`` threads."""

    name = "parallel"

    def __init__(self, workload: Workload, workers: int, threads: int = 1) -> None:
        self.workload = workload
        self.workers = workers
        self.threads = threads

    def train(self, jobs: list[Job], on_steps: StepsDone | None = None) -> list[TrainResult]:
        shares = balance([sum(p.steps for p in j.plans) for j in jobs], min(self.workers, len(jobs)))
        if len(shares) <= 1:
            return SequentialExecutor(self.workload).train(jobs, on_steps)
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        steps = ctx.RawArray("q", len(shares))  # each worker's finished steps (one writer each)
        reported = 0

        def poll() -> None:
            nonlocal reported
            done = sum(steps)
            if on_steps is not None and done > reported:
                on_steps(done - reported)
            reported = done

        procs = [
            ctx.Process(target=_worker, args=(self.workload, jobs, s, self.threads, queue, steps, w), daemon=True)
            for w, s in enumerate(shares)
        ]
        results: list[TrainResult | None] = [None] * len(jobs)
        threads = torch.get_num_threads()
        finished = False
        try:
            for p in procs:
                p.start()
            # While the workers hold the cores, a multi-threaded op in this process waits for
            # threads that are not scheduled (copying a result's tensors took ~0.2 ms each).
            torch.set_num_threads(1)
            for _ in range(len(jobs)):
                i, result, error = _receive(queue, procs, shares, results, poll)
                poll()
                if isinstance(error, BaseException):
                    raise error
                if error is not None:
                    raise WorkerError(error)
                results[i] = unpack(result)
            finished = True
        finally:
            torch.set_num_threads(threads)
            for p in procs:
                if p.pid is None:  # never started: the forks were cut short
                    continue
                if not finished:  # stopped or failed: the round's other results are not needed
                    p.kill()
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        return results  # type: ignore[return-value]

    def run(
        self, make_job: Callable[[int], Job], cids: Iterable[int], on_steps: StepsDone | None = None
    ) -> Iterator[tuple[Job, TrainResult]]:
        """Build every job of the round, then train them in parallel."""
        jobs = [make_job(cid) for cid in cids]
        yield from zip(jobs, self.train(jobs, on_steps))


def pack(result: TrainResult) -> bytes:
    """``result`` as one :mod:`~contrafl.execution.frames` frame's bytes, sent through the
    queue's pipe. Sent as tensors, every tensor would travel as a shared-memory segment of
    its own: 8.7 ms per result of a MOON client of the simple CNN from two workers,
    against 3.2 ms packed."""
    return frames.encode(result).numpy().tobytes()


def unpack(raw: bytes) -> TrainResult:
    """The :class:`TrainResult` of :func:`pack`, each tensor with a storage of its own."""
    return frames.decode(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
