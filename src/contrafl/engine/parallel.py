"""The parallel executor: clients trained in worker processes on a multi-core CPU.

Small models gain little from spreading one client's small tensor operations over many
threads, and several processes each running many threads on few cores slow each other
down badly. On the CPU it is faster to train several clients at once, one per worker
process, each with few threads. Workers are forked when a round's jobs are ready, so they
inherit the data, the model and the algorithm's loss functions without pickling; each
trains its share of the jobs with the sequential executor (seeded per job, so a client's
result does not depend on which worker trains it) and sends the results back.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.multiprocessing as mp
from torch.utils import _pytree as pytree

from ..algorithms.base import TrainResult
from .executor import Job, SequentialExecutor, Workload


def balance(steps: list[int], workers: int) -> list[list[int]]:
    """Assign jobs (by their number of steps) to workers, longest first to the least loaded."""
    loads = [0] * workers
    shares: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(steps)), key=lambda i: -steps[i]):
        w = loads.index(min(loads))
        shares[w].append(i)
        loads[w] += steps[i] + 1
    return [sorted(s) for s in shares if s]


def _worker(workload: Workload, jobs: list[Job], share: list[int], threads: int, queue, received) -> None:
    try:
        torch.set_num_threads(threads)
        executor = SequentialExecutor(workload)
        for i in share:
            queue.put((i, executor.train([jobs[i]])[0], None))
    except BaseException:  # reported to the parent, which raises it
        queue.put((None, None, traceback.format_exc()))
    received.wait()  # keep shared tensors alive until the parent has them


class ParallelExecutor:
    """Trains the jobs of a round in ``workers`` forked processes of ``threads`` threads."""

    name = "parallel"

    def __init__(self, workload: Workload, workers: int, threads: int = 1) -> None:
        self.workload = workload
        self.workers = workers
        self.threads = threads

    def train(self, jobs: list[Job]) -> list[TrainResult]:
        shares = balance([j.plan.steps for j in jobs], min(self.workers, len(jobs)))
        if len(shares) <= 1:
            return SequentialExecutor(self.workload).train(jobs)
        ctx = mp.get_context("fork")
        queue, received = ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(target=_worker, args=(self.workload, jobs, s, self.threads, queue, received), daemon=True)
            for s in shares
        ]
        for p in procs:
            p.start()
        results: list[TrainResult | None] = [None] * len(jobs)
        try:
            for _ in range(len(jobs)):
                i, result, error = queue.get()
                if error is not None:
                    raise RuntimeError(f"a worker process failed:\n{error}")
                results[i] = _owned(result)
        finally:
            received.set()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        return results  # type: ignore[return-value]

    def run(self, make_job: Callable[[int], Job], cids: Iterable[int]) -> Iterator[tuple[Job, TrainResult]]:
        """Build every job of the round, then train them in parallel."""
        jobs = [make_job(cid) for cid in cids]
        yield from zip(jobs, self.train(jobs))


def _owned(result: TrainResult) -> TrainResult:
    """A copy of a result received from a worker that no longer uses the worker's memory."""

    def clone(tree):
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)

    return TrainResult(clone(result.params), clone(result.buffers), clone(result.stats), result.steps, clone(result.opt_state))
