"""The functional client optimisers follow torch.optim exactly."""

import pytest
import torch

from contrafl.execution.optim import SGD, Adam


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
    new_state = opt.init([p.clone() for p in params0])
    st_state = {k: [torch.stack([a, b]) for a, b in zip(s_state[k], new_state[k])] for k in s_state}
    assert st_state["step"][0].tolist() == [4.0, 0.0]
    fresh = [p.clone() for p in params0]
    f_state = opt.init(fresh)
    for gs in grads:
        opt.step(stacked, [torch.stack([g, g]) for g in gs], st_state)
        opt.step(single, gs, s_state)
        opt.step(fresh, gs, f_state)
    for st, a, b in zip(stacked, single, fresh):
        torch.testing.assert_close(st[0], a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st[1], b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "opt_cls,ours,kwargs",
    [
        (torch.optim.SGD, SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
        (torch.optim.Adam, Adam, dict(lr=0.05, weight_decay=1e-2)),
    ],
)
def test_parameters_without_gradient_are_skipped_like_torch(opt_cls, ours, kwargs):
    """A parameter whose gradient is None gets no weight decay, momentum or Adam step
    (torch.optim skips it); here the second parameter has no gradient at steps 0 and 3."""
    params0, grads = _data(steps=5, seed=2)
    missing = {0, 3}
    ref = [p.clone().requires_grad_() for p in params0]
    ref_opt = opt_cls(ref, **kwargs)
    mine = [p.clone() for p in params0]
    opt = ours(**kwargs)
    state = opt.init(mine)
    for step, gs in enumerate(grads):
        gs = [gs[0], None if step in missing else gs[1]]
        for p, g in zip(ref, gs):
            p.grad = None if g is None else g.clone()
        ref_opt.step()
        opt.step(mine, gs, state)
        torch.testing.assert_close(mine[1], ref[1].detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(mine[1], params0[1])
    if ours is Adam:
        assert [float(t) for t in state["step"]] == [5.0, 3.0]
