"""Server-side optimisation applied on top of any algorithm's aggregate.

The aggregate ``w_agg`` proposed by an algorithm defines the pseudo-gradient
``delta = w_old - w_agg``. With momentum this is FedAvgM as implemented in MOON's
reference code (MOON Appendix E, Table 10)::

    v = beta * v + (1 - beta) * delta
    w = w_old - server_lr * v

(Hsu et al.'s undamped form ``v = beta * v + delta`` is the same rule with ``server_lr``
multiplied by ``1 - beta``.) With ``beta = 0`` and ``server_lr = 1`` the aggregate is
taken as it is. Only floating-point entries are updated; integer buffers take the
aggregated value.
"""

from __future__ import annotations

import torch

from .base import StateDict


class ServerOptimizer:
    """Momentum SGD on the server's pseudo-gradient (FedAvgM)."""

    def __init__(self, lr: float = 1.0, momentum: float = 0.0) -> None:
        self.lr, self.momentum = lr, momentum
        self.velocity: StateDict = {}

    @property
    def is_identity(self) -> bool:
        return self.lr == 1.0 and self.momentum == 0.0

    @torch.no_grad()
    def step(self, old: StateDict, aggregate: StateDict) -> StateDict:
        if self.is_identity:
            return aggregate
        new: StateDict = {}
        for key, agg in aggregate.items():
            if not agg.is_floating_point():
                new[key] = agg
                continue
            delta = old[key] - agg
            if key in self.velocity:
                v = self.velocity[key].mul_(self.momentum).add_(delta, alpha=1 - self.momentum)
            else:
                v = delta * (1 - self.momentum)
            self.velocity[key] = v
            new[key] = old[key] - self.lr * v
        return new

    def state_dict(self) -> dict:
        return {"velocity": self.velocity}

    def load_state_dict(self, state: dict) -> None:
        self.velocity = dict(state["velocity"])
