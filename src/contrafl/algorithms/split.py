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

from .base import StateDict

HEAD_PREFIX = "l3."


def is_head(name: str) -> bool:
    """Whether the state-dict entry ``name`` belongs to the classifier head."""
    return name.startswith(HEAD_PREFIX)


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
