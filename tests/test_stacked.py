"""Stacked forwards (contrafl.models.stacked) and where ``auto`` stacks clients on a CPU."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

from contrafl.config import load_config
from contrafl.engine.setup import prepare
from contrafl.execution.stacked import STACK_WIDTH, stack_width
from contrafl.models import stacked
from contrafl.models.base import FedModel, Heads
from contrafl.models.build import build_model

K, B = 3, 4

MODELS = {
    "moon_cnn": lambda: build_model("moon_cnn", (3, 16, 16), 10),
    "fedavg_cnn": lambda: build_model("fedavg_cnn", (1, 20, 20), 5, {"dim": 12}),
    "mlp, predictor and extra heads": lambda: build_model(
        "mlp", (2, 3), 4, {"hidden": [7, 5], "projection_dim": 6}, heads=Heads(predictor_hidden=3, predictor_bn=False, extra=(("aux", 2),))
    ),
    "mlp without projection or hidden layers": lambda: build_model("mlp", (5,), 3, {"hidden": [], "projection": False}),
}


@pytest.mark.parametrize("name", MODELS)
def test_a_stacked_forward_is_each_clients_forward(name):
    """Every output of the stacked forward of K clients is client k's own forward of
    x[k] under its own parameters, and so are the gradients of the summed losses."""
    torch.manual_seed(0)
    model = MODELS[name]()
    forward = stacked.stacked_forward(model)
    assert forward is not None
    state = {k: torch.stack([v + 0.1 * torch.randn_like(v) for _ in range(K)]).requires_grad_() for k, v in model.state_dict().items()}
    shape = (3, 16, 16) if name == "moon_cnn" else (1, 20, 20) if name == "fedavg_cnn" else (2, 3) if "predictor" in name else (5,)
    x = torch.randn(K, B, *shape)
    out = forward(state, x)
    own = [functional_call(model, {k: v[i] for k, v in state.items()}, (x[i],)) for i in range(K)]
    for field in ("h", "z", "logits", "p"):
        got = getattr(out, field)
        if getattr(own[0], field) is None:
            assert got is None
            continue
        torch.testing.assert_close(got, torch.stack([getattr(o, field) for o in own]), rtol=1e-5, atol=1e-5)
    if own[0].extra is not None:
        torch.testing.assert_close(out.extra["aux"], torch.stack([o.extra["aux"] for o in own]), rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(_total(out), list(state.values()))
    each = [torch.autograd.grad(_total(o), list(state.values())) for o in own]
    for i, g in enumerate(grads):  # to float rounding, relative to the gradient's scale (sums of many terms)
        expected = sum(e[i] for e in each)
        assert (g - expected).abs().max() <= 1e-5 * (1 + expected.abs().max())


def _total(out):
    """A loss of every output: the sum of their squares."""
    parts = [out.h, out.z, out.logits, out.p, *(out.extra or {}).values()]
    return sum(t.square().sum() for t in parts if t is not None)


class Encoder(nn.Module):
    """An encoder of a type no stacked forward knows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x).tanh()


def test_no_stacked_forward_where_clients_would_mix_or_the_layers_are_unknown(monkeypatch):
    """BatchNorm (batch statistics) and dropout (random masks) are per client; an encoder
    of an unknown type, or a Sequential with other layers, is not known. A registered
    type (a plugin's) is."""
    assert stacked.stacked_forward(build_model("resnet18", (3, 32, 32), 10)) is None
    assert stacked.stacked_forward(build_model("mlp", (5,), 3, {"dropout": 0.5})) is None
    assert stacked.stacked_forward(build_model("mlp", (5,), 3, {"projection_bn": True})) is None
    assert stacked.stacked_forward(FedModel(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), 3, 2)) is None
    assert stacked.stacked_forward(FedModel(Encoder(), 3, 2)) is None
    assert stacked.stacked_forward(nn.Linear(3, 2)) is None
    monkeypatch.setattr(stacked, "_ENCODERS", dict(stacked._ENCODERS))
    stacked.register(Encoder, lambda m, state, x: stacked.linear(x, state, "fc").tanh())
    model = FedModel(Encoder(), 3, 2, projection_dim=None)
    forward = stacked.stacked_forward(model)
    state = {k: torch.stack([v, 2 * v]) for k, v in model.state_dict().items()}
    x = torch.randn(2, 5, 4)
    expected = functional_call(model, {k: v[1] for k, v in state.items()}, (x[1],)).logits
    torch.testing.assert_close(forward(state, x).logits[1], expected)


def test_stack_width():
    """Clients stacked a few at a time train together while they have steps of one
    batch size: 25 clients of 51 samples in batches of 10 train 6 steps (5 of 10 and one
    of 1) in 6 stacked steps; clients of unequal sizes in more."""
    assert stack_width([51] * 50, 25, 10, 1, False) == 25.0
    assert stack_width([51] * 50, 25, 10, 1, True) == 25.0  # the short batch dropped
    assert stack_width([50, 20], 2, 10, 1, False) == pytest.approx(7 / 5)  # 5 and 2 steps
    assert stack_width([55, 53], 2, 10, 1, False) == pytest.approx(12 / 7)  # the last steps: sizes 5 and 3
    assert stack_width([55, 53], 1, 10, 2, False) == 1.0
    assert stack_width([], 4, 10, 1, False) == 0.0
    assert stack_width([3], 4, 10, 1, True) == 0.0  # no step at all


DIGITS = ["dataset=digits", "model=mlp", "algorithm=fedavg", "executor=distributed", "workers=2", "batch_size=10", "rounds=1"]


@pytest.mark.parametrize(
    "settings, stacks",
    [
        (["num_clients=20", "partition=iid"], True),  # 10 clients a rank of 67-68 samples: width 8.75
        (["num_clients=20", "partition=iid", "rank_executor=sequential"], False),  # as asked
        (["num_clients=20", "partition=iid", "model.dropout=0.5"], False),  # no stacked forward
        (["num_clients=20", "partition=iid", "model.projection_bn=true"], False),
        (["num_clients=10", "partition=dirichlet", "partition.beta=0.1"], False),  # unequal clients: narrow stacks
        (["num_clients=20", "partition=iid", "sample_fraction=0.5"], False),  # 5 clients a rank
    ],
)
def test_auto_stacks_clients_on_a_cpu_where_they_step_together(settings, stacks):
    """``rank_executor=auto`` on a CPU trains a rank's clients stacked (the vectorized
    executor) when the model has a stacked forward, the algorithm vectorises, and the
    clients take their steps together (at least STACK_WIDTH a step); otherwise one after
    the other."""
    cfg = prepare(load_config(None, [*DIGITS, *settings])).config
    assert cfg.rank_executor == ("vectorized" if stacks else "sequential")
    assert STACK_WIDTH == 8


@pytest.mark.parametrize("clients, stacks", [(10, True), (4, False)])
def test_auto_stacks_the_clients_of_a_single_core(monkeypatch, clients, stacks):
    """``executor=auto`` on one core: the vectorized executor where the round's clients
    step together (10 clients of 134-135 samples: width 9.3), else the sequential one."""
    from contrafl.engine import setup

    monkeypatch.setattr(setup, "cpu_cores", lambda: 1)
    cfg = prepare(load_config(None, [*DIGITS[:3], "batch_size=10", f"num_clients={clients}", "partition=iid"])).config
    assert cfg.executor == ("vectorized" if stacks else "sequential")
