"""A share of a round's replies as their sample-weighted mean: what a worker of the
distributed executor sends instead of each reply, when the server needs no more.

For an algorithm whose :meth:`~contrafl.algorithms.base.Algorithm.aggregate` needs only
the sample-weighted mean of the replies' payloads
(:meth:`~contrafl.algorithms.base.Algorithm.beyond_weighted_mean` is None, the property
secure aggregation rests on), a worker that trained clients ``S`` sends, for every
floating-point tensor of the payload, once::

    mean_S = sum_{k in S} (n_k / n_S) p_k        n_S = sum_{k in S} n_k

(equal weights when ``n_S = 0``, as :func:`~contrafl.algorithms.aggregation.sample_weights`),
and each reply without those tensors. The server rebuilds every reply with ``mean_S`` in
their place (:func:`restore`), as SecAgg+ hands it the mean: the sample-weighted mean over
all replies is then unchanged, ``sum_k (n_k / n) mean_S(k) = sum_S (n_S / n) mean_S``, up
to float rounding. Integer and bool tensors stay each client's own, and so does a
per-label table (FedCRL's, FedProto's ``reps`` and ``counts``), which the algorithm
weighs by its counts, not by ``n_k``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..algorithms.aggregation import sample_weights, weighted_sum
from ..algorithms.base import Reply
from .validate import is_label_table

IN_MEAN = "<in the share's mean>"
"""What stands in a summed reply for each floating-point tensor of its payload."""


def _is_float(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point()


def summed(replies: Sequence[Reply]) -> tuple[list[Reply], list[torch.Tensor]] | None:
    """``replies`` with each floating-point tensor of their payloads replaced by
    :data:`IN_MEAN`, and those tensors' sample-weighted mean (in payload order, each
    accumulated in its own dtype in the replies' order, as
    :func:`~contrafl.algorithms.aggregation.weighted_average`, by its
    :func:`~contrafl.algorithms.aggregation.weighted_sum`); None when the payloads
    differ in structure, shapes or dtypes, or have no floating-point tensor (or there
    are no replies): no mean to take."""
    if not replies:
        return None
    flat = [pytree.tree_flatten(r.payload, is_leaf=is_label_table) for r in replies]  # a label table stays the client's own
    # the tree structure and, per leaf, a floating-point tensor's shape and dtype: replies share a mean only where these agree
    layouts = [(spec, [(leaf.shape, leaf.dtype) if _is_float(leaf) else None for leaf in leaves]) for leaves, spec in flat]
    if not any(layouts[0][1]) or any(layout != layouts[0] for layout in layouts[1:]):
        return None
    weights = sample_weights(list(replies))
    floats = [[leaf for leaf in leaves if _is_float(leaf)] for leaves, _ in flat]
    mean = weighted_sum(floats, weights)
    bare = [
        dataclasses.replace(r, payload=pytree.tree_unflatten([IN_MEAN if _is_float(leaf) else leaf for leaf in leaves], spec))
        for r, (leaves, spec) in zip(replies, flat)
    ]
    return bare, mean


def restore(reply: Reply, mean: Sequence[torch.Tensor]) -> Reply:
    """``reply`` from :func:`summed` with its share's ``mean`` in place of each
    :data:`IN_MEAN`, in payload order."""
    it = iter(mean)
    payload = pytree.tree_map(lambda leaf: next(it) if isinstance(leaf, str) and leaf == IN_MEAN else leaf, reply.payload)
    return dataclasses.replace(reply, payload=payload)
