"""The package's folders show its data flow, and no import runs back up it:

data -> models -> algorithms -> metrics -> engine -> experiments, flower -> cli

A module may import from its own layer and the layers before it, never from a later one
(the few modules outside the layers are the shared basics every layer may use)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "src" / "contrafl"
LAYERS = ["data", "models", "algorithms", "metrics", "engine", ("experiments", "flower"), "cli"]
RANK = {name: rank for rank, layer in enumerate(LAYERS) for name in (layer if isinstance(layer, tuple) else (layer,))}
RANK["__main__"] = RANK["cli"]  # `python -m contrafl`


def layer_of(module: str) -> str | None:
    """The layer of ``contrafl.X...`` (None for the shared basics: config, params, errors, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path``, at any depth (imports inside
    functions count: they run too)."""
    module = ".".join(("contrafl", *path.relative_to(PACKAGE).with_suffix("").parts))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" for alias in node.names]
            found += [(node.lineno, name if layer_of(name) and not layer_of(target) else target) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("contrafl")]


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_layers_cover_the_package():
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(RANK) - {"cli", "__main__"}


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_back_up_the_data_flow(path):
    own = layer_of(".".join(("contrafl", *path.relative_to(PACKAGE).with_suffix("").parts)))
    if own is None:  # a shared basic: it imports no layer at all
        assert not [(line, name) for line, name in imports(path) if layer_of(name)], path
        return
    upward = [(line, name) for line, name in imports(path) if layer_of(name) and RANK[layer_of(name)] > RANK[own]]
    assert not upward, f"{path.relative_to(PACKAGE)} ({own}) imports a later layer: {upward}"
