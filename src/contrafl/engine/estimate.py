"""A new run's time, estimated before round 1 from a short measured calibration.

Local steps of clients of the run's second round (from their initial states) are
trained as the run's executor trains them, and one evaluation batch is evaluated; the
estimate scales them to the whole run (``contrafl run`` prints it, ``summary.json``
keeps it as ``estimated_time_s``):

* local training: every sampled client's local steps in every round (its plan's
  batches: its samples, the phases' epochs and batch sizes, ``drop_last``) at the
  measured time of a step. Sequential executor: one client's steps, as many as take
  about :data:`MEASURE_SECONDS` (one, when a step takes :data:`SLOW_STEP_S` or more:
  a step after the first, whose warm-up can take a second where a step takes a
  hundredth).
  Parallel executor: the same with a worker's threads, each round's clients shared
  among the workers as
  :func:`~contrafl.execution.parallel.balance` shares them, plus the executor's start
  (forking its workers), measured on one step per worker (a slow step: one step on
  each worker alone, their start included). Vectorized executor: a
  chunk of the round's clients and one client alone, :data:`CALIBRATION_STEPS` steps
  each, a step's time interpolated linearly in the number of clients still training.
  Distributed executor: one client's steps with a rank's threads, each round's clients
  shared among the ranks as the parallel executor's among its workers (the ranks start
  once, with the run).
* evaluation: the time of one evaluation batch (of at most :data:`EVAL_SAMPLES`
  samples), per sample, times the samples each
  evaluation evaluates (the test set, the clients' test data of the personalised
  evaluation, the kNN memory bank and queries).

Aggregation, communication accounting and checkpoints are not counted, nor a first
round cheaper than the others (MOON's has no contrastive term). The calibration trains
copies of the clients' jobs: the server, the client store, the random streams of the
run and the global random state stay as they were, so the run computes what it
computes without it.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from torch.utils import _pytree as pytree

from ..cores import cores_each
from ..execution.distributed import launched
from ..execution.executor import Job, SequentialExecutor
from ..execution.parallel import ParallelExecutor, balance
from ..execution.plan import ClientPlan
from .progress import clock_text
from ..words import count
from ..execution.vectorized import VectorizedExecutor

if TYPE_CHECKING:
    from .simulation import Simulation

CALIBRATION_STEPS = 5  # the fewest steps timed
MEASURE_SECONDS = 0.3  # of timed training per measurement (at most MAX_STEPS steps): well above the jitter of a busy machine
MAX_STEPS = 50
SHORT_RUN_S = 30.0  # contrafl run prints no estimate for a run that one timed step puts below this
SLOW_STEP_S = 1.0  # a step this slow after the first (a heavy model on a CPU) is timed once: the calibration takes a few steps' time
REPEATS = 2  # timings of the same steps, the least kept
EVAL_SAMPLES = 256  # the most samples of the evaluation batch timed
T = TypeVar("T")


@dataclass(frozen=True)
class Estimate:
    """The estimated seconds of a run and how they were found.

    Attributes:
        seconds: the whole estimate (training and evaluation).
        train_seconds: local training; ``train_seconds / steps`` is the time of a
            client's local step at the executor's pace.
        eval_seconds: evaluation.
        steps: the clients' local steps of the run.
        calibration_steps: the local steps the calibration trained.
    """

    seconds: float
    train_seconds: float
    eval_seconds: float
    steps: int
    calibration_steps: int

    def line(self) -> str:
        per_step = self.train_seconds / max(self.steps, 1)
        return (
            f"estimated time: ~{clock_text(self.seconds)} (calibrated on {count(self.calibration_steps, 'local step')}: "
            f"{per_step:.3g} s/step x {self.steps:,} steps + evaluation {clock_text(self.eval_seconds)})"
        )


def head(plan: ClientPlan, steps: int) -> ClientPlan:
    """The first ``steps`` steps of ``plan``."""
    steps = min(steps, plan.steps)
    end = plan.offsets[steps]
    aug = [{k: v[:end] for k, v in view.items()} for view in plan.aug]
    return ClientPlan(plan.order[:end], plan.sizes[:steps], aug, frozenset(e for e in plan.epoch_ends if e < steps))


def shares(steps: list[int], budget: int) -> list[int]:
    """``budget`` calibration steps spread over phases of ``steps`` steps, in proportion
    (at least one in every phase that has steps, at most its steps)."""
    total = sum(steps)
    return [min(s, max(1, round(budget * s / total))) if s else 0 for s in steps]


class Calibration:
    """Times local steps of clients of a run's second round (its first in a run of one
    round), trained from their initial states on copies of their jobs by the run's
    executor: a first round can be cheaper than the others (MOON has no previous model
    to contrast with, Orchestra trains no client)."""

    def __init__(self, sim: Simulation, budget: int) -> None:
        self.sim = sim
        self.t = min(1, sim.cfg.rounds - 1)
        self.budget = budget
        self.phases = sim.algorithm.phases(self.t)
        self.broadcast = sim.algorithm.broadcast(sim.server, self.t)
        self.executor = sim.round_executor(self.phases)
        self.cuda = sim.device.type == "cuda"
        # the round's clients, most steps first
        self.cids = sorted(sim.schedule[self.t], key=lambda c: -sim.planned_steps(c, self.phases))
        self.train = SequentialExecutor(self.executor.workload).train
        self._first: dict[int, float] = {}  # torch threads -> seconds of the first step
        self._warm: dict[int, float] = {}  # torch threads -> seconds of a step after it

    def job(self, cid: int, budget: int) -> Job:
        """Client ``cid``'s job cut to ``budget`` steps, its optimiser state a copy."""
        sim, algo = self.sim, self.sim.algorithm
        job = sim.client_job(cid, self.t, algo.message_for(self.broadcast, sim.server, cid, self.t), self.phases)[0]
        cut = shares([p.steps for p in job.plans], budget)
        opt_state = pytree.tree_map_only(torch.Tensor, torch.clone, job.opt_state)
        return Job(cid, job.task, [head(p, k) for p, k in zip(job.plans, cut)], job.seed, opt_state)

    def seconds(self, fn: Callable[[T], object], arg: T, warm_up: T | None = None, repeats: int = 1) -> float:
        """Seconds of ``fn(arg)``, the device synchronised, the least of ``repeats``
        calls (other work on the machine only slows a call down); after
        ``fn(warm_up)`` when given (first calls allocate and pick kernels)."""
        if warm_up is not None:
            fn(warm_up)
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            fn(arg)
            self.sync()
            times.append(time.perf_counter() - start)
        return min(times)

    def train_seconds(self, train: Callable[[list[Job]], object], jobs: list[Job]) -> float:
        """Seconds of ``train(jobs)`` after a warm-up on their first steps, the least
        of :data:`REPEATS` calls."""
        return self.seconds(train, jobs, [first_step(j) for j in jobs], REPEATS)

    def budget_for(self, step: float) -> int:
        """Steps that take about :data:`MEASURE_SECONDS` at ``step`` seconds a step
        (between ``budget`` and :data:`MAX_STEPS`)."""
        return max(self.budget, min(MAX_STEPS, round(MEASURE_SECONDS / max(step, 1e-6))))

    def first_step(self) -> float:
        """Seconds of the first local step (its warm-up included: an upper bound) of the
        round's client with the most steps, trained in this process with torch's
        current threads; timed once per thread count."""
        threads = torch.get_num_threads()
        if threads not in self._first:
            self._first[threads] = self.seconds(self.train, [self.job(self.cids[0], 1)])
        return self._first[threads]

    def warm_step(self) -> float:
        """Seconds of a local step without the first's warm-up: where the first takes
        :data:`SLOW_STEP_S` or more, the same step timed again (the first step's warm-up
        can take that long alone, a process's first kernels, where a step takes a
        hundredth); else the first (an upper bound). Timed once per thread count."""
        threads = torch.get_num_threads()
        if threads not in self._warm:
            first = self.first_step()
            self._warm[threads] = self.seconds(self.train, [self.job(self.cids[0], 1)]) if first >= SLOW_STEP_S else first
        return self._warm[threads]

    def slow(self) -> bool:
        """Whether a step takes :data:`SLOW_STEP_S` or more after the first
        (:meth:`warm_step`): its warm-up is small beside it, and that one step is the
        measurement."""
        return self.warm_step() >= SLOW_STEP_S

    def client_step(self) -> tuple[float, int]:
        """Seconds of a local step of the round's client with the most steps, trained
        in this process (a warm-up step, then :meth:`budget_for` steps, :data:`REPEATS`
        times; a slow step once after the first: :meth:`slow`), and the steps trained."""
        step = self.warm_step()
        if self.slow():
            return step, self.warm_up_steps()
        job = self.job(self.cids[0], self.budget_for(step))
        return self.seconds(self.train, [job], repeats=REPEATS) / steps_of(job), REPEATS * steps_of(job) + self.warm_up_steps()

    def warm_up_steps(self) -> int:
        """The steps :meth:`first_step` and :meth:`warm_step` train: two where the first
        takes :data:`SLOW_STEP_S` or more."""
        return 2 if self.first_step() >= SLOW_STEP_S else 1

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def first_step(job: Job) -> Job:
    return Job(job.cid, job.task, [head(p, 1) for p in job.plans], job.seed, job.opt_state)


def steps_of(job: Job) -> int:
    return sum(p.steps for p in job.plans)


def estimate(
    sim: Simulation, budget: int = CALIBRATION_STEPS, shortest: float = 0.0, say: Callable[[str], object] | None = None,
) -> Estimate | None:
    """The time of the new run ``sim``, calibrated on ``budget`` local steps (more for
    the parallel executor) of clients of its second round; None for a run that has
    done rounds, whose clients train elsewhere (a Flower grid), or whose calibration
    round has no client that takes a step, and for a run that its first timed step (one
    client's, a warm-up included: an upper bound) puts below ``shortest`` seconds, which
    needs no plan. Call it before :meth:`Simulation.run`: the run computes what it
    computes without it. A step slower than :data:`SLOW_STEP_S` after the first
    (:meth:`Calibration.slow`) is timed once, and ``say`` (when given) is told what it
    measured and what the calibration times next before it goes on."""
    if sim.transport is not None or sim.rounds_done:
        return None
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(sim.device) if sim.device.type == "cuda" else None
    threads = torch.get_num_threads()
    try:
        return _estimate(Calibration(sim, budget), shortest, say)
    finally:
        release_freed_memory()
        torch.set_num_threads(threads)
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, sim.device)


def release_freed_memory() -> None:
    """Give the memory the calibration freed back to the system: glibc keeps freed
    blocks below its (dynamic) mmap threshold in its heap, and a parallel run's workers,
    forked next, would carry them (0.5 GB after a step of FedU2's ResNet-18 on an
    evaluation batch of 1000). Nothing where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _estimate(cal: Calibration, shortest: float, say: Callable[[str], object] | None) -> Estimate | None:
    sim = cal.sim
    if not cal.cids or not steps_of(cal.job(cal.cids[0], 1)):  # e.g. Orchestra's first round
        return None
    per_round = [[sim.planned_steps(c, sim.algorithm.phases(t)) for c in sim.schedule[t]] for t in range(sim.cfg.rounds)]
    first = cal.first_step()
    if first * sum(map(sum, per_round)) < shortest:
        return None
    slow = cal.slow()
    parallel = isinstance(cal.executor, ParallelExecutor) and min(cal.executor.workers, len(cal.cids)) > 1
    if say is not None and slow:
        more = "one step on each worker, then " if parallel else ""
        say(
            f"estimating the run's time: a local step takes {cal.warm_step():.3g}s here (timed after a first step of "
            f"{first:.3g}s, its warm-up included); timing {more}an evaluation batch"
        )
    ranks = sim.cfg.workers if sim.executor_name == "distributed" else 1
    if isinstance(cal.executor, VectorizedExecutor):
        train_seconds, measured = _vectorized(cal, cal.executor, per_round, ranks)
    elif parallel:
        train_seconds, measured = _parallel(cal, cal.executor, per_round, slow)
    elif ranks > 1:
        train_seconds, measured = _distributed(cal, ranks, per_round)
    else:
        step, measured = cal.client_step()
        train_seconds = step * sum(map(sum, per_round))
    eval_seconds = _evaluation(cal)
    return Estimate(train_seconds + eval_seconds, train_seconds, eval_seconds, sum(map(sum, per_round)), measured)


def _parallel(cal: Calibration, executor: ParallelExecutor, per_round: list[list[int]], slow: bool) -> tuple[float, int]:
    """Training seconds of the rounds with client steps ``per_round`` and the steps
    measured. A round costs ``start + step * (the busiest worker's steps)``: ``step``
    is a client's step in this process with a worker's threads, ``start`` what the
    executor takes beyond one step to train one client per worker for one step (its
    workers start anew in every round). A ``slow`` step is measured on the workers
    alone: one step on each, their start included (small beside it), is ``step``, and
    ``start`` is 0."""
    torch.set_num_threads(executor.threads)
    jobs = [first_step(cal.job(c, 1)) for c in cal.cids[: executor.workers]]
    busiest = _busiest(per_round, min(executor.workers, len(cal.cids)))
    if slow:
        return cal.seconds(executor.train, jobs) * sum(busiest), len(jobs) + cal.warm_up_steps()
    step, measured = cal.client_step()
    start = max(cal.seconds(executor.train, jobs) - step, 0.0)
    return len(busiest) * start + step * sum(busiest), measured + len(jobs)


def _distributed(cal: Calibration, world: int, per_round: list[list[int]]) -> tuple[float, int]:
    """Training seconds of the rounds with client steps ``per_round`` on ``world`` ranks
    and the steps measured: a client's step with a rank's threads (``cores // world``
    where contrafl starts the ranks, torchrun's own otherwise) times the busiest rank's
    steps of every round (the ranks start once, with the run)."""
    _use_a_ranks_threads(world)
    step, measured = cal.client_step()
    return step * sum(_busiest(per_round, world)), measured


def _use_a_ranks_threads(world: int) -> None:
    """This process's torch threads set to a rank's of ``world`` where contrafl starts the
    ranks (the machine's cores shared among them); under torchrun, the launcher's own."""
    if launched() is None:
        torch.set_num_threads(cores_each(world))


def _busiest(per_round: list[list[int]], workers: int) -> list[int]:
    """The steps of each round's busiest worker, its clients shared among ``workers``
    as :func:`~contrafl.execution.parallel.balance` shares them."""
    return [max(sum(steps[i] for i in share) for share in balance(steps, min(workers, len(steps)))) for steps in per_round if steps]


def _vectorized(cal: Calibration, executor: VectorizedExecutor, per_round: list[list[int]], ranks: int = 1) -> tuple[float, int]:
    """Training seconds of the rounds with client steps ``per_round`` and the steps
    measured. A step of ``a`` clients costs ``one + slope * (a - 1)``, from a chunk of
    the round's clients and from one client, each trained ``budget`` steps. On ``ranks``
    ranks of the distributed executor (``rank_executor=vectorized``) each rank stacks
    its share of the round's clients with a rank's threads (as :func:`_distributed`), and
    a round takes its slowest rank's time."""
    if ranks > 1:
        _use_a_ranks_threads(ranks)
    first = cal.job(cal.cids[0], cal.budget)
    chunk = executor.chunk_size(first)
    jobs = [first] + [cal.job(c, cal.budget) for c in cal.cids[1:chunk]]
    lengths = [steps_of(j) for j in jobs]
    many = cal.train_seconds(executor.train, jobs) / max(lengths)
    one = cal.train_seconds(executor.train, [first]) / lengths[0]
    slope = (many - one) / (len(jobs) - 1) if len(jobs) > 1 else 0.0

    def stacked(steps: list[int]) -> float:
        seconds = 0.0
        for i in range(0, len(steps), chunk):  # the executor's chunks, in client order
            part = steps[i : i + chunk]  # clients still training at a step: sum(part) steps over max(part) steps
            seconds += max(part) * (one - slope) + slope * sum(part)
        return seconds

    seconds = 0.0
    for steps in per_round:
        if steps:
            shares = balance(steps, min(ranks, len(steps)))
            seconds += max(stacked([steps[i] for i in share]) for share in shares)
    return seconds, REPEATS * (sum(lengths) + lengths[0]) + len(jobs) + 1


def _evaluation(cal: Calibration) -> float:
    """Seconds of the run's evaluations: one evaluation batch of the global model
    timed, per sample, times the samples evaluated."""
    sim = cal.sim
    cfg, algo = sim.cfg, sim.algorithm
    source = sim.test if len(sim.test.y) else sim.train
    x = source.x[: min(cfg.eval_batch_size, EVAL_SAMPLES, len(source.y))]

    @torch.no_grad()
    def forward(x: torch.Tensor) -> None:
        sim.net(sim.server.model, sim.setup.eval_transform(x), train=False)

    per_sample = cal.seconds(forward, x, x) / max(len(x), 1)

    def due(every: int, t: int) -> bool:
        return t % every == 0 or t == cfg.rounds

    samples = 0
    n_test = len(sim.test.y)
    for t in range(1, cfg.rounds + 1):
        if due(cfg.eval_every, t):
            if algo.evaluates_global and algo.supervised:
                samples += n_test
            if cfg.eval_personal:
                test = sim.setup.partition.test
                samples += sum(len(r) for r in test) if test is not None else cfg.num_clients * n_test
        if cfg.knn_every and due(cfg.knn_every, t):
            samples += len(sim.train.y) + n_test
    return per_sample * samples
