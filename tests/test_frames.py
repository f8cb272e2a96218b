"""The distributed executor's frames (contrafl.execution.frames): what a rank sends comes
back equal, tensors with their dtype, shape, memory layout and autograd flags, a tensor
shared by several messages once, each with a storage of its own."""

from __future__ import annotations

import torch

from contrafl.algorithms.base import Reply
from contrafl.execution import frames
from contrafl.execution.outcomes import ClientOutcome


def test_a_frame_brings_back_what_was_sent():
    conv = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    broadcast = {"w": torch.randn(10), "b": torch.randn(3)}
    sent = {
        "messages": {0: broadcast, 1: broadcast, 2: {"w": broadcast["w"], "own": torch.arange(4)}},
        "conv": conv,
        "param": torch.nn.Parameter(torch.randn(3)),
        "grad": torch.randn(2, requires_grad=True),
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "strided": torch.arange(10.0)[::2],
        "half": torch.randn(3).bfloat16(),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "sparse": torch.eye(3).to_sparse(),
        "outcome": ClientOutcome(7, Reply(7, 5, {"w": torch.ones(2)}), 0.25, 3),
        "error": ValueError("a worker's error"),
        "text": "hi",
    }
    got = frames.decode(frames.encode(sent))
    assert got["conv"].stride() == conv.stride() and torch.equal(got["conv"], conv)  # channels-last stays so
    shared = got["messages"][0]["w"]
    assert shared is got["messages"][1]["w"] is got["messages"][2]["w"] and torch.equal(shared, broadcast["w"])
    assert isinstance(got["param"], torch.nn.Parameter) and got["grad"].requires_grad and not got["empty"].requires_grad
    for key in ["flags", "empty", "scalar", "strided", "half", "conj"]:
        assert got[key].dtype == sent[key].dtype and got[key].shape == sent[key].shape and torch.equal(got[key], sent[key]), key
    assert torch.equal(got["sparse"].to_dense(), torch.eye(3))
    assert got["outcome"].cid == 7 and torch.equal(got["outcome"].reply.payload["w"], torch.ones(2))
    assert isinstance(got["error"], ValueError) and got["text"] == "hi"
    storages = {t.untyped_storage().data_ptr() for t in [got["conv"], shared, got["messages"][0]["b"], got["scalar"]]}
    assert len(storages) == 4  # each tensor its own storage: a client's state is not a view into the whole frame
    assert got["scalar"].untyped_storage().nbytes() == 4


def test_every_tensor_starts_aligned_and_the_frame_has_no_slack():
    sent = [torch.randn(n) for n in (1, 3, 4, 5)] + [torch.zeros(3, dtype=torch.float64)]
    frame = frames.encode(sent)
    assert frame.dtype == torch.uint8 and frame.numel() % frames.ALIGN == 0
    got = frames.decode(frame)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, sent))
    assert frame.numel() < 8 + 400 + sum(-(-t.numel() * t.element_size() // 16) * 16 for t in sent)
