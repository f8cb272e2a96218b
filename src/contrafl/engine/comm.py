"""Communication accounting: bytes of the messages exchanged, by payload kind."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def tensor_bytes(obj: Any) -> int:
    """Bytes of all tensors in a nested structure of dicts, lists and tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def payload_bytes(payload: Mapping[str, Any]) -> dict[str, int]:
    """``{kind: bytes}`` of a message or reply payload."""
    return {kind: tensor_bytes(value) for kind, value in payload.items()}


def add_bytes(total: dict[str, int], part: Mapping[str, int], times: int = 1) -> None:
    for kind, n in part.items():
        total[kind] = total.get(kind, 0) + n * times
