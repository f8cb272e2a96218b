"""What the clients of a round give back, and how a server reaches clients elsewhere.

:class:`ClientOutcome` is one client's part of a round as the server sees it, whichever
process trained it (:class:`~contrafl.execution.clients.LocalClients` in this one, a
rank of the distributed executor, a Flower node); :class:`Transport` is the interface of
a runtime that trains and evaluates clients outside the server's process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from ..algorithms.base import Phase, Reply, StateDict, TrainResult


@dataclass
class ClientOutcome:
    """One client's part of a round as the server sees it: its reply with the training
    loss and the loss's parts (:func:`loss_parts`) summed over its steps and the number
    of steps, or ``reply=None`` and why (``lost``: the client never answered, e.g. its
    process died; ``rejected``: the client's update failed the checks of
    :func:`~contrafl.execution.validate.check_reply` where it was made, before a transport
    that hides single updates, such as secure aggregation, could carry it). ``time``:
    the simulated time its work took (``steps / speed``, :mod:`contrafl.speeds`);
    ``straggler``: how a client that missed the round's deadline was cut
    (:meth:`~contrafl.execution.clients.LocalClients.cut_at_deadline`); ``checked``: the reply passed
    :meth:`~contrafl.execution.clients.LocalClients.reply_problems` where it was made (a worker of the distributed
    executor, before it summed the replies), so the server does not check it again.
    From :meth:`~contrafl.execution.clients.LocalClients.train_locally` the loss and its parts are 0-dim tensors where
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


Scores = dict[str, Any]
"""A model's evaluation on a client's test data: ``acc``, ``loss`` (means) and ``n``
(:func:`contrafl.metrics.evaluate.evaluate`); with probes (:data:`Probe`), ``probes``:
each probe's ``{"acc", "n"}`` by name."""

Probe = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""What a client's model is evaluated on besides its test data, made from that data:
``(x, y) -> (x', y')``, the accuracy on which is the probe's measure (a backdoor's
success rate: the samples of other labels with the trigger, labelled with the target)."""


class Transport(Protocol):
    """How the server reaches clients that are not in its process, e.g. over a Flower
    grid (:class:`contrafl.flower.server.GridTransport`). Without one, a
    :class:`~contrafl.engine.simulation.Simulation` trains and evaluates its clients
    itself (:meth:`~contrafl.execution.clients.LocalClients.train_locally`,
    :meth:`~contrafl.execution.clients.LocalClients.evaluate_locally`)."""

    runtime: str
    """What runs the clients, named as the run's ``executor`` in ``summary.json``
    (``flower``); a transport without it keeps the configured executor's name."""

    sums: bool
    """Optional, False where missing: the replies are rebuilt from sums over the round's
    clients (secure aggregation): each carries the round's means and a share of its
    totals, its per-label counts the round's totals, which were checked where they were
    summed (:func:`~contrafl.execution.validate.count_problem` does not apply)."""

    def train(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], phases: list[Phase]
    ) -> Iterable[ClientOutcome]:
        """Round ``t``'s local training of clients ``cids`` on their messages: their
        outcomes, in any order. (A transport that sees its clients' local steps counts
        them in the simulation's :attr:`~contrafl.execution.clients.LocalClients.round_work`.)"""
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



def trained_model(result: TrainResult) -> StateDict:
    """The model a client trained: its ``model`` role (parameters and buffers,
    :func:`~contrafl.algorithms.base.model_state`; the parameters alone where the role
    has no buffers), or the union of the trained roles when none is called ``model`` (a
    model trained as disjoint parts, ``body`` and ``head``). It may be a partial state
    dict of the run's architecture."""
    roles = ["model"] if "model" in result.params else list(result.params)
    return {k: v for r in roles for k, v in {**result.params[r], **result.buffers.get(r, {})}.items()}
