"""What the clients of a run are made of, and what an algorithm sees of a client.

:class:`Setup` holds a run's parts (:func:`~contrafl.engine.setup.prepare` makes it);
:class:`Context` is the engine's :class:`~contrafl.algorithms.base.ClientContext`; the
protocols say what :class:`~contrafl.execution.clients.LocalClients` needs of the
services the round loop gives it (a client store, local DP, a progress line).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..algorithms.base import Algorithm, Reply, StateDict
from ..config import Config
from ..data import augment
from ..data.augment import view_transform
from ..data.base import FederatedDataset
from ..data.partition import Partition
from ..models.base import FedModel, ModelOutput
from ..rng import generator
from .work import RoundWork


@dataclass
class Setup:
    """Everything a run is made of (:func:`~contrafl.engine.setup.prepare` makes it): what
    :class:`LocalClients` train and a :class:`~contrafl.engine.simulation.Simulation` runs."""

    config: Config
    data: FederatedDataset
    partition: Partition
    algorithm: Algorithm
    model: FedModel
    model_factory: Callable[[int], FedModel]
    train_transform: augment.Transform
    eval_transform: augment.Transform
    device: torch.device
    warnings: list[str] = dataclasses.field(default_factory=list)


class Store(Protocol):
    """Where client states live between rounds (:class:`~contrafl.engine.client_store.
    ClientStore`): an entry ``{"algorithm": state, "optimizer": opt_state}`` a client."""

    def get(self, cid: int) -> dict[str, Any] | None: ...
    def put(self, cid: int, entry: dict[str, Any]) -> None: ...
    def __contains__(self, cid: object) -> bool: ...
    def close(self) -> None: ...


class LocalPrivacy(Protocol):
    """Client-level DP where it acts on the clients (:class:`~contrafl.engine.privacy.Privacy`)."""

    mode: str

    def privatize(self, reply: Reply, message: dict[str, Any], t: int) -> Reply: ...
    def check_local(self, reply: Reply, message: dict[str, Any]) -> str | None: ...


class Watcher(Protocol):
    """Told of a round's work as local steps finish (:class:`~contrafl.engine.progress.Progress`)."""

    def working(self, work: RoundWork) -> None: ...


class Context:
    """The engine's :class:`~contrafl.algorithms.base.ClientContext` of client ``cid`` in
    ``round``, served by ``sim`` (the :class:`~contrafl.execution.clients.LocalClients`
    that trains it)."""

    def __init__(self, sim: Any, cid: int, round: int) -> None:
        self._sim = sim
        self.cid = cid
        self.round = round
        self.num_samples = len(sim.rows[cid])
        self.label_counts = sim.label_counts[cid]
        self.net = sim.client_net
        self.smallest_batch = sim.smallest_batch

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
