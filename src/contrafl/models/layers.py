"""Layers shared by the backbones.

:func:`max_pool2x2` is ``F.max_pool2d(x, 2)`` made fast for the many small-batch CPU steps
of a federated simulation, and :func:`channels_last` the layout it is fastest in.

On the CPU, PyTorch's NCHW kernel of ``F.max_pool2d`` is slower than three
``torch.maximum`` over the strided sub-grids of the 2×2 windows with a hand-written
backward (autograd's backward of ``torch.maximum`` is slower still), and its
channels-last kernel, vectorised over channels, is faster than both. FedAvgCNN's first
pooling, batch 64, one thread, forward and backward: 10.8 ms (NCHW kernel), 8.0 ms
(hand-written), 2.9 ms (channels-last kernel). So :func:`max_pool2x2` takes PyTorch's
kernel for channels-last inputs and the hand-written one for the others, except for
channels-last forward passes without a gradient over fewer than 16 channels, where the
hand-written forward is the faster (see ``_VECTOR_CHANNELS``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["channels_last", "max_pool2x2"]


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[N, C, H, W]``) with channels-last strides, the same values; a view of
    ``x`` (no copy) when it already has them. Unlike ``x.contiguous(memory_format=torch.channels_last)``
    this also works under ``vmap``."""
    return x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


#: Below this many channels, PyTorch's channels-last kernel, vectorised over channels,
#: runs mostly scalar: its forward alone is slower than the hand-written one (MOON's CNN,
#: 6 channels at 28x28: 0.87 ms against 0.36 ms, batch 64, one thread), which is the
#: kernel for forward passes without a gradient (frozen models, evaluation). With a
#: gradient PyTorch's is still faster, its backward being far cheaper.
_VECTOR_CHANNELS = 16


def _is_channels_last(x: torch.Tensor) -> bool:
    """Whether ``x`` is a ``[N, C, H, W]`` batch laid out channels-last, with windows to
    pool (strides are readable under ``vmap``, ``is_contiguous(memory_format=...)`` is
    not)."""
    return x.dim() == 4 and x.shape[1] > 1 and x.stride(1) == 1 and min(x.shape[-2:]) >= 2


def _corner(x: torch.Tensor, row: int, col: int) -> torch.Tensor:
    """View of element ``(row, col)`` of every 2×2 window of ``x`` (odd trailing rows and
    columns are dropped, as by ``F.max_pool2d``)."""
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    return x[..., row:h:2, col:w:2]


def _corners(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-left, top-right, bottom-left and bottom-right elements ``a, b, c, d`` of
    every 2×2 window."""
    return _corner(x, 0, 0), _corner(x, 0, 1), _corner(x, 1, 0), _corner(x, 1, 1)


def _step(t: torch.Tensor) -> torch.Tensor:
    """Heaviside step ``1[t > 0]`` as a float tensor (float arithmetic is several times
    faster on CPU than a comparison producing a bool tensor)."""
    return torch.sign(t).relu_()


class _MaxPool2x2(torch.autograd.Function):
    """``y = max(max(a, b), max(c, d))`` with the gradient of ``F.max_pool2d``.

    The gradient goes to the first maximum of each window in row-major order (the rule
    of PyTorch's kernels, ties included). With ``s = 1[max(c, d) > max(a, b)]``,
    ``s_b = 1[b > a]`` and ``s_d = 1[d > c]``::

        dL/da = g (1 - s) (1 - s_b)    dL/db = g (1 - s) s_b
        dL/dc = g s (1 - s_d)          dL/dd = g s s_d

    The selectors are piecewise constant, so they are computed from detached tensors
    (their derivative is zero); this also keeps the backward differentiable in ``g``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b, c, d = _corners(x)
        top, bottom = torch.maximum(a, b), torch.maximum(c, d)
        return torch.maximum(top, bottom), top, bottom

    @staticmethod
    def setup_context(
        ctx: Any, inputs: tuple[torch.Tensor], output: tuple[torch.Tensor, ...]
    ) -> None:
        (x,) = inputs
        _, top, bottom = output
        ctx.mark_non_differentiable(top, bottom)
        ctx.save_for_backward(x, top, bottom)
        ctx.save_for_forward(x, top, bottom)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _top: Any, _bottom: Any) -> torch.Tensor:
        x, top, bottom = (t.detach() for t in ctx.saved_tensors)
        a, b, c, d = _corners(x)
        g_bottom = grad * _step(bottom - top)
        g_top = grad - g_bottom
        g_b = g_top * _step(b - a)
        g_d = g_bottom * _step(d - c)
        # Allocated from g_bottom so that, under vmap, it is batched whenever x or grad is.
        even = x.shape[-2] % 2 == 0 and x.shape[-1] % 2 == 0
        grad_x = g_bottom.new_empty(x.shape) if even else g_bottom.new_zeros(x.shape)
        # One fresh view per write: a view taken before an earlier in-place write would
        # carry stale autograd metadata when the backward itself is differentiated.
        _corner(grad_x, 0, 0).copy_(g_top - g_b)
        _corner(grad_x, 0, 1).copy_(g_b)
        _corner(grad_x, 1, 0).copy_(g_bottom - g_d)
        _corner(grad_x, 1, 1).copy_(g_d)
        return grad_x

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, top, bottom = (t.detach() for t in ctx.saved_tensors)
        a, b, c, d = _corners(x)
        a_t, b_t, c_t, d_t = _corners(x_t)
        top_t = torch.lerp(a_t, b_t, _step(b - a))
        bottom_t = torch.lerp(c_t, d_t, _step(d - c))
        return torch.lerp(top_t, bottom_t, _step(bottom - top)), None, None


def max_pool2x2(x: torch.Tensor) -> torch.Tensor:
    """2×2 max-pooling with stride 2 over the last two dimensions of ``[..., H, W]``.

    Equal to ``F.max_pool2d(x, 2)`` in values (output ``[..., H // 2, W // 2]``) and in
    gradients, including PyTorch's tie rule (the first maximum of a window in row-major
    order gets the gradient). Works under ``torch.func`` transforms (``grad``, ``vmap``,
    ``jvp``, ``functional_call``) and for any number of leading dimensions. A
    channels-last batch goes to ``F.max_pool2d``, but for a forward pass without a
    gradient over few channels; its result is channels-last too.
    """
    if _is_channels_last(x) and (x.shape[1] >= _VECTOR_CHANNELS or (torch.is_grad_enabled() and x.requires_grad)):
        return F.max_pool2d(x, 2)
    return _MaxPool2x2.apply(x)[0]
