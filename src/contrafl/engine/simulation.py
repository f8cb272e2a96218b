"""The round loop of a federated simulation.

Each round: sample clients, broadcast the server's message, let the algorithm prepare
each client's local task, train the clients with the executor, collect the replies,
aggregate, apply the server optimiser, account for communication and evaluate. The loop
never looks at which algorithm runs: everything algorithm-specific goes through the
:class:`~contrafl.algorithms.base.Algorithm` interface.

Every ``checkpoint_every`` rounds (and after the last) the run directory gets a
checkpoint with everything needed to continue exactly: the server's state and
optimiser, every client's state (:class:`~contrafl.engine.client_store.ClientStore`),
the metrics so far and the communication totals. Every random stream is derived from
(seed, round, client) (:mod:`contrafl.rng`), so :meth:`Simulation.restore`
followed by :meth:`Simulation.run` continues with the same numbers as a run that was
never stopped. ``summary.json`` always says how the run stands: ``running``,
``completed``, ``interrupted`` (SIGINT, SIGTERM, SIGHUP) or ``failed`` (with the error).
With ``tracking`` set, the config, each round's row and the summary also go to
TensorBoard, MLflow or CSV files (:mod:`~contrafl.engine.tracking`), after
``metrics.jsonl``.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ..algorithms.base import LocalTask, Phase, Reply, ServerState, StateDict, TrainResult
from ..algorithms.server_opt import ServerOptimizer
from ..config import Config, fingerprint
from ..cores import cores_each, cpu_cores
from ..data.augment import Transform, Views, view_transform
from ..errors import CheckpointError, ClientUpdateError, one_line
from ..metrics.evaluate import evaluate
from ..metrics.history import mean_std, rounds_to_reach
from ..metrics.knn import bank_and_queries, extract_features, knn_accuracy
from ..models.base import ModelOutput
from .checkpoint import CHECKPOINT_FORMAT, check_checkpoint, check_client_state, client_files, is_whole, load_safe, save_atomic
from .client_store import ClientStore
from .comm import add_bytes, payload_bytes
from . import distributed
from .distributed import DistributedTransport
from .executor import AutocastNet, FunctionalNet, Job, PhaseRun, SequentialExecutor, Workload
from .optim import make_optimizer
from .parallel import ParallelExecutor
from .plan import ClientPlan, epoch_batch_sizes, make_plan
from .privacy import LEDGER, Privacy, require_accounting
from .progress import Progress, RoundWork
from ..rng import derive_seed, generator
from ..speeds import client_speeds, round_speed, step_budget
from .run_dir import CHECKPOINT, RunDir
from .sampling import sample_schedule, secret_sample
from .setup import Setup, choose_executor
from .signals import interrupts, signal_name, stop_point
from .tracking import Tracking, open_tracking
from .validate import PendingCheck, begin_check, count_problem, finish_checks, norm_outliers
from .vectorized import StepArenas, VectorizedExecutor


class Context:
    """The engine's :class:`~contrafl.algorithms.base.ClientContext`."""

    def __init__(self, sim: "Simulation", cid: int, round: int) -> None:
        self._sim = sim
        self.cid = cid
        self.round = round
        self.num_samples = len(sim.rows[cid])
        self.label_counts = sim.label_counts[cid]
        self.net = sim.client_net

    def initial_state(self) -> StateDict:
        return self._sim.initial_state(self.cid)

    def predict(self, state) -> tuple[ModelOutput, torch.Tensor]:
        return self._sim.predict(state, self._sim.rows_t[self.cid])

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._sim.rows_t[self.cid]
        return self._sim.setup.eval_transform(self._sim.train.x[rows]), self._sim.train.y[rows]

    def augmented_data(self, view: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._sim.rows_t[self.cid]
        transform = view_transform(self._sim.setup.train_transform, view)
        return transform(self._sim.train.x[rows], transform.sample(len(rows), generator)), self._sim.train.y[rows]

    def generator(self, *key: object) -> torch.Generator:
        return generator(self._sim.cfg.seed, "client", self.round, self.cid, *key)


@dataclass
class ClientOutcome:
    """One client's part of a round as the server sees it: its reply with the training
    loss and the loss's parts (:func:`loss_parts`) summed over its steps and the number
    of steps, or ``reply=None`` and why (``lost``: the client never answered, e.g. its
    process died; ``rejected``: the client's update failed the checks of
    :func:`~contrafl.engine.validate.check_reply` where it was made, before a transport
    that hides single updates, such as secure aggregation, could carry it). ``time``:
    the simulated time its work took (``steps / speed``, :mod:`contrafl.speeds`);
    ``straggler``: how a client that missed the round's deadline was cut
    (:meth:`Simulation.cut_at_deadline`); ``checked``: the reply passed
    :meth:`Simulation.reply_problems` where it was made (a worker of the distributed
    executor, before it summed the replies), so the server does not check it again.
    From :meth:`Simulation.train_locally` the loss and its parts are 0-dim tensors where
    they were computed: :func:`as_floats` reads many with one transfer (on a GPU one
    wait for the device, not one a client); sent to another process, they are floats."""

    cid: int
    reply: Reply | None
    loss: float | torch.Tensor | None = None
    steps: int = 0
    lost: str | None = None
    parts: dict[str, float | torch.Tensor] = field(default_factory=dict)
    time: float | None = None
    straggler: dict[str, Any] | None = None
    rejected: str | None = None
    checked: bool = False


def loss_parts(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parts of a client's loss among the statistics of its local training (summed
    over its steps): every scalar statistic but the total ``loss`` (MOON's ``ce`` and
    ``con``, FedU2's ``align`` and ``uniformity``, ...), unweighted as the algorithm
    computed them."""
    return {k: v for k, v in stats.items() if k != "loss" and v.dim() == 0}


def as_floats(tree: Any) -> Any:
    """``tree`` with every tensor among its leaves (0-dim) as a float, all read with one
    transfer (on a GPU, one wait for the device)."""
    leaves, spec = pytree.tree_flatten(tree)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if at:
        device = leaves[at[0]].device
        values = torch.stack([leaves[i].detach().float().to(device) for i in at]).tolist()
        for i, value in zip(at, values):
            leaves[i] = value
    return pytree.tree_unflatten(leaves, spec)


Scores = dict[str, float]
"""A model's evaluation on a client's test data: ``acc``, ``loss`` (means) and ``n``
(:func:`contrafl.metrics.evaluate.evaluate`)."""


class Transport(Protocol):
    """How the server reaches clients that are not in its process, e.g. over a Flower
    grid (:class:`contrafl.flower.server.GridTransport`). Without one, a
    :class:`Simulation` trains and evaluates its clients itself
    (:meth:`Simulation.train_locally`, :meth:`Simulation.evaluate_locally`)."""

    runtime: str
    """What runs the clients, named as the run's ``executor`` in ``summary.json``
    (``flower``); a transport without it keeps the configured executor's name."""

    sums: bool
    """Optional, False where missing: the replies are rebuilt from sums over the round's
    clients (secure aggregation): each carries the round's means and a share of its
    totals, its per-label counts the round's totals, which were checked where they were
    summed (:func:`~contrafl.engine.validate.count_problem` does not apply)."""

    def train(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], phases: list[Phase]
    ) -> Iterable[ClientOutcome]:
        """Round ``t``'s local training of clients ``cids`` on their messages: their
        outcomes, in any order. (A transport that sees its clients' local steps counts
        them in the simulation's :attr:`Simulation.round_work`.)"""
        ...

    def evaluate(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]]
    ) -> Iterable[tuple[int, Scores | None]]:
        """Each client's personal model at the start of round ``t`` (made from its state
        and its message) on its own test data: ``(cid, scores)``, ``None`` for a client
        without a personal model; clients that cannot be reached may be missing."""
        ...

    def evaluate_model(self, t: int, cids: list[int], state: StateDict) -> Iterable[tuple[int, Scores | None]]:
        """The model ``state`` (the global model before round ``t``) on each client's own
        test data (federated evaluation): ``(cid, scores)``; clients that cannot be
        reached may be missing."""
        ...


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
"""The most memory :attr:`Simulation.train_inputs` spends on a training set transformed ahead of the steps."""
READY_CHUNK = 4096
"""Samples transformed at a time by :attr:`Simulation.train_inputs`."""


class Simulation:
    """A federated simulation of one configuration."""

    def __init__(self, setup: Setup, run_dir: RunDir | None = None, progress: Progress | None = None) -> None:
        cfg = self.cfg = setup.config
        self.setup = setup
        self.algorithm = setup.algorithm
        self.device = setup.device
        self.run_dir = run_dir
        self.progress = progress
        self.train = setup.data.train.to(self.device)
        self.test = setup.data.test.to(self.device)
        self.net = FunctionalNet(setup.model.to(self.device))
        self.autocast = torch.bfloat16 if cfg.precision == "bf16" else None
        self.client_net = self.net if self.autocast is None else AutocastNet(self.net, self.autocast)
        """The forward algorithms get for their own computations (:attr:`Context.net`), in the run's precision."""
        self.rows = [np.asarray(r) for r in setup.partition.train]
        self.rows_t = [torch.as_tensor(r, dtype=torch.long, device=self.device) for r in self.rows]
        labels = setup.data.train.y.numpy()
        self.label_counts = torch.as_tensor(setup.partition.counts(labels, setup.data.num_classes))
        initial = {k: v.detach().clone() for k, v in setup.model.state_dict().items()}
        self.server = self.algorithm.init_server(initial)
        self.server_opt = ServerOptimizer(cfg.server_lr, cfg.server_momentum)
        if run_dir is not None:
            self.store = ClientStore(cfg.client_memory_gb * 2**30, run_dir.client_dir, self.device, keep=True)
        else:
            spill = Path(tempfile.gettempdir()) / f"contrafl-{os.getpid()}-{id(self)}"
            self.store = ClientStore(cfg.client_memory_gb * 2**30, spill, self.device)
        self.executor_name = cfg.executor if cfg.executor != "auto" else choose_executor(cfg, type(self.algorithm), self.device)
        self.local_executor = self.executor_name if self.executor_name != "distributed" else cfg.rank_executor
        """The executor that trains this process's clients: the run's, or for the distributed
        executor the one each rank trains its share with (``rank_executor``)."""
        self.round_work: RoundWork | None = None
        """The current round's progress (:meth:`run_round`), in which a transport that sees
        its clients' local steps counts them."""
        self.schedule = sample_schedule(cfg.num_clients, cfg.sample_fraction, cfg.rounds, cfg.seed)
        """Each round's clients drawn from the seed (:meth:`sample`: the round's actual
        clients, which ``sampling=secret`` draws otherwise; time estimates take this one)."""
        self._secret_samples: dict[int, list[int]] = {}
        self.speeds = client_speeds(cfg.client_speed, cfg.num_clients, cfg.seed).tolist()
        self.timed = cfg.client_speed != "constant" or cfg.speed_jitter > 0 or cfg.round_deadline is not None
        """Rounds record their simulated duration (``round_time``)."""
        self.fingerprint = fingerprint(cfg)
        self.privacy = Privacy.of(cfg)
        """Client-level DP (``dp``), None without; its ledger is kept in the run directory."""
        if self.privacy is not None and run_dir is not None:
            self.privacy.ledger.open(run_dir.path / LEDGER)
        self.history: list[dict[str, Any]] = []
        self.comm_total: dict[str, dict[str, int]] = {"down": {}, "up": {}}
        self.rounds_done = 0
        self.transport: Transport | None = None  # None: train_locally, evaluate_locally
        self.step_arenas = StepArenas()  # the vectorized executor's graphs from round to round
        self.checkpointed = 0  # rounds saved in the run directory's checkpoint
        self.wall_time_before = 0.0  # seconds spent before a resume
        self.checkpoint_seconds = 0.0  # spent writing checkpoints (by this process)
        self.estimated_time_s: float | None = None  # before round 1 (contrafl.engine.estimate), for the summary
        self.extensions: list[dict[str, int]] = []
        """The run's extensions to more rounds (``--resume RUN rounds=N``), oldest first:
        ``{"from": M, "to": N, "after": rounds done then}`` (:meth:`extension`)."""
        self.placement: dict[int, int] = {}
        """Client -> the rank (above 0) that trained it last and keeps its state, for an
        executor whose ranks keep clients where they trained them (the distributed
        one). It is saved with the checkpoints, so that a resumed run shares its clients
        among the ranks as the uninterrupted run does, and sums in the same order."""

    # -- services for the algorithm's client context ----------------------------------
    def initial_state(self, cid: int) -> StateDict:
        """Client ``cid``'s own random initialisation (MOON initialises every party's net)."""
        model = self.setup.model_factory(derive_seed(self.cfg.seed, "client-init", cid))
        return {k: v.detach().to(self.device) for k, v in model.state_dict().items()}

    @torch.no_grad()
    def predict(self, state, rows: torch.Tensor) -> tuple[ModelOutput, torch.Tensor]:
        outs = []
        bs = self.cfg.eval_batch_size
        for i in range(0, len(rows), bs):
            x = self.setup.eval_transform(self.train.x[rows[i : i + bs]])
            outs.append(self.net(state, x, train=False))
        joined = pytree.tree_map(lambda *parts: None if parts[0] is None else torch.cat(parts), *outs) if outs else None
        return joined, self.train.y[rows]

    # -- the loop -------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run the remaining rounds; the summary. Any exception propagates after the
        summary has recorded the run as ``interrupted`` or ``failed``."""
        start = time.perf_counter()
        cfg, run_dir = self.cfg, self.run_dir
        if self.privacy is not None:
            require_accounting()  # before anything is written: the server reports epsilon
        if run_dir is not None:
            run_dir.write_config(self.cfg)
            run_dir.write_text("partition.json", json.dumps(self.setup.partition.to_json()))
            if cfg.node_data != "own":  # the server of a federation does not know its clients' labels
                counts = {"classes": list(self.setup.data.classes), "counts": self.label_counts.tolist()}
                run_dir.write_text("label_counts.json", json.dumps(counts))
        status, error = "running", None
        tracking: Tracking | None = None
        ranks: DistributedTransport | None = None  # the distributed executor's, started for this call
        try:
            with interrupts():
                if self.executor_name == "distributed" and self.transport is None:
                    self.transport = ranks = distributed.start(self)
                if run_dir is not None:
                    run_dir.write_json("summary.json", self.summary("running", time.perf_counter() - start))
                    tracking = open_tracking(cfg.tracking, cfg.tracking_uri, run_dir.path)
                    if tracking is not None:
                        tracking.start(cfg.to_dict(), self.history)
                if self.progress is not None:  # the ETA counts from here, not from a calibration or a store's setup
                    self.progress.resume_at(self.rounds_done)
                for t in range(self.rounds_done, cfg.rounds):
                    stop_point()  # a stop requested during the last round (signals.py)
                    round_start = time.perf_counter()
                    row = self.run_round(t)
                    self.history.append(row)
                    self.rounds_done = t + 1
                    if run_dir is not None:
                        run_dir.append("metrics.jsonl", row)
                        run_dir.append("timing.jsonl", {"round": t + 1, "seconds": time.perf_counter() - round_start})
                        if (t + 1) % cfg.checkpoint_every == 0 or t + 1 == cfg.rounds:
                            self.save_checkpoint(time.perf_counter() - start)
                    if tracking is not None:  # after metrics.jsonl and the checkpoint: never loses a round
                        tracking.log_round(row)
                    if self.progress is not None:
                        self.progress.round_done(row)
            status = "completed"
        except KeyboardInterrupt as exc:
            status, error = "interrupted", f"stopped by {signal_name(exc)}"
            raise
        except BaseException as exc:
            status, error = "failed", one_line(exc)
            if run_dir is not None:  # the whole traceback, for a bug report
                run_dir.write_text("error.txt", traceback.format_exc())
            raise
        finally:
            if ranks is not None:
                ranks.close()
                self.transport = None
            summary = self.summary(status, time.perf_counter() - start, error)
            if run_dir is not None:
                run_dir.write_json("summary.json", summary)
                if tracking is not None:
                    tracking.finish(summary)
                run_dir.close()
            self.store.close()
        return summary

    # -- checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, seconds: float) -> None:
        """Write the checkpoint of the rounds done so far (atomically, client states
        first) and the summary that goes with it."""
        assert self.run_dir is not None
        start = time.perf_counter()
        manifest = self.store.checkpoint()
        save_atomic(
            {
                "format": CHECKPOINT_FORMAT,
                "round": self.rounds_done,
                "fingerprint": self.fingerprint,
                "config": self.cfg.to_dict(),
                "server": {"model": self.server.model, "extras": self.server.extras},
                "server_optimizer": self.server_opt.state_dict(),
                "clients": manifest,
                "history": self.history,
                "comm_total": self.comm_total,
                "privacy": self.privacy.state_dict() if self.privacy is not None else {},
                "wall_time_s": self.wall_time_before + seconds,
                **({"extensions": self.extensions} if self.extensions else {}),
                **({"placement": self.placement} if self.placement else {}),
            },
            self.run_dir.checkpoint_path,
        )
        self.store.commit(manifest)
        self.checkpointed = self.rounds_done
        self.checkpoint_seconds += time.perf_counter() - start
        self.run_dir.write_json("summary.json", self.summary("running", seconds))

    def restore(self, checkpoint: Any, path: Path) -> None:
        """Continue from ``checkpoint``, read from ``path`` (:func:`load_checkpoint`), once
        :func:`~contrafl.engine.checkpoint.check_checkpoint` has found it one of this
        configuration and initial server model: server, clients, metrics; the run
        directory's metrics and timing files are cut back to it. Tensors go to this
        simulation's device (a run may resume on another one). A checkpoint of this
        configuration with fewer rounds extends the run (:attr:`extensions`)."""
        check_checkpoint(checkpoint, path, self.cfg, self.server.model)
        on_device = pytree.tree_map_only(torch.Tensor, lambda t: t.to(self.device), checkpoint)
        self.server = ServerState(on_device["server"]["model"], on_device["server"]["extras"])
        self.server_opt.load_state_dict(on_device["server_optimizer"])
        self.store.restore(checkpoint["clients"], check_client_state)
        self.history = list(checkpoint["history"])
        self.comm_total = checkpoint["comm_total"]
        self.rounds_done = self.checkpointed = int(checkpoint["round"])
        if self.privacy is not None:  # the rows metrics.jsonl published after the checkpoint count too
            later = [r for r in self.run_dir.rows("metrics.jsonl") if is_whole(r.get("round")) and r["round"] > self.rounds_done] if self.run_dir else []
            self.privacy.load_state_dict(checkpoint.get("privacy", {}), self.history + later, f"checkpoint {path}")
        self.extensions = [dict(e) for e in checkpoint.get("extensions", [])]
        self.placement = dict(checkpoint.get("placement", {}))
        before = checkpoint["config"].get("rounds")
        if is_whole(before) and before < self.cfg.rounds:  # check_checkpoint let only the rounds grow
            self.extensions.append({"from": before, "to": self.cfg.rounds, "after": self.rounds_done})
        self.wall_time_before = float(checkpoint["wall_time_s"])
        if self.run_dir is not None:
            self.run_dir.truncate(self.rounds_done, self.history)
        if self.progress is not None:
            self.progress.resume_at(self.rounds_done)

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
            plan = make_plan(self.rows[cid], epochs, batch, cfg.drop_last, samplers, self.algorithm.views, g)
            plans.append(plan if self.local_executor == "vectorized" else plan.to(self.device))
        return plans

    def planned_steps(self, cid: int, phases: list[Phase]) -> int:
        """Client ``cid``'s local steps in ``phases`` as the phases' epochs and batch sizes
        give them (an algorithm's per-client epochs and a deadline can change them when
        the client's job is made)."""
        cfg = self.cfg
        n = len(self.rows[cid])
        return sum(
            (phase.epochs if phase.epochs is not None else cfg.local_epochs)
            * len(epoch_batch_sizes(n, phase.batch_size or cfg.batch_size, cfg.drop_last))
            for phase in phases
        )

    @functools.cached_property
    def train_inputs(self) -> tuple[torch.Tensor, Transform | Views]:
        """The training samples the local steps gather their batches from, and the
        transform they apply to each batch.

        A deterministic single-view pipeline (no random op, e.g. ``augment=none``'s
        normalisation) on the CPU, for an executor that trains clients step by step (not
        the vectorized one), is applied here, once, to the whole training set, in
        the model's layout (:meth:`FunctionalNet.layout`), when the result takes at most
        :data:`READY_INPUTS_BYTES`; the steps then only gather rows (MOON's CNN, batch
        10: the per-step conversion and layout were 8% of a step). The values are the
        same, elementwise. Otherwise the stored samples (``uint8`` images: a quarter of
        float32's memory) and the run's pipeline."""
        x, transform = self.train.x, self.setup.train_transform
        deterministic = isinstance(transform, Transform) and not any(op.keys for op in transform.ops)
        steps = self.local_executor != "vectorized"  # whose vmap takes its [K, B] batches as they come (NCHW)
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

    def dropped_out(self, t: int, sampled: list[int]) -> set[int]:
        """The clients of round ``t``'s sample that do not reply (``client_dropout``):
        each with that probability, independently, from a stream of (seed, round) alone,
        so the same clients drop out whatever the executor, the transport or a resume."""
        p = self.cfg.client_dropout
        if not p or not sampled:
            return set()
        draws = torch.rand(len(sampled), generator=generator(self.cfg.seed, "dropout", t))
        return {cid for cid, u in zip(sampled, draws.tolist()) if u < p}

    def round_time(self, times: list[float], missing: bool) -> float:
        """A round's simulated duration: until the slowest reply (``times``, each client's
        ``steps / speed``), or until ``round_deadline`` when a client is ``missing``
        (dropped out, lost, or cut at the deadline: the server waits until then)."""
        deadline = self.cfg.round_deadline
        if missing and deadline is not None:
            return deadline
        return round(max(times, default=0.0), 6)

    def sample(self, t: int) -> list[int]:
        """Round ``t``'s clients: :attr:`schedule`'s, or with ``sampling=secret`` a draw
        of the OS CSPRNG (:func:`~contrafl.engine.sampling.secret_sample`), made once per
        round of this process and kept nowhere else."""
        if self.cfg.sampling != "secret":
            return self.schedule[t]
        if t not in self._secret_samples:
            self._secret_samples = {t: secret_sample(self.cfg.num_clients, self.cfg.sample_fraction)}
        return self._secret_samples[t]

    def run_round(self, t: int) -> dict[str, Any]:
        cfg, algo = self.cfg, self.algorithm
        sampled = self.sample(t)
        broadcast = algo.broadcast(self.server, t)
        phases = algo.phases(t)
        down: dict[str, int] = {}
        broadcast_bytes = payload_bytes(broadcast)
        own_messages: dict[int, dict[str, Any]] = {}  # clients whose message is not the broadcast

        def message_for(cid: int) -> dict[str, Any]:
            message = algo.message_for(broadcast, self.server, cid, t)
            add_bytes(down, broadcast_bytes if message is broadcast else payload_bytes(message))
            if message is not broadcast:
                own_messages[cid] = message
            return message

        rejected: dict[int, str] = {}
        lost: dict[int, str] = {}
        losses: dict[int, float | torch.Tensor] = {}
        parts: dict[int, dict[str, float | torch.Tensor]] = {}
        steps = 0
        times: list[float] = []
        stragglers: list[dict[str, Any]] = []
        up: dict[str, int] = {}
        specs: dict[int, Any] = {}
        arrived: dict[int, Reply] = {}  # every reply that reached the server, valid or not, by its client
        checks: dict[int, tuple[PendingCheck, Reply]] = {}  # their checks, the values tested after the loop
        dropped = self.dropped_out(t, sampled)
        for cid in dropped:
            lost[cid] = f"dropped out (client_dropout={cfg.client_dropout:g})"
        replying = [cid for cid in sampled if cid not in dropped]
        work = self.round_work = RoundWork(t + 1, len(replying))
        if self.transport is not None:
            outcomes = self.transport.train(t, replying, message_for, phases)
        else:
            outcomes = self.train_locally(t, replying, message_for, phases, work)
        for done, outcome in enumerate(outcomes, start=1):
            stop_point()  # a stop requested while the last client trained
            work.clients_done = done
            if self.progress is not None:
                self.progress.working(work)
            cid = outcome.cid
            if outcome.time is not None:
                times.append(outcome.time)
            if outcome.straggler is not None:
                stragglers.append(outcome.straggler)
            if outcome.rejected is not None:
                rejected[cid] = self.reject(cid, outcome.rejected, t)
                continue
            if outcome.reply is None:
                lost[cid] = outcome.lost or "no reply"
                continue
            reply = outcome.reply
            add_bytes(up, payload_bytes(reply.payload))
            arrived[cid] = reply
            if not outcome.checked:
                checks[cid] = (self.begin_reply_check(cid, reply, own_messages.get(cid, broadcast), specs), reply)
            if outcome.loss is not None:
                losses[cid] = outcome.loss
            parts[cid] = outcome.parts
            steps += outcome.steps
        for cid, reason in self.reply_problems(checks, lambda c: own_messages.get(c, broadcast)).items():
            rejected[cid] = self.reject(cid, reason, t)
        losses, parts = as_floats((losses, parts))
        replies = [arrived[cid] for cid in sorted(arrived) if cid not in rejected]
        for cid, reason in norm_outliers(replies, broadcast, cfg.update_outlier_factor, own_messages).items():
            rejected[cid] = self.reject(cid, reason, t)
        replies = [r for r in replies if r.cid not in rejected]
        privacy: dict[str, Any] = {}
        if self.privacy is not None:  # the releases are in the ledger before anything made from them leaves
            received = list(arrived.values())
            messages = {r.cid: own_messages.get(r.cid, broadcast) for r in received}
            if self.privacy.mode == "central":
                replies, privacy["dp_clipped"] = self.privacy.central(replies, messages, t)
            privacy |= self.privacy.record(t, replies if self.privacy.mode == "central" else received)

        if replies:
            old = self.server.model
            self.server = algo.aggregate(self.server, replies, t)
            self.server.model = self.server_opt.step(old, self.server.model)

        add_bytes(self.comm_total["down"], down)
        add_bytes(self.comm_total["up"], up)

        row: dict[str, Any] = {
            "round": t + 1,
            "clients": sampled,
            "train_loss": sum(losses[c] for c in sorted(losses)) / steps if steps else None,
            "local_steps": steps,
        }
        names = sorted({name for c in parts for name in parts[c]})
        if steps and names:  # each part's sum over the round's steps / steps, as train_loss
            row["loss_parts"] = {n: sum(parts[c].get(n, 0.0) for c in sorted(parts)) / steps for n in names}
        if rejected:
            row["rejected"] = [{"client": cid, "reason": why} for cid, why in sorted(rejected.items())]
        if lost:
            row["lost"] = [{"client": cid, "reason": why} for cid, why in sorted(lost.items())]
        if stragglers:
            row["stragglers"] = sorted(stragglers, key=lambda c: c["client"])
        if self.timed:
            row["round_time"] = self.round_time(times, bool(lost or stragglers))
        if cfg.sampling == "secret":
            row = without_clients(row)
        row.update(privacy)
        if (t + 1) % cfg.eval_every == 0 or t + 1 == cfg.rounds:
            row.update(self.evaluate(t + 1))
        if cfg.knn_every and ((t + 1) % cfg.knn_every == 0 or t + 1 == cfg.rounds):
            row["knn_acc"] = self.evaluate_knn()
        row["bytes_down"] = down
        row["bytes_up"] = up
        return row

    def begin_reply_check(self, cid: int, reply: Reply, message: dict[str, Any], specs: dict[int, Any]) -> PendingCheck:
        """The check of client ``cid``'s ``reply`` to ``message`` begun
        (:func:`~contrafl.engine.validate.begin_check`; :meth:`reply_problems` finishes
        it): the reply must name its client and match the algorithm's
        :meth:`~contrafl.algorithms.base.Algorithm.reply_spec` of ``message`` (kept in
        ``specs`` by the message's ``id``, for the messages of one round)."""
        if reply.cid != cid:
            return PendingCheck(f"the reply names client {reply.cid!r}")
        spec = specs.get(id(message))
        if spec is None:
            spec = specs[id(message)] = self.algorithm.reply_spec(message)
        return begin_check(reply, spec)

    def reply_problems(
        self, checks: dict[int, tuple[PendingCheck, Reply]], message_of: Callable[[int], dict[str, Any]]
    ) -> dict[int, str]:
        """``{cid: why}`` for the replies whose begun checks fail
        (:func:`~contrafl.engine.validate.finish_checks`: their values tested together),
        or, with ``dp=local``, :meth:`Privacy.check_local` against ``message_of(cid)``;
        otherwise a reply's ``num_samples`` must be the client's where the server holds
        the data, and its label counts possible
        (:func:`~contrafl.engine.validate.count_problem`)."""
        reasons = finish_checks([check for check, _ in checks.values()])
        problems = {}
        epochs = int(self.cfg.local_epochs)
        for (cid, (_, reply)), reason in zip(checks.items(), reasons):
            if reason is None and self.privacy is not None and self.privacy.mode == "local":
                reason = self.privacy.check_local(reply, message_of(cid))
                if reason is None and self.cfg.node_data != "own":  # true counts with weight 1 (dp.labels=clear): at most the largest client's
                    reason = count_problem(reply.payload, max(map(len, self.rows), default=0) * epochs)
            elif reason is None and not getattr(self.transport, "sums", False):
                held = len(self.rows[cid]) if self.cfg.node_data != "own" else None  # the server holds the data: it knows the count
                if held is not None and reply.num_samples != held:
                    reason = f"num_samples={reply.num_samples}, but the client holds {held} training samples (a client that lies about its weight)"
                else:
                    reason = count_problem(reply.payload, reply.num_samples * epochs)
            if reason is not None:
                problems[cid] = reason
        return problems

    @property
    def sums_replies(self) -> bool:
        """Whether the server may get the valid replies of a share of a round's clients as
        their sample-weighted mean (:mod:`contrafl.engine.partial`): the algorithm's
        aggregate needs no more (``beyond_weighted_mean``), and no setting looks at single
        updates (differential privacy, ``update_outlier_factor``)."""
        algo = self.algorithm
        return algo.beyond_weighted_mean(algo.params) is None and self.privacy is None and not self.cfg.update_outlier_factor

    def local_models(self, cids: Iterable[int], t: int | None = None) -> dict[int, StateDict]:
        """The models clients ``cids`` hold after their local training in round ``t``
        (default :attr:`rounds_done`, the next round) from the current server state,
        trained as :meth:`run_round` trains them (the round's broadcast and phases, the
        client's stored state, :meth:`client_job`'s plans and seeds, the run's executor)
        whether or not the round samples them: :func:`trained_model` of each result.

        Nothing else happens: no reply, aggregation, evaluation or checkpoint, and the
        server, the client store (the executor gets a copy of a stored optimiser state,
        which it updates in place), the history and the run directory stay as they
        are, so the next :meth:`run_round` computes what it would have computed without
        this call. (:meth:`~contrafl.algorithms.base.Algorithm.client_end` only makes
        the reply and the client's next state from the result, so it is not called.)"""
        t = self.rounds_done if t is None else t
        broadcast = self.algorithm.broadcast(self.server, t)
        phases = self.algorithm.phases(t)

        def make_job(cid: int) -> Job:
            job = self.client_job(cid, t, self.algorithm.message_for(broadcast, self.server, cid, t), phases)[0]
            job.opt_state = pytree.tree_map_only(torch.Tensor, torch.clone, job.opt_state)
            return job

        return {job.cid: trained_model(result) for job, result in self.round_executor(phases).run(make_job, list(cids))}

    def reject(self, cid: int, reason: str, round: int) -> str:
        """Record a client update that failed validation, or stop the run
        (``on_bad_update=stop``)."""
        if self.cfg.on_bad_update == "stop":
            diverged = "training diverged: lower lr or the loss weights (e.g. algorithm.mu)"
            if self.privacy is not None:
                diverged += ", or the DP noise (dp.noise_multiplier, dp.clip)"
            advice = diverged if "non-finite" in reason else "the client sent an update the server cannot aggregate"
            who = "a client" if self.cfg.sampling == "secret" else f"client {cid}"  # the round's clients are a secret
            raise ClientUpdateError(
                f"{who}'s update in round {round + 1} was rejected: {reason}; {advice}, "
                "or set on_bad_update=skip to leave such updates out of the aggregate"
            )
        return reason

    # -- evaluation -----------------------------------------------------------------
    def evaluate(self, next_round: int) -> dict[str, Any]:
        """The global model on the test set (when there is one) and, with
        ``eval_personal``, every client's model on its own test data."""
        out: dict[str, Any] = {}
        bs, tf = self.cfg.eval_batch_size, self.setup.eval_transform
        if self.algorithm.evaluates_global and self.algorithm.supervised:
            if self.cfg.global_eval == "federated":
                out.update(self.evaluate_federated(next_round))
            elif len(self.test.y):
                res = evaluate(self.net, self.server.model, self.test.x, self.test.y, tf, bs)
                out["test_acc"], out["test_loss"] = res["acc"], res["loss"]
        if self.cfg.eval_personal:
            out.update(self.evaluate_clients(next_round))
        return out

    def evaluate_federated(self, next_round: int) -> dict[str, Any]:
        """Federated evaluation of the global model, as Flower's evaluate round: every
        client evaluates it on its local test split, and ``test_acc`` is
        ``sum_i correct_i / sum_i n_i``, ``test_loss`` the sample-weighted mean loss, over
        the clients that replied (``test_clients``), summed in client order."""
        evaluate_round = self.transport.evaluate_model if self.transport is not None else self.evaluate_model_locally
        clients = list(range(self.cfg.num_clients))
        scores = dict(evaluate_round(next_round, clients, self.server.model))
        scored = [scores[cid] for cid in clients if scores.get(cid) is not None and scores[cid]["n"]]
        if not scored:
            return {}
        total = sum(res["n"] for res in scored)
        return {
            "test_acc": sum(round(res["acc"] * res["n"]) for res in scored) / total,
            "test_loss": sum(res["loss"] * res["n"] for res in scored) / total,
            "test_clients": len(scored),
        }

    def evaluate_model_locally(self, t: int, cids: list[int], state: StateDict) -> Iterator[tuple[int, Scores | None]]:
        """The model ``state`` on each of ``cids``' local test split, in this process
        (:meth:`Transport.evaluate_model`)."""
        test_rows = self.setup.partition.test
        for cid in cids:
            rows = torch.as_tensor(test_rows[cid] if test_rows is not None else [], dtype=torch.long, device=self.device)
            yield cid, evaluate(self.net, state, self.train.x[rows], self.train.y[rows], self.setup.eval_transform, self.cfg.eval_batch_size)

    def evaluate_knn(self) -> float:
        """Weighted kNN accuracy of the global model's encoder features ``h``
        (:func:`~contrafl.metrics.knn.knn_scores`, ``knn_k`` neighbours,
        ``knn_temperature``): the memory bank is the union of the clients' training sets,
        the queries the test set (the clients' test splits when the test set is pooled
        into them), both without augmentation."""
        cfg, tf = self.cfg, self.setup.eval_transform
        x_bank, y_bank, x_test, y_test = bank_and_queries(self.train, self.test, self.setup.partition)

        def encode(x: torch.Tensor) -> torch.Tensor:
            return self.net(self.server.model, x, train=False).h

        with torch.no_grad():
            bank = extract_features(encode, x_bank, tf, cfg.eval_batch_size)
            queries = extract_features(encode, x_test, tf, cfg.eval_batch_size)
        return knn_accuracy(bank, y_bank, queries, y_test, self.setup.data.num_classes, cfg.knn_k, cfg.knn_temperature)

    def evaluate_clients(self, next_round: int) -> dict[str, Any]:
        """PFLlib's personalised evaluation: every client, sampled or not, is evaluated
        with the model it holds at the start of ``next_round``
        (:meth:`~contrafl.algorithms.base.Algorithm.personal_model`) on its local test
        split (the global test set without one). ``personal_acc`` is the sample-weighted
        accuracy ``sum_i correct_i / sum_i n_i``, ``personal_acc_std`` the population std
        of the clients' accuracies, ``personal_acc_mean`` their unweighted mean and
        ``personal_loss`` the sample-weighted loss (when every client's model has one;
        FedProto's prototype distances have none); sums in client order, whatever order
        the scores arrive in. ``client_acc``, ``client_loss`` and ``client_n`` list every
        client's own values by client id (``None`` for a client without a personal model,
        test samples or reply)."""
        algo = self.algorithm
        message = algo.broadcast(self.server, next_round)
        evaluate_round = self.transport.evaluate if self.transport is not None else self.evaluate_locally
        clients = list(range(self.cfg.num_clients))
        scores = dict(evaluate_round(next_round, clients, lambda cid: algo.message_for(message, self.server, cid, next_round)))
        scored = [scores[cid] for cid in clients if scores.get(cid) is not None and scores[cid]["n"]]
        if not scored:
            return {}
        accs = [res["acc"] for res in scored]
        total = sum(res["n"] for res in scored)
        mean, std = mean_std(accs)
        out: dict[str, Any] = {
            "personal_acc": sum(res["acc"] * res["n"] for res in scored) / total,
            "personal_acc_std": std,
            "personal_acc_mean": mean,
        }
        if all(res["loss"] is not None for res in scored):
            out["personal_loss"] = sum(res["loss"] * res["n"] for res in scored) / total
        out["personal_clients"] = len(scored)
        for key in ("acc", "loss", "n"):
            out[f"client_{key}"] = [None if scores.get(cid) is None else scores[cid][key] for cid in clients]
        return out

    def evaluate_locally(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]]
    ) -> Iterator[tuple[int, Scores | None]]:
        """Clients ``cids`` evaluated in this process (:meth:`Transport.evaluate`): each
        one's personal model from its stored state (its initial state when it has none)
        and ``message_for(cid)``, on its local test split or the global test set."""
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
            yield cid, evaluate(self.net, model.state, x, y, tf, bs, scores=model.scores)

    # -- outputs --------------------------------------------------------------------
    def summary(self, status: str, seconds: float, error: str | None = None) -> dict[str, Any]:
        evaluated = [r for r in self.history if "test_acc" in r or "personal_acc" in r or "knn_acc" in r]
        last = evaluated[-1] if evaluated else {}
        summary: dict[str, Any] = {"status": status}
        if error is not None:
            summary["error"] = error
        summary |= {
            "algorithm": self.cfg.algorithm.name,
            "dataset": self.cfg.dataset.name,
            "rounds_completed": self.rounds_done,
            "checkpointed_rounds": self.checkpointed,
            "rounds": self.cfg.rounds,
            "final": {k: v for k, v in last.items() if k not in ("clients", "bytes_down", "bytes_up") and not k.startswith("client_")},
        }
        accs = [r["test_acc"] for r in evaluated if "test_acc" in r]
        if accs:
            best = max(range(len(accs)), key=accs.__getitem__)
            summary["best_test_acc"] = accs[best]
            summary["best_round"] = [r for r in evaluated if "test_acc" in r][best]["round"]
        knn = [r for r in evaluated if "knn_acc" in r]
        if knn:
            best_row = max(knn, key=lambda r: r["knn_acc"])
            summary["best_knn_acc"] = best_row["knn_acc"]
            summary["best_knn_round"] = best_row["round"]
        personal = [r for r in evaluated if "personal_acc" in r]
        if personal:  # PFLlib reports the best round
            best_row = max(personal, key=lambda r: r["personal_acc"])
            summary["best_personal_acc"] = best_row["personal_acc"]
            summary["best_personal_acc_std"] = best_row["personal_acc_std"]
            summary["best_personal_round"] = best_row["round"]
        if self.cfg.target_accuracy is not None:
            summary["target_accuracy"] = self.cfg.target_accuracy
            summary["rounds_to_target"] = rounds_to_reach(self.history, self.cfg.target_accuracy)
        seconds += self.wall_time_before
        summary["rejected_updates"] = sum(len(r.get("rejected", [])) for r in self.history)
        if self.privacy is not None:
            summary["dp"] = self.privacy.summary()
        if self.timed:
            summary["simulated_time"] = round(sum(r["round_time"] for r in self.history), 6)
            summary["straggler_replies"] = {
                "dropped": sum(1 for r in self.history for c in r.get("stragglers", []) if not c["done"]),
                "partial": sum(1 for r in self.history for c in r.get("stragglers", []) if c["done"]),
            }
        summary["bytes_total"] = self.comm_total
        summary["executor"] = getattr(self.transport, "runtime", self.executor_name)
        summary["device"] = str(self.device)
        summary["fingerprint"] = self.fingerprint
        summary["wall_time_s"] = round(seconds, 3)
        summary["checkpoint_time_s"] = round(self.checkpoint_seconds, 3)
        summary["seconds_per_round"] = round(seconds / self.rounds_done, 3) if self.rounds_done else None
        if self.estimated_time_s is not None:
            summary["estimated_time_s"] = self.estimated_time_s
        if self.extensions:
            summary["extended"] = self.extension()
        return summary

    def extension(self) -> dict[str, Any] | None:
        """How the run was extended to more rounds, None if it never was: ``{"from": the
        rounds it started with, "to": its rounds now, "equal_to_fresh_run": whether its
        metrics are those of a run started with that many, "why": what differs and why
        (None when equal), "extensions": :attr:`extensions`}``. Client sampling, DP
        accounting and every random stream do not depend on the total rounds; what
        does: an algorithm's schedule over them
        (:meth:`~contrafl.algorithms.base.Algorithm.depends_on_total_rounds`), for the
        rounds computed before an extension, and the evaluation of a run's last round
        when ``eval_every`` (``knn_every``) would not evaluate it."""
        if not self.extensions:
            return None
        cfg, why = self.cfg, []
        reason = type(self.algorithm).depends_on_total_rounds(self.algorithm.params)
        spans, start = [], 1
        for e in self.extensions:
            if e["after"] >= start:
                done = f"round {start}" if start == e["after"] else f"rounds {start}-{e['after']}"
                spans.append(f"{done} ran with rounds={e['from']}")
                start = e["after"] + 1
        if reason and spans:
            why.append(f"{reason}, and {', '.join(spans)}")
        ends = [e["from"] for e in self.extensions if e["after"] == e["from"]]  # evaluated as the last round
        extra = [m for m in ends if m % cfg.eval_every or (cfg.knn_every and m % cfg.knn_every)]
        if extra:
            every = f"eval_every={cfg.eval_every}" + (f", knn_every={cfg.knn_every}" if cfg.knn_every else "")
            rows = f"round {extra[0]} of metrics.jsonl has" if len(extra) == 1 else f"rounds {', '.join(map(str, extra))} of metrics.jsonl have"
            why.append(f"{rows} the evaluation of the run's last round, which a fresh run with {every} does not make (the training is the same)")
        return {
            "from": self.extensions[0]["from"], "to": cfg.rounds, "equal_to_fresh_run": not why,
            "why": "; ".join(why) or None, "extensions": self.extensions,
        }


def without_clients(row: dict[str, Any]) -> dict[str, Any]:
    """A round's row that does not say which clients took part (``sampling=secret``): no
    ``clients`` list, rejected and lost replies without their client, stragglers as
    whether they replied (their speed and planned steps would name them)."""
    out = {k: v for k, v in row.items() if k != "clients"}
    for key in ("rejected", "lost"):
        if key in out:
            out[key] = [{"reason": item["reason"]} for item in out[key]]
    if "stragglers" in out:
        out["stragglers"] = [{"done": item["done"] > 0} for item in out["stragglers"]]
    return out


def trained_model(result: TrainResult) -> StateDict:
    """The model a client trained: its ``model`` role (parameters and buffers,
    :func:`~contrafl.algorithms.base.model_state`; the parameters alone where the role
    has no buffers), or the union of the trained roles when none is called ``model`` (a
    model trained as disjoint parts, ``body`` and ``head``). It may be a partial state
    dict of the run's architecture."""
    roles = ["model"] if "model" in result.params else list(result.params)
    return {k: v for r in roles for k, v in {**result.params[r], **result.buffers.get(r, {})}.items()}


def check_partition(setup: Setup, path: Path, advice: str) -> None:
    """Stop with a :class:`CheckpointError` when the data give another partition than the
    run directory ``path`` recorded."""
    partition = path / "partition.json"
    if partition.is_file() and partition.read_text() != json.dumps(setup.partition.to_json()):
        raise CheckpointError(f"the data gives another partition than {partition} (different dataset files?); {advice}")


def resume(setup: Setup, run_dir: RunDir, progress: Progress | None = None) -> Simulation:
    """A simulation that continues the run in ``run_dir`` from its last checkpoint, or
    from round 0 when it has none yet (its per-round files are then emptied). The data
    must give the partition the run started with."""
    check_partition(setup, run_dir.path, "resume with the data the run started with")
    sim = Simulation(setup, run_dir, progress)
    checkpoint = load_checkpoint(run_dir.path)
    if checkpoint is not None:
        sim.restore(checkpoint, run_dir.checkpoint_path)
    else:
        if sim.privacy is not None:
            sim.privacy.load_state_dict({}, run_dir.rows("metrics.jsonl"), f"{run_dir.path / 'metrics.jsonl'}")
        run_dir.truncate(0, [])
    return sim


def read_only(setup: Setup, path: Path, checkpoint: dict[str, Any], clients: Iterable[int] | None = None) -> Simulation:
    """A simulation in the state of ``checkpoint``, the last checkpoint of the run in
    ``path`` (:func:`load_checkpoint`), that writes nothing there, for analyses of the
    run (``contrafl eval-repr``): it has no run directory, its client store spills to a
    private temporary directory (removed by ``sim.store.close()``), and it loads the
    client states the checkpoint names from the run's ``client-state/``
    (:attr:`RunDir.client_dir`) into that store: only those of ``clients`` when given,
    the other clients then look as if they had no state yet. The data must give the
    run's partition."""
    path = Path(path)
    check_partition(setup, path, "analyse the run with the data it was trained on")
    sim = Simulation(setup)
    where = path / CHECKPOINT
    check_checkpoint(checkpoint, where, setup.config, sim.server.model)  # with the manifest restore is not given
    files = client_files(checkpoint["clients"], f"checkpoint {where}")
    sim.restore({**checkpoint, "clients": {"files": {}, "serial": checkpoint["clients"]["serial"]}}, where)
    for cid in files if clients is None else [c for c in clients if c in files]:
        state = load_safe(path / "client-state" / files[cid], f"client {cid}'s state", sim.device)
        check_client_state(state, path / "client-state" / files[cid], cid)
        sim.store.put(cid, state)
    return sim


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The checkpoint of a run directory (loaded safely), or None if it has none yet."""
    path = Path(run_dir) / CHECKPOINT
    return load_safe(path, "checkpoint", map_location="cpu") if path.is_file() else None

