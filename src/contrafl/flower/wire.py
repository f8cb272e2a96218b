"""Flower ``RecordDict`` s as bytes, and frames on a stream socket, without torch: what a
ClientApp process and its SuperNode's worker (:mod:`contrafl.flower.worker`) send each
other.

:func:`pack` writes a JSON header (per record: its name and kind, and per entry its key
and either an array's ``dtype``, ``shape``, ``stype`` and byte count, or a config or
metric value) followed by the arrays' bytes; :func:`unpack` is its exact inverse (same
records, keys and order; arrays byte for byte; values as JSON keeps them, floats exactly,
``bytes`` in base64). Nothing is unpickled.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
from typing import Any

from . import require_flwr

require_flwr()
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402

_LENGTH = struct.Struct("!Q")
_VALUES = {"config": ConfigRecord, "metric": MetricRecord}


def _tag(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    return value


def _untag(value: Any) -> Any:
    if isinstance(value, dict):
        return base64.b64decode(value["bytes"])
    if isinstance(value, list):
        return [_untag(v) for v in value]
    return value


def pack(record: RecordDict) -> bytes:
    """``record`` as bytes (:func:`unpack` reads them back)."""
    header: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, rec in record.items():
        if isinstance(rec, ArrayRecord):
            entries = []
            for key, array in rec.items():
                entries.append([key, array.dtype, list(array.shape), array.stype, len(array.data)])
                blobs.append(array.data)
            header.append({"name": name, "kind": "array", "entries": entries})
        else:
            kind = "config" if isinstance(rec, ConfigRecord) else "metric"
            header.append({"name": name, "kind": kind, "entries": [[k, _tag(v)] for k, v in rec.items()]})
    head = json.dumps(header).encode()
    return _LENGTH.pack(len(head)) + head + b"".join(blobs)


def unpack(data: bytes) -> RecordDict:
    """The RecordDict :func:`pack` made ``data`` from."""
    (size,) = _LENGTH.unpack_from(data)
    offset = _LENGTH.size + size
    records: dict[str, Any] = {}
    for rec in json.loads(data[_LENGTH.size:offset]):
        if rec["kind"] == "array":
            arrays = {}
            for key, dtype, shape, stype, nbytes in rec["entries"]:
                arrays[key] = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data[offset:offset + nbytes])
                offset += nbytes
            records[rec["name"]] = ArrayRecord(array_dict=arrays)
        else:
            records[rec["name"]] = _VALUES[rec["kind"]]({k: _untag(v) for k, v in rec["entries"]})
    return RecordDict(records)


def send_frame(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` with its length first."""
    sock.sendall(_LENGTH.pack(len(data)))
    if data:
        sock.sendall(data)


def recv_frame(sock: socket.socket) -> bytes:
    """The next frame :func:`send_frame` sent; :class:`ConnectionError` when the other end
    closed the connection first."""
    (size,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, done = memoryview(buffer), 0
    while done < size:
        got = sock.recv_into(view[done:])
        if not got:
            raise ConnectionError("the connection closed in the middle of a frame")
        done += got
    return bytes(buffer)
