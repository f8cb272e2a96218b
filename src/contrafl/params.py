"""Declarative, validated parameter sets.

Every configurable component (dataset, partition, model, algorithm) declares its options
as a frozen dataclass whose fields carry a constraint in their metadata::

    @dataclass(frozen=True)
    class Params:
        mu: float = param(1.0, Interval(0, None), "weight of the contrastive term")

:func:`build` turns a plain mapping (from YAML or ``key=value`` overrides) into such a
dataclass, converting strings, rejecting unknown keys with a did-you-mean hint and raising
a one-line :class:`~contrafl.errors.ConfigError` that names the value, what was expected
and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["Interval", "NoOptions", "OneOf", "param", "build", "describe", "fold", "suggest", "to_dict"]


@dataclass(frozen=True)
class Interval:
    """A numeric range; ``None`` bounds are open-ended."""

    low: float | None = None
    high: float | None = None
    closed: str = "both"  # "both", "left", "right", "neither"

    def __call__(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        left = self.closed in ("both", "left")
        right = self.closed in ("both", "right")
        if self.low is not None and (value < self.low or (value == self.low and not left)):
            return False
        if self.high is not None and (value > self.high or (value == self.high and not right)):
            return False
        return True

    def __str__(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>=' if self.closed in ('both', 'left') else '>'} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<=' if self.closed in ('both', 'right') else '<'} {self.high:g}")
        return " and ".join(parts) if parts else "any number"


@dataclass(frozen=True)
class OneOf:
    """A value from a fixed set of choices; strings match case-insensitively (see :func:`fold`)."""

    choices: tuple

    def __call__(self, value: Any) -> bool:
        return value in self.choices

    def canonical(self, value: Any) -> Any:
        """The choice that ``value`` names (``"SGD"`` -> ``"sgd"``), else ``value`` unchanged."""
        if isinstance(value, str):
            for choice in self.choices:
                if isinstance(choice, str) and fold(choice) == fold(value):
                    return choice
        return value

    def __str__(self) -> str:
        return "one of " + ", ".join(str(c) for c in self.choices)


@dataclass(frozen=True)
class NoOptions:
    """The options of a component that has none."""


def param(default: Any, check: Any = None, doc: str = "") -> Any:
    """A dataclass field with a constraint and a one-line description."""
    return dataclasses.field(default=default, metadata={"check": check, "doc": doc})


def fold(name: Any) -> str:
    """The form under which names match: lower case, ``-`` as ``_`` (``FedSiam-DA`` -> ``fedsiam_da``)."""
    return str(name).lower().replace("-", "_")


def _closeness(word: str, candidate: str) -> float:
    """How well ``word`` spells ``candidate`` (ratio >= 0.6) or one of its ``_``-separated words
    (ratio >= 0.8, for words of 3 characters or more); 0 when neither."""
    whole = difflib.SequenceMatcher(None, word, candidate).ratio()
    parts = [difflib.SequenceMatcher(None, word, part).ratio() for part in candidate.split("_")]
    part = max(parts) if len(word) >= 3 else 0.0
    return max(whole if whole >= 0.6 else 0.0, part if part >= 0.8 else 0.0)


def suggest(name: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'x'?)``, or an empty string when no candidate is close.

    Matching ignores case and reads ``-`` as ``_``. A candidate spelled the same way wins; else
    every candidate containing the typed word (3 characters or more) is listed (``fraction`` ->
    ``sample_fraction``, ``test_fraction``); else the candidates that spell it, or one of their
    words, best (``fracton`` -> the same two, ``rouns`` -> ``rounds``).
    """
    folded = {fold(c): str(c) for c in candidates}
    word = fold(name)
    if word in folded:
        close = [folded[word]]
    elif len(word) >= 3 and any(word in f for f in folded):
        close = sorted(c for f, c in folded.items() if word in f)
    else:
        scores = {c: _closeness(word, f) for f, c in folded.items()}
        best = max(scores.values(), default=0.0)
        close = sorted(c for c, score in scores.items() if score == best > 0)
    if not close:
        return ""
    quoted = [f"'{c}'" for c in close]
    listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return f" (did you mean {listed}?)"


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any) -> Any:
    """Convert ``value`` to the annotated type ``tp``; raise ValueError when impossible."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(" or ".join(errors))
    if origin in (tuple, list):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        if isinstance(value, str):
            value = [v for v in value.strip("[]() ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError("a list")
        return origin(_convert(v, item) if item is not Any else v for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(_type_name(bool))
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(_type_name(int))
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                raise ValueError(_type_name(int)) from None
            if f.is_integer():
                return int(f)
        raise ValueError(_type_name(int))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(_type_name(float))
        try:
            number = float(value)
        except (ValueError, OverflowError):
            raise ValueError(_type_name(float)) from None
        if not math.isfinite(number):
            raise ValueError("a finite number")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError(_type_name(str))
        return str(value)
    return value


def build(cls: type, values: Mapping[str, Any] | None, where: str) -> Any:
    """Validate ``values`` against the parameter dataclass ``cls``.

    ``where`` is the configuration prefix used in messages (``"algorithm"`` gives
    ``algorithm.mu=-1 is invalid ...``; ``""`` names top-level settings bare).
    """
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}

    def key(name: str) -> str:
        return f"{where}.{name}" if where else name

    hints = typing.get_type_hints(cls)
    unknown = [k for k in values if k not in fields]
    if unknown:
        known = ", ".join(sorted(fields)) or "none"
        raise ConfigError(
            f"unknown option {key(unknown[0])!r}{suggest(unknown[0], list(fields))}; "
            f"valid options{' of ' + where if where else ''} are: {known}"
        )
    kwargs = {}
    for name, value in values.items():
        f = fields[name]
        try:
            converted = _convert(value, hints[name])
        except ValueError as exc:
            raise ConfigError(
                f"{key(name)}={value!r} is invalid: expected {exc}; set it with {key(name)}=VALUE"
            ) from None
        check = f.metadata.get("check")
        if hasattr(check, "canonical"):  # OneOf, or a constraint with its own canonical form
            converted = check.canonical(converted)
        if check is not None and converted is not None and not check(converted):
            close = suggest(str(value), [str(c) for c in check.choices]) if isinstance(check, OneOf) else ""
            if hasattr(check, "why"):  # a constraint that can say what is wrong with the value
                close = f" ({check.why(converted)})"
            raise ConfigError(
                f"{key(name)}={value!r} is invalid: expected {check}{close}; set it with {key(name)}=VALUE"
            )
        kwargs[name] = converted
    return cls(**kwargs)


def describe(cls: type) -> list[tuple[str, Any, str]]:
    """``(name, default, doc)`` for each option, for ``contrafl list`` and ``--help``."""
    return [(f.name, f.default, f.metadata.get("doc", "")) for f in dataclasses.fields(cls)]


def to_dict(obj: Any) -> dict[str, Any]:
    """A parameter dataclass as a plain dict (tuples become lists, for YAML)."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out
