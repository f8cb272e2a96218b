"""Client-level differential privacy (``dp=central`` or ``dp=local``).

A client's update ``u_i`` is every floating-point tensor of its reply's payload minus the
tensor of the same name in the message it trained on (the tensor itself where the
message has none: SCAFFOLD's ``delta_c``, prototypes), as one vector
(:func:`~contrafl.engine.validate.update_norm`). DP-FedAvg (McMahan et al., ICLR 2018)
bounds each client's influence by clipping it to the norm ``C`` (``dp.clip``)::

    clip(u_i) = u_i * min(1, C / ||u_i||)

and adds Gaussian noise of standard deviation ``sigma = z * C`` (``z``:
``dp.noise_multiplier``) to what leaves the trusted party:

- ``central``: the server (trusted) clips every reply and adds one draw ``xi`` of
  ``N(0, (sigma / m)^2 I)`` to each of the ``m`` replies it aggregates. The algorithm's
  aggregate is an affine function of the replies' sum with equal weights (every reply
  counts as one sample), so the sum gets ``m * xi ~ N(0, sigma^2 I)``: the Gaussian
  mechanism on the sum of clipped updates, whose l2 sensitivity is ``C``.
- ``local``: each client clips its own update and adds ``N(0, sigma^2 I)`` before it
  sends it; the server sees nothing else of the client's data.

Noise is drawn from the streams ``(seed, "dp", round)`` (central) and ``(seed, "dp",
round, client)`` (local), so a run is reproducible and a Flower deployment draws the same
noise as the simulator. :class:`Accountant` reports epsilon at ``dp.delta`` with
dp-accounting's RDP accountant.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import params as P
from ..algorithms.base import Reply
from ..config import Config
from ..errors import ConfigError
from ..rng import generator

DP_MODES = {
    "none": "no differential privacy (the default)",
    "central": "the server clips each update to dp.clip and adds N(0, (z C)^2) to their sum (a trusted server; needs an algorithm that aggregates sums)",
    "local": "each client clips its update and adds N(0, (z C)^2) before sending (no trust in the server; much more noise)",
}
MODES = tuple(DP_MODES)


@dataclass(frozen=True)
class DPParams:
    """Options of the ``dp`` setting."""

    clip: float = P.param(1.0, P.Interval(0, None, "neither"), "C: l2 bound of each client's update (all floating-point tensors of its reply, as one vector)")
    noise_multiplier: float = P.param(1.0, P.Interval(0, None), "z: the Gaussian noise's standard deviation is z * C on the sum of the updates (central) or on each update (local)")
    delta: float = P.param(1e-5, P.Interval(0, 1, "neither"), "delta at which epsilon is reported (take it below 1 / num_clients)")
    rep_clip: float | None = P.param(None, P.Interval(0, None, "neither"), "per-label tables (prototypes): clip each label's representation to this l2 norm before the update's clip (none: only the update's clip)")
    labels: str = P.param("hide", P.OneOf(("hide", "clear")), "per-label tables: hide which labels a client holds (every label's row is sent, absent ones as zeros under the noise, and every label counts once) or send the label counts in the clear (not covered by DP)")


class Privacy:
    """A run's client-level DP (``dp=central`` or ``dp=local``, the module doc) and the
    releases it has counted, which the run's checkpoint keeps (:meth:`state_dict`).

    Args:
        cfg: the run's resolved configuration (``dp`` not ``none``).
        sampled: clients sampled per round (``m`` of the accounting).
    """

    def __init__(self, cfg: Config, sampled: int) -> None:
        self.mode = cfg.dp.name
        self.params: DPParams = P.build(DPParams, cfg.dp.options, "dp")
        self.seed, self.num_clients, self.sampled = cfg.seed, cfg.num_clients, sampled
        self.releases = 0  # central: rounds whose aggregate was released
        self.client_releases: dict[int, int] = {}  # local: each client's noisy replies

    @classmethod
    def of(cls, cfg: Config, sampled: int) -> Privacy | None:
        """The run's DP, or None when ``dp=none``."""
        return None if cfg.dp.name == "none" else cls(cfg, sampled)

    def privatize(self, reply: Reply, message: Any, t: int) -> Reply:
        """``dp=local``: the reply a client sends, its per-label tables protected
        (:func:`protect_labels`), its update clipped to ``C`` plus ``N(0, (z C)^2)`` noise
        from the stream ``(seed, "dp", t, cid)``, counting as one sample."""
        p = self.params
        payload = protect_labels(reply.payload, p.rep_clip, p.labels == "hide")
        payload, _ = clip(payload, message, p.clip)
        noise = gaussian(updates(payload, message), p.noise_multiplier * p.clip, generator(self.seed, "dp", t, reply.cid))
        return Reply(reply.cid, 1, add_noise(payload, message, noise))

    def central(self, replies: list[Reply], messages: Mapping[int, Any], t: int) -> tuple[list[Reply], int]:
        """``dp=central``: the replies clipped to ``C``, each counting as one sample, with
        one draw ``xi ~ N(0, (z C / m)^2)`` from the stream ``(seed, "dp", t)`` added to
        each of the ``m`` replies' updates (the aggregate's sum then carries
        ``N(0, (z C)^2)``); and how many were clipped."""
        p = self.params
        clipped, out = 0, []
        for r in replies:
            payload, norm = clip(r.payload, messages[r.cid], p.clip)
            clipped += norm > p.clip
            out.append((r.cid, payload))
        if not out:
            return [], 0
        std = p.noise_multiplier * p.clip / len(out)
        xi = gaussian(updates(out[0][1], messages[out[0][0]]), std, generator(self.seed, "dp", t))
        return [Reply(cid, 1, add_noise(payload, messages[cid], xi)) for cid, payload in out], clipped

    @functools.cached_property
    def accountant(self) -> Accountant:
        """The run's accountant, built on first use: a client's process (a Flower
        SuperNode's) needs no dp-accounting."""
        return Accountant(self.mode, self.params.noise_multiplier, self.params.delta, self.num_clients, self.sampled)

    def spent(self) -> int:
        """The releases so far (local: of the client that has sent most)."""
        return self.releases if self.mode == "central" else max(self.client_releases.values(), default=0)

    def count(self, cids: list[int]) -> dict[str, Any]:
        """Count a round's releases (central: the aggregate of the replies of ``cids``, if
        any; local: each of ``cids``'s noisy reply): its row's ``dp_epsilon`` (epsilon so
        far at ``delta``) and ``dp_releases``."""
        if self.mode == "central":
            self.releases += bool(cids)
        else:
            for cid in cids:
                self.client_releases[cid] = self.client_releases.get(cid, 0) + 1
        return {"dp_epsilon": self.accountant.epsilon(self.spent()), "dp_releases": self.spent()}

    def summary(self) -> dict[str, Any]:
        """The summary's ``dp`` block."""
        return {
            "mode": self.mode, "epsilon": self.accountant.epsilon(self.spent()), "delta": self.params.delta,
            "releases": self.spent(), "neighbouring": self.accountant.relation,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"releases": self.releases, "client_releases": self.client_releases}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.releases = int(state.get("releases", 0))
        self.client_releases = {int(c): int(n) for c, n in state.get("client_releases", {}).items()}


def map_update(payload: Any, message: Any, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> Any:
    """``payload`` with every floating-point tensor ``p`` (update ``u = p - m``, ``m`` the
    message's tensor of the same name and shape, else 0) replaced by ``m + fn(k, u)``,
    ``k`` numbering the tensors in the payload's order."""
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
        return value

    return walk(payload, message)


def updates(payload: Any, message: Any) -> list[torch.Tensor]:
    """The update's tensors ``u_k`` in :func:`map_update`'s order."""
    out: list[torch.Tensor] = []
    map_update(payload, message, lambda k, u: out.append(u) or u)
    return out


def is_label_table(value: Any) -> bool:
    """A per-label table of a reply (:mod:`contrafl.algorithms.prototypes`): a mapping with
    ``reps`` (float ``[C, d]``) and ``counts`` (integer ``[C]``, FedCRL, FedProto, FedPAC,
    FedGH) or ``mask`` (bool ``[C]``, FedSSC)."""
    if not isinstance(value, Mapping) or not isinstance(value.get("reps"), torch.Tensor) or value["reps"].dim() != 2:
        return False
    marks = [value.get(k) for k in ("counts", "mask")]
    return any(isinstance(m, torch.Tensor) and m.dim() == 1 and not m.is_floating_point() for m in marks)


def protect_labels(payload: Any, rep_clip: float | None, hide: bool) -> Any:
    """``payload`` with every per-label table's rows clipped to ``rep_clip`` (when given)
    and, with ``hide``, its label marks set for every label (``counts`` 1, ``mask``
    True): the table then has the same shape and marks whatever labels the client holds,
    an absent label's row being zeros, which the noise hides like any other row."""
    if isinstance(payload, Mapping) and is_label_table(payload):
        reps = payload["reps"]
        if rep_clip is not None:
            norms = reps.double().norm(dim=1, keepdim=True)
            reps = reps * (rep_clip / norms).clamp(max=1.0).to(reps.dtype)
        out = {**payload, "reps": reps}
        if hide:
            out.update({k: torch.ones_like(v) for k, v in payload.items() if k in ("counts", "mask")})
        return out
    if isinstance(payload, Mapping):
        return {k: protect_labels(v, rep_clip, hide) for k, v in payload.items()}
    return payload


def clip(payload: Any, message: Any, bound: float) -> tuple[Any, float]:
    """``(payload with its update clipped to norm bound, the update's norm before)``."""
    norm = math.sqrt(sum(float(u.double().pow(2).sum()) for u in updates(payload, message)))
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return (payload if scale == 1.0 else map_update(payload, message, lambda k, u: u * scale)), norm


def gaussian(shapes: list[torch.Tensor], std: float, generator: torch.Generator) -> list[torch.Tensor]:
    """One ``N(0, std^2)`` tensor like each of ``shapes`` (float32 on the CPU, drawn in order)."""
    return [std * torch.randn(u.shape, generator=generator, dtype=torch.float32) for u in shapes]


def add_noise(payload: Any, message: Any, noise: list[torch.Tensor]) -> Any:
    """``payload`` with ``noise[k]`` added to its ``k``-th update tensor."""
    if len(noise) != len(updates(payload, message)):
        raise ValueError("the noise does not match the reply's update tensors")
    return map_update(payload, message, lambda k, u: u + noise[k].to(u))


class Accountant:
    """Epsilon at ``delta`` of ``releases`` Gaussian releases of noise multiplier ``z``
    on an l2 sensitivity of ``C`` (relative: ``sigma = z * C``), with dp-accounting's RDP
    accountant (Mironov 2017; Wang, Balle and Kasiviswanathan 2019 for sampling).

    - ``central`` with every client in every round: ``GaussianDpEvent(z)``, neighbouring
      federations differing by one client added or removed (sensitivity ``C``).
    - ``central`` with ``m`` of ``N`` clients sampled without replacement (contrafl's
      sampler): ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))``;
      that accounting needs neighbours that differ by one client replaced, which moves
      the sum of clipped updates by up to ``2C``, hence ``z / 2``.
    - ``local``: a client's own releases, ``GaussianDpEvent(z / 2)`` each (its whole data
      replaced moves its clipped update by up to ``2C``); the run reports the client that
      replied most often.
    """

    def __init__(self, mode: str, z: float, delta: float, num_clients: int, sampled: int) -> None:
        from dp_accounting import dp_event

        self.z, self.delta = z, delta
        self.relation = "add_or_remove_one"
        if mode == "local":
            self.event = dp_event.GaussianDpEvent(z / 2)
            self.relation = "replace_one"
        elif sampled < num_clients:
            self.event = dp_event.SampledWithoutReplacementDpEvent(num_clients, sampled, dp_event.GaussianDpEvent(z / 2))
            self.relation = "replace_one"
        else:
            self.event = dp_event.GaussianDpEvent(z)

    def epsilon(self, releases: int) -> float | None:
        """Epsilon after ``releases`` compositions of the event: 0 for none, None (no
        guarantee) when the noise multiplier is 0."""
        if releases == 0:
            return 0.0
        if self.z == 0:
            return None
        from dp_accounting import privacy_accountant
        from dp_accounting.rdp import RdpAccountant

        relation = getattr(privacy_accountant.NeighboringRelation, self.relation.upper())
        accountant = RdpAccountant(neighboring_relation=relation)
        accountant.compose(self.event, releases)
        return float(accountant.get_epsilon(self.delta))


def require_accounting() -> None:
    """A one-line error when dp-accounting is not installed."""
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        raise ConfigError('dp needs the dp-accounting package for its privacy accountant; pip install "contrafl[privacy]"') from None
