"""Numbers in the words of printed messages."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n noun`` in the singular for one, else the plural (``noun + 's'`` unless given):
    ``count(1, "round")`` is ``1 round``, ``count(3, "local epoch")`` ``3 local epochs``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
