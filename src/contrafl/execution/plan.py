"""A client's local-training schedule, drawn before training starts.

The schedule fixes which samples form each batch and the random augmentation parameters
of every sample, from a generator keyed by (seed, round, client). Executors only consume
it, so the sequential and the vectorized executor see identical batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


Sampler = Callable[[int, torch.Generator], dict[str, torch.Tensor]]


@dataclass
class ClientPlan:
    """Local steps of one client.

    Attributes:
        order: int64 ``[total]`` dataset rows in the order they are used.
        sizes: batch size of every step (``sum(sizes) == total``).
        aug: one dict of augmentation parameters per view, each tensor ``[total, ...]``
            aligned with ``order``.
        epoch_ends: steps after which a local epoch is complete.
    """

    order: torch.Tensor
    sizes: list[int]
    aug: list[dict[str, torch.Tensor]]
    epoch_ends: frozenset[int]

    def __post_init__(self) -> None:
        self.offsets = [0, *itertools.accumulate(self.sizes)]

    @property
    def steps(self) -> int:
        return len(self.sizes)

    def batch(self, step: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """Rows and augmentation parameters of ``step``."""
        a, b = self.offsets[step], self.offsets[step + 1]
        return self.order[a:b], [{k: v[a:b] for k, v in view.items()} for view in self.aug]

    def head(self, steps: int) -> "ClientPlan":
        """The plan's first ``steps`` steps (a client cut short by a deadline): the same
        batches and augmentations as the whole plan's, then nothing."""
        end = self.offsets[steps]
        aug = [{k: v[:end] for k, v in view.items()} for view in self.aug]
        return ClientPlan(self.order[:end], self.sizes[:steps], aug, frozenset(e for e in self.epoch_ends if e < steps))

    def to(self, device: torch.device) -> "ClientPlan":
        if self.order.device == torch.device(device) and all(v.device == self.order.device for view in self.aug for v in view.values()):
            return self
        aug = [{k: v.to(device) for k, v in view.items()} for view in self.aug]
        return ClientPlan(self.order.to(device), self.sizes, aug, self.epoch_ends)


def epoch_batch_sizes(n: int, batch_size: int, drop_last: bool, smallest: int = 1) -> list[int]:
    """Sizes of the batches of one epoch over ``n`` samples; with ``drop_last`` (MOON's
    DataLoader setting) the last incomplete batch is dropped, without it kept when it
    has at least ``smallest`` samples (a model with BatchNorm trains no batch of one,
    :func:`~contrafl.models.base.smallest_batch`)."""
    full, rest = divmod(n, batch_size)
    return [batch_size] * full + ([] if drop_last or rest < max(smallest, 1) else [rest])


def make_plan(
    rows: np.ndarray,
    epochs: int,
    batch_size: int,
    drop_last: bool,
    sample_aug: Sampler | Sequence[Sampler],
    views: int,
    generator: torch.Generator,
    smallest: int = 1,
) -> ClientPlan:
    """Shuffle ``rows`` once per epoch and cut batches of ``batch_size``.

    With ``drop_last`` (MOON's DataLoader setting) the last incomplete batch of each epoch
    is dropped, so a client with fewer than ``batch_size`` samples takes no step; without
    it, the last batch is kept when it has at least ``smallest`` samples (its samples are
    left out of the epoch otherwise, as with ``drop_last``).
    ``sample_aug(n, generator)`` draws the augmentation parameters of ``n`` samples; a
    sequence holds one sampler per view pipeline, view ``v`` using ``sample_aug[v % len]``
    (:class:`~contrafl.data.augment.Views`).
    """
    rows_t = torch.as_tensor(np.asarray(rows), dtype=torch.long)
    n = len(rows_t)
    epoch_sizes = epoch_batch_sizes(n, batch_size, drop_last, smallest)
    used = sum(epoch_sizes)
    order, sizes, ends = [], [], []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator)[:used]
        order.append(rows_t[perm])
        sizes.extend(epoch_sizes)
        if epoch_sizes:
            ends.append(len(sizes) - 1)
    order_t = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    samplers = sample_aug if isinstance(sample_aug, Sequence) else [sample_aug]
    aug = [samplers[v % len(samplers)](len(order_t), generator) for v in range(views)]
    return ClientPlan(order_t, sizes, aug, frozenset(ends))
