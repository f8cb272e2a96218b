"""Components from installed packages: Python entry points.

A package adds algorithms, datasets, models, partitions or augmentations by declaring
entry points in the groups of :data:`GROUPS` (``[project.entry-points."contrafl.algorithms"]``
in its ``pyproject.toml``). Each entry point's object is the item to register (an
:class:`~contrafl.algorithms.base.Algorithm` subclass, a
:class:`~contrafl.data.registry.DatasetSpec`, a :class:`~contrafl.models.registry.ModelSpec`,
a :class:`~contrafl.data.partition.PartitionSpec`, an augmentation factory), registered
under the entry point's name. A :class:`~contrafl.registry.Registry` loads its group on
its first lookup or listing (docs/extending.md).

A plugin that fails to load is left out with a one-line warning on stderr; a plugin
whose name is taken (by a built-in or another plugin) is a :class:`ConfigError`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from .errors import ConfigError, one_line
from .params import fold

GROUPS = {
    "algorithm": "contrafl.algorithms",
    "dataset": "contrafl.datasets",
    "model": "contrafl.models",
    "partition": "contrafl.partitions",
    "augmentation": "contrafl.augmentations",
}
"""The entry-point group of each kind of component."""


@dataclass(frozen=True)
class Plugin:
    """An item loaded from an entry point: its name, the object and its package."""

    name: str
    item: Any
    package: str


def entry_points(group: str) -> list[metadata.EntryPoint]:
    """The installed entry points of ``group``."""
    return list(metadata.entry_points(group=group))


def package_of(ep: metadata.EntryPoint) -> str:
    """The name of the distribution that declares ``ep`` (``?`` when unknown)."""
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None and dist.metadata["Name"] else "?"


def problem(kind: str, name: str, item: Any, expects: type | None) -> str | None:
    """Why ``item`` cannot be registered as the ``kind`` ``name``, or None."""
    if expects is not None:
        fits = issubclass(item, expects) if isinstance(item, type) else isinstance(item, expects)
        if not fits:
            what = f"a subclass of {expects.__name__}" if isinstance(item, type) or kind == "algorithm" else f"a {expects.__name__}"
            return f"its object is {item!r}, expected {what}"
    own = getattr(item, "name", None)
    if isinstance(own, str) and fold(own) != fold(name):
        return f"the entry point is named '{name}' but its {kind} calls itself '{own}'; make the two names equal"
    return None


def load(kind: str, group: str, taken: Mapping[str, tuple[str, Any]], expects: type | None = None) -> list[Plugin]:
    """The plugins of ``group`` that load, in entry-point order. ``taken`` maps the folded
    names already registered (built-ins) to their spelling and item; a plugin that takes
    one of them (unless with that very item, registered by the plugin's own module), or
    the name of another plugin, raises a one-line :class:`ConfigError` naming both. A
    plugin that fails to import, or whose object does not fit, is left out with a
    one-line warning on stderr."""
    found: list[Plugin] = []
    owners: dict[str, Plugin] = {}
    for ep in entry_points(group):
        package = package_of(ep)
        try:
            item = ep.load()
        except Exception as exc:  # a broken plugin must not break the others
            _warn(f"plugin {kind} '{ep.name}' of package {package} failed to load ({one_line(exc)}); it is left out")
            continue
        why = problem(kind, ep.name, item, expects)
        if why is not None:
            _warn(f"plugin {kind} '{ep.name}' of package {package} is left out: {why}")
            continue
        key = fold(ep.name)
        if key in taken and taken[key][1] is not item:
            raise ConfigError(
                f"plugin {kind} '{ep.name}' of package {package} has the name of the built-in {kind} '{taken[key][0]}'; "
                f"rename the entry point in {package}'s pyproject.toml (group {group}) or uninstall {package}"
            )
        if key in owners:
            other = owners[key]
            raise ConfigError(
                f"plugin {kind} '{ep.name}' of package {package} has the name of {kind} '{other.name}' of package "
                f"{other.package}; rename one of the entry points (group {group}) or uninstall one of the packages"
            )
        owners[key] = Plugin(ep.name, item, package)
        found.append(owners[key])
    return found


def _warn(message: str) -> None:
    print(f"contrafl: warning: {message}", file=sys.stderr)
