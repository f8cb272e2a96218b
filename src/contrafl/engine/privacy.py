"""Client-level differential privacy (``dp=central`` or ``dp=local``).

A client's update ``u_i`` is every floating-point tensor of its reply's payload minus the
tensor of the same position in the message it trained on (the tensor itself where the
message has none: SCAFFOLD's ``delta_c``, prototypes), as one vector
(:func:`~contrafl.execution.validate.update_norm`). DP-FedAvg (McMahan et al., ICLR 2018)
bounds each client's influence by clipping it to the norm ``C`` (``dp.clip``)::

    clip(u_i) = u_i * min(1, C / ||u_i||)

and adds Gaussian noise of standard deviation ``sigma = z * C`` (``z``:
``dp.noise_multiplier``) to what leaves the trusted party:

- ``central``: the server (trusted) clips every reply and adds one draw ``xi`` of
  ``N(0, (sigma / m)^2 I)`` to each of the ``m`` replies it aggregates. The algorithm's
  aggregate is an affine function of the replies' sum with equal weights (every reply
  counts as one sample), so the sum gets ``m * xi ~ N(0, sigma^2 I)``: the Gaussian
  mechanism on the sum of clipped updates.
- ``local``: each client clips its own update and adds ``N(0, sigma^2 I)`` before it
  sends it. The server checks what it receives (:meth:`Privacy.check_local`): every
  reply weighs one sample, and an update longer than clipping plus the noise can make
  it is refused.

The noise is secret by default (``dp.noise=secret``): drawn from the operating system's
CSPRNG by the party that adds it (:func:`secret_gaussian`), so that nobody else can
subtract it. ``dp.noise=reproducible`` draws it from the streams ``(seed, "dp", round)``
and ``(seed, "dp", round, client)`` instead, which anyone holding ``config.yaml`` can
regenerate: for studying utility only.

Every release is written to the run's privacy ledger (:class:`Ledger`) before anything
made from it leaves the server, and the ledger is never cut back on resume: a round
re-run after a crash that releases something else than the first time counts twice.
:class:`Accountant` turns the ledger into epsilon at ``dp.delta`` with dp-accounting's
RDP accountant (docs/privacy.md gives the threat model of each mode).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import params as P
from ..algorithms.base import Reply
from ..config import Config
from ..errors import CheckpointError, ConfigError
from ..files import append_line, refuse_link
from ..rng import generator
from .checkpoint import is_whole
from .sampling import clients_per_round
from ..execution.validate import float_leaves, is_label_table, label_tables, map_update, updates, vector_norm

DP_MODES = {
    "none": "no differential privacy (the default)",
    "central": "the server clips each update to dp.clip and adds N(0, (z C)^2) to their sum (a trusted server; needs an algorithm that aggregates sums)",
    "local": "each client clips its update and adds N(0, (z C)^2) before sending (no trust in the server; much more noise)",
}
MODES = tuple(DP_MODES)
FALSE_REJECTION = 1e-9
"""``dp=local``: the probability that the server refuses an honest client's reply as
longer than clipping plus the noise can make it (:meth:`Privacy.local_bound`)."""
LEDGER = "dp_ledger.jsonl"


@dataclass(frozen=True)
class DPParams:
    """Options of the ``dp`` setting."""

    clip: float = P.param(1.0, P.Interval(0, None, "neither"), "C: l2 bound of each client's update (all floating-point tensors of its reply, as one vector)")
    noise_multiplier: float = P.param(1.0, P.Interval(0, None), "z: the Gaussian noise's standard deviation is z * C on the sum of the updates (central) or on each update (local)")
    delta: float = P.param(1e-5, P.Interval(0, 1, "neither"), "delta at which epsilon is reported (take it below 1 / num_clients)")
    rep_clip: float | None = P.param(None, P.Interval(0, None, "neither"), "per-label tables (prototypes): clip each label's representation to this l2 norm before the update's clip (none: only the update's clip)")
    labels: str = P.param("hide", P.OneOf(("hide", "clear")), "per-label tables: hide which labels a client holds (every label's row is sent, an absent one with no update, and every label counts once) or send the label counts in the clear (not covered by DP)")
    noise: str = P.param(
        "secret", P.OneOf(("secret", "reproducible")),
        "secret: drawn from the OS CSPRNG of the party that adds it (runs are not repeatable); reproducible: from the run's seed, which anyone with config.yaml can subtract (protects nothing; for studying utility)",
    )


def sampling_kind(cfg: Config) -> str:
    """How a round's clients are drawn, as the accounting sees it: ``full`` (every client),
    ``secret`` (``sampling=secret``: the OS CSPRNG, written nowhere) or ``public``
    (``sampling=seeded``: a function of the seed, listed in ``metrics.jsonl``)."""
    if clients_per_round(cfg.num_clients, cfg.sample_fraction) >= cfg.num_clients:
        return "full"
    return "secret" if cfg.sampling == "secret" else "public"


class Privacy:
    """A run's client-level DP (``dp=central`` or ``dp=local``, the module doc): the
    clipping, the noise, the server's checks and the releases it has counted.

    Args:
        cfg: the run's resolved configuration (``dp`` not ``none``).
    """

    def __init__(self, cfg: Config) -> None:
        self.mode = cfg.dp.name
        self.params: DPParams = P.build(DPParams, cfg.dp.options, "dp")
        self.seed, self.num_clients = cfg.seed, cfg.num_clients
        self.sampled = clients_per_round(cfg.num_clients, cfg.sample_fraction)
        self.sampling = sampling_kind(cfg)
        self.ledger = Ledger()

    @classmethod
    def of(cls, cfg: Config) -> Privacy | None:
        """The run's DP, or None when ``dp=none``."""
        return None if cfg.dp.name == "none" else cls(cfg)

    @property
    def sigma(self) -> float:
        """The noise's standard deviation ``z * C``."""
        return self.params.noise_multiplier * self.params.clip

    def noise(self, like: list[torch.Tensor], std: float, *key: object) -> list[torch.Tensor]:
        """``N(0, std^2)`` tensors shaped as ``like``: secret (:func:`secret_gaussian`), or
        from the stream ``(seed, "dp", *key)`` with ``dp.noise=reproducible``."""
        if self.params.noise == "reproducible":
            return gaussian(like, std, generator(self.seed, "dp", *key))
        return secret_gaussian(like, std)

    # -- clients (dp=local) --------------------------------------------------------------
    def privatize(self, reply: Reply, message: Any, t: int) -> Reply:
        """``dp=local``: the reply a client sends, its per-label tables protected
        (:func:`protect_labels`), its update clipped to ``C`` plus ``N(0, (z C)^2)``
        noise, counting as one sample."""
        p = self.params
        payload = protect_labels(reply.payload, message, p.rep_clip, p.labels == "hide")
        payload, _ = clip(payload, message, p.clip)
        noise = self.noise(float_leaves(payload), self.sigma, t, reply.cid)
        return Reply(reply.cid, 1, add_noise(payload, message, noise))

    # -- server --------------------------------------------------------------------------
    def local_bound(self, size: int) -> float:
        """``dp=local``: the longest update an honest client of ``size`` update values
        sends, but with probability :data:`FALSE_REJECTION`::

            ||clip(u) + n|| <= C + ||n||,   P(||n|| > sigma (sqrt(d) + t)) <= exp(-t^2 / 2)

        (the norm is 1-Lipschitz and ``E||n|| <= sigma sqrt(d)``; Gaussian concentration),
        with ``t = sqrt(2 ln(1 / FALSE_REJECTION))``, plus a relative 1e-5 for rounding."""
        t = math.sqrt(2 * math.log(1 / FALSE_REJECTION))
        return (self.params.clip + self.sigma * (math.sqrt(size) + t)) * (1 + 1e-5)

    def coordinate_bound(self, size: int) -> float:
        """``dp=local``: the largest value of an honest client's update of ``size`` values,
        but with probability :data:`FALSE_REJECTION`::

            |clip(u)_j + n_j| <= C + |n_j|,   P(max_j |n_j| > sigma t) <= 2 d exp(-t^2 / 2)

        (a clipped update has no value above ``C``; the union bound over the ``d``
        values), with ``t = sqrt(2 ln(2 d / FALSE_REJECTION))``, plus a relative 1e-5 for
        rounding. Without it a client could put its whole :meth:`local_bound` into one
        value (``sqrt(d)`` times what the noise gives one value)."""
        t = math.sqrt(2 * math.log(2 * max(size, 1) / FALSE_REJECTION))
        return (self.params.clip + self.sigma * t) * (1 + 1e-5)

    def check_local(self, reply: Reply, message: Any) -> str | None:
        """``dp=local``: why the server cannot take ``reply`` as a protected update, or
        None. It must weigh one sample (else a client could outweigh the others), hide its
        labels when ``dp.labels=hide`` (every label marked), and its update must be no
        longer than :meth:`local_bound` and have no value above :meth:`coordinate_bound`."""
        if reply.num_samples != 1:
            return f"num_samples={reply.num_samples!r}, expected 1 (under dp=local every reply counts once)"
        if self.params.labels == "hide":
            for table in label_tables(reply.payload):
                for key in ("counts", "mask"):
                    if key in table and not bool((table[key] == 1).all()):
                        return f"a per-label table's {key} mark only some labels, expected every label (dp.labels=hide)"
        u = updates(reply.payload, message)
        size = sum(x.numel() for x in u)
        norm, bound = vector_norm(u), self.local_bound(size)
        if norm > bound:
            return (
                f"update norm {norm:.4g} exceeds {bound:.4g}, the most that clipping to dp.clip={self.params.clip:g} "
                f"plus the noise gives (false rejections: {FALSE_REJECTION:g})"
            )
        largest, bound = max((float(x.abs().max()) for x in u if x.numel()), default=0.0), self.coordinate_bound(size)
        if largest > bound:
            return (
                f"an update value of {largest:.4g} exceeds {bound:.4g}, the largest that clipping to dp.clip={self.params.clip:g} "
                f"plus the noise gives one of its {size} values (false rejections: {FALSE_REJECTION:g})"
            )
        return None

    def central(self, replies: list[Reply], messages: Mapping[int, Any], t: int) -> tuple[list[Reply], int]:
        """``dp=central``: the replies clipped to ``C``, each counting as one sample, with
        one draw ``xi ~ N(0, (z C / m)^2)`` added to each of the ``m`` replies' updates
        (the aggregate's sum then carries ``N(0, (z C)^2)``); and how many were clipped."""
        p = self.params
        clipped, out = 0, []
        for r in replies:
            payload, norm = clip(r.payload, messages[r.cid], p.clip)
            clipped += norm > p.clip
            out.append((r.cid, payload))
        if not out:
            return [], 0
        xi = self.noise(float_leaves(out[0][1]), self.sigma / len(out), t)
        return [Reply(cid, 1, add_noise(payload, messages[cid], xi)) for cid, payload in out], clipped

    # -- accounting ------------------------------------------------------------------------
    def record(self, t: int, replies: list[Reply]) -> dict[str, Any]:
        """Write round ``t``'s releases to the ledger (central: the aggregate of
        ``replies``, noised, if any; local: each noisy reply that reached the server) and
        return its row's ``dp_epsilon`` (epsilon so far at ``delta``) and
        ``dp_releases``."""
        if self.mode == "central":
            if replies:
                digest = release_digest(x for r in replies for x in float_leaves(r.payload))
                clients = [r.cid for r in replies] if self.sampling == "public" else None
                self.ledger.add(t, None, digest, clients)
        else:
            for r in replies:
                self.ledger.add(t, r.cid, release_digest(float_leaves(r.payload)))
        spent = self.spent()
        return {"dp_epsilon": self.accountant.epsilon(spent), "dp_releases": spent}

    @functools.cached_property
    def accountant(self) -> Accountant:
        """The run's accountant, built on first use: a client's process (a Flower
        SuperNode's) needs no dp-accounting."""
        return Accountant.of(self.mode, self.sampling, self.params.noise_multiplier, self.params.delta, self.num_clients, self.sampled)

    def spent(self) -> int:
        """The releases epsilon counts: central with full participation or a secret
        sample, the aggregates released; otherwise those of the client that has the most
        (central with a public sample: the aggregates that included it; local: its noisy
        replies)."""
        if self.mode == "central" and self.sampling != "public":
            return self.ledger.aggregates()
        return self.ledger.most_per_client()

    def summary(self) -> dict[str, Any]:
        """The summary's ``dp`` block."""
        return {
            "mode": self.mode, "epsilon": self.accountant.epsilon(self.spent()), "delta": self.params.delta,
            "releases": self.spent(), "neighbouring": self.accountant.relation, "sampling": self.sampling,
            "noise": self.params.noise,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"ledger": list(self.ledger.entries)}

    def load_state_dict(self, state: Any, history: list[dict[str, Any]], where: str) -> None:
        """Check the ledger against a checkpoint's copy (``state``) and the rounds
        ``history`` published (the checkpoint's rows and any later rows of
        ``metrics.jsonl``): the run directory's file (:meth:`Ledger.open`) must begin with
        the checkpoint's releases (:meth:`Ledger.extend`), hold a release of every round
        that reported one, and no fewer releases than the last row reported. A
        :class:`CheckpointError` naming ``where`` otherwise: a deleted, emptied or cut
        ledger stops the run."""
        entries = state.get("ledger", []) if isinstance(state, Mapping) else None
        if not isinstance(entries, list):
            raise CheckpointError(f"{where}: the privacy ledger is {type(entries).__name__}, expected a list of releases; the checkpoint was edited or not written by contrafl")
        self.ledger.extend(entries, where)
        previous = 0
        for row in history:
            released = row.get("dp_releases") if isinstance(row, Mapping) else None
            if not is_whole(released) or released < previous:
                raise CheckpointError(f"{where}: round {row.get('round') if isinstance(row, Mapping) else '?'}'s dp_releases={released!r} is not a count that never decreases; the checkpoint was edited or not written by contrafl")
            if released > previous and not self.ledger.has_round(int(row["round"]) - 1):
                raise CheckpointError(
                    f"{where}: round {row['round']} released an update that the privacy ledger does not record "
                    f"(epsilon would be under-reported); restore {LEDGER} and the checkpoint together, or start the run again"
                )
            previous = released
        if self.spent() < previous:
            raise CheckpointError(
                f"{where}: the privacy ledger counts {self.spent()} releases, fewer than the {previous} the rounds reported "
                f"(epsilon would be under-reported); restore {LEDGER} and the checkpoint together, or start the run again"
            )


class Ledger:
    """The releases of a run, one entry ``{"round", "client", "digest", "prev"}`` each
    (``client`` None for a central aggregate, which lists its ``clients`` when the sample
    is public), appended (and synced) to a file of the run directory before the release
    is used, and never removed: a resumed run keeps counting what earlier attempts
    released. The same release again (same round, client and digest: a re-run that
    computed the same thing) counts once.

    The file is a hash chain: ``prev`` is the hash of the entry before (:func:`link`;
    empty for the first), so a line edited or removed anywhere but at the end is found
    when the ledger is read; a checkpoint holds the entries up to its round, which the
    file must begin with (:meth:`extend`), and ``metrics.jsonl`` the releases each round
    published (:meth:`Privacy.load_state_dict`). A deleted, emptied or cut ledger is
    found unless it lost only releases made after the last checkpoint and the last
    published row (a round killed before its row was written), which nothing else
    records."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.path: Path | None = None
        self.head = ""  # link() of the last entry
        self._keys: set[tuple[int, int | None, str]] = set()
        self._rounds: set[int] = set()
        self._aggregates = 0  # central aggregates
        self._per_client: dict[int, int] = {}  # noisy replies, or the public sample's aggregates that list the client

    def open(self, path: Path) -> None:
        """Keep the ledger in ``path`` from now on, with the entries it already holds
        (checked: releases, each linked to the one before)."""
        self.path = Path(path)
        refuse_link(self.path)
        if self.path.is_file():
            for n, line in enumerate(self.path.read_text().splitlines(), start=1):
                where = f"{self.path} line {n}"
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    raise CheckpointError(f"{where} is not JSON; the privacy ledger was edited or damaged (restore it, or start the run again)") from None
                self._take(entry, where)

    def add(self, round: int, client: int | None, digest: str, clients: list[int] | None = None) -> None:
        """Record a release (written to the file first), unless the ledger has it."""
        entry: dict[str, Any] = {"round": round, "client": client, "digest": digest}
        if clients is not None:
            entry["clients"] = clients
        if (round, client, digest) in self._keys:
            return
        entry["prev"] = self.head
        if self.path is not None:
            append_line(self.path, json.dumps(entry), sync=True)
        self._take(entry, "the privacy ledger")

    def extend(self, entries: list[Any], where: str) -> None:
        """Check that the ledger begins with ``entries`` (the copy ``where``, a
        checkpoint, holds); a ledger kept in no file (a read-only simulation) takes them."""
        if self.path is None:
            for n, entry in enumerate(entries, start=1):
                self._take(entry, f"{where}, release {n}")
            return
        if len(self.entries) < len(entries):
            state = "missing" if not self.path.exists() else f"holds {len(self.entries)} release{'' if len(self.entries) == 1 else 's'}"
            raise CheckpointError(
                f"{self.path} {state}, but {where} recorded {len(entries)}: the privacy ledger was deleted, emptied or cut "
                "(epsilon would be under-reported); restore it, or start the run again"
            )
        if self.entries[: len(entries)] != entries:
            first = next(n for n, (a, b) in enumerate(zip(self.entries, entries), start=1) if a != b)
            raise CheckpointError(
                f"{self.path} line {first} differs from release {first} that {where} recorded: the privacy ledger and the "
                "checkpoint are of different runs or were edited; restore them together, or start the run again"
            )

    def _take(self, entry: Any, where: str) -> None:
        """Count ``entry``, checked: a release linked to the last entry."""
        ok = (
            isinstance(entry, Mapping) and _count(entry.get("round")) and isinstance(entry.get("digest"), str)
            and (entry.get("client") is None or _count(entry["client"]))
            and (entry.get("clients") is None or (isinstance(entry["clients"], list) and all(map(_count, entry["clients"]))))
            and isinstance(entry.get("prev"), str)
        )
        if not ok:
            raise CheckpointError(f"{where}: {json.dumps(entry, default=str)[:80]} is not a release (round, client, digest, prev); the privacy ledger was edited or not written by contrafl")
        if entry["prev"] != self.head:
            raise CheckpointError(f"{where} does not follow the release before it (its prev hash differs): a release was removed or edited; restore the privacy ledger, or start the run again")
        key = (entry["round"], entry["client"], entry["digest"])
        self._keys.add(key)
        self.entries.append(dict(entry))
        self.head = link(entry)
        self._rounds.add(entry["round"])
        self._aggregates += entry["client"] is None
        for c in entry.get("clients") or ([] if entry["client"] is None else [entry["client"]]):
            self._per_client[c] = self._per_client.get(c, 0) + 1

    def aggregates(self) -> int:
        """The central aggregates released."""
        return self._aggregates

    def most_per_client(self) -> int:
        """The releases of the client that has the most: its noisy replies, or the central
        aggregates that list it."""
        return max(self._per_client.values(), default=0)

    def has_round(self, round: int) -> bool:
        return round in self._rounds


def link(entry: Mapping[str, Any]) -> str:
    """The hash an entry's successor names as ``prev``: SHA-256 of its canonical JSON."""
    return hashlib.sha256(json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def _count(value: Any) -> bool:
    """A whole number >= 0 (a round or a client id)."""
    return is_whole(value) and value >= 0


def release_digest(tensors: Iterable[torch.Tensor]) -> str:
    """A SHA-256 of ``tensors``' values (shape, dtype and bytes): the same release computed
    again has the same digest."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def protect_labels(payload: Any, message: Any, rep_clip: float | None, hide: bool) -> Any:
    """``payload`` with every per-label table's rows clipped to ``rep_clip`` (when given)
    and, with ``hide``, a row for every label (a compact table, one row per marked label,
    is spread out to ``[C, d]``), its label marks set for every label (``counts`` 1,
    ``mask`` True) and each absent label's row made an empty update: the message's row
    where the message has a table of that shape, else zeros. The table then has the same
    shape and marks whatever labels the client holds, and the noise covers every row
    alike."""
    if is_label_table(payload):
        reps = payload["reps"]
        if rep_clip is not None:
            norms = reps.double().norm(dim=1, keepdim=True)
            reps = reps * (rep_clip / norms).clamp(max=1.0).to(reps.dtype)
        out = {**payload, "reps": reps}
        if hide:
            marks = payload["counts"] if "counts" in payload else payload["mask"]
            if len(reps) != len(marks):  # a compact table (FedSSC's): one row per marked label
                reps = reps.new_zeros(len(marks), reps.shape[1]).index_copy(0, torch.nonzero(marks > 0).flatten(), reps)
            ref = message.get("reps") if isinstance(message, Mapping) else None
            empty = ref.to(reps) if isinstance(ref, torch.Tensor) and ref.shape == reps.shape else torch.zeros_like(reps)
            out["reps"] = torch.where((marks > 0)[:, None], reps, empty)
            out.update({k: torch.ones_like(v) for k, v in payload.items() if k in ("counts", "mask")})
        return out
    if isinstance(payload, Mapping):
        return {k: protect_labels(v, message.get(k) if isinstance(message, Mapping) else None, rep_clip, hide) for k, v in payload.items()}
    if isinstance(payload, (list, tuple)):
        refs = message if isinstance(message, (list, tuple)) and len(message) == len(payload) else [None] * len(payload)
        return type(payload)(protect_labels(v, r, rep_clip, hide) for v, r in zip(payload, refs))
    return payload


def clip(payload: Any, message: Any, bound: float) -> tuple[Any, float]:
    """``(payload with its update clipped to norm bound, the update's norm before)``."""
    norm = vector_norm(updates(payload, message))
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return (payload if scale == 1.0 else map_update(payload, message, lambda k, u: u * scale)), norm


def gaussian(shapes: list[torch.Tensor], std: float, generator: torch.Generator) -> list[torch.Tensor]:
    """One ``N(0, std^2)`` tensor like each of ``shapes`` (float32 on the CPU, drawn in
    order from ``generator``: reproducible)."""
    return [std * torch.randn(u.shape, generator=generator, dtype=torch.float32) for u in shapes]


def secret_normal(n: int) -> torch.Tensor:
    """``n`` draws of ``N(0, 1)`` (float64) from the operating system's CSPRNG
    (``os.urandom``), by the Box-Muller transform of uniforms ``u = (k + 1/2) / 2^53``,
    ``k`` 53 random bits::

        z = sqrt(-2 ln u_1) * (cos(2 pi u_2), sin(2 pi u_2))
    """
    pairs = (n + 1) // 2
    bits = torch.frombuffer(bytearray(os.urandom(16 * pairs)), dtype=torch.int64) if pairs else torch.zeros(0, dtype=torch.int64)
    u = ((bits & (2**53 - 1)).double() + 0.5) * 2.0**-53
    u1, u2 = u[:pairs], u[pairs:]
    r, theta = torch.sqrt(-2 * torch.log(u1)), 2 * math.pi * u2
    return torch.cat([r * torch.cos(theta), r * torch.sin(theta)])[:n]


def secret_gaussian(shapes: list[torch.Tensor], std: float) -> list[torch.Tensor]:
    """One ``N(0, std^2)`` tensor like each of ``shapes`` (float32 on the CPU) from the
    operating system's CSPRNG (:func:`secret_normal`): nothing in the run's files or
    state determines it."""
    z = secret_normal(sum(u.numel() for u in shapes))
    out, start = [], 0
    for u in shapes:
        out.append((std * z[start : start + u.numel()]).to(torch.float32).view(u.shape))
        start += u.numel()
    return out


def add_noise(payload: Any, message: Any, noise: list[torch.Tensor]) -> Any:
    """``payload`` with ``noise[k]`` added to its ``k``-th update tensor."""
    if len(noise) != len(float_leaves(payload)):
        raise ValueError("the noise does not match the reply's update tensors")
    return map_update(payload, message, lambda k, u: u + noise[k].to(u))


class Accountant:
    """Epsilon at ``delta`` of ``k`` compositions of a release, with dp-accounting's RDP
    accountant (Mironov 2017; Wang, Balle and Kasiviswanathan 2019 for sampling).

    ``events`` are descriptions of one release that each bound its privacy loss; epsilon
    is the smallest of their bounds. Each event's RDP at every order is computed once;
    ``k`` releases have ``k`` times it (what the library's ``compose(event, k)``
    computes), so a round's epsilon costs one conversion whatever ``k`` is (:meth:`of`
    chooses the events).
    """

    def __init__(self, events: tuple[Any, ...], relation: str, delta: float, noisy: bool = True) -> None:
        self.events, self.relation, self.delta, self.noisy = events, relation, delta, noisy
        self._epsilons: dict[int, float] = {}

    @classmethod
    def of(cls, mode: str, sampling: str, z: float, delta: float, num_clients: int, sampled: int) -> Accountant:
        """The accountant of a run (docs/privacy.md, "Epsilon"):

        - ``central``, every client in every round (``full``): ``GaussianDpEvent(z)`` per
          round, neighbouring federations differing by one client added or removed
          (sensitivity ``C``).
        - ``central``, ``m`` of ``N`` clients drawn secretly (``sampling=secret``):
          ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))`` per round;
          that accounting needs neighbours that differ by one client replaced, which
          moves the sum of clipped updates by up to ``2C``, hence ``z / 2``. A client
          takes part in at most every round, so ``GaussianDpEvent(z / 2)`` per round
          bounds it too, and is the smaller bound for little noise (``z`` about 0.5).
        - ``central``, a public sample (``sampling=seeded``): no amplification, since
          everyone who has ``config.yaml`` knows who took part; ``GaussianDpEvent(z / 2)``
          (replace-one, as for the secret sample) for each round a client took part in,
          reported for the client that took part most often.
        - ``local``: a client's own releases, ``GaussianDpEvent(z / 2)`` each (its whole
          data replaced moves its clipped update by up to ``2C``), reported for the client
          that sent most.
        """
        from dp_accounting import dp_event

        if mode == "central" and sampling == "full":
            return cls((dp_event.GaussianDpEvent(z),), "add_or_remove_one", delta, z > 0)
        gaussian = dp_event.GaussianDpEvent(z / 2)
        if mode == "central" and sampling == "secret":
            return cls((dp_event.SampledWithoutReplacementDpEvent(num_clients, sampled, gaussian), gaussian), "replace_one", delta, z > 0)
        return cls((gaussian,), "replace_one", delta, z > 0)

    @functools.cached_property
    def _units(self) -> list[tuple[Any, Any]]:
        """Each event's RDP orders and its RDP at each (one composition)."""
        from dp_accounting import privacy_accountant
        from dp_accounting.rdp import RdpAccountant

        relation = getattr(privacy_accountant.NeighboringRelation, self.relation.upper())
        units = []
        for event in self.events:
            accountant = RdpAccountant(neighboring_relation=relation)
            accountant.compose(event, 1)
            units.append((accountant._orders, accountant._rdp))  # the library keeps no public getter of the RDP curve
        return units

    def epsilon(self, releases: int) -> float | None:
        """Epsilon after ``releases`` compositions (the smallest of the events' bounds):
        0 for none, None (no guarantee) when the noise multiplier is 0."""
        if releases == 0:
            return 0.0
        if not self.noisy:
            return None
        if releases not in self._epsilons:
            from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

            self._epsilons[releases] = min(float(compute_epsilon(orders, releases * rdp, self.delta)[0]) for orders, rdp in self._units)
        return self._epsilons[releases]


def require_accounting() -> None:
    """A one-line error when dp-accounting is not installed."""
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        raise ConfigError('dp needs the dp-accounting package for its privacy accountant; pip install "contrafl[privacy]"') from None
