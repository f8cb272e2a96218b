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
    ``CIFAR10`` and ``fedsiam-da`` find ``cifar10`` and ``fedsiam_da``. Items of installed
    packages (entry points of :attr:`group`, :mod:`contrafl.plugins`) join the built-ins
    on the first lookup or listing.
    """

    def __init__(self, kind: str, group: str | None = None, expects: type | None = None) -> None:
        """``group``: the entry-point group of plugins of this kind (:mod:`contrafl.plugins`),
        loaded on the first lookup or listing; ``expects``: the type (or base class) a
        plugin's object must have."""
        self.kind = kind
        self.group = group
        self.expects = expects
        self._items: dict[str, T] = {}
        self._folded: dict[str, str] = {}
        self._packages: dict[str, str] = {}
        self._loaded = group is None
        self._error: ConfigError | None = None

    def _load_plugins(self) -> None:
        """Register the plugins of :attr:`group`, once; a name clash raises at every lookup."""
        if self._error is not None:
            raise self._error
        if self._loaded:
            return
        self._loaded = True  # before loading: a plugin's module may look names up
        from . import plugins

        taken = {key: (name, self._items[name]) for key, name in self._folded.items()}
        try:
            found = plugins.load(self.kind, self.group, taken, self.expects)
        except ConfigError as exc:
            self._error = exc
            raise
        for plugin in found:
            if fold(plugin.name) in taken:  # a built-in that the package also declares
                continue
            if fold(plugin.name) not in self._folded:  # else registered by the plugin's own module
                self.add(plugin.name, plugin.item)
            self._packages[self._folded[fold(plugin.name)]] = plugin.package

    def package(self, name: str) -> str | None:
        """The package of the plugin registered as ``name``; None for a built-in."""
        self._load_plugins()
        return self._packages.get(self._folded.get(fold(name), name))

    def add(self, name: str, item: T) -> T:
        """Register ``item`` as ``name`` and return it; ValueError if the name (folded) is taken."""
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
        self._load_plugins()
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
        """The registered names, built-ins first, in registration order."""
        self._load_plugins()
        return list(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        """``(name, item)`` pairs of every registered item, built-ins first."""
        self._load_plugins()
        return iter(list(self._items.items()))

    def __contains__(self, name: object) -> bool:
        self._load_plugins()
        return isinstance(name, str) and fold(name) in self._folded
