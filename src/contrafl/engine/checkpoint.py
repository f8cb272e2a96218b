"""Durable, safe files for checkpoints and client states.

:func:`save_atomic` writes through a temporary file in the same directory, ``fsync`` s it
and renames it over the target, so a reader (or a run resumed after ``kill -9``) sees
either the previous file or the new one, never a torn one. :func:`load_safe` reads with
``torch.load(weights_only=True)``: only tensors and plain containers (dict, list, tuple,
numbers, strings) are rebuilt, so a crafted file cannot execute code on loading; any
problem with the file is one :class:`~contrafl.errors.CheckpointError` line. The
metrics rows travel as one pickle of plain values (:func:`pack_history`), read by an
unpickler that rebuilds no class and calls no function (:func:`history_rows`).
:func:`check_checkpoint`, :func:`client_files` and :func:`check_client_state` check
what a loaded file holds before anything uses it: a malformed or edited checkpoint is one
such line too, and never makes a run read, change or remove files outside its own
``client-state/``.
"""

from __future__ import annotations

import io
import math
import pickle
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import Config, differences, fingerprint
from ..errors import CheckpointError
from ..files import write_atomic
from .run_dir import to_json

CHECKPOINT_FORMAT = 2
"""Version of the checkpoint's layout: 2 since its ``history`` is :func:`pack_history`'s
bytes. A checkpoint of format 1 (the rows themselves) is read too; any other is refused."""

READ_FORMATS = (1, CHECKPOINT_FORMAT)
"""The formats a run resumes from."""

CHECKPOINT_KEYS = (
    "format", "round", "fingerprint", "config", "server", "server_optimizer", "clients", "history", "comm_total",
    "wall_time_s",
)
"""The entries of every checkpoint (:meth:`~contrafl.engine.simulation.Simulation.save_checkpoint`;
the optional ``privacy`` is checked where it is restored, by ``Privacy.load_state_dict``; the
optional ``extensions``, of a run extended to more rounds, and ``placement``, of the
distributed executor's clients on its ranks, by :func:`check_checkpoint`)."""

FOREIGN = "the checkpoint was not written by contrafl or was edited: start the run again in a new directory"
"""The end of every message about a checkpoint whose content is not what contrafl writes."""

_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module \S+ is blocked)")
"""torch's refusal of a pickle that names a Python object other than a tensor or plain container."""


def pack_history(rows: list[dict[str, Any]]) -> bytes:
    """The metrics rows of the rounds done as one pickle: ``torch.save`` pickles nested
    containers object by object through Python (1,000 rows of 100 clients' accuracies:
    102 ms, against 6 ms for these bytes), and a checkpoint is written every round."""
    return pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)


class _PlainValues(pickle.Unpickler):
    """An unpickler of plain values only (dicts, lists, tuples, strings, numbers, None):
    it finds no class or function, so a crafted pickle can build nothing else and run
    nothing (the pickle module's "restricting globals")."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def history_rows(obj: Mapping[str, Any]) -> Any:
    """The metrics rows of the checkpoint ``obj``: :func:`pack_history`'s bytes read by
    :class:`_PlainValues` (format 2), or the rows a checkpoint of format 1 holds. A value
    that is not such bytes comes back as it is, for :func:`check_checkpoint` to refuse;
    bytes that are not a pickle of plain values are a :class:`pickle.UnpicklingError`."""
    history = obj.get("history")
    if obj.get("format") == 1 or not isinstance(history, bytes):
        return history
    try:
        return _PlainValues(io.BytesIO(history)).load()
    except Exception as exc:  # any failure of a crafted or torn pickle
        raise pickle.UnpicklingError(str(exc) or type(exc).__name__) from None


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` that survives a crash at any point."""
    write_atomic(path, lambda f: torch.save(obj, f))


def load_safe(path: Path, what: str, map_location: Any = None) -> Any:
    """Load a file written by :func:`save_atomic` without executing code from it. A file
    that names a Python object other than tensors and plain containers (torch's
    "unsupported GLOBAL" refusal) is refused as unsafe; any other failure (an empty,
    truncated or foreign file) means it is not a contrafl checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist; resume from a run directory that has a checkpoint")
    try:
        with warnings.catch_warnings():  # torch's warning about a foreign pickle protocol: the error says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # pickle, zip and torch errors of a bad file
        refused = _REFUSED_GLOBAL.search(str(exc))
        if refused:
            raise CheckpointError(
                f"{what} {path} cannot be loaded: it names the Python object {refused[1]}, which contrafl never writes "
                f"(refused: loading could run code); {FOREIGN}"
            ) from None
        raise CheckpointError(
            f"{what} {path} cannot be loaded ({_failure(exc, path)}): it is not a contrafl checkpoint "
            "(corrupted, truncated or not written by contrafl); start the run again in a new directory"
        ) from None


def _failure(exc: Exception, path: Path) -> str:
    """Why torch could not read ``path``, in a few words: the error's type and the first
    sentence of its reason (the unpickler's own, without torch's advice around it)."""
    if path.stat().st_size == 0:
        return "the file is empty"
    text = str(exc)
    inner = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    reason = (inner[1] if inner else text.strip().split("\n")[0]).split(". ")[0].strip()
    return f"{type(exc).__name__}: {reason[:120]}" if reason else type(exc).__name__


def _describe(value: Any) -> str:
    """A value in a few words, for a message: a tensor's dtype and shape, a container's
    kind and size, the repr of anything else (shortened)."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    if isinstance(value, dict):
        return f"a dict with keys {_short(list(value))}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    return _short(value)


def _short(value: Any) -> str:
    """The repr of ``value``, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_whole(value: Any) -> bool:
    """Whether ``value`` is a whole number (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def client_files(manifest: Any, where: str, num_clients: int | None = None) -> dict[int, str]:
    """``{cid: file name}`` of a client-state manifest (``{"files": {cid: name},
    "serial": n}``, :meth:`~contrafl.engine.client_store.ClientStore.checkpoint`), whose
    rule is checked: every cid is a whole number (or its decimal string), below
    ``num_clients`` when given, and every name the plain file name ``client-<cid>-<k>.pt``
    of its own client with ``k`` in ``1..n``. So a crafted manifest never makes a store
    read, keep or remove a file outside its directory, or another client's file.
    ``where`` says whose manifest it is in the :class:`CheckpointError` of a violation."""
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)
            and is_whole(manifest.get("serial")) and manifest["serial"] >= 0):
        raise CheckpointError(
            f"{where}: clients is {_describe(manifest)}, expected "
            f"{{'files': {{client id: file name}}, 'serial': a whole number >= 0}}; {FOREIGN}"
        )
    serial = manifest["serial"]
    ids = "a client id >= 0" if num_clients is None else f"a client id in 0..{num_clients - 1}"
    files: dict[int, str] = {}
    for key, name in manifest["files"].items():
        digits = isinstance(key, str) and re.fullmatch(r"0|[1-9][0-9]*", key)
        cid = key if is_whole(key) else int(key) if digits else None
        if cid is None or cid < 0 or (num_clients is not None and cid >= num_clients) or cid in files:
            raise CheckpointError(f"{where}: clients.files has the key {_short(key)}, expected {ids} (each once); {FOREIGN}")
        number = re.fullmatch(rf"client-{cid}-([1-9][0-9]*)\.pt", name) if isinstance(name, str) else None
        if number is None or int(number[1]) > serial:
            raise CheckpointError(
                f"{where}: clients.files names {_short(name)} for client {cid}, expected a file name "
                f"client-{cid}-<k>.pt with k in 1..{serial}; {FOREIGN}"
            )
        files[cid] = name
    return files


def check_client_state(obj: Any, path: Path, cid: int) -> None:
    """Refuse ``obj``, client ``cid``'s state read from ``path``, unless it is a client's
    entry of a simulation's store (:meth:`~contrafl.engine.simulation.Simulation.client_job`):
    a dict of the algorithm's state (a dict) and the persisted optimiser state (a list,
    or None)."""
    if not (isinstance(obj, dict) and isinstance(obj.get("algorithm"), dict)
            and "optimizer" in obj and (obj["optimizer"] is None or isinstance(obj["optimizer"], list))):
        raise CheckpointError(
            f"client {cid}'s state {path} is {_describe(obj)}, expected a dict of 'algorithm' (a dict) "
            f"and 'optimizer' (a list or None); {FOREIGN}"
        )


def check_checkpoint(obj: Any, path: Path, cfg: Config, model: Mapping[str, torch.Tensor]) -> None:
    """Refuse ``obj``, the checkpoint read from ``path``, unless a run of ``cfg`` whose
    freshly initialised server model is ``model`` can continue from it: a dict of
    :data:`CHECKPOINT_KEYS` in :data:`CHECKPOINT_FORMAT` with ``cfg``'s fingerprint, or
    that of ``cfg`` with fewer rounds (:func:`extended_from`; checked before everything
    that depends on the configuration), a round in ``0..cfg.rounds`` and one history
    row per round (a dict of JSON values with its round), a server model with exactly
    the names, shapes and dtypes of ``model``, a server-optimiser velocity of some of
    them, client states of clients ``0..cfg.num_clients - 1`` (:func:`client_files`),
    communication totals in bytes, a wall time, a robust aggregator's state (optional), the run's extensions to
    more rounds (optional) and the ranks that keep clients' states (optional). The first violation is one :class:`CheckpointError` line naming the
    entry, its value and what was expected."""

    def bad(entry: str, value: Any, expected: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {entry} is {_describe(value)}, expected {expected}; {FOREIGN}")

    if not isinstance(obj, dict):
        raise bad("the file's content", obj, f"a dict of {', '.join(CHECKPOINT_KEYS)}")
    if "format" in obj and obj["format"] not in READ_FORMATS:
        raise CheckpointError(
            f"checkpoint {path} has format {_short(obj['format'])}, not {' or '.join(map(str, READ_FORMATS))}: it was written "
            "by another contrafl version; resume it with that version, or start the run again in a new directory"
        )
    missing = [key for key in CHECKPOINT_KEYS if key not in obj]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} has no {missing[0]!r} entry, expected {', '.join(CHECKPOINT_KEYS)}; {FOREIGN}"
        )
    if not isinstance(obj["fingerprint"], str):
        raise bad("fingerprint", obj["fingerprint"], "the configuration's hash, a string")
    if not (isinstance(obj["config"], dict) and all(isinstance(key, str) for key in obj["config"])):
        raise bad("config", obj["config"], "the run's configuration, a dict of settings")
    if obj["fingerprint"] != fingerprint(cfg) and extended_from(obj, cfg) is None:
        changed = differences(obj["config"], cfg.to_dict())
        before = obj["config"].get("rounds")
        if is_whole(before) and cfg.rounds is not None and before < cfg.rounds:  # more rounds alone is an extension
            changed = [c for c in changed if not c.startswith("rounds:")]
        raise CheckpointError(
            "the checkpoint belongs to another configuration"
            + (f" ({'; '.join(changed[:3])})" if changed else "")
            + "; resume with the run directory's own config.yaml"
        )
    rounds = obj["round"]
    if not (is_whole(rounds) and 0 <= rounds <= cfg.rounds):
        raise bad("round", rounds, f"the rounds done, a whole number in 0..{cfg.rounds}")
    if obj["format"] != 1 and not isinstance(obj["history"], bytes):
        raise bad("history", obj["history"], "the metrics rows of the rounds done, pickled (bytes)")
    try:
        history = history_rows(obj)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"checkpoint {path}: history is not a pickle of plain values ({exc}); {FOREIGN}") from None
    if not (isinstance(history, list) and len(history) == rounds):
        raise bad("history", history, f"a list of {rounds} rows, one per round done")
    for i, row in enumerate(history, 1):
        if not (isinstance(row, dict) and row.get("round") == i and _json(row)):
            raise bad(f"history row {i}", row, f"a metrics row (a dict of JSON values) with round {i}")
    server = obj["server"]
    if not (isinstance(server, dict) and isinstance(server.get("model"), dict) and isinstance(server.get("extras"), dict)):
        raise bad("server", server, "a dict of 'model' (a dict of tensors) and 'extras' (a dict)")
    _check_tensors(server["model"], model, "server.model", bad)
    missing = [name for name in model if name not in server["model"]]
    if missing:
        raise CheckpointError(
            f"checkpoint {path}: server.model has no {missing[0]!r}, expected every tensor of the run's model "
            f"({_describe(model[missing[0]])} there); {FOREIGN}"
        )
    velocity = obj["server_optimizer"].get("velocity") if isinstance(obj["server_optimizer"], dict) else None
    if not isinstance(velocity, dict):
        raise bad("server_optimizer", obj["server_optimizer"], "a dict of 'velocity' (a dict of tensors)")
    _check_tensors(velocity, model, "server_optimizer.velocity", bad)
    client_files(obj["clients"], f"checkpoint {path}", cfg.num_clients)
    comm = obj["comm_total"]
    if not (isinstance(comm, dict) and all(
        isinstance(comm.get(way), dict) and all(isinstance(k, str) and is_whole(n) and n >= 0 for k, n in comm[way].items())
        for way in ("down", "up")
    )):
        raise bad("comm_total", comm, "{'down': {kind: bytes}, 'up': {kind: bytes}}")
    wall = obj["wall_time_s"]
    if not (isinstance(wall, (int, float)) and not isinstance(wall, bool) and math.isfinite(wall) and wall >= 0):
        raise bad("wall_time_s", wall, "the seconds the run took, a number >= 0")
    _check_extensions(obj.get("extensions", []), obj["config"].get("rounds"), bad)
    centers = obj.get("aggregator", {})
    if not (isinstance(centers, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() == 1 and v.is_floating_point() and bool(torch.isfinite(v).all())
        for k, v in centers.items()
    )):
        raise bad("aggregator", centers, "a dict of name -> finite 1-D float tensor (centered clipping's previous aggregates)")
    placement = obj.get("placement", {})
    if not (isinstance(placement, dict) and all(
        is_whole(cid) and 0 <= cid < cfg.num_clients and is_whole(rank) and rank >= 1 for cid, rank in placement.items()
    )):
        raise bad("placement", placement, f"a dict of client (0..{cfg.num_clients - 1}) -> the rank above 0 that keeps its state")


def extended_from(obj: dict[str, Any], cfg: Config) -> int | None:
    """The rounds of the run whose checkpoint is ``obj`` when ``cfg`` is that run's
    configuration with more rounds (the run extended: ``contrafl run --resume RUN
    rounds=N``), else None. Every other change of a fingerprinted setting is another
    configuration."""
    before = obj["config"].get("rounds") if isinstance(obj.get("config"), dict) else None
    if not (is_whole(before) and cfg.rounds is not None and before < cfg.rounds):
        return None
    return before if obj.get("fingerprint") == fingerprint({**cfg.to_dict(), "rounds": before}) else None


def _check_extensions(extensions: Any, rounds: Any, bad: Callable[[str, Any, str], CheckpointError]) -> None:
    """The optional ``extensions`` entry: the run's extensions to more rounds, each
    ``{"from": M, "to": N, "after": k}`` (k rounds done when the M-round run was
    extended to N, ``0 <= k <= M < N``), each starting where the one before ended and
    the last ending at the checkpoint's ``config.rounds``."""
    expected = "a list of {'from': M, 'to': N, 'after': rounds done} (0 <= after <= M < N), each from the last one's N to config.rounds"
    if not isinstance(extensions, list):
        raise bad("extensions", extensions, expected)
    previous = None
    for e in extensions:
        ok = isinstance(e, dict) and set(e) == {"from", "to", "after"} and all(is_whole(e[k]) for k in e)
        if not (ok and 0 <= e["after"] <= e["from"] < e["to"] and previous in (None, e["from"])):
            raise bad("extensions", extensions, expected)
        previous = e["to"]
    if previous is not None and previous != rounds:
        raise bad("extensions", extensions, expected)


def _check_tensors(
    tensors: dict[Any, Any], model: Mapping[str, torch.Tensor], entry: str, bad: Callable[[str, Any, str], CheckpointError]
) -> None:
    """Every entry of ``tensors`` is a tensor of ``model`` with its shape and dtype."""
    for name, value in tensors.items():
        if name not in model:
            raise bad(f"{entry}[{_short(name)}]", value, f"only tensors of the run's model, which has no {_short(name)}")
        ref = model[name]
        if not (isinstance(value, torch.Tensor) and value.shape == ref.shape and value.dtype == ref.dtype):
            raise bad(f"{entry}[{name!r}]", value, _describe(ref))


def _json(row: dict[Any, Any]) -> bool:
    """Whether ``row`` can be written to ``metrics.jsonl``."""
    try:
        to_json(row)
    except (TypeError, ValueError):
        return False
    return True
