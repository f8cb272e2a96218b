"""Aggregation rules shared by server strategies, in plain tensor code."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Reply, StateDict


def sample_weights(replies: Sequence[Reply]) -> list[float]:
    """FedAvg weights ``n_k / sum_j n_j`` over the replying clients."""
    total = sum(r.num_samples for r in replies)
    if total == 0:
        return [1.0 / len(replies)] * len(replies)
    return [r.num_samples / total for r in replies]


def weighted_sum(tensors: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """``sum_k weights[k] * tensors[k]``, position by position over the clients' lists of
    tensors, accumulated in client order in each tensor's own dtype (one fused ``add_``
    per client)."""
    acc = torch._foreach_mul(list(tensors[0]), weights[0])
    for ts, w in zip(tensors[1:], weights[1:]):
        torch._foreach_add_(acc, list(ts), alpha=w)
    return acc


def weighted_average(states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
    """``sum_k weights[k] * states[k]`` for every entry of the state dicts.

    Floating-point entries are accumulated in client order in their own dtype (as MOON's
    reference code does); integer entries (BatchNorm's ``num_batches_tracked``) are
    averaged in float64 and truncated, as loading MOON's averaged state dict does.
    """
    floats = [key for key, first in states[0].items() if first.is_floating_point()]
    summed = dict(zip(floats, weighted_sum([[s[key] for key in floats] for s in states], weights))) if floats else {}
    return {
        key: summed[key] if key in summed
        else sum(float(w) * s[key].double() for s, w in zip(states, weights)).to(first.dtype)
        for key, first in states[0].items()
    }
