"""A tree's named arrays packed into one Flower ``Array``, and back, without torch (the
ClientApp's secure aggregation reads and replaces some of them).

:func:`record_of` writes the named numpy arrays' bytes, one after the other and little
endian, into a single uint8 Array ``"packed"`` of the ArrayRecord ``"arrays"``, and a
ConfigRecord ``"tree"`` holding the tree's JSON ``"json"`` (:mod:`contrafl.flower.codec`),
the arrays' ``"layout"`` (JSON ``[[name, dtype, shape], ...]`` in the order of their
bytes) and the ``"format"`` number. :func:`named_arrays` is its inverse; a layout dtype is
a plain numeric numpy dtype (nothing is unpickled), and a layout that does not cover the
packed bytes exactly is refused.

One Array, not one per tensor: Flower pushes and pulls each Array of a message as an
object of its own, a request each; sending a model's 14 tensors as 14 Arrays cost a round
of three SuperNodes 1.6-2 s more on one machine than sending them packed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from . import require_flwr

require_flwr()
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict  # noqa: E402

ARRAYS = "arrays"
TREE = "tree"
PACKED = "packed"
FORMAT = 2
_CARRIERS = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32",
             "float64", "complex64", "complex128")


def record_of(arrays: Mapping[str, np.ndarray], structure: str) -> RecordDict:
    """The RecordDict of the named ``arrays`` (numeric numpy arrays) and the tree's JSON
    ``structure``: their bytes packed into one Array, with their layout."""
    layout, parts = [], []
    for name, array in arrays.items():
        if array.dtype.name not in _CARRIERS:
            raise ValueError(f"cannot encode array {name!r} of numpy dtype {array.dtype}: expected one of {', '.join(_CARRIERS)}")
        layout.append([name, array.dtype.name, list(array.shape)])
        parts.append(np.ascontiguousarray(array, array.dtype.newbyteorder("<")).reshape(-1).view(np.uint8))
    packed = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return RecordDict(
        {
            ARRAYS: ArrayRecord(array_dict={PACKED: Array(packed)}, keep_input=False),
            TREE: ConfigRecord({"format": FORMAT, "json": structure, "layout": json.dumps(layout, separators=(",", ":"))}),
        }
    )


def named_arrays(record: RecordDict) -> dict[str, np.ndarray]:
    """``{name: numpy array}`` of the tensors :func:`record_of` packed into ``record`` (in
    their carrier dtype: bfloat16 as int16), each a writable array of its own."""
    arrays, config = records(record)
    if list(arrays) != [PACKED]:
        raise ValueError(f"not a RecordDict made by contrafl.flower.codec.encode (arrays: {list(arrays)[:3]}, expected [{PACKED!r}])")
    packed = arrays[PACKED].numpy()
    if packed.dtype != np.uint8 or packed.ndim != 1:
        raise ValueError(f"the packed arrays are {packed.dtype} of shape {list(packed.shape)}, expected uint8 of one dimension")
    try:
        layout = json.loads(config["layout"])
        entries = [(str(name), str(dtype), [int(n) for n in shape]) for name, dtype, shape in layout]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed layout of the packed arrays: {type(exc).__name__}: {exc}") from None
    out: dict[str, np.ndarray] = {}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in _CARRIERS or min(shape, default=0) < 0 or name in out:
            raise ValueError(f"malformed layout of the packed arrays at array {name!r} (dtype {dtype!r}, shape {shape})")
        kind = np.dtype(dtype).newbyteorder("<")
        size = int(np.prod(shape, dtype=np.int64)) * kind.itemsize
        if offset + size > len(packed):
            raise ValueError(f"the packed arrays end at byte {len(packed)}, inside array {name!r} (bytes {offset} to {offset + size})")
        out[name] = packed[offset:offset + size].view(kind).astype(kind.newbyteorder("="), copy=True).reshape(shape)
        offset += size
    if offset != len(packed):
        raise ValueError(f"the packed arrays hold {len(packed) - offset} bytes after the last array of their layout")
    return out


def records(record: RecordDict) -> tuple[ArrayRecord, ConfigRecord]:
    """The ArrayRecord and the ConfigRecord of a RecordDict made by :func:`record_of`."""
    arrays, config = record.get(ARRAYS), record.get(TREE)
    if not isinstance(arrays, ArrayRecord) or not isinstance(config, ConfigRecord):
        raise ValueError(f"not a RecordDict made by contrafl.flower.codec.encode (records: {sorted(record)})")
    if config.get("format") != FORMAT:
        raise ValueError(f"contrafl tree format {config.get('format')!r}, expected {FORMAT}")
    return arrays, config
