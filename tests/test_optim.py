"""The functional client optimisers follow torch.optim exactly."""

import pytest
import torch

from contrafl.engine.optim import SGD, Adam


def _run_reference(opt_cls, kwargs, params0, grads_seq):
    params = [p.clone().requires_grad_() for p in params0]
    opt = opt_cls(params, **kwargs)
    for grads in grads_seq:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def _data(steps=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    params0 = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(3, 4, generator=g), torch.randn(5, generator=g)] for _ in range(steps)]
    return params0, grads


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-2), (0.5, 1e-5)])
def test_sgd_matches_torch(momentum, wd):
    params0, grads = _data()
    ref = _run_reference(torch.optim.SGD, dict(lr=0.1, momentum=momentum, weight_decay=wd), params0, grads)
    opt = SGD(lr=0.1, momentum=momentum, weight_decay=wd)
    params = [p.clone() for p in params0]
    state = opt.init(params)
    for gs in grads:
        opt.step(params, gs, state)
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("wd", [0.0, 1e-3])
def test_adam_matches_torch(wd):
    params0, grads = _data()
    ref = _run_reference(torch.optim.Adam, dict(lr=0.01, weight_decay=wd), params0, grads)
    opt = Adam(lr=0.01, weight_decay=wd)
    params = [p.clone() for p in params0]
    state = opt.init(params)
    for gs in grads:
        opt.step(params, gs, state)
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adam_stacked_clients_with_different_histories():
    """Stacked parameters with per-client step counts update like separate optimisers."""
    params0, grads = _data(steps=4, seed=1)
    opt = Adam(lr=0.05)
    # client 0 takes 4 steps alone first; then both clients take 4 steps stacked
    single = [p.clone() for p in params0]
    s_state = opt.init(single)
    for gs in grads:
        opt.step(single, gs, s_state)
    stacked = [torch.stack([s, p]) for s, p in zip(single, params0)]
    st_state = opt.init(stacked, lead=(2,))
    st_state["exp_avg"] = [torch.stack([a, torch.zeros_like(a)]) for a in s_state["exp_avg"]]
    st_state["exp_avg_sq"] = [torch.stack([a, torch.zeros_like(a)]) for a in s_state["exp_avg_sq"]]
    st_state["step"] = torch.tensor([4.0, 0.0])
    fresh = [p.clone() for p in params0]
    f_state = opt.init(fresh)
    for gs in grads:
        opt.step(stacked, [torch.stack([g, g]) for g in gs], st_state)
        opt.step(single, gs, s_state)
        opt.step(fresh, gs, f_state)
    for st, a, b in zip(stacked, single, fresh):
        torch.testing.assert_close(st[0], a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st[1], b, rtol=1e-5, atol=1e-6)
