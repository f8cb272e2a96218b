"""References to the user's own code: ``MODULE:NAME`` or ``path/to/file.py:NAME``.

``model=mypkg.nets:make_encoder`` names an attribute of an importable module,
``model=./nets.py:make_encoder`` one of a Python file (a relative path is read from the
current directory and recorded absolute, so that a run resumes from anywhere). A run's
fingerprint includes the SHA-256 of the file (:func:`source_digest`), so that a changed
file is another configuration. This module imports no torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError


@dataclass(frozen=True)
class Reference:
    """``module:attr``; ``module`` is a module name, or an absolute file path when ``is_file``."""

    module: str
    attr: str
    is_file: bool

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}"


def is_reference(name: object) -> bool:
    """Whether a component name refers to the user's code (it contains ``:``)."""
    return isinstance(name, str) and ":" in name


def parse(text: str, key: str = "model") -> Reference:
    """The reference written ``text`` (``key=text`` in messages); file paths made absolute."""
    module, _, attr = text.rpartition(":")
    module, attr = module.strip(), attr.strip()
    if not module or not attr.isidentifier():
        raise ConfigError(
            f"{key}={text} is invalid: expected MODULE:FACTORY or FILE.py:FACTORY with FACTORY the name of a function, "
            f"e.g. {key}=mypkg.nets:make_encoder or {key}=./nets.py:make_encoder"
        )
    is_file = module.endswith(".py") or "/" in module or os.sep in module
    if is_file:
        module = os.path.abspath(os.path.expanduser(module))
    return Reference(module, attr, is_file)


def source_file(ref: Reference) -> Path | None:
    """The file that defines ``ref``'s module (None when it cannot be found without
    importing it: not installed, or not a Python source file)."""
    if ref.is_file:
        return Path(ref.module)
    try:
        spec = importlib.util.find_spec(ref.module)
    except Exception:  # a parent package that fails to import, a malformed name
        return None
    origin = spec.origin if spec is not None and spec.has_location else None
    return Path(origin) if origin else None


def source_digest(ref: Reference) -> str:
    """SHA-256 of the file that defines ``ref``'s module, or ``missing`` when it cannot be read."""
    path = source_file(ref)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None else "missing"
    except OSError:
        return "missing"
