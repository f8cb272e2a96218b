"""The round loop of a federated simulation.

Each round: sample clients, broadcast the server's message, train the clients (in this
process, :class:`~contrafl.execution.clients.LocalClients`, or through a
:class:`~contrafl.execution.outcomes.Transport`: the distributed executor's ranks, a
Flower grid), collect and check the replies, aggregate, apply the server optimiser,
account for communication and evaluate. The loop never looks at which algorithm runs:
everything algorithm-specific goes through the
:class:`~contrafl.algorithms.base.Algorithm` interface.

:class:`Simulation` is made of parts with one concern each: the clients of its own
process (:class:`~contrafl.execution.clients.LocalClients`: client states, jobs,
executors), checkpoint and resume (:class:`~contrafl.engine.resumable.Resumable`),
evaluation (:class:`~contrafl.engine.evaluation.Evaluation`) and the summary
(:class:`~contrafl.engine.outputs.Outputs`); this module keeps the loop.
``summary.json`` always says how the run stands: ``running``, ``completed``,
``interrupted`` (SIGINT, SIGTERM, SIGHUP) or ``failed`` (with the error). With
``tracking`` set, the config, each round's row and the summary also go to TensorBoard,
MLflow or CSV files (:mod:`~contrafl.engine.tracking`), after ``metrics.jsonl``.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..algorithms.base import Reply, StateDict
from ..algorithms.server_opt import ServerOptimizer
from ..config import Config, fingerprint
from ..errors import ClientUpdateError, one_line
from ..execution import distributed
from ..execution.clients import LocalClients
from ..execution.context import Setup
from ..execution.distributed import DistributedTransport
from ..execution.executor import Job
from ..execution.outcomes import Transport, as_floats, trained_model
from ..execution.signals import interrupts, signal_name, stop_point
from ..execution.validate import PendingCheck, norm_outliers
from ..execution.work import RoundWork
from ..rng import generator
from .attacking import Attack
from .client_store import ClientStore
from .comm import add_bytes, payload_bytes
from .evaluation import Evaluation
from .outputs import Outputs, without_clients
from .privacy import LEDGER, Privacy, require_accounting
from .progress import Progress
from .resumable import Resumable
from .robustness import RobustAggregation, detection
from .run_dir import RunDir
from .sampling import sample_schedule, secret_sample
from .setup import choose_executor, prepare
from .tracking import Tracking, open_tracking


def executors(cfg: Config, setup: Setup) -> tuple[str, str]:
    """The run's executor (``executor``, ``auto`` chosen) and the one that trains the
    clients of each process (for the distributed executor, ``rank_executor``)."""
    name = cfg.executor if cfg.executor != "auto" else choose_executor(cfg, type(setup.algorithm), setup.device)
    return name, name if name != "distributed" else cfg.rank_executor


def spill_dir() -> Path:
    """A private directory for the client states a store spills (made when it first
    spills, removed when it closes)."""
    return Path(tempfile.gettempdir()) / f"contrafl-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def worker_clients(setup: Setup) -> LocalClients:
    """The clients of a process that serves a run's clients without running its loop
    (a rank of the distributed executor, a Flower node): the run's local executor and
    DP, a store that spills to a private temporary directory."""
    cfg = setup.config
    store = ClientStore(cfg.client_memory_gb * 2**30, spill_dir(), setup.device)
    return LocalClients(setup, store, executors(cfg, setup)[1], Privacy.of(cfg))


def worker_clients_of(cfg: Config) -> LocalClients:
    """:func:`worker_clients` of the run ``cfg``, its data loaded anew (a spawned rank)."""
    return worker_clients(prepare(cfg))


class Simulation(LocalClients, Resumable, Evaluation, Outputs):
    """A federated simulation of one configuration."""

    def __init__(self, setup: Setup, run_dir: RunDir | None = None, progress: Progress | None = None) -> None:
        cfg = setup.config
        memory = cfg.client_memory_gb * 2**30
        if run_dir is not None:
            store = ClientStore(memory, run_dir.client_dir, setup.device, keep=True)
        else:
            store = ClientStore(memory, spill_dir(), setup.device)
        self.executor_name, local = executors(cfg, setup)
        super().__init__(setup, store, local, Privacy.of(cfg), progress)
        self.run_dir = run_dir
        initial = {k: v.detach().clone() for k, v in setup.model.state_dict().items()}
        self.server = self.algorithm.init_server(initial)
        self.server_opt = ServerOptimizer(cfg.server_lr, cfg.server_momentum)
        self.robust = RobustAggregation.of(cfg.aggregator)
        """The robust rule in place of the algorithm's means (``aggregator``), or None."""
        self.attack = Attack.of(cfg)
        """The run's Byzantine clients (``attack``), or None."""
        self.attack_tests = self.attack.test_sets(self.test) if self.attack is not None else {}
        """What the global model is evaluated on besides the test set (the backdoor's success rate)."""
        self.probes = self.attack.probes() if self.attack is not None else {}
        self.schedule = sample_schedule(cfg.num_clients, cfg.sample_fraction, cfg.rounds, cfg.seed)
        """Each round's clients drawn from the seed (:meth:`sample`: the round's actual
        clients, which ``sampling=secret`` draws otherwise; time estimates take this one)."""
        self._secret_samples: dict[int, list[int]] = {}
        self.timed = cfg.client_speed != "constant" or cfg.speed_jitter > 0 or cfg.round_deadline is not None
        """Rounds record their simulated duration (``round_time``)."""
        self.fingerprint = fingerprint(cfg)
        if self.privacy is not None and run_dir is not None:  # client-level DP's ledger is kept in the run directory
            self.privacy.ledger.open(run_dir.path / LEDGER)
        self.history: list[dict[str, Any]] = []
        self.comm_total: dict[str, dict[str, int]] = {"down": {}, "up": {}}
        self.rounds_done = 0
        self.transport: Transport | None = None  # None: train_locally, evaluate_locally
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
                    self.transport = ranks = distributed.start(
                        self, self.placement, functools.partial(worker_clients, self.setup), functools.partial(worker_clients_of, cfg)
                    )
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

    def sample(self, t: int) -> list[int]:
        """Round ``t``'s clients: :attr:`schedule`'s, or with ``sampling=secret`` a draw
        of the OS CSPRNG (:func:`~contrafl.engine.sampling.secret_sample`), made once per
        round of this process and kept nowhere else."""
        if self.cfg.sampling != "secret":
            return self.schedule[t]
        if t not in self._secret_samples:
            self._secret_samples = {t: secret_sample(self.cfg.num_clients, self.cfg.sample_fraction)}
        return self._secret_samples[t]

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

    def run_round(self, t: int) -> dict[str, Any]:
        """Round ``t`` (0-based): sample, broadcast, train the clients (here or through the
        transport), check the replies (one by one, then their norms against each other),
        apply DP, aggregate and step the server optimiser, count the bytes, and evaluate
        as scheduled (:meth:`~contrafl.engine.evaluation.Evaluation.evaluate_round`):
        the round's row of ``metrics.jsonl``."""
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
        byzantine = self.attack.attackers(t, sampled) if self.attack is not None else []
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
            if not outcome.checked and cid not in byzantine:  # an attacker's reply is checked once crafted
                checks[cid] = (self.begin_reply_check(cid, reply, own_messages.get(cid, broadcast), specs), reply)
            if outcome.loss is not None:
                losses[cid] = outcome.loss
            parts[cid] = outcome.parts
            steps += outcome.steps
        if byzantine:  # the attackers craft their replies from the round's (omniscient attacks: from the honest ones)
            crafted = self.attack.craft(t, arrived, byzantine, {c: own_messages.get(c, broadcast) for c in arrived})
            arrived.update(crafted)
            for cid in byzantine:
                if cid in arrived:
                    checks[cid] = (self.begin_reply_check(cid, arrived[cid], own_messages.get(cid, broadcast), specs), arrived[cid])
        sums = getattr(self.transport, "sums", False)
        for cid, reason in self.reply_problems(checks, lambda c: own_messages.get(c, broadcast), sums).items():
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

        robustness: dict[str, Any] = {}
        if self.robust is not None and replies:
            replies, robustness = self.robust.apply(replies, {r.cid: own_messages.get(r.cid, broadcast) for r in replies})
            if self.attack is not None:
                robustness |= detection(robustness.get("flagged"), byzantine, [r.cid for r in replies])
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
        if self.attack is not None:
            row["attackers"] = byzantine
        if robustness:
            row["aggregator"] = robustness
        if self.timed:
            row["round_time"] = self.round_time(times, bool(lost or stragglers))
        if cfg.sampling == "secret":
            row = without_clients(row)
        row.update(privacy)
        row.update(self.evaluate_round(t))
        row["bytes_down"] = down
        row["bytes_up"] = up
        return row

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
