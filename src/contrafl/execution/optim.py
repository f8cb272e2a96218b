"""Client optimisers written once, in plain tensor code.

They update lists of tensors in place and keep their state in plain dicts, so the same
code serves one client (tensors of the model's shapes) and many clients at once (tensors
with a leading client dimension). The update rules are PyTorch's ``torch.optim.SGD`` and
``torch.optim.Adam`` (L2 weight decay added to the gradient).
"""

from __future__ import annotations

import torch

OptState = dict[str, list[torch.Tensor] | torch.Tensor]


def present(
    params: list[torch.Tensor], grads: list[torch.Tensor | None], state: OptState
) -> tuple[list[torch.Tensor], list[torch.Tensor], OptState]:
    """The parameters that have a gradient, their gradients and their state entries.

    Like ``torch.optim``, a parameter whose gradient is ``None`` (the loss does not
    depend on it) is skipped: no weight decay, no momentum, no Adam step."""
    keep = [i for i, g in enumerate(grads) if g is not None]
    if len(keep) == len(grads):
        return params, grads, state  # type: ignore[return-value]
    return (
        [params[i] for i in keep],
        [grads[i] for i in keep],  # type: ignore[misc]
        {k: [v[i] for i in keep] for k, v in state.items()},
    )


class SGD:
    """SGD with momentum and L2 weight decay (``torch.optim.SGD`` with dampening 0)::

        d = g + weight_decay * w
        b = momentum * b + d          (b starts at 0, so the first step has b = d)
        w = w - lr * b
    """

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay

    def init(self, params: list[torch.Tensor]) -> OptState:
        if not self.momentum:
            return {}
        return {"momentum": [torch.zeros_like(p) for p in params]}

    @torch.no_grad()
    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor | None], state: OptState) -> None:
        params, grads, state = present(params, grads, state)
        if not params:
            return
        if self.weight_decay:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        if self.momentum:
            bufs = state["momentum"]
            torch._foreach_mul_(bufs, self.momentum)
            torch._foreach_add_(bufs, grads)
            grads = bufs
        torch._foreach_add_(params, grads, alpha=-self.lr)


class Adam:
    """Adam with L2 weight decay (``torch.optim.Adam``, ``amsgrad=False``)::

        d = g + weight_decay * w
        m = b1 * m + (1 - b1) * d ;  v = b2 * v + (1 - b2) * d^2 ;  t = t + 1
        w = w - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    Every parameter has its own step count ``t`` (as in ``torch.optim``, a parameter
    without a gradient is not stepped), a float tensor shaped like the leading
    (client) dimensions of the parameters when they are stacked for many clients, so
    clients with different histories share one update.
    """

    def __init__(
        self,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay

    def init(self, params: list[torch.Tensor]) -> OptState:
        return {
            "exp_avg": [torch.zeros_like(p) for p in params],
            "exp_avg_sq": [torch.zeros_like(p) for p in params],
            "step": [torch.zeros((), dtype=torch.float32, device=p.device) for p in params],
        }

    @torch.no_grad()
    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor | None], state: OptState) -> None:
        params, grads, state = present(params, grads, state)
        if not params:
            return
        b1, b2 = self.betas
        if self.weight_decay:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        m, v, steps = state["exp_avg"], state["exp_avg_sq"], state["step"]
        torch._foreach_lerp_(m, grads, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
        torch._foreach_add_(steps, 1)
        for p, mi, vi, step in zip(params, m, v, steps):
            shape = step.shape + (1,) * (p.dim() - step.dim())
            bc1 = 1 - b1**step
            bc2_sqrt = (1 - b2**step).sqrt()
            denom = (vi.sqrt() / bc2_sqrt.reshape(shape)).add_(self.eps)
            p.addcdiv_(mi, denom * bc1.reshape(shape), value=-self.lr)


def make_optimizer(
    name: str, lr: float, momentum: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999)
) -> SGD | Adam:
    """The client optimiser named in the configuration."""
    if name == "sgd":
        return SGD(lr, momentum, weight_decay)
    return Adam(lr, betas, weight_decay=weight_decay)
