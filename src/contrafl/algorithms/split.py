"""Body/head splits of the run's model, shared by the personalised algorithms.

Every model is ``features`` (→ projection head ``l1``, ``l2``) → classifier ``l3``
(:class:`~contrafl.models.base.FedModel`). Personalised FL splits it in two:

* the **head** ``psi``: the classifier ``l3`` (PFLlib's ``head``, FedCRL's projection
  layer psi);
* the **body** ``phi``: everything else (PFLlib's ``base``, FedCRL's representation
  layers phi), whose output is the representation ``z`` the classifier reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn import functional as F

from ..models.base import ModelOutput
from .base import Batch, Federation, LocalTask, Network, StateDict, TaskView

HEAD_PREFIX = "l3."


def is_head(name: str) -> bool:
    """Whether the state-dict entry ``name`` belongs to the classifier head."""
    return name.startswith(HEAD_PREFIX)


def head_logits(z: torch.Tensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The classifier head of ``state`` (``l3``: ``W z + b``) on representations ``z``;
    ``state`` may hold more than the head."""
    return F.linear(z, state[f"{HEAD_PREFIX}weight"], state.get(f"{HEAD_PREFIX}bias"))


def split_head(state: Mapping[str, torch.Tensor]) -> tuple[StateDict, StateDict]:
    """``(body, head)`` of a full state dict."""
    body = {k: v for k, v in state.items() if not is_head(k)}
    head = {k: v for k, v in state.items() if is_head(k)}
    return body, head


def mix(local: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor], alpha: float | torch.Tensor) -> StateDict:
    """``alpha * local + (1 - alpha) * other`` entry by entry (integer entries, such as
    BatchNorm's batch counter, are taken from ``local``)."""
    return {
        k: torch.lerp(other[k], v, alpha if isinstance(alpha, torch.Tensor) else float(alpha)) if v.is_floating_point() else v
        for k, v in local.items()
    }


def body_head_task(federation: Federation, body: Mapping[str, torch.Tensor], head: Mapping[str, torch.Tensor]) -> LocalTask:
    """A local task training the roles ``body`` and ``head`` (each a partial state dict,
    split into parameters and buffers)."""
    body_params, body_buffers = federation.split(body)
    head_params, head_buffers = federation.split(head)
    return LocalTask(
        params={"body": body_params, "head": head_params},
        buffers={"body": body_buffers, "head": head_buffers},
    )


def body_head_forward(task: TaskView, batch: Batch, net: Network) -> ModelOutput:
    """Train-mode forward of the model made of the ``body`` and ``head`` roles."""
    state = {**task.params["body"], **task.params["head"], **task.buffers["body"], **task.buffers["head"]}
    return net(state, batch.x, train=True)


def split_ce(task: TaskView, batch: Batch, net: Network) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``CE(h(phi(x)), y)`` of the model made of the ``body`` and ``head`` roles."""
    loss = F.cross_entropy(body_head_forward(task, batch, net).logits, batch.y)
    return loss, {"loss": loss.detach()}
