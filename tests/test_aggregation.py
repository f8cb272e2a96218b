"""Server aggregation rules against their formulas."""

import torch

from contrafl.algorithms.aggregation import sample_weights, weighted_average
from contrafl.algorithms.base import Reply
from contrafl.algorithms.server_opt import ServerOptimizer


def test_sample_weights():
    replies = [Reply(0, 10, {}), Reply(1, 30, {}), Reply(2, 60, {})]
    assert sample_weights(replies) == [0.1, 0.3, 0.6]


def test_weighted_average_equals_formula():
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g),
               "bn.num_batches_tracked": torch.tensor(k * 7)} for k in range(1, 4)]
    weights = [0.2, 0.5, 0.3]
    avg = weighted_average(states, weights)
    for key in ("w", "b"):
        expected = sum(w * s[key] for s, w in zip(states, weights))
        torch.testing.assert_close(avg[key], expected)
    # 0.2*7 + 0.5*14 + 0.3*21 = 14.7 -> truncated like MOON's load_state_dict
    assert avg["bn.num_batches_tracked"].dtype == torch.int64
    assert avg["bn.num_batches_tracked"].item() == 14
    # inputs are not modified
    assert states[0]["w"].shape == (4, 3)


def test_server_momentum_is_moon_fedavgm():
    """v = beta v + (1 - beta)(w_old - w_avg); w = w_old - v (MOON main.py)."""
    opt = ServerOptimizer(lr=1.0, momentum=0.9)
    w0 = {"w": torch.tensor([1.0, 2.0])}
    a1 = {"w": torch.tensor([0.5, 1.0])}
    w1 = opt.step(w0, a1)
    v1 = 0.1 * (w0["w"] - a1["w"])
    torch.testing.assert_close(w1["w"], w0["w"] - v1)
    a2 = {"w": torch.tensor([0.0, 0.0])}
    w2 = opt.step(w1, a2)
    v2 = 0.9 * v1 + 0.1 * (w1["w"] - a2["w"])
    torch.testing.assert_close(w2["w"], w1["w"] - v2)


def test_server_optimizer_identity_without_momentum():
    opt = ServerOptimizer()
    agg = {"w": torch.randn(3)}
    assert opt.step({"w": torch.zeros(3)}, agg) is agg
