"""What a client's reply puts into a secure sum, and the replies the server rebuilds from
the sums (:mod:`contrafl.flower.secagg`), without torch.

An algorithm that secure aggregation serves aggregates sums only. Under SecAgg+ a client
sends, masked, and nothing of it in the clear (:func:`client_sums`; its evaluation of
the global model, federated evaluation, as the sums of its test samples, correct
predictions and loss: :func:`score_sums`, :func:`rebuild_scores`):

- **weighted floating-point tensors**: every floating-point tensor ``x`` of its payload,
  clipped to ``+-CLIPPING_RANGE``, times ``w / W`` (``w``: the reply's ``num_samples``,
  ``W``: the run's public ``max_weight``, so each value stays in the clipping range);
  the rows of a per-label table (``reps`` beside integer ``counts``: FedCRL, FedProto)
  times ``omega_l / W_omega``, where ``omega_l`` is the label's count (``counts``
  weighting, ``W_omega``: the public bound on a count, :attr:`SumSpec.count_bound`) or
  1 when the client holds the label (``uniform``, ``W_omega = 1``);
- **whole numbers**, exactly: ``num_samples``, ``steps``, the loss and its parts (sums
  over the client's steps, in fixed point of :data:`FIXED`, positive and negative parts
  apart) and each table's ``omega``, each written in :data:`DIGITS` base-:data:`BASE`
  digits ``d / BASE`` in ``[0, 1)``, whose sums the server reads back exactly
  (:func:`whole_sums`).

The reply's tree keeps in the clear only its structure and the integer payload tensors
outside label tables (the simulated ``time``, a function of the steps, is left out: a
run that simulates clients' speeds refuses secure aggregation). The server learns
the round's sums: the total weight, steps and loss, each label's total ``omega``, and the
weighted means ``W S_x / sum w`` and ``W_omega S_{r,l} / sum omega_l``. It rebuilds
every client's reply with these in place (:func:`rebuild`): the means as its tensors (an
algorithm's weighted mean of equal payloads, and FedCRL's per-label mean of equal
tables, is that mean), each label's total ``omega`` as its counts, and the totals of
``num_samples``, ``steps`` and the loss shared out, so that the round's sums are those of
the clients.

**What the server checks** (:class:`SumRejected`): a malicious client may skip its own
checks and the mod's clipping, but what it sends enters only sums. Every sum must be
finite; every digit sum a whole number in range (values outside SecAgg+'s range wrap
around and show); every mean inside the clipping range (a weighted mean of clipped
values is); the total weight positive and at most ``m W`` for ``m`` clients, or exactly
the round's known total where the server knows the clients' sample counts (shared
data); each label's total at most ``m W_omega``, and with ``counts`` weighting and
true counts (no ``dp=local``) the labels' totals summing to at most the total weight
times the local epochs (a client counts the samples its table averaged, each epoch's). Within those bounds a client
moves a mean by at most ``2 CLIPPING_RANGE W / sum w`` per value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import require_flwr

require_flwr()
from flwr.app import RecordDict  # noqa: E402

from ..errors import ContraflError  # noqa: E402
from .packed import named_arrays, record_of  # noqa: E402

#: Every float value a client sends is clipped to +-CLIPPING_RANGE (SecAgg+'s default is 8).
CLIPPING_RANGE = 8.0
#: Quantisation levels over [-CLIPPING_RANGE, CLIPPING_RANGE] (SecAgg+'s default, 2**22).
QUANTIZATION_RANGE = 2**22
#: The quantisation step: each masked value is rounded (stochastically) to a multiple of it.
STEP = 2 * CLIPPING_RANGE / QUANTIZATION_RANGE
BASE = 256
DIGITS = 6
FIXED = 2**16
"""The loss and its parts travel as whole multiples of ``1 / FIXED``."""
#: Floating-point dtypes numpy has (the others travel as integers of their width).
NUMPY_FLOATS = ("float16", "float32", "float64")
#: Payload dtypes (as the reply's tree names them) that travel in the clear.
CLEAR = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
SCALARS = ("num_samples", "steps")


class SumRejected(ContraflError):
    """A round's secure sum that fails the server's checks (the message says which);
    ``clients``: those whose vectors it holds, ``errors``: the round's error replies."""

    clients: list[int] = []
    errors: dict[int, Any] = {}


@dataclass(frozen=True)
class SumSpec:
    """The public parameters of a run's secure sums, the same for every client.

    Attributes:
        max_weight: ``W``, the largest ``num_samples`` a client may have (1 under
            ``dp=local``, where every reply weighs 1).
        labels: how the algorithm weighs a per-label table's rows (``counts`` or
            ``uniform``; :meth:`~contrafl.algorithms.base.Algorithm.label_weighting`).
        counts_are_samples: a table's counts sum to the client's ``num_samples`` (true
            counts: no ``dp=local``, which marks every label once or sends counts with
            one sample's weight).
        epochs: the run's local epochs: a table counts the samples its rows averaged,
            every epoch's (FedCRL's and FedProto's counts are ``epochs`` times the
            label's samples, less a last partial batch).
        max_count: the largest count of a label a client may send (``W epochs``
            unless ``dp=local`` sends true counts with weight 1: then the largest
            client's sample count times the epochs).
    """

    max_weight: int
    labels: str = "counts"
    counts_are_samples: bool = True
    epochs: int = 1
    max_count: int = 0

    @property
    def count_bound(self) -> int:
        return self.max_count or self.max_weight * self.epochs

    def to_json(self) -> str:
        return json.dumps({"max_weight": self.max_weight, "labels": self.labels, "counts_are_samples": self.counts_are_samples,
                           "epochs": self.epochs, "max_count": self.count_bound})

    @classmethod
    def from_json(cls, text: str) -> SumSpec:
        spec = json.loads(text)
        return cls(int(spec["max_weight"]), str(spec["labels"]), bool(spec["counts_are_samples"]), int(spec["epochs"]), int(spec["max_count"]))


# -- client --------------------------------------------------------------------------------
def client_sums(reply: RecordDict, spec: SumSpec) -> tuple[list[np.ndarray], RecordDict, str]:
    """A client's checked train reply (a :mod:`~contrafl.flower.codec` record) as what
    SecAgg+ masks: the weighted float32 tensors, then the digits of its whole numbers;
    the rest of the reply in the clear; and the layout of the masked part (JSON), which
    the server needs to read the sums. :class:`ContraflError` (one line) for a reply the
    sums cannot carry."""
    structure = json.loads(str(reply["tree"]["json"]))
    top = dict(structure["dict"])
    dtypes = tensor_dtypes(top["payload"])
    masked_dtypes = {name: dtype for name, dtype in dtypes.items() if is_masked(name, dtype)}
    arrays = named_arrays(reply)
    w = int(top["num_samples"]["value"])
    if not 0 <= w <= spec.max_weight:
        raise ContraflError(  # the count itself stays here: this message goes to the server
            f"this client has more training samples than the run's secure-aggregation max weight {spec.max_weight} "
            "(a public bound on every client's sample count); deploy with a larger --max-weight"
        )
    steps = int(top["steps"]["value"])
    loss = top["loss"]["value"] if top["loss"]["value"] is not None else 0.0  # None: no step (fewer samples than a batch)
    parts = {k: node["value"] if node["value"] is not None else 0.0 for k, node in top["parts"]["dict"]}
    for name, value in {"the training loss": loss, **{f"loss part {k!r}": v for k, v in parts.items()}}.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ContraflError(f"{name} is {value!r}, which a secure sum cannot carry (training diverged?)")
    floats, names, ints = [], [], [("num_samples", [w]), ("steps", [steps]), *_signed("loss", loss)]
    for k, v in parts.items():
        ints += _signed(f"part:{k}", v)
    tables = label_tables(top["payload"])
    for reps, counts in tables.items():
        marks = arrays[counts].astype(np.int64)
        if (marks < 0).any() or (marks > spec.count_bound).any():
            raise ContraflError(f"a label count of {counts!r} is outside [0, {spec.count_bound}], the run's public bound on a label's samples")
        omega = marks if spec.labels == "counts" else (marks > 0).astype(np.int64)
        scale = spec.count_bound if spec.labels == "counts" else 1
        floats.append((clipped(arrays[reps], dtypes[reps]) * (omega / scale)[:, None]).astype(np.float32))
        names.append([reps, dtypes[reps], "label"])
        ints.append((f"omega:{reps}", omega.tolist()))
    for name, dtype in masked_dtypes.items():
        if name in tables:
            continue
        floats.append((clipped(arrays[name], dtype) * (w / spec.max_weight)).astype(np.float32))
        names.append([name, dtype, "sample"])
    masked = {name for name, _, _ in names} | set(tables.values())
    hidden = {"num_samples": {"value": None}, "steps": {"value": None}, "loss": {"value": None}, "time": {"value": None},
              "straggler": {"value": None}, "parts": {"dict": [[k, {"value": None}] for k in parts]}}  # time: the steps, simulated
    clear = {"dict": [[key, hidden.get(key, node)] for key, node in structure["dict"]]}
    rest = record_of({n: a for n, a in arrays.items() if n not in masked}, json.dumps(clear, separators=(",", ":")))
    values = np.array([v for _, vs in ints for v in vs], dtype=np.int64)
    layout = {"floats": names, "ints": [[key, len(vs)] for key, vs in ints], "tables": tables}
    return [*floats, digits(values)], rest, json.dumps(layout, separators=(",", ":"))


def score_sums(reply: RecordDict) -> tuple[list[np.ndarray], RecordDict, str]:
    """A client's evaluation of the global model (``{acc, loss, n}``, or ``{}`` without
    test data) as what SecAgg+ masks: its test samples, correct predictions and summed
    loss (fixed point) as the digits of whole numbers; nothing in the clear."""
    top = {key: node["value"] for key, node in json.loads(str(reply["tree"]["json"]))["dict"]}
    n = int(top.get("n") or 0)
    acc, loss = (float(top["acc"]), float(top["loss"])) if n else (0.0, 0.0)
    if not (math.isfinite(acc) and math.isfinite(loss)):
        raise ContraflError(f"the evaluation's accuracy {acc!r} or loss {loss!r} is not finite, which a secure sum cannot carry")
    ints = [("n", [n]), ("correct", [round(acc * n)]), *_signed("loss", loss * n)]
    values = np.array([v for _, vs in ints for v in vs], dtype=np.int64)
    layout = {"floats": [], "ints": [[key, len(vs)] for key, vs in ints], "tables": {}, "scores": True}
    return [digits(values)], record_of({}, json.dumps({"dict": []})), json.dumps(layout, separators=(",", ":"))


def _signed(key: str, value: float) -> list[tuple[str, list[int]]]:
    """A real ``value`` as two whole numbers of ``1 / FIXED``: its positive and negative parts."""
    fixed = round(value * FIXED)
    return [(f"{key}+", [max(fixed, 0)]), (f"{key}-", [max(-fixed, 0)])]


def digits(values: np.ndarray) -> np.ndarray:
    """Non-negative whole ``values`` as their :data:`DIGITS` base-:data:`BASE` digits
    ``d / BASE`` (float32, ``[len(values), DIGITS]``, least significant first)."""
    if (values < 0).any() or (values >= BASE**DIGITS).any():
        raise ContraflError(f"a whole number of this reply is outside [0, {BASE}**{DIGITS}), which a secure sum cannot carry")
    out = np.zeros((len(values), DIGITS), np.float32)
    rest = values.copy()
    for k in range(DIGITS):
        out[:, k] = (rest % BASE) / BASE
        rest //= BASE
    return out


def clipped(values: np.ndarray, dtype: str) -> np.ndarray:
    """A floating-point tensor of the tree's ``dtype`` (its codec array ``values``) in
    float64, clipped to ``+-CLIPPING_RANGE`` as SecAgg+ clips it."""
    if dtype in NUMPY_FLOATS:
        out = values.astype(np.float64)
    else:  # bfloat16 and the float8 types travel as integers of their width
        import torch

        out = torch.from_numpy(values).view(getattr(torch, dtype)).double().numpy()
    return np.clip(out, -CLIPPING_RANGE, CLIPPING_RANGE)


def label_tables(node: dict[str, Any]) -> dict[str, str]:
    """``{reps array: counts array}`` of the per-label tables (a mapping of a float
    ``reps`` and an integer ``counts``) under the codec tree's JSON ``node``."""
    if "dict" in node:
        entries = dict(node["dict"])
        reps, counts = entries.get("reps", {}), entries.get("counts", {})
        if "tensor" in reps and "tensor" in counts and counts["dtype"] in CLEAR and reps["dtype"] not in CLEAR:
            return {reps["tensor"]: counts["tensor"]}
        subs = [sub for _, sub in node["dict"]]
    else:
        subs = node.get("list", node.get("tuple", []))
    return {r: c for sub in subs for r, c in label_tables(sub).items()}


def tensor_dtypes(node: dict[str, Any]) -> dict[str, str]:
    """``{array name: dtype}`` of the tensors under the codec tree's JSON ``node``."""
    if "tensor" in node:
        return {node["tensor"]: node["dtype"]}
    subs = [sub for _, sub in node["dict"]] if "dict" in node else node.get("list", node.get("tuple", []))
    return {name: dtype for sub in subs for name, dtype in tensor_dtypes(sub).items()}


def is_masked(name: str, dtype: str) -> bool:
    """Whether payload tensor ``name`` of the tree's ``dtype`` goes to SecAgg+ (a
    floating-point dtype: float16, bfloat16, float32, float64, a float8 type) or travels
    in the clear (an integer or bool dtype). :class:`ContraflError` for any other dtype
    (complex), which SecAgg+ can carry neither way."""
    if dtype in NUMPY_FLOATS or dtype == "bfloat16" or dtype.startswith("float8_"):
        return True
    if dtype in CLEAR:
        return False
    raise ContraflError(
        f"payload tensor {name!r} has dtype {dtype}, which secure aggregation cannot carry (SecAgg+ masks real "
        "floating-point tensors and carries integer ones in the clear); deploy without --secure-aggregation"
    )


# -- server --------------------------------------------------------------------------------
def whole_sums(digit_sums: np.ndarray, clients: int) -> np.ndarray:
    """The exact whole sums of ``clients`` clients' numbers from the sums of their digits
    (:func:`digits`), or :class:`SumRejected` when a digit sum is not a whole number of
    ``[0, clients (BASE - 1)]`` within the quantisation's error (a client sent values
    outside SecAgg+'s range, or skipped its clipping)."""
    scaled = digit_sums * BASE
    whole = np.rint(scaled)
    error = clients * STEP * BASE * 2
    if not np.isfinite(scaled).all() or (np.abs(scaled - whole) > error).any() or (whole < 0).any() or (whole > clients * (BASE - 1)).any():
        raise SumRejected("its securely summed counts are not whole numbers in range (a client sent values outside SecAgg+'s range)")
    return (whole.astype(np.int64) * BASE ** np.arange(DIGITS, dtype=np.int64)).sum(axis=1)


def rebuild(
    mean: list[np.ndarray], rests: Mapping[int, RecordDict], layouts: Mapping[int, str], spec: SumSpec, expected: int | None = None,
) -> dict[int, RecordDict]:
    """Every client's reply rebuilt from the round's unmasked ``mean`` (SecAgg+'s mean of
    the ``m`` clients' masked parts, all of weight 1), their clear ``rests`` and the
    ``layouts`` of what they masked (module docstring); ``expected``: the round's total
    weight where the server knows it. :class:`SumRejected` when the sums fail a check."""
    cids = sorted(rests)
    m = len(cids)
    if len({layouts[c] for c in cids}) != 1:
        raise SumRejected("its clients masked replies of different layouts, which cannot be summed")
    layout = json.loads(layouts[cids[0]])
    sums = [np.asarray(a, np.float64) * m for a in mean]
    if len(sums) != len(layout["floats"]) + 1 or not all(np.isfinite(s).all() for s in sums):
        raise SumRejected("its unmasked sum is not finite, or not of the clients' layout")
    whole, start = {}, 0
    totals = whole_sums(sums[-1], m)
    for key, size in layout["ints"]:
        whole[key] = totals[start:start + size]
        start += size
    weight = int(whole["num_samples"][0])
    if expected is not None and weight != expected:
        raise SumRejected(f"its securely summed weight is {weight}, but its clients hold {expected} samples (a client lied about its sample count)")
    if not 0 < weight <= m * spec.max_weight:
        raise SumRejected(f"its securely summed weight is {weight}, outside (0, {m * spec.max_weight}] for {m} clients of max weight {spec.max_weight}")
    means: dict[str, np.ndarray] = {}
    bound = CLIPPING_RANGE + m * STEP * spec.max_weight / weight + 1e-6
    for (name, dtype, kind), s in zip(layout["floats"], sums[:-1], strict=True):
        if kind == "label":
            omega = whole[f"omega:{name}"]
            scale = spec.count_bound if spec.labels == "counts" else 1
            if (omega > m * scale).any():
                raise SumRejected(f"its summed label counts exceed {m * scale}, {m} clients' public bound of {scale} each")
            if spec.labels == "counts" and spec.counts_are_samples and omega.sum() > weight * spec.epochs:
                raise SumRejected(
                    f"its summed label counts ({int(omega.sum())}) exceed its summed weight times the local epochs "
                    f"({weight} x {spec.epochs}): more labelled samples than the clients trained on"
                )
            value = np.where(omega[:, None] > 0, s * scale / np.maximum(omega, 1)[:, None], 0.0)
            limit = CLIPPING_RANGE + m * STEP * scale / np.maximum(omega, 1)[:, None] + 1e-6
        else:
            value, limit = s * spec.max_weight / weight, bound
        if (np.abs(value) > limit).any():
            raise SumRejected(f"its mean of {name!r} leaves the clipping range +-{CLIPPING_RANGE:g} (a client skipped its clipping)")
        means[name] = value
    loss = (int(whole["loss+"][0]) - int(whole["loss-"][0])) / FIXED
    parts = {key[5:-1]: (int(whole[key][0]) - int(whole[key[:-1] + "-"][0])) / FIXED for key, _ in layout["ints"] if key.startswith("part:") and key.endswith("+")}
    samples, steps = _shares(weight, m), _shares(int(whole["steps"][0]), m)
    return {
        cid: _rebuilt(rests[cid], means, layout, whole, {
            "num_samples": samples[i], "steps": steps[i], "loss": loss / m, "parts": {k: v / m for k, v in parts.items()},
        })
        for i, cid in enumerate(cids)
    }


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` rounded to the tree's floating-point ``dtype``, as the codec carries it
    (bfloat16 and the float8 types as the integers of their width)."""
    if dtype in NUMPY_FLOATS:
        return np.ascontiguousarray(values.astype(dtype))
    import torch

    from .codec import _SAME_WIDTH

    cast = torch.from_numpy(np.ascontiguousarray(values)).to(getattr(torch, dtype))
    return cast.view(_SAME_WIDTH[cast.element_size()]).numpy()


def rebuild_scores(mean: list[np.ndarray], cids: list[int], layouts: Mapping[int, str]) -> dict[int, dict[str, Any] | None]:
    """The clients' evaluations rebuilt from the round's unmasked ``mean`` of their
    :func:`score_sums`: the totals of test samples and correct predictions shared out as
    whole numbers (``correct_i <= n_i``, summing to the totals) with the mean loss, so
    that the server's sample-weighted means are the round's (``None`` for a share
    without samples). :class:`SumRejected` when the sums fail a check."""
    m = len(cids)
    if len({layouts[c] for c in cids}) != 1 or not json.loads(layouts[cids[0]]).get("scores"):
        raise SumRejected("its clients masked evaluations of different layouts, which cannot be summed")
    n, correct, positive, negative = (int(v) for v in whole_sums(np.asarray(mean[-1], np.float64) * m, m))
    if correct > n:
        raise SumRejected(f"its summed correct predictions ({correct}) exceed its summed test samples ({n})")
    if n == 0:
        return {cid: None for cid in cids}
    loss = (positive - negative) / FIXED / n
    return {
        cid: {"acc": c / k, "loss": loss, "n": k} if k else None
        for cid, k, c in zip(cids, _shares(n, m), _shares(correct, m))
    }


def _shares(total: int, m: int) -> list[int]:
    """``total`` shared out among ``m`` as whole numbers that sum to it."""
    return [total // m + (i < total % m) for i in range(m)]


def _rebuilt(rest: RecordDict, means: Mapping[str, np.ndarray], layout: Mapping[str, Any], whole: Mapping[str, np.ndarray],
             values: Mapping[str, Any]) -> RecordDict:
    """A client's reply: its clear ``rest`` with the means, the label totals and its
    share of the totals (``values``) in place."""
    arrays = named_arrays(rest)
    structure = json.loads(str(rest["tree"]["json"]))
    dtypes = tensor_dtypes(structure)
    arrays.update({name: as_dtype(means[name], dtype) for name, dtype, _ in layout["floats"]})
    arrays.update({counts: whole[f"omega:{reps}"].astype(dtypes[counts]) for reps, counts in layout["tables"].items()})
    filled = {
        "num_samples": {"value": values["num_samples"]}, "steps": {"value": values["steps"]}, "loss": {"value": values["loss"]},
        "parts": {"dict": [[k, {"value": v}] for k, v in values["parts"].items()]},
    }
    structure["dict"] = [[key, filled.get(key, node)] for key, node in structure["dict"]]
    return record_of(arrays, json.dumps(structure, separators=(",", ":")))
