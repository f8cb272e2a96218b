"""``contrafl --version`` prints the version of pyproject.toml, and CHANGELOG.md has a
section for it (Keep a Changelog: an ``## [Unreleased]`` section, then one per release)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_option_prints_the_version_of_pyproject():
    done = subprocess.run([sys.executable, "-m", "contrafl", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"contrafl {VERSION}"


def test_changelog_has_an_unreleased_section_and_one_for_the_version():
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings[0] == "Unreleased", headings
    assert VERSION in headings, (VERSION, headings)
