"""Test-set evaluation of global and personal models."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.nn import functional as F

from ..models.base import ModelOutput


@torch.no_grad()
def evaluate(
    net: Callable[..., ModelOutput],
    state: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    transform: Callable[[torch.Tensor], torch.Tensor],
    batch_size: int,
    scores: Callable[[ModelOutput], torch.Tensor] | None = None,
) -> dict[str, float | int | None]:
    """Top-1 accuracy and mean cross-entropy of ``state`` (eval mode) on ``(x, y)``:
    ``{"acc", "loss", "n"}``.

    The prediction is the argmax of ``scores(outputs)`` (default: the logits); the loss
    is the cross-entropy of the logits, and ``None`` when a score function replaces them
    (FedProto's distances to prototypes are no logits). Without samples both are ``None``.
    """
    if len(y) == 0:
        return {"acc": None, "loss": None, "n": 0}
    correct = torch.zeros((), dtype=torch.long, device=y.device)
    loss = torch.zeros((), dtype=torch.float64, device=y.device)
    for i in range(0, len(y), batch_size):
        out = net(state, transform(x[i : i + batch_size]), train=False)
        target = y[i : i + batch_size]
        predicted = (out.logits if scores is None else scores(out)).argmax(1)
        correct += (predicted == target).sum()
        if scores is None:
            loss += F.cross_entropy(out.logits.float(), target, reduction="sum").double()
    n = len(y)
    return {"acc": correct.item() / n, "loss": loss.item() / n if scores is None else None, "n": n}
