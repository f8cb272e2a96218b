"""The client side of a contrafl run on Flower: one partition's local training and
evaluation.

A SuperNode serves the client whose id is its node config's ``partition-id``. It reads
the run's ``config.yaml`` and ``partition.json`` from the run directory and keeps only
its own rows of the data (:func:`~contrafl.engine.setup.own_rows`). For each train
message it runs what the simulator runs for that client in the same round
(:meth:`~contrafl.execution.clients.LocalClients.train_locally` with the sequential
executor: ``client_begin``, the local steps with the same plans and seeds,
``client_end``); for each evaluate message, the simulator's personal evaluation
(:meth:`~contrafl.execution.clients.LocalClients.evaluate_locally`), with the clients of
:func:`~contrafl.engine.simulation.worker_clients` (no round loop).

The client's state (its algorithm state and optimiser state) lives in files of its own,
``client-<cid>/round-<T>.pt``, the state after its training in round ``T`` (rounds
counted from 1, as in ``metrics.jsonl``), so that it survives a restart of the SuperNode
(Flower's ``context.state`` does not). Round ``T`` starts from the newest state of a
round before ``T``. A server that restarts resumes from its last checkpoint, made after
round ``C``, and trains rounds ``C+1, C+2, ...`` again, so each train message says ``C``
and the client keeps, besides the state it has just made, its newest state of a round
up to ``C``; states of rounds after the current one belong to a run the server
abandoned and are removed.

A Byzantine SuperNode (node config ``attack``, :mod:`contrafl.flower.byzantine`) trains
on its data poisoned as the simulator poisons an attacker's (data attacks) and crafts
its reply from its own update (:meth:`FlowerClient.crafted`) before it is checked and sent.

(The methods take the engine's round index ``t``, counted from 0: round ``T = t + 1``.)
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from ..algorithms.base import Reply
from ..config import load_config
from ..data.partition import Partition
from ..engine.attacking import Attack
from ..engine.checkpoint import load_safe, save_atomic
from ..engine.setup import own_rows, prepare, prepare_node
from ..engine.simulation import worker_clients
from ..execution.outcomes import Scores, as_floats
from ..execution.validate import check_reply
from ..errors import ConfigError, ContraflError
from ..files import write_atomic
from .byzantine import node_attack, node_spelling
from .codec import decode, encode
from .node import REPRODUCIBLE_WARNING, NodeSettings, client_state_dir, reproducible_noise
from flwr.app import MessageType, RecordDict

STATE_FILE = re.compile(r"round-(\d+)\.pt")
DATA_FILE = "data.json"
"""The record of a client's data in its state folder (:meth:`FlowerClient.check_data`)."""


class FlowerClient:
    """Client ``cid`` of the run in ``run_dir`` (its ``config.yaml`` and ``partition.json``).

    The client's data are the rows of its partition of the dataset in ``data_dir``
    (default: the config's); its states live in ``state_dir/client-<cid>/`` (default
    ``state_dir``: ``run_dir/flower-clients``)."""

    def __init__(
        self, run_dir: Path, cid: int, state_dir: Path | None = None, data_dir: Path | None = None, data: Path | None = None,
        attack: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        overrides = ["executor=sequential"] + ([f"data_dir={data_dir}"] if data_dir is not None else [])
        cfg = load_config(self.run_dir / "config.yaml", overrides)
        if not 0 <= cid < cfg.num_clients:
            raise ContraflError(f"partition-id={cid} is not a client of the run (0..{cfg.num_clients - 1}); set the SuperNode's --node-config partition-id")
        self.cid = cid
        if reproducible_noise(cfg):
            print(f"contrafl: warning: client {cid}: {REPRODUCIBLE_WARNING}", file=sys.stderr, flush=True)
        if attack is not None:  # a Byzantine SuperNode: its client the one attacker (its data poisoned by prepare)
            cfg = node_attack(cfg, cid, *attack)
        try:
            if cfg.node_data == "own":
                if data is None:
                    raise ContraflError("this run's clients hold their own data (node_data=own); set the SuperNode's --node-config data='PATH'")
                try:
                    setup = prepare_node(cfg, data, cid)
                except ContraflError as exc:
                    raise ContraflError(f"client {cid}'s data do not fit the federation: {exc}") from None
            else:
                setup = own_rows(prepare(cfg, Partition.load(self.run_dir / "partition.json")), cid)
        except ConfigError as exc:  # the attack does not suit the algorithm or the data
            if attack is None or "attack" not in str(exc):
                raise
            raise ConfigError(f"node config attack='{attack[0]}': {node_spelling(str(exc))}") from None
        self.attack = Attack.of(setup.config)
        """The attack this SuperNode makes (node config ``attack``), or None."""
        self.sim = worker_clients(setup)
        self.state_dir = client_state_dir(self.run_dir, cid, state_dir)
        self.check_data(setup.data.train.x, setup.data.train.y)

    def check_data(self, *tensors: torch.Tensor) -> None:
        """:class:`ContraflError` unless the client's data (its training and local test
        rows, ``tensors``) are those it had when the run began, as recorded then in its
        state folder (:data:`DATA_FILE`: their count and SHA-256). A site whose data
        changed between rounds would train a run whose rounds saw different data, and
        whose resume no longer equals it: refused, with what changed. (A worker that has
        loaded them keeps training on what it loaded until it restarts.)"""
        digest = hashlib.sha256()
        for tensor in tensors:
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        record = {"samples": int(tensors[-1].shape[0]), "sha256": digest.hexdigest()}
        file = self.state_dir / DATA_FILE
        try:
            before = json.loads(file.read_text())
        except FileNotFoundError:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            text = json.dumps(record).encode()
            write_atomic(file, lambda f: f.write(text))
            return
        except (OSError, ValueError):
            raise ContraflError(f"client {self.cid}: {file} is not a record of its data; remove it to record the data as they are now") from None
        if before != record:
            change = f"{before.get('samples')} samples then, {record['samples']} now" if before.get("samples") != record["samples"] else "the same count, other values"
            raise ContraflError(
                f"client {self.cid}'s data changed since the run began ({change}); put the run's data back, "
                "or start a new run with these: all of a run's rounds train on the same data"
            )

    @classmethod
    def of(cls, settings: NodeSettings) -> FlowerClient:
        """The client of a SuperNode's settings (checked first), with torch's threads set
        as its node config says."""
        settings.check()
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        optional = (Path(p) if p is not None else None for p in (settings.state_dir, settings.data_dir, settings.data))
        attack = (settings.attack, settings.attack_options) if settings.attack is not None else None
        return cls(Path(settings.run_dir), settings.partition_id, *optional, attack=attack)

    def answer(self, kind: str, content: RecordDict) -> RecordDict:
        """The reply content to a ``train`` or ``evaluate`` message's ``content`` (checked
        to be meant for this client): :meth:`train`'s tree, :meth:`evaluate`'s scores
        (``{}`` when the client has no test data), or for the evaluation of the global
        model (``global``) :meth:`evaluate_model`'s; to a ``query``, nothing (the client
        is loaded: its data fit the run)."""
        if kind == MessageType.QUERY:
            return RecordDict()
        request = decode(content)
        if int(request["client"]) != self.cid:
            raise ContraflError(f"a message for client {request['client']} reached the SuperNode of partition {self.cid}")
        t, message = int(request["round"]), request["message"]
        if kind == MessageType.TRAIN:
            tree = self.train(t, message, int(request["checkpointed"]))
            return encode(self.checked(message, tree) if request.get("secure", False) else tree)
        if request.get("global", False):
            return encode(self.evaluate_model(t, message["model"]))
        return encode(self.evaluate(t, message) or {})

    def checked(self, message: dict[str, Any], tree: dict[str, Any]) -> dict[str, Any]:
        """A reply ``tree`` of :meth:`train` bound for a secure sum, checked here as the
        server checks a plain reply (:func:`~contrafl.execution.validate.check_reply`
        against the algorithm's ``reply_spec`` of ``message``), since the sum would hide
        it from the server: the tree when it passes, else only why not
        (``{"rejected": reason}``), so that the update enters no sum."""
        reply = Reply(self.cid, tree["num_samples"], tree["payload"])
        reason = check_reply(reply, self.sim.algorithm.reply_spec(message))
        return tree if reason is None else {"rejected": reason}

    def states(self) -> dict[int, Path]:
        """``{round: file}`` of the client's saved states."""
        if not self.state_dir.is_dir():
            return {}
        found = (STATE_FILE.fullmatch(p.name) for p in self.state_dir.iterdir())
        return {int(m.group(1)): self.state_dir / m.group(0) for m in found if m}

    def load_state(self, t: int) -> None:
        """Put the client's state at the start of round ``t + 1`` (its newest state of a
        round up to ``t``, none when it has not trained yet) into the simulation's store,
        which keeps nothing else: a client that serves several messages (a SuperNode's
        worker) starts each from its files, as a new one would."""
        self.sim.store.clear()
        states = self.states()
        before = [r for r in states if r <= t]
        if before:
            self.sim.store.put(self.cid, load_safe(states[max(before)], f"client {self.cid}'s state", self.sim.device))

    def train(self, t: int, message: dict[str, Any], checkpointed: int) -> dict[str, Any]:
        """Local training in round ``t + 1`` on ``message``: the reply as a tree
        (``payload``, ``num_samples``, ``loss``, ``steps``, the loss's ``parts``, the
        simulated ``time`` and how a straggler was cut, or ``lost`` and why). The
        client's next state is saved (``round-<t+1>.pt``) before the reply leaves; it keeps
        the states a server resuming from its checkpoint after round ``checkpointed`` may
        need."""
        sim, cid = self.sim, self.cid
        self.load_state(t)
        outcome = next(iter(sim.train_locally(t, [cid], lambda _: message, sim.algorithm.phases(t))))
        entry = sim.store.get(cid)
        if entry is not None:
            try:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                save_atomic(entry, self.state_dir / f"round-{t + 1}.pt")
            except (OSError, RuntimeError) as exc:  # a full disk (torch.save says so as a RuntimeError); no reply leaves
                free = shutil.disk_usage(self.state_dir).free if self.state_dir.is_dir() else 0
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{free} bytes free there"
                raise ContraflError(
                    f"client {cid} cannot save its state of round {t + 1} in {self.state_dir} ({why}); "
                    "free space there, or give the SuperNode another state-dir: it then trains the round again from its last state"
                ) from None
            states = self.states()
            keep = {t + 1, max((r for r in states if r <= checkpointed), default=0)}
            for r, path in states.items():
                if r not in keep:
                    path.unlink()
        timing = {"time": outcome.time, "straggler": outcome.straggler}
        if outcome.reply is None:  # a straggler dropped at the round's deadline
            return {"lost": outcome.lost, **timing}
        reply = self.crafted(t, message, outcome.reply)
        loss, parts = as_floats((outcome.loss, outcome.parts))
        return {"payload": reply.payload, "num_samples": reply.num_samples, "loss": loss, "steps": outcome.steps, "parts": parts, **timing}

    def crafted(self, t: int, message: dict[str, Any], reply: Reply) -> Reply:
        """``reply`` to ``message`` in round ``t + 1`` as this SuperNode's attack crafts it
        (node config ``attack``; :mod:`contrafl.flower.byzantine`): from its own reply alone,
        as the simulator's non-omniscient attacker does; ``reply`` itself when the node is
        honest or the attack leaves this round's reply as it is."""
        if self.attack is None:
            return reply
        return self.attack.craft(t, {self.cid: reply}, [self.cid], {self.cid: message}).get(self.cid, reply)

    def evaluate_model(self, t: int, state: dict[str, torch.Tensor]) -> Scores:
        """The global model ``state`` before round ``t + 1`` on the client's test data
        (federated evaluation)."""
        return next(iter(self.sim.evaluate_model_locally(t, [self.cid], state)))[1]

    def evaluate(self, t: int, message: dict[str, Any]) -> Scores | None:
        """The client's personal model at the start of round ``t + 1`` on its test data."""
        self.load_state(t)
        return next(iter(self.sim.evaluate_locally(t, [self.cid], lambda _: message)))[1]
