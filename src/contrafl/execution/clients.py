"""The clients of this process: what a round's clients need, trained and evaluated here.

:class:`LocalClients` turns a round's messages into local training: for each client it
takes the state it keeps (:attr:`LocalClients.store`), lets the algorithm make the local
task (``client_begin``), draws the client's batches (its plans), hands the jobs to the
run's executor (sequential, parallel or vectorized), and makes the reply and the next
state from the result (``client_end``), with local DP and the round's deadline applied.
The server's round loop (:class:`~contrafl.engine.simulation.Simulation`, which is one)
uses it for the clients of its own process; each rank of the distributed executor and
each Flower node serves its clients with one, and never runs a round loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ..algorithms.base import LocalTask, Phase, StateDict
from ..config import Config
from ..cores import cores_each, cpu_cores
from ..data.augment import Transform, Views, view_transform
from ..metrics.evaluate import evaluate
from ..models.base import ModelOutput, smallest_batch
from ..models.stacked import stacked_forward
from ..rng import derive_seed, generator
from ..speeds import client_speeds, round_speed, step_budget
from .context import Context, LocalPrivacy, Setup, Store, Watcher
from .executor import AutocastNet, FunctionalNet, Job, PhaseRun, SequentialExecutor, Workload
from .optim import make_optimizer
from .outcomes import ClientOutcome, Probe, Scores, loss_parts
from .parallel import ParallelExecutor
from .plan import ClientPlan, epoch_batch_sizes, make_plan
from .replies import ReplyChecks
from .vectorized import StepArenas, VectorizedExecutor
from .work import RoundWork


def make_executor(name: str, workload: Workload, cfg: Config, arenas: StepArenas | None = None):
    """The executor ``name`` for ``workload``; ``arenas``: what the vectorized executor
    keeps from round to round (its steps' CUDA graphs and the tensors they run on)."""
    if name == "vectorized":
        return VectorizedExecutor(workload, cfg.vectorize_memory_gb * 2**30, cfg.cuda_graphs, cfg.pad_finished_clients, arenas)
    if name == "parallel":
        workers = cfg.workers or cpu_cores()
        return ParallelExecutor(workload, workers, threads=cores_each(workers))
    return SequentialExecutor(workload)


READY_INPUTS_BYTES = 1 << 30
"""The most memory :attr:`LocalClients.train_inputs` spends on a training set transformed ahead of the steps."""
READY_CHUNK = 4096
"""Samples transformed at a time by :attr:`LocalClients.train_inputs`."""


class LocalClients(ReplyChecks):
    """The clients of a run that train and evaluate in this process."""

    def __init__(
        self,
        setup: Setup,
        store: Store,
        executor: str,
        privacy: LocalPrivacy | None = None,
        progress: Watcher | None = None,
    ) -> None:
        cfg = self.cfg = setup.config
        self.setup = setup
        self.algorithm = setup.algorithm
        self.device = setup.device
        self.store = store
        """Every client's state between rounds (:class:`Store`)."""
        self.local_executor = executor
        """The executor that trains this process's clients (``sequential``, ``parallel`` or
        ``vectorized``): the run's, or for the distributed executor the one each rank
        trains its share with (``rank_executor``)."""
        self.privacy = privacy
        """Client-level DP, None without (:class:`LocalPrivacy`)."""
        self.progress = progress
        self.train = setup.data.train.to(self.device)
        self.test = setup.data.test.to(self.device)
        self.net = FunctionalNet(setup.model.to(self.device))
        self.smallest_batch = smallest_batch(setup.model)
        """The fewest samples a training batch takes (2 for a model with BatchNorm): a
        shorter last batch of an epoch is left out (:func:`epoch_batch_sizes`,
        :meth:`smallest`)."""
        self.autocast = torch.bfloat16 if cfg.precision == "bf16" else None
        self.client_net = self.net if self.autocast is None else AutocastNet(self.net, self.autocast)
        """The forward algorithms get for their own computations (:attr:`Context.net`), in the run's precision."""
        self.rows = [np.asarray(r) for r in setup.partition.train]
        self.rows_t = [torch.as_tensor(r, dtype=torch.long, device=self.device) for r in self.rows]
        labels = setup.data.train.y.numpy()
        self.label_counts = torch.as_tensor(setup.partition.counts(labels, setup.data.num_classes))
        self.speeds = client_speeds(cfg.client_speed, cfg.num_clients, cfg.seed).tolist()
        self.step_arenas = StepArenas()  # the vectorized executor's graphs from round to round
        self.round_work: RoundWork | None = None
        """The current round's progress, in which a transport that sees its clients' local
        steps counts them."""
        self.probes: dict[str, Probe] = {}
        """What the clients' personal models are evaluated on besides their test data, by
        name (:meth:`evaluate_locally`): an attack's (a backdoor's success rate)."""

    def initial_state(self, cid: int) -> StateDict:
        """Client ``cid``'s own random initialisation (MOON initialises every party's net)."""
        model = self.setup.model_factory(derive_seed(self.cfg.seed, "client-init", cid))
        return {k: v.detach().to(self.device) for k, v in model.state_dict().items()}

    @torch.no_grad()
    def predict(self, state: StateDict, rows: torch.Tensor) -> tuple[ModelOutput, torch.Tensor]:
        """The model ``state``'s outputs on the training samples ``rows`` (eval mode, the
        evaluation transform, ``eval_batch_size`` at a time) and their labels."""
        outs = []
        bs = self.cfg.eval_batch_size
        for i in range(0, len(rows), bs):
            x = self.setup.eval_transform(self.train.x[rows[i : i + bs]])
            outs.append(self.net(state, x, train=False))
        joined = pytree.tree_map(lambda *parts: None if parts[0] is None else torch.cat(parts), *outs) if outs else None
        return joined, self.train.y[rows]

    def phase_runs(self, phases: list[Phase]) -> list[PhaseRun]:
        """The phases with their optimisers (the run's, with each phase's overrides)."""
        cfg = self.cfg
        runs = []
        for phase in phases:
            o = {"name": cfg.optimizer, "lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay}
            o.update(phase.optimizer or {})
            runs.append(PhaseRun(phase.stages, make_optimizer(o["name"], o["lr"], o["momentum"], o["weight_decay"])))
        return runs

    def plans(self, cid: int, t: int, phases: list[Phase], task: LocalTask) -> list[ClientPlan]:
        """Client ``cid``'s batches of every phase of round ``t``, drawn one phase after
        the other from the client's stream of the round, on the run's device; for the
        vectorized executor on the CPU, where it gathers all its clients' batches into
        one tensor that it moves to the device in one copy."""
        cfg = self.cfg
        g = generator(cfg.seed, "plan", t, cid)
        plans = []
        for i, phase in enumerate(phases):
            epochs = task.epochs[i] if task.epochs is not None else phase.epochs if phase.epochs is not None else cfg.local_epochs
            batch = phase.batch_size or cfg.batch_size
            samplers = [view_transform(self.setup.train_transform, v).sample for v in range(self.algorithm.views)]
            plan = make_plan(self.rows[cid], epochs, batch, cfg.drop_last, samplers, self.algorithm.views, g, self.smallest(phase))
            plans.append(plan if self.local_executor == "vectorized" else plan.to(self.device))
        return plans

    def smallest(self, phase: Phase) -> int:
        """The fewest samples a batch of ``phase`` takes: :attr:`smallest_batch` for each
        of its :attr:`~contrafl.algorithms.base.Phase.parts` where the model needs more
        than one (BatchNorm), else 1."""
        return self.smallest_batch * phase.parts if self.smallest_batch > 1 else 1

    def planned_steps(self, cid: int, phases: list[Phase]) -> int:
        """Client ``cid``'s local steps in ``phases`` as the phases' epochs and batch sizes
        give them (an algorithm's per-client epochs and a deadline can change them when
        the client's job is made)."""
        cfg = self.cfg
        n = len(self.rows[cid])
        return sum(
            (phase.epochs if phase.epochs is not None else cfg.local_epochs)
            * len(epoch_batch_sizes(n, phase.batch_size or cfg.batch_size, cfg.drop_last, self.smallest(phase)))
            for phase in phases
        )

    @functools.cached_property
    def train_inputs(self) -> tuple[torch.Tensor, Transform | Views]:
        """The training samples the local steps gather their batches from, and the
        transform they apply to each batch.

        A deterministic single-view pipeline (no random op, e.g. ``augment=none``'s
        normalisation) on the CPU, for an executor that trains clients step by step (not
        the vectorized one, unless the model has a stacked forward), is applied here,
        once, to the whole training set, in the model's layout
        (:meth:`FunctionalNet.layout`), when the result takes at most
        :data:`READY_INPUTS_BYTES`; the steps then only gather rows (MOON's CNN, batch
        10: the per-step conversion and layout were 8% of a step). The values are the
        same, elementwise. Otherwise the stored samples (``uint8`` images: a quarter of
        float32's memory) and the run's pipeline."""
        x, transform = self.train.x, self.setup.train_transform
        deterministic = isinstance(transform, Transform) and not any(op.keys for op in transform.ops)
        # the vectorized executor's vmap takes its [K, B] batches as they come (NCHW), but
        # for a stacked forward (a CPU), which lays them out itself
        steps = self.local_executor != "vectorized" or stacked_forward(self.setup.model) is not None
        if not (deterministic and steps and self.algorithm.views == 1 and self.device.type == "cpu" and len(x)):
            return x, transform
        head = self.net.layout(transform(x[:2]))  # two samples: the layout's strides, which do not depend on the count
        if head.element_size() * head[0].numel() * len(x) > READY_INPUTS_BYTES:
            return x, transform
        ready = torch.empty_strided((len(x), *head.shape[1:]), head.stride(), dtype=head.dtype)
        for start in range(0, len(x), READY_CHUNK):
            ready[start : start + READY_CHUNK] = transform(x[start : start + READY_CHUNK])
        return ready, Transform()

    def round_executor(self, phases: list[Phase]) -> SequentialExecutor | ParallelExecutor | VectorizedExecutor:
        """The run's executor for a round of ``phases``."""
        x, transform = self.train_inputs
        workload = Workload(
            x,
            self.train.y,
            transform,
            self.net,
            self.phase_runs(phases),
            autocast=self.autocast,
            keep_opt_state=self.cfg.persist_optimizer_state,
        )
        return make_executor(self.local_executor, workload, self.cfg, self.step_arenas)

    def client_job(self, cid: int, t: int, message: dict[str, Any], phases: list[Phase]) -> tuple[Job, Context, dict[str, Any]]:
        """Client ``cid``'s local training in round ``t`` of ``phases`` on ``message``:
        the job, the client's context and its entry in the store (or a fresh one)."""
        algo = self.algorithm
        ctx = Context(self, cid, t)
        entry = self.store.get(cid) or {"algorithm": algo.init_client(ctx), "optimizer": None}
        task = algo.client_begin(message, entry["algorithm"], ctx)
        seed = derive_seed(self.cfg.seed, "dropout", t, cid)
        return Job(cid, task, self.plans(cid, t, phases, task), seed, entry["optimizer"]), ctx, entry

    def train_locally(
        self,
        t: int,
        cids: list[int],
        message_for: Callable[[int], dict[str, Any]],
        phases: list[Phase],
        work: RoundWork | None = None,
    ) -> Iterator[ClientOutcome]:
        """Round ``t``'s local training of clients ``cids`` in this process with the run's
        executor: ``client_begin`` on ``message_for(cid)``, the executor, ``client_end``;
        each client's next state goes to the store. The outcomes come in the order the
        executor finishes the clients. A client that misses ``round_deadline``
        (:meth:`cut_at_deadline`) trains what it finished, or is lost; with ``dp=local``
        its reply is privatized (:meth:`Privacy.privatize`) before it leaves. ``work``
        (the round's, when given) counts the planned and finished local steps, and the
        progress is told as they finish (``work.steps``, when set, is left as it is: the
        steps of a round whose other clients train elsewhere)."""
        algo, cfg = self.algorithm, self.cfg
        executor = self.round_executor(phases)
        planned = {cid: self.planned_steps(cid, phases) for cid in cids}
        work = work or RoundWork(t + 1, len(cids))
        if work.steps is None:
            work.steps = sum(planned.values())

        def steps_done(n: int) -> None:
            work.steps_done += n
            if self.progress is not None:
                self.progress.working(work)

        open_clients: dict[int, tuple[Context, dict[str, Any]]] = {}
        cuts: dict[int, dict[str, Any]] = {}
        messages: dict[int, dict[str, Any]] = {}
        speeds: dict[int, float] = {}

        def make_job(cid: int) -> Job:
            messages[cid] = message_for(cid)
            job, ctx, entry = self.client_job(cid, t, messages[cid], phases)
            open_clients[cid] = (ctx, entry)
            speeds[cid] = self.speed(cid, t)
            cut = self.cut_at_deadline(cid, speeds[cid], job)
            if cut is not None:
                cuts[cid] = cut
            work.steps += sum(plan.steps for plan in job.plans) - planned[cid]  # per-client epochs, a deadline's cut
            return job

        for job, result in executor.run(make_job, cids, steps_done):
            ctx, entry = open_clients.pop(job.cid)
            message, cut, speed = messages.pop(job.cid), cuts.pop(job.cid, None), speeds.pop(job.cid)
            if cut is not None and not cut["done"]:  # dropped at the deadline: no reply, the state stays
                yield ClientOutcome(job.cid, None, lost=f"straggler: missed round_deadline={cfg.round_deadline:g}", time=cfg.round_deadline, straggler=cut)
                continue
            reply, state = algo.client_end(job.task, result, entry["algorithm"], ctx)
            if self.privacy is not None and self.privacy.mode == "local":
                reply = self.privacy.privatize(reply, message, t)
            entry = {"algorithm": state, "optimizer": result.opt_state if cfg.persist_optimizer_state else None}
            if entry["algorithm"] or entry["optimizer"] is not None or job.cid in self.store:
                self.store.put(job.cid, entry)
            loss = result.stats.get("loss")
            time = result.steps / speed
            yield ClientOutcome(job.cid, reply, loss, result.steps, parts=loss_parts(result.stats), time=time, straggler=cut)

    def speed(self, cid: int, t: int) -> float:
        """Client ``cid``'s speed in round ``t`` (:func:`~contrafl.speeds.round_speed`)."""
        return round_speed(self.speeds[cid], self.cfg.speed_jitter, self.cfg.seed, t, cid)

    def cut_at_deadline(self, cid: int, speed: float, job: Job) -> dict[str, Any] | None:
        """Apply ``round_deadline`` to client ``cid``'s ``job`` of a round in which it runs
        at ``speed`` (``s_i``): ``None`` when its planned steps ``K`` fit
        (``K / s_i <= round_deadline``), else how it was cut:
        ``{"client", "speed", "planned": K, "done": k}``. With ``stragglers=partial`` the
        job keeps its first ``k = floor(round_deadline * s_i)`` steps (the same batches
        as the whole plan's first ``k``); with ``drop``, or when ``k`` is 0, it keeps none
        (``done`` 0) and the client does not reply."""
        deadline = self.cfg.round_deadline
        planned = sum(plan.steps for plan in job.plans)
        if deadline is None or planned <= step_budget(deadline, speed):
            return None
        budget = step_budget(deadline, speed) if self.cfg.stragglers == "partial" else 0
        plans = []
        for plan in job.plans:  # phases in order: the budget goes to the first ones
            plans.append(plan.head(min(plan.steps, budget)))
            budget -= plans[-1].steps
        job.plans = plans
        done = sum(plan.steps for plan in plans)
        return {"client": cid, "speed": round(speed, 6), "planned": planned, "done": done}

    def evaluate_model_locally(self, t: int, cids: list[int], state: StateDict) -> Iterator[tuple[int, Scores | None]]:
        """The model ``state`` on each of ``cids``' local test split, in this process
        (:meth:`Transport.evaluate_model`)."""
        test_rows = self.setup.partition.test
        for cid in cids:
            rows = torch.as_tensor(test_rows[cid] if test_rows is not None else [], dtype=torch.long, device=self.device)
            yield cid, evaluate(self.net, state, self.train.x[rows], self.train.y[rows], self.setup.eval_transform, self.cfg.eval_batch_size)

    def evaluate_locally(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]]
    ) -> Iterator[tuple[int, Scores | None]]:
        """Clients ``cids`` evaluated in this process (:meth:`Transport.evaluate`): each
        one's personal model from its stored state (its initial state when it has none)
        and ``message_for(cid)``, on its local test split or the global test set, and on
        what each of :attr:`probes` makes of that data (``probes`` in its scores)."""
        algo, tf, bs = self.algorithm, self.setup.eval_transform, self.cfg.eval_batch_size
        test_rows = self.setup.partition.test
        for cid in cids:
            ctx = Context(self, cid, t)
            entry = self.store.get(cid)
            state = entry["algorithm"] if entry is not None else algo.init_client(ctx)
            model = algo.personal_model(state, message_for(cid), ctx)
            if model is None:
                yield cid, None
                continue
            if test_rows is not None:
                rows = torch.as_tensor(test_rows[cid], dtype=torch.long, device=self.device)
                x, y = self.train.x[rows], self.train.y[rows]
            else:
                x, y = self.test.x, self.test.y
            scores = evaluate(self.net, model.state, x, y, tf, bs, scores=model.scores)
            if self.probes:
                scores["probes"] = {name: _probed(probe(x, y), self.net, model, tf, bs) for name, probe in self.probes.items()}
            yield cid, scores


def _probed(data: tuple[torch.Tensor, torch.Tensor], net: Any, model: Any, transform: Any, batch_size: int) -> Scores:
    """A personal model's accuracy on a probe's data (:data:`~contrafl.execution.outcomes.Probe`)."""
    x, y = data
    res = evaluate(net, model.state, x, y, transform, batch_size, scores=model.scores)
    return {"acc": res["acc"], "n": res["n"]}
