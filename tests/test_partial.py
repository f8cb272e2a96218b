"""A share of replies as their sample-weighted mean (engine.partial, issue #36 item 1)."""

from __future__ import annotations

import torch

from contrafl.algorithms.aggregation import sample_weights, weighted_average
from contrafl.algorithms.base import Reply
from contrafl.execution.partial import IN_MEAN, restore, summed


def _reply(cid: int, n: int, value: float) -> Reply:
    g = torch.Generator().manual_seed(cid)
    return Reply(cid, n, {
        "model": {"w": torch.randn(3, 2, generator=g) + value, "tracked": torch.tensor(cid + 7)},
        "extra": [torch.randn(4, generator=g, dtype=torch.float64)],
    })


def test_the_mean_stands_for_each_reply_and_keeps_the_weighted_mean_of_all():
    """Two shares summed apart and rebuilt: the aggregate over the rebuilt replies equals
    the one over the original replies (float tolerance); integer tensors stay each
    client's own; the mean is accumulated in each tensor's dtype."""
    replies = [_reply(c, n, c) for c, n in enumerate([5, 1, 3, 8, 2])]
    rebuilt = []
    for share in (replies[:2], replies[2:]):
        bare, mean = summed(share)
        assert [r.cid for r in bare] == [r.cid for r in share] and bare[0].payload["model"]["w"] == IN_MEAN
        assert [m.dtype for m in mean] == [torch.float32, torch.float64]
        rebuilt += [restore(r, mean) for r in bare]
    assert [int(r.payload["model"]["tracked"]) for r in rebuilt] == [c + 7 for c in range(5)]
    expected = weighted_average([r.payload["model"] for r in replies], sample_weights(replies))
    got = weighted_average([r.payload["model"] for r in rebuilt], sample_weights(rebuilt))
    torch.testing.assert_close(got["w"], expected["w"], rtol=1e-6, atol=1e-6)
    extra = sum(w * r.payload["extra"][0] for r, w in zip(replies, sample_weights(replies)))
    torch.testing.assert_close(sum(w * r.payload["extra"][0] for r, w in zip(rebuilt, sample_weights(rebuilt))), extra)


def test_a_share_without_samples_weighs_its_replies_equally():
    replies = [_reply(0, 0, 1.0), _reply(1, 0, 3.0)]
    _, mean = summed(replies)
    torch.testing.assert_close(mean[0], (replies[0].payload["model"]["w"] + replies[1].payload["model"]["w"]) / 2)


def test_replies_that_differ_in_structure_or_have_nothing_to_average_are_not_summed():
    a, b = _reply(0, 1, 0.0), _reply(1, 1, 0.0)
    assert summed([]) is None
    assert summed([a, Reply(1, 1, {"model": b.payload["model"]})]) is None  # no "extra"
    wide = Reply(1, 1, {**b.payload, "model": {**b.payload["model"], "w": torch.zeros(2, 3)}})
    assert summed([a, wide]) is None  # another shape
    assert summed([Reply(0, 1, {"counts": torch.tensor([1, 2])})]) is None  # integers only


def test_a_label_table_stays_each_clients_own():
    """FedCRL's and FedProto's per-label tables are weighted by their counts, not by the
    reply's sample count: a share keeps each reply's table and sums only the rest."""
    replies = [
        Reply(c, n, {"body": {"w": torch.full((2,), float(c))},
                     "prototypes": {"reps": torch.full((3, 2), float(c)), "counts": torch.tensor([c, 0, 2])}})
        for c, n in enumerate([4, 1, 3])
    ]
    bare, mean = summed(replies)
    assert len(mean) == 1 and all(r.payload["body"]["w"] == IN_MEAN for r in bare)
    for r, original in zip(bare, replies):
        assert r.payload["prototypes"] is original.payload["prototypes"]
    torch.testing.assert_close(mean[0], torch.full((2,), (0 * 4 + 1 * 1 + 2 * 3) / 8))
