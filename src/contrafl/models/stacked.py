"""K models of one architecture in one forward pass: the stacked clients of a CPU.

:func:`stacked_forward` gives, for a :class:`FedModel` whose layers it knows, a function
``forward(state, x) -> ModelOutput`` where every tensor of ``state`` is ``[K, ...]``
(client ``k``'s parameters at index ``k``) and ``x`` is ``[K, B, ...]``; each output is
``[K, B, ...]``, client ``k``'s forward of ``x[k]`` under ``state[k]``:

- a convolution of the K clients is one grouped convolution (``groups = K``) over their
  images laid side by side along the channels, ``[B, K*C, H, W]`` in channels-last, the
  layout in which oneDNN's convolutions and PyTorch's pooling are fastest on a CPU;
- pooling and ReLU act on that whole stack at once;
- a fully connected layer is one batched matrix product, ``y_k = x_k W_k^T + b_k``
  (``baddbmm``).

Each client's values are its own forward's, up to the order of float sums. On MOON's CNN
(batch 10, 25 clients, one thread of an EPYC) a training step costs 1.34 ms a client,
against 1.8 ms for one client after another and 2.4 ms under ``torch.func.vmap``, whose
batching rules move the clients' dimension through copies and strided kernels
(docs/performance.md). An encoder is known by its type: :func:`register` adds one (a
plugin's too). Models with BatchNorm or dropout have no stacked forward (their batch
statistics and random masks are per client), nor has an encoder of an unknown type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from .base import FedModel, ModelOutput, smallest_batch
from .layers import max_pool2x2

State = Mapping[str, torch.Tensor]
"""Parameters by name, each ``[K, ...]``: client ``k``'s at index ``k``."""
StackedForward = Callable[[State, torch.Tensor], ModelOutput]
"""``(state, x [K, B, ...]) -> ModelOutput`` of ``[K, B, ...]`` tensors (:func:`stacked_forward`)."""
Encoder = Callable[[nn.Module, State, torch.Tensor], torch.Tensor]
"""``(encoder, state, x [K, B, ...]) -> [K, B, d]``: the stacked forward of one encoder
type, ``state`` keyed by the encoder's own parameter names."""

_ENCODERS: dict[type, tuple[Encoder, Callable[[nn.Module], bool]]] = {}


def register(kind: type, forward: Encoder, supports: Callable[[nn.Module], bool] = lambda m: True) -> None:
    """Make encoders of type ``kind`` stackable with ``forward``, for the modules for
    which ``supports(module)`` holds."""
    _ENCODERS[kind] = (forward, supports)


def stacked_forward(model: nn.Module) -> StackedForward | None:
    """The stacked forward of ``model`` (see the module's doc), or ``None`` when it has
    none: not a :class:`FedModel`, an encoder of an unregistered type, BatchNorm,
    dropout."""
    if not isinstance(model, FedModel) or smallest_batch(model) > 1 or model.dropout:
        return None
    entry = _ENCODERS.get(type(model.features))
    if entry is None or not entry[1](model.features):
        return None
    if model.predictor is not None and not all(isinstance(m, (nn.Linear, nn.ReLU)) for m in model.predictor):
        return None
    encode = entry[0]

    def forward(state: State, x: torch.Tensor) -> ModelOutput:
        h = encode(model.features, _within(state, "features."), x)
        z = h
        if model.projection_dim is not None:
            z = linear(F.relu(linear(h, state, "l1")), state, "l2")
        logits = linear(z, state, "l3") if model.l3 is not None else None
        p = None
        if model.predictor is not None:
            p = sequential(model.predictor, _within(state, "predictor."), z)
        extra = None
        if model.heads is not None:
            extra = {name: linear(z, state, f"heads.{name}") for name in model.heads}
        return ModelOutput(h, z, logits, p, extra)

    return forward


def _within(state: State, prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def linear(x: torch.Tensor, state: State, name: str) -> torch.Tensor:
    """``x_k W_k^T + b_k`` for every client ``k``: ``x [K, B, in]``, ``W [K, out, in]``."""
    weight, bias = state[f"{name}.weight"], state.get(f"{name}.bias")
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def images(x: torch.Tensor) -> torch.Tensor:
    """``x [K, B, C, H, W]`` as ``[B, K*C, H, W]`` in channels-last (one copy): client
    ``k``'s channels are ``k*C .. k*C + C - 1``."""
    K, B, C, H, W = x.shape
    return x.permute(1, 3, 4, 0, 2).reshape(B, H, W, K * C).permute(0, 3, 1, 2)


def conv(h: torch.Tensor, state: State, name: str, layer: nn.Conv2d, clients: int) -> torch.Tensor:
    """``layer`` of every client on ``h [B, K*C, H, W]`` (:func:`images`): one grouped
    convolution whose group ``k`` holds client ``k``'s weights."""
    weight, bias = state[f"{name}.weight"], state.get(f"{name}.bias")
    return F.conv2d(
        h, weight.reshape(-1, *weight.shape[2:]), None if bias is None else bias.reshape(-1),
        layer.stride, layer.padding, layer.dilation, layer.groups * clients,
    )


def flatten(h: torch.Tensor, clients: int) -> torch.Tensor:
    """``h [B, K*C, H, W]`` as ``[K, B, C*H*W]``, each client's features in ``(C, H, W)``
    order as ``flatten(1)`` gives them."""
    B = h.shape[0]
    return h.reshape(B, clients, -1).transpose(0, 1)


def sequential(layers: nn.Sequential, state: State, x: torch.Tensor) -> torch.Tensor:
    """A ``Sequential`` of ``Flatten``, ``Linear`` and ``ReLU`` layers on ``x [K, B, ...]``."""
    for name, layer in layers.named_children():
        if isinstance(layer, nn.Flatten):
            x = x.flatten(2)
        elif isinstance(layer, nn.Linear):
            x = linear(x, state, name)
        else:
            x = F.relu(x)
    return x


register(
    nn.Sequential,
    sequential,
    lambda m: all(isinstance(c, (nn.Flatten, nn.Linear, nn.ReLU)) for c in m.children())
    and all(c.start_dim == 1 and c.end_dim == -1 for c in m.children() if isinstance(c, nn.Flatten)),
)


def pool_relu(h: torch.Tensor) -> torch.Tensor:
    """``relu(max_pool2x2(h))``, the CNNs' block end."""
    return F.relu(max_pool2x2(h))
