"""The round loop of a federated simulation.

Each round: sample clients, broadcast the server's message, let the algorithm prepare
each client's local task, train the clients with the executor, collect the replies,
aggregate, apply the server optimiser, account for communication and evaluate. The loop
never looks at which algorithm runs: everything algorithm-specific goes through the
:class:`~contrafl.algorithms.base.Algorithm` interface.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..algorithms.base import Algorithm, Reply, StateDict, model_state
from ..algorithms.server_opt import ServerOptimizer
from ..config import Config
from ..errors import ClientUpdateError, ConfigError, ContraflError
from ..eval.evaluate import evaluate
from ..eval.metrics import mean_std, rounds_to_reach
from ..models.base import ModelOutput
from .client_store import ClientStore
from .comm import add_bytes, payload_bytes
from .executor import FunctionalNet, Job, SequentialExecutor, Workload
from .optim import make_optimizer
from .parallel import ParallelExecutor
from .plan import make_plan
from .progress import Progress
from .rng import derive_seed, generator
from .run_dir import RunDir
from .sampling import sample_schedule
from .setup import Setup
from .vectorized import VectorizedExecutor


class Context:
    """The engine's :class:`~contrafl.algorithms.base.ClientContext`."""

    def __init__(self, sim: "Simulation", cid: int, round: int) -> None:
        self._sim = sim
        self.cid = cid
        self.round = round
        self.num_samples = len(sim.rows[cid])
        self.label_counts = sim.label_counts[cid]

    def initial_state(self) -> StateDict:
        return self._sim.initial_state(self.cid)

    def predict(self, state) -> tuple[ModelOutput, torch.Tensor]:
        return self._sim.predict(state, self._sim.rows_t[self.cid])


def choose_executor(cfg: Config, algorithm: Algorithm, device: torch.device) -> str:
    """The executor for ``executor=auto``.

    On CUDA: the vectorized executor for algorithms that support it with equal batch
    sizes (``drop_last``). On a multi-core CPU, when a round trains at least two clients:
    the parallel executor (batched per-client convolutions are slower than one client at
    a time on a CPU, and one client's small operations do not use many cores well; it
    is faster from 3 local steps per client on, docs/performance.md). Otherwise the
    sequential executor.
    """
    can_vectorize = algorithm.vectorizable and cfg.drop_last
    if cfg.executor == "vectorized" and not can_vectorize:
        why = f"algorithm {algorithm.name} cannot be vectorized" if not algorithm.vectorizable else "drop_last=false gives unequal batch sizes"
        raise ConfigError(f"executor=vectorized is not possible: {why}; use executor=sequential or executor=auto")
    if cfg.executor == "parallel" and device.type != "cpu":
        raise ConfigError("executor=parallel trains on the CPU; use executor=vectorized or auto with device=cuda")
    if cfg.executor != "auto":
        return cfg.executor
    if device.type == "cuda":
        return "vectorized" if can_vectorize else "sequential"
    if cpu_cores() > 1 and cfg.num_clients * cfg.sample_fraction >= 2:
        return "parallel"
    return "sequential"


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def make_executor(name: str, workload: Workload, cfg: Config):
    """The executor ``name`` for ``workload``."""
    if name == "vectorized":
        return VectorizedExecutor(workload, cfg.vectorize_memory_gb * 2**30)
    if name == "parallel":
        workers = cfg.workers or cpu_cores()
        return ParallelExecutor(workload, workers, threads=max(1, cpu_cores() // workers))
    return SequentialExecutor(workload)


def check_reply(reply: Reply, round: int) -> None:
    """Reject a reply with non-finite values before it reaches the aggregate."""

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and not torch.isfinite(obj).all():
                raise ClientUpdateError(
                    f"client {reply.cid} returned non-finite values in '{path}' at round {round + 1}; "
                    "training diverged: lower lr or the loss weights (e.g. algorithm.mu)"
                )
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")

    walk(reply.payload, "")


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
        self.rows = [np.asarray(r) for r in setup.partition.train]
        self.rows_t = [torch.as_tensor(r, dtype=torch.long, device=self.device) for r in self.rows]
        labels = setup.data.train.y.numpy()
        self.label_counts = torch.as_tensor(setup.partition.counts(labels, setup.data.num_classes))
        initial = {k: v.detach().clone() for k, v in setup.model.state_dict().items()}
        self.server = self.algorithm.init_server(initial)
        self.server_opt = ServerOptimizer(cfg.server_lr, cfg.server_momentum)
        spill = run_dir.spill_dir if run_dir is not None else Path(tempfile.gettempdir()) / f"contrafl-{os.getpid()}-{id(self)}"
        self.store = ClientStore(cfg.client_memory_gb * 2**30, spill)
        self.optimizer = make_optimizer(cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay)
        self.executor_name = choose_executor(cfg, self.algorithm, self.device)
        self.schedule = sample_schedule(cfg.num_clients, cfg.sample_fraction, cfg.rounds, cfg.seed)
        self.history: list[dict[str, Any]] = []
        self.comm_total = {"down": {}, "up": {}}
        self.rounds_done = 0

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
        fields = [
            torch.cat([getattr(o, f) for o in outs]) if outs and getattr(outs[0], f) is not None else None
            for f in ModelOutput._fields
        ]
        return ModelOutput(*fields), self.train.y[rows]

    # -- the loop -------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        status = "completed"
        if self.run_dir is not None:
            self.run_dir.write_config(self.cfg)
            self.setup.partition.save(self.run_dir.path / "partition.json")
        try:
            for t in range(self.cfg.rounds):
                round_start = time.perf_counter()
                row = self.run_round(t)
                self.history.append(row)
                self.rounds_done = t + 1
                if self.run_dir is not None:
                    self.run_dir.append("metrics.jsonl", row)
                    self.run_dir.append("timing.jsonl", {"round": t + 1, "seconds": time.perf_counter() - round_start})
                if self.progress is not None:
                    self.progress.round_done(row)
        except (ContraflError, KeyboardInterrupt) as exc:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"failed: {exc}"
            raise
        finally:
            summary = self.summary(status, time.perf_counter() - start)
            if self.run_dir is not None:
                self.run_dir.write_json("summary.json", summary)
                self.run_dir.save_checkpoint(self.checkpoint())
            self.store.close()
        return summary

    def run_round(self, t: int) -> dict[str, Any]:
        cfg, algo = self.cfg, self.algorithm
        sampled = self.schedule[t]
        message = algo.broadcast(self.server, t)
        workload = Workload(
            self.train.x,
            self.train.y,
            self.setup.train_transform,
            self.net,
            algo.stages(t),
            self.optimizer,
            autocast=torch.bfloat16 if cfg.precision == "bf16" else None,
        )
        executor = make_executor(self.executor_name, workload, cfg)
        open_clients: dict[int, tuple[Context, dict[str, Any]]] = {}

        def make_job(cid: int) -> Job:
            ctx = Context(self, cid, t)
            entry = self.store.get(cid) or {"algorithm": algo.init_client(ctx), "optimizer": None}
            open_clients[cid] = (ctx, entry)
            plan = make_plan(
                self.rows[cid],
                cfg.local_epochs,
                cfg.batch_size,
                cfg.drop_last,
                self.setup.train_transform.sample,
                algo.views,
                generator(cfg.seed, "plan", t, cid),
            ).to(self.device)
            task = algo.client_begin(message, entry["algorithm"], ctx)
            return Job(cid, task, plan, derive_seed(cfg.seed, "dropout", t, cid), entry["optimizer"])

        replies: list[Reply] = []
        loss_sum, steps = 0.0, 0
        for done, (job, result) in enumerate(executor.run(make_job, sampled), start=1):
            ctx, entry = open_clients.pop(job.cid)
            reply, state = algo.client_end(job.task, result, entry["algorithm"], ctx)
            check_reply(reply, t)
            replies.append(reply)
            entry = {"algorithm": state, "optimizer": result.opt_state if cfg.persist_optimizer_state else None}
            if cfg.eval_personal and "model" in result.params and algo.personal_state(state, self.server) is None:
                entry["local"] = model_state(result)  # evaluated when the algorithm keeps no personal model
            self.store.put(job.cid, entry)
            if "loss" in result.stats:
                loss_sum += float(result.stats["loss"])
            steps += result.steps
            if self.progress is not None:
                self.progress.clients(t + 1, done, len(sampled))
        replies.sort(key=lambda r: r.cid)

        old = self.server.model
        self.server = algo.aggregate(self.server, replies, t)
        self.server.model = self.server_opt.step(old, self.server.model)

        down, up = {}, {}
        add_bytes(down, payload_bytes(message), times=len(sampled))
        for r in replies:
            add_bytes(up, payload_bytes(r.payload))
        add_bytes(self.comm_total["down"], down)
        add_bytes(self.comm_total["up"], up)

        row: dict[str, Any] = {
            "round": t + 1,
            "clients": sampled,
            "train_loss": loss_sum / steps if steps else None,
            "local_steps": steps,
        }
        if (t + 1) % cfg.eval_every == 0 or t + 1 == cfg.rounds:
            row.update(self.evaluate())
        row["bytes_down"] = down
        row["bytes_up"] = up
        return row

    # -- evaluation -----------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        bs, tf = self.cfg.eval_batch_size, self.setup.eval_transform
        if self.algorithm.evaluates_global:
            res = evaluate(self.net, self.server.model, self.test.x, self.test.y, tf, bs)
            out["test_acc"], out["test_loss"] = res["acc"], res["loss"]
        if self.cfg.eval_personal:
            accs, correct, total = [], 0.0, 0
            test_rows = self.setup.partition.test
            for cid in range(self.cfg.num_clients):
                entry = self.store.get(cid)
                if entry is None:
                    continue
                state = self.algorithm.personal_state(entry["algorithm"], self.server)
                if state is None:
                    state = entry.get("local")
                if state is None:
                    continue
                if test_rows is not None:
                    rows = torch.as_tensor(test_rows[cid], dtype=torch.long, device=self.device)
                    res = evaluate(self.net, state, self.train.x[rows], self.train.y[rows], tf, bs)
                else:
                    res = evaluate(self.net, state, self.test.x, self.test.y, tf, bs)
                if res["n"]:
                    accs.append(res["acc"])
                    correct += res["acc"] * res["n"]
                    total += res["n"]
            if accs:
                mean, std = mean_std(accs)
                out["personal_acc"], out["personal_acc_std"] = mean, std
                out["personal_acc_weighted"] = correct / total
                out["personal_clients"] = len(accs)
        return out

    # -- outputs --------------------------------------------------------------------
    def summary(self, status: str, seconds: float) -> dict[str, Any]:
        evaluated = [r for r in self.history if "test_acc" in r or "personal_acc" in r]
        last = evaluated[-1] if evaluated else {}
        summary: dict[str, Any] = {
            "status": status,
            "algorithm": self.cfg.algorithm.name,
            "dataset": self.cfg.dataset.name,
            "rounds_completed": self.rounds_done,
            "rounds": self.cfg.rounds,
            "final": {k: v for k, v in last.items() if k not in ("clients", "bytes_down", "bytes_up")},
        }
        accs = [r["test_acc"] for r in evaluated if "test_acc" in r]
        if accs:
            best = max(range(len(accs)), key=accs.__getitem__)
            summary["best_test_acc"] = accs[best]
            summary["best_round"] = [r for r in evaluated if "test_acc" in r][best]["round"]
        if self.cfg.target_accuracy is not None:
            summary["target_accuracy"] = self.cfg.target_accuracy
            summary["rounds_to_target"] = rounds_to_reach(self.history, self.cfg.target_accuracy)
        summary["bytes_total"] = self.comm_total
        summary["executor"] = self.executor_name
        summary["device"] = str(self.device)
        summary["wall_time_s"] = round(seconds, 3)
        summary["seconds_per_round"] = round(seconds / self.rounds_done, 3) if self.rounds_done else None
        return summary

    def checkpoint(self) -> dict[str, Any]:
        return {
            "round": self.rounds_done,
            "model": self.server.model,
            "server_extras": self.server.extras,
            "server_optimizer": self.server_opt.state_dict(),
            "config": self.cfg.to_dict(),
        }

