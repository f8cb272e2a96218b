"""What the round loop measures of a representation: the weighted kNN monitor of
InstDisc that FedU2's code (XeniaLLL/FedU2, ``src/my/algo/commons/evaluate.py``) runs
every round (k = 200, t = 0.1, cosine similarity of l2-normalised encoder features, the
memory bank the union of the clients' training sets, no augmentation), and the features
it compares. The probes that run after training are
:mod:`contrafl.experiments.representation`'s.

Pure functions on tensors (CPU or CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

__all__ = ["bank_and_queries", "extract_features", "knn_accuracy", "knn_predict", "knn_scores"]


@torch.no_grad()
def extract_features(
    encode: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    transform: Callable[[torch.Tensor], torch.Tensor],
    batch_size: int,
) -> torch.Tensor:
    """Representations ``[N, D]`` (float32) of all samples, without gradients::

        features[i] = encode(transform(x[i]))

    computed ``batch_size`` samples at a time, in order. ``encode`` must be the encoder
    in eval mode (e.g. ``lambda b: net(state, b, train=False).h``) and ``transform`` the
    deterministic evaluation transform (raw samples -> network inputs, e.g.
    :func:`contrafl.data.augment.eval_transform`). The features are left on the device
    ``encode`` returns them on.
    """
    if len(x) == 0:
        raise ValueError("extract_features needs at least one sample")
    chunks = [encode(transform(x[i : i + batch_size])).float() for i in range(0, len(x), batch_size)]
    return torch.cat(chunks)


@torch.no_grad()
def knn_scores(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Class scores ``[M, C]`` of the weighted kNN classifier of InstDisc (Wu et al. 2018).

    With ``f`` the l2-normalised features (``f = v / max(||v||, 1e-12)``, zero vectors
    stay zero), for every test sample ``q``::

        s_j      = <f_q, f_j>                        cosine similarity to train sample j
        N_k(q)   = the k train samples of largest s_j   (torch.topk)
        w_j      = exp(s_j / temperature)            j in N_k(q)
        score_c  = sum_{j in N_k(q)} w_j [y_j = c]

    exactly the computation of the official kNN monitor (FedU2
    ``src/my/algo/commons/evaluate.py``, ``knn_evaluate`` lines 28/35 and
    ``knn_predict`` lines 78-90): normalise, one matrix product, ``topk``, ``exp`` of the
    top-k similarities, one-hot labels weighted and summed over the neighbours. Ties
    between equally similar neighbours at the k-th place are resolved by ``torch.topk``
    as in the official code. ``k`` larger than the number of train samples is clipped
    (the official code raises). Test samples are processed ``chunk_size`` at a time
    (``chunk_size * N`` similarities in memory); rows are independent, so the result
    does not depend on the chunking. Computed in float32 on the device of
    ``test_features``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if len(train_features) == 0:
        raise ValueError("knn needs at least one training sample")
    device = test_features.device
    bank = F.normalize(train_features.to(device=device, dtype=torch.float32), dim=1).t().contiguous()
    labels = train_labels.to(device=device, dtype=torch.long)
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"train labels must lie in [0, {num_classes})")
    k = min(k, bank.shape[1])
    queries = F.normalize(test_features.to(torch.float32), dim=1)
    out = []
    for i in range(0, len(queries), chunk_size):
        q = queries[i : i + chunk_size]
        sim = q @ bank  # [B, N]
        top_sim, top_idx = sim.topk(k, dim=1)  # [B, k], descending
        weights = (top_sim / temperature).exp()
        one_hot = F.one_hot(labels[top_idx], num_classes).to(weights.dtype)  # [B, k, C]
        out.append((one_hot * weights.unsqueeze(-1)).sum(dim=1))
    if not out:
        return torch.zeros(0, num_classes, device=device)
    return torch.cat(out)


def knn_predict(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Predicted labels ``[M]`` (int64) of the weighted kNN classifier: the argmax of
    :func:`knn_scores` over classes.

    The official code takes ``argsort(descending=True)[:, 0]``, which for tied class
    scores returns an unspecified one of them; ``argmax`` returns the smallest tied
    class index (deterministic). Ties of scores that are sums of exponentials are
    practically confined to constructed examples.
    """
    return knn_scores(train_features, train_labels, test_features, num_classes, k, temperature, chunk_size).argmax(1)


def knn_accuracy(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    chunk_size: int = 256,
) -> float:
    """Top-1 accuracy of :func:`knn_predict` on ``test_labels``:
    ``mean_i [pred_i = y_i]``."""
    if len(test_labels) == 0:
        return float("nan")
    pred = knn_predict(train_features, train_labels, test_features, num_classes, k, temperature, chunk_size)
    return (pred == test_labels.to(pred.device)).double().mean().item()


def bank_and_queries(train: Any, test: Any, partition: Any) -> tuple[torch.Tensor, ...]:
    """``(x_bank, y_bank, x_query, y_query)`` of representation evaluation: the memory bank
    (the probes' training set) is the union of the clients' training samples, the queries
    the test set, or the clients' test splits when the run pooled the test set into them.
    ``train`` and ``test`` are the run's splits (``x``, ``y``), on any device."""
    device = train.y.device
    rows = torch.as_tensor(np.concatenate(partition.train), dtype=torch.long, device=device)
    if len(test.y):
        return train.x[rows], train.y[rows], test.x, test.y
    test_rows = torch.as_tensor(np.concatenate(partition.test), dtype=torch.long, device=device)
    return train.x[rows], train.y[rows], train.x[test_rows], train.y[test_rows]
