"""The package's folders show its data flow, and no import runs back up it:

data -> models -> algorithms -> metrics -> execution -> engine -> experiments, flower -> cli

A module may import from its own layer and the layers before it, never from a later one
(the few modules outside the layers are the shared basics every layer may use), and no
module imports itself through others (no circle anywhere in the package). The executors
(execution/) sit below the round loop (engine/): a rank of the distributed executor
serves its clients without it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "src" / "contrafl"
LAYERS = ["data", "models", "algorithms", "metrics", "execution", "engine", ("experiments", "flower"), "cli"]
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


def module_of(path: Path) -> str:
    parts = ("contrafl", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if path.name == "__init__.py" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name imported from a package that is
    not a module of its own counts as the package)."""
    modules = {module_of(p) for p in sources()}
    graph = {}
    for path in sources():
        own, targets = module_of(path), set()
        for _, name in imports(path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != own:
                targets.add(name)
        graph[own] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_executor_imports_the_round_loop():
    """execution/ never imports engine/ (not even for type hints): the round loop drives
    the executors, and a distributed rank serves jobs without it."""
    for path in sorted((PACKAGE / "execution").glob("*.py")):
        assert not [name for _, name in imports(path) if name.startswith("contrafl.engine")], path.name
