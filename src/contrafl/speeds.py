"""Client speeds of the straggler model (``client_speed``, ``round_deadline``).

A client's speed ``s_i`` is the number of local steps it takes per unit of simulated
time, so a client that plans ``K_i`` steps in a round needs ``K_i / s_i`` time units; a
speed-1 client takes one step per unit. Speeds are drawn once per run, for every client,
from the stream ``(seed, "speed")`` alone, so a client is as slow in every round, on every
executor and transport, and after a resume. The distributions (``client_speed``):

- ``constant``: ``s_i = 1`` for every client (no stragglers).
- ``lognormal:SIGMA``: ``s_i = exp(SIGMA * z_i)``, ``z_i ~ N(0, 1)``; the median client has
  speed 1 and a spread of devices as in measurements of phones (heavy slow tail).
- ``uniform:LOW,HIGH``: ``s_i ~ U(LOW, HIGH)``.
- ``slow:FRACTION,FACTOR``: ``round(FRACTION * N)`` clients chosen at random run ``FACTOR``
  times slower (``s_i = 1 / FACTOR``), the others at speed 1 (PFLlib's
  ``train_slow_rate``).

With ``speed_jitter`` J > 0 a client's speed also varies from round to round, as a
device's load does: in round ``t`` it runs at ``s_i * exp(J * z_it)``, ``z_it ~ N(0, 1)``
from the stream ``(seed, "speed", t, i)`` (:func:`round_speed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KINDS = {"constant": 0, "lognormal": 1, "uniform": 2, "slow": 2}  # name -> number of arguments


@dataclass(frozen=True)
class SpeedSpec:
    """A ``client_speed`` value (:class:`contrafl.params` constraint): a distribution's
    name and its arguments, ``lognormal:0.5``, ``uniform:0.2,1``, ``slow:0.3,4``."""

    def parse(self, value: str) -> tuple[str, tuple[float, ...]]:
        """``(name, args)`` of a valid ``value``; ValueError (saying what is wrong) else."""
        name, _, rest = value.strip().partition(":")
        name = name.strip().lower()
        if name not in KINDS:
            raise ValueError(f"unknown distribution {name!r}")
        try:
            args = tuple(float(a) for a in rest.split(",")) if rest.strip() else ()
        except ValueError:
            raise ValueError(f"arguments {rest!r} are not numbers") from None
        if len(args) != KINDS[name] or not all(math.isfinite(a) for a in args):
            raise ValueError(f"{name} takes {KINDS[name] or 'no'} number{'' if KINDS[name] == 1 else 's'}")
        if name == "lognormal" and not args[0] > 0:
            raise ValueError("lognormal's SIGMA must be > 0")
        if name == "uniform" and not 0 < args[0] <= args[1]:
            raise ValueError("uniform needs 0 < LOW <= HIGH")
        if name == "slow" and not (0 <= args[0] <= 1 and args[1] >= 1):
            raise ValueError("slow needs 0 <= FRACTION <= 1 and FACTOR >= 1")
        return name, args

    def __call__(self, value: Any) -> bool:
        try:
            self.parse(value)
        except (ValueError, AttributeError):
            return False
        return True

    def why(self, value: Any) -> str:
        """What is wrong with an invalid ``value``."""
        try:
            self.parse(value)
        except (ValueError, AttributeError) as exc:
            return str(exc)
        return "valid"

    def canonical(self, value: Any) -> Any:
        """``Uniform: 0.2, 1`` -> ``uniform:0.2,1``."""
        if not self(value):
            return value
        name, args = self.parse(value)
        return name + (":" + ",".join(f"{a:g}" for a in args) if args else "")

    def __str__(self) -> str:
        return "constant, lognormal:SIGMA, uniform:LOW,HIGH or slow:FRACTION,FACTOR"


def client_speeds(spec: str, num_clients: int, seed: int) -> torch.Tensor:
    """Every client's speed ``s_i`` (float64 ``[num_clients]``) under the distribution
    ``spec``, from the stream ``(seed, "speed")``."""
    import torch  # here: the configuration (SpeedSpec) loads without torch

    from .rng import generator

    name, args = SpeedSpec().parse(spec)
    g = generator(seed, "speed")
    if name == "lognormal":
        return torch.exp(args[0] * torch.randn(num_clients, generator=g, dtype=torch.float64))
    if name == "uniform":
        low, high = args
        return low + (high - low) * torch.rand(num_clients, generator=g, dtype=torch.float64)
    speeds = torch.ones(num_clients, dtype=torch.float64)
    if name == "slow":
        fraction, factor = args
        slow = torch.randperm(num_clients, generator=g)[: round(fraction * num_clients)]
        speeds[slow] = 1 / factor
    return speeds


def round_speed(speed: float, jitter: float, seed: int, t: int, cid: int) -> float:
    """Client ``cid``'s speed in round ``t``: ``speed * exp(jitter * z)`` with ``z ~ N(0, 1)``
    from the stream ``(seed, "speed", t, cid)``; ``speed`` itself when ``jitter`` is 0."""
    if not jitter:
        return speed
    import torch

    from .rng import generator

    z = torch.randn(1, generator=generator(seed, "speed", t, cid), dtype=torch.float64)
    return speed * math.exp(jitter * float(z))


def step_budget(deadline: float, speed: float) -> int:
    """The local steps a client of ``speed`` completes by the round's ``deadline``:
    ``floor(deadline * speed)`` (with a relative tolerance of 1e-9, so that a deadline of
    exactly ``K / s`` allows ``K`` steps despite rounding)."""
    return math.floor(deadline * speed * (1 + 1e-9))
