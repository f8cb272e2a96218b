"""Validation of client updates before they reach the aggregate.

One validator serves every server: the simulator's round loop now, a deployment's server
(Flower) later. A reply is checked against the structure its algorithm expects
(:meth:`~contrafl.algorithms.base.Algorithm.reply_spec`): the payload's keys, every
tensor's shape and dtype, finite floating-point values and a non-negative sample count.
Optionally, an update whose norm is more than ``outlier_factor`` times the median update
norm of the round's valid replies is rejected too, with the update of a payload entry
measured against the broadcast entry of the same name (``||w_k - w||`` for a model)::

    reject k  if  ||u_k|| > outlier_factor * median_j ||u_j||
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..algorithms.base import Reply, TensorSpec, dtype_name


def check_reply(reply: Reply, spec: Mapping[str, Any]) -> str | None:
    """Why ``reply`` cannot be aggregated, or None when it matches ``spec``, its
    floating-point values are finite and its per-label tables have a row per label
    (:func:`table_problem`)."""
    return finish_checks([begin_check(reply, spec)])[0]


@dataclass
class PendingCheck:
    """A reply's :func:`check_reply` begun by :func:`begin_check`: its structure checked
    (``reason``), its floating-point tensors (named) and per-label tables kept for
    :func:`finish_checks`."""

    reason: str | None
    floats: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    tables: list[Mapping[str, Any]] = field(default_factory=list)


def begin_check(reply: Reply, spec: Mapping[str, Any]) -> PendingCheck:
    """The part of :func:`check_reply` that reads no tensor value: the sample count, and
    the payload's structure, shapes and dtypes against ``spec``."""
    n = reply.num_samples
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return PendingCheck(f"num_samples={n!r}, expected a non-negative integer")
    floats: list[tuple[str, torch.Tensor]] = []
    reason = _check(reply.payload, spec, "", floats)
    return PendingCheck(reason) if reason is not None else PendingCheck(None, floats, label_tables(reply.payload))


def finish_checks(checks: Sequence[PendingCheck]) -> list[str | None]:
    """Each begun check's reason, or None: its structure's (:func:`begin_check`), else
    the first of its tensors with non-finite values, else its first per-label table's
    problem. The values of all the replies are tested together (:func:`non_finite`): on a
    GPU a few kernels and one wait for the device, not a few and one wait per reply."""
    reasons = [c.reason for c in checks]
    values = [c.floats if c.reason is None else [] for c in checks]
    for i, why in enumerate(non_finite(values)):
        if reasons[i] is None:
            reasons[i] = why or next(filter(None, map(table_problem, checks[i].tables)), None)
    return reasons


def non_finite(groups: Sequence[Sequence[tuple[str, torch.Tensor]]]) -> list[str | None]:
    """For each group of named floating-point tensors, why one of them has NaN or
    infinite values (the first in order), or None. One fused pass over all the groups
    first: a tensor's L2 norm is finite when all its values are (a sum of finite squares
    overflows only past its dtype's largest value, and then the exact scan below clears
    the tensor), so the scan runs only on a group with a norm that is not. L2, not L1:
    PyTorch's CPU kernel of the L2 norm is vectorised, the L1's is not (0.08 against
    0.53 ms for MOON's CNN, 151,278 values: 50 replies a round of pfl's device shape)."""
    values = [t for group in groups for _, t in group]
    if not values:
        return [None] * len(groups)
    norms = torch.stack([n.float().to(values[0].device) for n in torch._foreach_norm(values, 2)])
    finite = norms.isfinite()
    if bool(finite.all()):
        return [None] * len(groups)
    flags, out, start = finite.tolist(), [], 0
    for group in groups:
        end = start + len(group)
        out.append(None if all(flags[start:end]) else _scan(group))
        start = end
    return out


def _scan(tensors: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """Why the first of ``tensors`` with non-finite values has them, counted exactly."""
    for where, value in tensors:
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            nan = int(torch.isnan(value).sum())
            return f"{where} has non-finite values ({nan} NaN, {int((~finite).sum()) - nan} infinite)"
    return None


def table_problem(table: Mapping[str, Any]) -> str | None:
    """Why a per-label table's rows do not match its marks: ``reps`` has one row per label
    (``len(counts)`` or ``len(mask)``) or, with a ``mask``, one per marked label."""
    rows = len(table["reps"])
    marks = table["counts"] if isinstance(table.get("counts"), torch.Tensor) else table["mask"]
    allowed = {len(marks)} | ({int((marks > 0).sum())} if "mask" in table else set())
    if rows not in allowed:
        return f"a per-label table has {rows} rows for {len(marks)} labels ({int((marks > 0).sum())} marked)"
    return None


def is_label_table(value: Any) -> bool:
    """A per-label table of a reply (:mod:`contrafl.algorithms.prototypes`): a mapping with
    ``reps`` (float ``[C, d]``) and ``counts`` (integer ``[C]``, FedCRL, FedProto, FedPAC,
    FedGH), or ``reps`` with a ``mask`` (bool ``[C]``) whose rows are either every label's
    or only the marked labels' (FedSSC's compact ``[m, d]``)."""
    if not isinstance(value, Mapping) or not isinstance(value.get("reps"), torch.Tensor) or value["reps"].dim() != 2:
        return False
    marks = [value.get(k) for k in ("counts", "mask")]
    return any(isinstance(m, torch.Tensor) and m.dim() == 1 and not m.is_floating_point() for m in marks)


def count_problem(payload: Any, total: int) -> str | None:
    """Why the label counts of ``payload``'s per-label tables cannot be a client's: a
    negative count, or more than ``total`` in a table (the samples the client trained
    on, every epoch's: FedCRL and FedProto count each epoch's samples). A client that
    forged its counts would otherwise weigh its rows as it likes (one count of 1e12
    makes the global row of that label its own)."""
    for table in label_tables(payload):
        counts = table.get("counts")
        if not isinstance(counts, torch.Tensor):
            continue
        if bool((counts < 0).any()):
            return "a per-label table has a negative count"
        if int(counts.sum()) > total:
            return f"a per-label table counts {int(counts.sum())} samples, more than the {total} the client trained on (its samples times the local epochs)"
    return None


def label_tables(payload: Any) -> list[Mapping[str, Any]]:
    """The per-label tables of ``payload`` (:func:`is_label_table`)."""
    if is_label_table(payload):
        return [payload]
    if isinstance(payload, Mapping):
        return [t for v in payload.values() for t in label_tables(v)]
    if isinstance(payload, (list, tuple)):
        return [t for v in payload for t in label_tables(v)]
    return []


def _check(value: Any, spec: Any, path: str, floats: list[tuple[str, torch.Tensor]]) -> str | None:
    """Why ``value`` does not have the structure, shapes and dtypes of ``spec``, or None;
    appends its floating-point tensors, named, to ``floats`` (for :func:`non_finite`)."""
    where = f"'{path}'" if path else "the payload"
    if isinstance(spec, TensorSpec):
        if not isinstance(value, torch.Tensor):
            return f"{where} is a {type(value).__name__}, expected a tensor {spec}"
        if value.dtype != spec.dtype:
            return f"{where} has dtype {dtype_name(value.dtype)}, expected {dtype_name(spec.dtype)}"
        shape = tuple(value.shape)
        if len(shape) != len(spec.shape) or any(e is not None and e != s for s, e in zip(shape, spec.shape)):
            return f"{where} has shape {list(shape)}, expected {spec}"
        if (value.is_floating_point() or value.is_complex()) and value.numel():
            floats.append((where, value))
        return None
    if isinstance(spec, Mapping):
        if not isinstance(value, Mapping):
            return f"{where} is a {type(value).__name__}, expected a mapping"
        missing = [k for k in spec if k not in value]
        if missing:
            return f"{_join(path, missing[0])!r} is missing"
        extra = [k for k in value if k not in spec]
        if extra:
            return f"{_join(path, extra[0])!r} is not expected"
        for k, sub in spec.items():
            reason = _check(value[k], sub, _join(path, k), floats)
            if reason:
                return reason
        return None
    if isinstance(spec, Sequence):
        if not isinstance(value, Sequence) or len(value) != len(spec):
            return f"{where} is not a sequence of {len(spec)} entries"
        for i, (v, s) in enumerate(zip(value, spec)):
            reason = _check(v, s, f"{path}[{i}]", floats)
            if reason:
                return reason
        return None
    raise TypeError(f"bad reply spec at {where}: {spec!r}")


def update_norm(payload: Mapping[str, Any], message: Mapping[str, Any]) -> float:
    """``sqrt(sum_p ||payload[p] - message[p]||^2)`` over the floating-point tensors of the
    payload (:func:`updates`: in mappings, lists and tuples), with ``message[p] = 0``
    where the broadcast has no tensor of that position and shape."""
    return vector_norm(updates(payload, message))


def map_update(payload: Any, message: Any, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> Any:
    """``payload`` with every floating-point tensor ``p`` (update ``u = p - m``, ``m`` the
    message's tensor of the same position and shape, else 0) replaced by ``m + fn(k, u)``,
    ``k`` numbering the tensors in the payload's order; mappings, lists and tuples are
    walked alike."""
    count = 0

    def walk(value: Any, ref: Any) -> Any:
        nonlocal count
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point():
                return value
            base = ref.to(value) if isinstance(ref, torch.Tensor) and ref.shape == value.shape else torch.zeros_like(value)
            k, count = count, count + 1
            return base + fn(k, value - base)
        if isinstance(value, Mapping):
            return {key: walk(v, ref.get(key) if isinstance(ref, Mapping) else None) for key, v in value.items()}
        if isinstance(value, (list, tuple)):
            refs = ref if isinstance(ref, (list, tuple)) and len(ref) == len(value) else [None] * len(value)
            return type(value)(walk(v, r) for v, r in zip(value, refs))
        return value

    return walk(payload, message)


def updates(payload: Any, message: Any) -> list[torch.Tensor]:
    """The update's tensors ``u_k`` in :func:`map_update`'s order."""
    out: list[torch.Tensor] = []
    map_update(payload, message, lambda k, u: out.append(u) or u)
    return out


def update_vector(payload: Any, message: Any, dtype: torch.dtype) -> torch.Tensor:
    """The update's tensors (:func:`updates`) as one flat vector of ``dtype`` (empty when
    the payload has no floating-point tensor)."""
    parts = updates(payload, message)
    return torch.cat([u.reshape(-1).to(dtype) for u in parts]) if parts else torch.zeros(0, dtype=dtype)


def with_update(payload: Any, message: Any, vector: torch.Tensor) -> Any:
    """``payload`` with its update replaced by ``vector`` (:func:`update_vector`'s layout):
    every floating-point tensor becomes ``m + `` its slice of ``vector``, in its dtype."""
    sizes = [u.numel() for u in updates(payload, message)]
    pieces = vector.split(sizes)
    return map_update(payload, message, lambda k, u: pieces[k].view_as(u).to(u))


def vector_norm(tensors: list[torch.Tensor]) -> float:
    """``||(t_1, ..., t_k)||`` in float64."""
    return math.sqrt(sum(float(u.double().pow(2).sum()) for u in tensors))


def float_leaves(payload: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``payload`` in :func:`map_update`'s order."""
    if isinstance(payload, torch.Tensor):
        return [payload] if payload.is_floating_point() else []
    if isinstance(payload, Mapping):
        return [x for v in payload.values() for x in float_leaves(v)]
    if isinstance(payload, (list, tuple)):
        return [x for v in payload for x in float_leaves(v)]
    return []


def norm_outliers(
    replies: Sequence[Reply], message: Mapping[str, Any], factor: float, messages: Mapping[int, Mapping[str, Any]] | None = None
) -> dict[int, str]:
    """``{cid: reason}`` for the replies whose update norm exceeds ``factor`` times the
    round's median (none when ``factor`` is 0 or the median is 0). Each update is
    measured against the client's own message in ``messages`` where it has one, else
    against ``message``."""
    if factor <= 0 or not replies:
        return {}
    messages = messages or {}
    norms = {r.cid: update_norm(r.payload, messages.get(r.cid, message)) for r in replies}
    median = statistics.median(norms.values())
    if median <= 0:
        return {}
    return {
        cid: f"update norm {norm:.4g} is {norm / median:.1f} times the round's median {median:.4g} (limit {factor:g})"
        for cid, norm in norms.items()
        if norm > factor * median
    }


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
