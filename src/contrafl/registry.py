"""Name → component registries with helpful errors for unknown names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .errors import ConfigError
from .params import fold, suggest

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to components of one kind (datasets, models, ...).

    Names are looked up case-insensitively, with ``-`` read as ``_`` (:func:`~contrafl.params.fold`):
    ``CIFAR10`` and ``fedsiam-da`` find ``cifar10`` and ``fedsiam_da``.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._folded: dict[str, str] = {}

    def add(self, name: str, item: T) -> T:
        if fold(name) in self._folded:
            raise ValueError(f"{self.kind} '{name}' is registered twice (as '{self._folded[fold(name)]}')")
        self._items[name] = item
        self._folded[fold(name)] = name
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""
        return lambda item: self.add(name, item)

    def canonical(self, name: str) -> str:
        """The registered spelling of ``name``; ConfigError with a suggestion if unknown."""
        try:
            return self._folded[fold(name)]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} {str(name)!r}{suggest(str(name), list(self._items))}; "
                f"expected one of: {', '.join(self._items)} (see `contrafl list`)"
            ) from None

    def get(self, name: str) -> T:
        """The item registered as ``name`` (matched as in :meth:`canonical`)."""
        return self._items[self.canonical(name)]

    def names(self) -> list[str]:
        return list(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(self._items.items())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and fold(name) in self._folded
