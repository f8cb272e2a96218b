"""The README's first screen says what contrafl does and how to start, and its links
lead somewhere."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_first_screen_names_every_family_the_install_and_a_first_command():
    first = "\n".join(README.splitlines()[:40])
    for system in ("MOON", "FedSSC", "FedSiam-DA", "FedCRL", "FedU2"):
        assert system in first, system
    assert 'pip install torch==2.13.0 -e ".[' in first and "\ncontrafl " in first
    for family in ("#quick-start", "#personalised-fl-in-pfllibs-protocol", "#federated-self-supervised-learning"):
        assert f"]({family})" in first, family


def test_every_link_within_the_readme_and_to_docs_resolves():
    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", README, flags=re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith("http"):
            continue
        path, _, fragment = target.partition("#")
        if path:
            assert (ROOT / path).exists(), target
            if fragment and path.endswith(".md"):
                assert fragment in {anchor(h) for h in re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), flags=re.M)}, target
        else:
            assert fragment in anchors, target


SPAWNED = (  # the distributed executor's workers spawned, as on macOS and Windows
    "import contrafl.execution.distributed as distributed, contrafl.engine.setup as setup\n"
    "distributed.can_fork = setup.can_fork = lambda: False\n"
)


def python_api_example() -> str:
    return README.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_python_api_example_runs_where_workers_are_spawned(tmp_path):
    """The README's Python API example as a script, where the distributed executor
    spawns its workers (macOS, Windows; forced here): it prints the final accuracy, and
    its main-module guard keeps each spawned worker, which imports the script again,
    from starting a run of its own. Without the guard the script ends at once with an
    error that names it, instead of waiting for a worker that never joins."""
    script = tmp_path / "example.py"
    script.write_text(SPAWNED + python_api_example())
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert 0 <= float(done.stdout.split()[-1]) <= 1 and "bootstrapping phase" not in done.stderr

    lines = python_api_example().splitlines()
    guard = next(i for i, line in enumerate(lines) if line.startswith("if __name__"))
    script.write_text(SPAWNED + "\n".join(lines[:guard] + [line.removeprefix("    ") for line in lines[guard + 1 :]]))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert 'worker 1 ended (exit code 1) before it joined the run' in done.stderr
    assert 'under `if __name__ == "__main__":`' in done.stderr.splitlines()[-1]


def test_the_byzantine_section_commands_run_as_written(tmp_path):
    """The README's "Byzantine clients" commands, each as written with two rounds and a run
    directory added: every `contrafl run` line completes, and the backdoor run's metrics
    hold what the section says a run records."""
    from contrafl.cli import main

    section = README[README.index("## Byzantine clients"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    lines = [line.split()[1:] for line in block.strip().splitlines()]
    assert lines and all(line[0] in ("run", "list") for line in lines)
    for i, args in enumerate(lines):
        extra = ["rounds=2", "--out", str(tmp_path / str(i)), "--quiet"] if args[0] == "run" else []
        assert main([*args, *extra]) == 0, args
    backdoor = [json.loads(x) for x in (tmp_path / "1" / "metrics.jsonl").read_text().splitlines()][-1]
    assert 0 <= backdoor["personal_backdoor_success"] <= 1 and "backdoor_success" in backdoor and "aggregator" in backdoor
