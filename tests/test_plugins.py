"""Plugins: algorithms, datasets and models of an installed package (entry points).

``tests/plugin_example`` (the package of docs/extending.md) is installed with pip into a
temporary folder, never into the test environment, and the CLI runs in subprocesses
that have it on ``PYTHONPATH``. The loading rules (a broken plugin is a warning, a name
clash an error) are tested on a registry of its own with made-up entry points.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from contrafl import plugins
from contrafl.algorithms.base import Algorithm
from contrafl.algorithms.fedprox import FedProx
from contrafl.errors import ConfigError
from contrafl.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tests" / "plugin_example"
DOCS = ROOT / "docs" / "extending.md"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that sees contrafl-example installed (``pip install
    --target``, from a copy: a build leaves files next to its sources)."""
    tmp = tmp_path_factory.mktemp("plugin")
    shutil.copytree(EXAMPLE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(tmp / "site"), str(tmp / "src")],
        check=True, capture_output=True, text=True, timeout=300,
    )
    path = os.pathsep.join(filter(None, [str(tmp / "site"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "contrafl", *args], capture_output=True, text=True, env=env, timeout=300)


def test_list_shows_the_plugins_with_their_package(plugin_env):
    proc = cli(plugin_env, "list")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    for name in ("fedlc", "blobs", "resmlp"):
        (line,) = [line for line in lines if line.split()[:1] == [name]]
        assert line.endswith("(plugin: contrafl-example)")
    assert "      algorithm.tau=1.0  strength of the calibration (0: FedAvg)" in lines
    assert "      model.blocks=2  number of residual blocks" in lines
    assert not any("plugin" in line for line in lines if line.split()[:1] == ["fedavg"])


def test_run_with_the_plugin_algorithm_dataset_and_model(plugin_env, tmp_path):
    out = tmp_path / "run"
    proc = cli(
        plugin_env, "run", "--quiet", "--out", str(out), "algorithm=fedlc", "algorithm.tau=0.5", "dataset=blobs",
        "dataset.samples=300", "model=resmlp", "model.width=16", "rounds=2", "num_clients=3", "local_epochs=1",
        "executor=sequential",
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(0 <= r["test_acc"] <= 1 for r in rows)
    config = (out / "config.yaml").read_text()
    assert "name: fedlc\n  tau: 0.5" in config and "name: blobs" in config and "name: resmlp" in config


def test_docs_show_the_plugin_files_verbatim():
    """docs/extending.md includes every file of tests/plugin_example as it is."""
    text = DOCS.read_text()
    shown = dict(re.findall(r"<!-- file: (tests/plugin_example/[^ ]+) -->\n```\w*\n(.*?)```\n", text, re.S))
    files = {str(p.relative_to(ROOT)) for p in EXAMPLE.rglob("*") if p.is_file() and p.suffix in (".py", ".toml")}
    files.discard("tests/plugin_example/contrafl_example/__init__.py")  # a docstring, described in words
    assert files <= set(shown), f"not shown in docs/extending.md: {sorted(files - set(shown))}"
    for path, code in shown.items():
        assert (ROOT / path).read_text() == code, f"docs/extending.md shows another {path}; copy the file into the page"


# -- the loading rules, on a registry of their own --------------------------------------------


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Make :func:`contrafl.plugins.entry_points` return the given entry points, each
    of the package named after ``@`` in its value."""
    def install(*eps: tuple[str, str]) -> None:
        made = [(EntryPoint(name, value.partition("@")[0], "test.group"), value.partition("@")[2]) for name, value in eps]
        packages = {id(ep): package for ep, package in made}
        monkeypatch.setattr(plugins, "entry_points", lambda group: [ep for ep, _ in made] if group == "test.group" else [])
        monkeypatch.setattr(plugins, "package_of", lambda ep: packages.get(id(ep), "?"))

    return install


def registry() -> Registry:
    algorithms = Registry("algorithm", "test.group", Algorithm)
    algorithms.add("fedavg", object)
    return algorithms


def test_a_broken_plugin_is_a_warning_and_the_others_load(fake_entry_points, capsys):
    fake_entry_points(
        ("broken", "no_such_module_xyz:Thing@pkg-broken"),
        ("fedprox", "contrafl.algorithms.fedprox:FedProx@pkg-good"),
        ("wrong", "contrafl.algorithms.fedprox:proximal_term@pkg-wrong"),
        ("renamed", "contrafl.algorithms.fedprox:FedProx@pkg-renamed"),
    )
    algorithms = registry()
    assert algorithms.get("fedprox") is FedProx and algorithms.names() == ["fedavg", "fedprox"]
    assert algorithms.package("fedprox") == "pkg-good" and algorithms.package("fedavg") is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3
    assert err[0] == (
        "contrafl: warning: plugin algorithm 'broken' of package pkg-broken failed to load "
        "(ModuleNotFoundError: No module named 'no_such_module_xyz'); it is left out"
    )
    assert err[1].startswith("contrafl: warning: plugin algorithm 'wrong' of package pkg-wrong is left out: its object is <function proximal_term")
    assert err[1].endswith("expected a subclass of Algorithm")
    assert "'renamed' but its algorithm calls itself 'fedprox'; make the two names equal" in err[2]
    algorithms.names()
    assert capsys.readouterr().err == ""  # loaded once


def test_a_name_clash_is_an_error_naming_both(fake_entry_points):
    fake_entry_points(("FedAvg", "contrafl.algorithms.fedavg:FedAvg@pkg-a"))
    algorithms = registry()
    with pytest.raises(ConfigError) as exc:
        algorithms.get("fedavg")
    assert str(exc.value) == (
        "plugin algorithm 'FedAvg' of package pkg-a has the name of the built-in algorithm 'fedavg'; "
        "rename the entry point in pkg-a's pyproject.toml (group test.group) or uninstall pkg-a"
    )
    with pytest.raises(ConfigError):  # at every lookup, not only the first
        algorithms.names()


def test_two_plugins_of_one_name_are_an_error(fake_entry_points):
    fake_entry_points(
        ("fedprox", "contrafl.algorithms.fedprox:FedProx@pkg-a"),
        ("fedprox", "contrafl.algorithms.fedprox:FedProx@pkg-b"),
    )
    with pytest.raises(ConfigError, match="plugin algorithm 'fedprox' of package pkg-b has the name of algorithm 'fedprox' of package pkg-a"):
        registry().names()


def test_the_built_in_registries_read_their_groups():
    from contrafl.algorithms import ALGORITHMS
    from contrafl.data.augment import AUGMENTATIONS
    from contrafl.data.partition import PARTITIONS
    from contrafl.data.registry import DATASETS
    from contrafl.models import MODELS

    groups = {r.kind: r.group for r in (ALGORITHMS, DATASETS, MODELS, PARTITIONS, AUGMENTATIONS)}
    assert groups == plugins.GROUPS
