"""contrafl messages and reply payloads as Flower ``RecordDict`` s, and back.

A message (server to client) or a reply payload (client to server) is a tree of dicts
with str or int keys, lists, tuples, torch tensors, and Python scalars (int, float, bool,
str) or None. :func:`encode` names every tensor by its path and writes the structure as
JSON; :func:`contrafl.flower.packed.record_of` packs the tensors into one Array and the
JSON beside them. :func:`decode` is its exact inverse: same keys (int and str kept
apart) in the same order, same containers, tensors bit-identical with the same dtype and
shape. Mappings come back as ``dict`` and subclasses of the scalar types (``np.float64``)
as the plain type. Nothing is unpickled: the packed bytes are ``.npy`` read with
``allow_pickle=False``, every array's dtype is a plain numeric one, and the structure is
JSON.

JSON nodes::

    {"dict": [[key, node], ...]}       # JSON keeps int key 3 apart from str key "3"
    {"list": [node, ...]}   {"tuple": [node, ...]}
    {"tensor": name, "dtype": "bfloat16"}
    {"value": scalar}                  # int, float (nan and inf included), bool, str, None

Array names are the path's keys joined by ``/`` (``model/features.0.weight``,
``class_reps/3``, ``stats/h``). In a str key ``%`` and ``/`` are written ``%25`` and
``%2F``, and a str key that reads as an integer has its first character escaped
(``"3"`` gives ``%33``), so every tree position has its own name. :func:`decode` reads
the names from the JSON and never parses them.

Tensors are moved to the CPU (detached, conjugation resolved, made contiguous). Dtypes
numpy has no type for (bfloat16, the float8 types, complex32) travel as the integer
dtype of the same width (``t.view(torch.int16)`` for bfloat16) and are viewed back to
the dtype the JSON names.

Communication accounting: :func:`record_bytes` counts what Flower counts
(``count_bytes()`` of each record: the packed Array's ``.npy`` bytes, i.e. the tensors'
data plus a header of 128 bytes, and its name; the JSON texts; the record names).
:func:`contrafl.engine.comm.payload_bytes` counts only the tensors' data,
``numel * element_size`` by kind, leaving out names, scalars and structure. So for a
payload ``p``, ``record_bytes(encode(p)) = sum(payload_bytes(p).values()) + 128 +
(names) + (JSON)``; neither is the exact wire size (Flower adds protobuf framing, chunks
large arrays and de-duplicates identical ones by content hash).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from . import require_flwr

require_flwr()
from flwr.app import MetricRecord, RecordDict  # noqa: E402

from .packed import named_arrays, record_of, records  # noqa: E402

_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INTEGER = re.compile(r"-?[0-9]+")
_SCALARS = (bool, int, float, str, type(None))


# -- trees ---------------------------------------------------------------------------------
def encode(tree: Mapping[str, Any]) -> RecordDict:
    """The RecordDict of a message or reply payload (see the module docstring)."""
    if not isinstance(tree, Mapping):
        raise ValueError(f"cannot encode a {type(tree).__name__}: expected a mapping")
    arrays: dict[str, np.ndarray] = {}
    structure = _encode_node(tree, None, arrays)
    return record_of(arrays, json.dumps(structure, separators=(",", ":")))


def decode(record: RecordDict, device: torch.device | str | None = None) -> dict[str, Any]:
    """The tree :func:`encode` made ``record`` from; tensors on ``device`` when given (else
    the CPU)."""
    arrays, structure = named_arrays(record), _structure(record)
    used: set[str] = set()
    try:
        tree = _decode_node(structure, arrays, device, used)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed contrafl tree in the RecordDict: {type(exc).__name__}: {exc}") from None
    unused = [name for name in arrays if name not in used]
    if unused:
        raise ValueError(f"array {unused[0]!r} of the RecordDict is not in its tree")
    return tree


def _encode_node(value: Any, path: str | None, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        name = path or ""
        arrays[name] = _to_array(value, name)
        return {"tensor": name, "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, Mapping):
        return {"dict": [[key, _encode_node(v, _join(path, _component(key, path)), arrays)] for key, v in value.items()]}
    if isinstance(value, (list, tuple)):
        nodes = [_encode_node(v, _join(path, str(i)), arrays) for i, v in enumerate(value)]
        return {"tuple" if isinstance(value, tuple) else "list": nodes}
    if isinstance(value, _SCALARS):
        return {"value": _plain(value)}
    raise ValueError(
        f"cannot encode {_where(path)} of type {type(value).__name__}: expected a tensor, dict, list, "
        "tuple, int, float, bool, str or None"
    )


def _decode_node(node: Any, arrays: dict[str, np.ndarray], device: Any, used: set[str]) -> Any:
    if "dict" in node:
        return {key: _decode_node(sub, arrays, device, used) for key, sub in node["dict"]}
    if "list" in node:
        return [_decode_node(sub, arrays, device, used) for sub in node["list"]]
    if "tuple" in node:
        return tuple(_decode_node(sub, arrays, device, used) for sub in node["tuple"])
    if "tensor" in node:
        used.add(node["tensor"])
        return _from_array(arrays, node["tensor"], node["dtype"], device)
    if "value" in node and isinstance(node["value"], _SCALARS):
        return node["value"]
    raise ValueError(f"malformed contrafl tree in the RecordDict: bad node {json.dumps(node)[:80]}")


def _structure(record: RecordDict) -> dict[str, Any]:
    """The parsed JSON structure of ``record``."""
    _, config = records(record)
    try:
        structure = json.loads(config["json"])
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed contrafl tree in the RecordDict: {exc}") from None
    if not isinstance(structure, dict) or "dict" not in structure:
        raise ValueError("malformed contrafl tree in the RecordDict: the root is not a mapping")
    return structure


def _to_array(t: torch.Tensor, name: str) -> np.ndarray:
    """``t`` on the CPU as a numpy array, through the same-width integer when numpy lacks its dtype."""
    if t.layout != torch.strided:
        raise ValueError(f"cannot encode {_where(name)}: {t.layout} tensors are not supported")
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    try:
        return t.numpy()
    except TypeError:  # bfloat16, float8, complex32
        return t.view(_SAME_WIDTH[t.element_size()]).numpy()


def _from_array(arrays: dict[str, np.ndarray], name: str, dtype_name: str, device: Any) -> torch.Tensor:
    if name not in arrays:
        raise ValueError(f"array {name!r} of the tree is missing from the RecordDict")
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"array {name!r} has unknown dtype {dtype_name!r}")
    t = torch.from_numpy(arrays[name])
    if t.dtype != dtype:
        if t.dtype != _SAME_WIDTH.get(dtype.itemsize):
            raise ValueError(f"array {name!r} holds {t.dtype}, which cannot carry the tree's {dtype}")
        t = t.view(dtype)
    return t if device is None else t.to(device)


def _component(key: Any, parent: str | None) -> str:
    """``key`` as one part of an array name (see the module docstring)."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise ValueError(f"cannot encode {_where(parent)}: key {key!r} is a {type(key).__name__}, expected str or int")
    if isinstance(key, int):
        return str(int(key))
    text = key.replace("%", "%25").replace("/", "%2F")
    return f"%{ord(text[0]):02X}{text[1:]}" if _INTEGER.fullmatch(text) else text


def _join(path: str | None, component: str) -> str:
    return component if path is None else f"{path}/{component}"


def _where(path: str | None) -> str:
    return "the tree" if path is None else f"'{path}'"


def _plain(value: bool | int | float | str | None) -> bool | int | float | str | None:
    """``value`` as its plain Python type (``np.float64`` is a float)."""
    for kind in _SCALARS[:-1]:
        if isinstance(value, kind):
            return kind(value)
    return None


# -- metrics -------------------------------------------------------------------------------
def encode_metrics(metrics: Mapping[str, Any]) -> MetricRecord:
    """A MetricRecord of scalar metrics: bools become ints; numpy scalars and 0-d torch
    tensors become Python ints or floats. Anything else (lists, dicts, tensors with
    dimensions, strings) is a ValueError naming the metric."""
    out: dict[str, int | float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"metric name {key!r} is a {type(key).__name__}, expected str")
        out[key] = _metric(key, value)
    return MetricRecord(out)


def decode_metrics(record: MetricRecord) -> dict[str, Any]:
    """The metrics of ``record`` as a plain dict (ints and floats), in order."""
    return dict(record.items())


def _metric(key: str, value: Any) -> int | float:
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        if value.ndim != 0:
            raise ValueError(f"metric {key!r} has shape {list(value.shape)}, expected a scalar")
        value = value.item()
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float):
        return float(value)
    raise ValueError(f"metric {key!r} is a {type(value).__name__}, expected an int, float or bool scalar")


# -- accounting ----------------------------------------------------------------------------
def record_bytes(record: RecordDict) -> int:
    """Bytes of ``record`` as Flower counts them (``count_bytes()`` of every record, plus
    the record names); see the module docstring for how it compares with
    :func:`contrafl.engine.comm.payload_bytes`."""
    return sum(len(name) + part.count_bytes() for name, part in record.items())
