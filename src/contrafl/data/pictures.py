"""What the loaders of the user's images share (``dataset=folder``, ``dataset=huggingface``):
the check of ``dataset.size``, the side lengths it names, the errors Pillow raises for
unreadable data, and one decoded image as the ``uint8 [C, H, W]`` pixels of a sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)
"""What Pillow raises for unreadable data, depending on the decoder (UnidentifiedImageError
is an OSError)."""


@dataclass(frozen=True)
class Size:
    """Check of ``dataset.size``: one positive side ``N`` (``N x N``), or ``[H, W]``."""

    def __call__(self, value: Any) -> bool:
        sides = [value] if isinstance(value, int) else list(value)
        return len(sides) in (1, 2) and all(s >= 1 for s in sides)

    def __str__(self) -> str:
        return "a positive size N (N x N) or [H,W]"


def sides(size: int | list[int]) -> tuple[int, int]:
    """``(height, width)`` of a ``dataset.size`` that passed :class:`Size`."""
    values = [size] if isinstance(size, int) else list(size)
    return values[0], values[-1]


def pixels(img: Image.Image, height: int, width: int, mode: str) -> np.ndarray:
    """``img`` in Pillow ``mode`` (``RGB`` or ``L``), resized bilinearly to ``height x width``
    when it has another size (torchvision's ``Resize`` default), as ``uint8 [C, H, W]``."""
    img = img.convert(mode)
    if img.size != (width, height):
        img = img.resize((width, height), Image.Resampling.BILINEAR)
    array = np.asarray(img)
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
