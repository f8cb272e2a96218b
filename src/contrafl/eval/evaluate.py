"""Test-set evaluation of global and personal models."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.nn import functional as F


@torch.no_grad()
def evaluate(
    net: Callable[..., object],
    state: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    transform: Callable[[torch.Tensor], torch.Tensor],
    batch_size: int,
) -> dict[str, float]:
    """Top-1 accuracy and mean cross-entropy of ``state`` (eval mode) on ``(x, y)``."""
    if len(y) == 0:
        return {"acc": float("nan"), "loss": float("nan"), "n": 0}
    correct = torch.zeros((), dtype=torch.long, device=y.device)
    loss = torch.zeros((), dtype=torch.float64, device=y.device)
    for i in range(0, len(y), batch_size):
        out = net(state, transform(x[i : i + batch_size]), train=False)
        target = y[i : i + batch_size]
        correct += (out.logits.argmax(1) == target).sum()
        loss += F.cross_entropy(out.logits.float(), target, reduction="sum").double()
    n = len(y)
    return {"acc": correct.item() / n, "loss": loss.item() / n, "n": n}
