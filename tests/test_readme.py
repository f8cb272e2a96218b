"""The README's first screen says what contrafl does and how to start, and its links
lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

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
