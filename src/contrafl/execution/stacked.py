"""The network that a loss sees under the vectorized executor's ``vmap`` on a CPU.

Under ``vmap`` the loss is one client's, and its ``net(state, x)`` would run the model
through functorch's batching rules. :class:`StackedNet` instead leaves ``vmap`` for the
forward: it takes the physical tensors behind the batched ones (``[K, ...]``, all the
clients'), runs the model's stacked forward (:func:`contrafl.models.stacked.stacked_forward`:
grouped convolutions and batched matrix products, channels-last) and hands the outputs
back batched. Ordinary autograd records what it computed, so the executor takes the
gradient outside ``vmap``: ``d/dw_k sum_j loss_j = d loss_k / d w_k``, the clients'
losses being independent (:func:`stacked_grad_and_value`).

A forward whose tensors are not batched at the executor's level (a frozen model shared
by all clients, ``in_dims=None``) runs once on the clients' batches concatenated; a
forward inside a transform of the loss's own (Per-FedAvg's inner ``torch.func.grad``)
goes through ``vmap`` as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch._C._functorch as functorch
from torch.func import vmap
from torch.utils import _pytree as pytree

from ..models.base import ModelOutput
from ..models.stacked import StackedForward
from .plan import epoch_batch_sizes


class StackedNet:
    """``net(state, x, train=...)`` for a loss run under ``vmap`` (see the module's doc),
    made where the loss runs: it stacks the clients of the ``vmap`` level it is made at,
    whose batches hold samples of ``sample_dims`` dimensions. ``batched`` is the run's
    :class:`FunctionalNet` for calls that stay in ``vmap``, ``plain`` the same network
    outside any transform."""

    def __init__(self, forward: StackedForward, batched: Callable, plain: Callable, sample_dims: int) -> None:
        self.forward, self.batched, self.plain, self.sample_dims = forward, batched, plain, sample_dims
        self.level = functorch.maybe_current_level()

    def __call__(self, state: Mapping[str, torch.Tensor], x: torch.Tensor, *, train: bool) -> ModelOutput:
        if functorch.maybe_current_level() != self.level:
            return self.batched(state, x, train=train)
        inputs, x_dim = functorch._unwrap_batched(x, self.level)
        if x_dim is None or inputs.dim() != 2 + self.sample_dims:  # the same inputs for all, or not [K, B, sample]
            return self.batched(state, x, train=train)
        physical = {k: functorch._unwrap_batched(v, self.level) for k, v in state.items()}
        inputs = inputs.movedim(x_dim, 0)
        K, B = inputs.shape[:2]
        if all(d is None for _, d in physical.values()):  # one model for all: one forward of all the batches
            out = self.plain({k: v for k, (v, _) in physical.items()}, inputs.flatten(0, 1), train=train)
            return _batched(out, self.level, lambda t: t.unflatten(0, (K, B)))
        stacked = {k: v.expand(K, *v.shape) if d is None else v.movedim(d, 0) for k, (v, d) in physical.items()}
        return _batched(self.forward(stacked, inputs), self.level, lambda t: t)


def _batched(out: ModelOutput, level: int, shape: Callable[[torch.Tensor], torch.Tensor]) -> ModelOutput:
    """``out``'s tensors (``[K, B, ...]`` after ``shape``) batched over their first
    dimension at ``level``."""
    return pytree.tree_map(lambda t: functorch._add_batch_dim(shape(t), 0, level) if isinstance(t, torch.Tensor) else t, out)


def stacked_grad_and_value(loss: Callable[..., tuple[torch.Tensor, Any]], in_dims: tuple, make_net: Callable[[], StackedNet]) -> Callable:
    """What ``vmap(grad_and_value(loss, argnums=0, has_aux=True), in_dims)`` computes,
    with the forward of :class:`StackedNet`: ``fn(params, *rest) -> (grads, (values,
    aux))``. ``loss(params, *rest, net)`` takes the network last, ``make_net()`` under
    ``vmap``."""

    def per_client(*args: Any) -> tuple[torch.Tensor, Any]:
        return loss(*args, make_net())

    losses = vmap(per_client, in_dims=in_dims, randomness="different")

    def fn(params: Any, *rest: Any) -> tuple[Any, tuple[torch.Tensor, Any]]:
        leaves, spec = pytree.tree_flatten(params)
        leaves = [t.detach().requires_grad_(True) for t in leaves]
        with torch.enable_grad():
            values, aux = losses(pytree.tree_unflatten(leaves, spec), *rest)
            grads = torch.autograd.grad(values.sum(), leaves, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
        return pytree.tree_unflatten(grads, spec), (values.detach(), pytree.tree_map(_detached, aux))

    return fn


def _detached(v: Any) -> Any:
    return v.detach() if isinstance(v, torch.Tensor) else v


STACK_WIDTH = 8
"""The least :func:`stack_width` at which ``executor=auto`` (``rank_executor=auto``)
stacks clients on a CPU. Measured on 2 cores (docs/performance.md): pfl-research's device
shape (25 clients a rank of 50-51 images in batches of 10, width 24) took 22% less time
stacked, its silo shape (5 clients a rank of 144 to 809 images, batches of 64, width
2.5-2.9) 5-9% more; with fewer of the device shape's clients a round, stacking tied at
widths 4 and 6 and took 5-10% less time at 8."""


def stack_width(sizes: Sequence[int], per_stack: int, batch_size: int, epochs: int, drop_last: bool) -> float:
    """How many clients a stacked step trains on average when the clients of ``sizes``
    (their training samples), in their order, are stacked ``per_stack`` at a time, each
    taking ``epochs`` epochs of ``batch_size``: their steps over the steps the stacks run,
    a step running once for each batch size among the clients still training (a
    client's last batch of an epoch is short unless ``drop_last``)."""
    steps = runs = 0
    for start in range(0, len(sizes), max(per_stack, 1)):
        plans = [epoch_batch_sizes(n, batch_size, drop_last) * epochs for n in sizes[start : start + per_stack]]
        steps += sum(map(len, plans))
        runs += sum(len({p[s] for p in plans if s < len(p)}) for s in range(max(map(len, plans), default=0)))
    return steps / runs if runs else 0.0

