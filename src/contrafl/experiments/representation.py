"""Evaluation of learned representations after training: linear probe, semi-supervised
fine-tuning, singular-value spectrum (the kNN monitor that runs every round is
:mod:`contrafl.metrics.knn`'s).

Pure functions on tensors (CPU or CUDA); the caller wires them to run directories and
checkpoints. They follow the evaluation protocols of the official FedU2 code
(XeniaLLL/FedU2, CVPR 2024):

* :func:`linear_probe`: ``linear_eval.py``: a ``Linear(D, C)`` on frozen, precomputed,
  unnormalised, un-augmented features, Adam lr 3e-3 (no weight decay, no schedule),
  batch 512, 200 epochs; the accuracy after the last epoch is reported.
* :func:`finetune`: ``semi_eval.py``: encoder + ``Linear(D, C)`` trained end to end on a
  class-stratified 1 % / 10 % labelled subset, SGD momentum 0.9 with lr 1e-3 for the
  encoder and 0.3 for the head, batch 128, 200 epochs, BatchNorm in train mode; test
  accuracy at epochs 100 and 200, the best of the two reported.
* :func:`singular_spectrum`: the paper's Figure 3 (top-k log singular values of the
  covariance matrix of the test-set representations); the official code has no script
  for it.

Randomness comes only from the ``torch.Generator`` s passed in (CPU generators, as in
:mod:`contrafl.data.augment`), so every result is a function of the inputs and seeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
from torch.nn import functional as F

from ..execution.optim import SGD, Adam

__all__ = [
    "FinetuneResult",
    "LinearProbeResult",
    "Spectrum",
    "TrainTransform",
    "finetune",
    "linear_probe",
    "select_labeled",
    "singular_spectrum",
]


# ----------------------------------------------------------------------------- features


# ----------------------------------------------------------------------------- kNN


# ----------------------------------------------------------------------------- linear probe


@dataclass
class LinearProbeResult:
    """What :func:`linear_probe` returns.

    Attributes:
        acc: test accuracy after the last epoch (what the official ``linear_eval.py``
            reports; it evaluates only once, at the end).
        best_acc: the largest accuracy in ``history`` (a test-set-selected number, for
            reference only; equals ``acc`` without ``eval_every``).
        history: ``(epoch, test accuracy)`` at every evaluation, the last one included.
        weight, bias: the trained classifier, ``logits = features @ weight.T + bias``.
    """

    acc: float
    best_acc: float
    history: list[tuple[int, float]]
    weight: torch.Tensor
    bias: torch.Tensor


def linear_probe(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    num_classes: int,
    epochs: int = 200,
    lr: float = 3e-3,
    batch_size: int = 512,
    *,
    generator: torch.Generator,
    weight_decay: float = 0.0,
    eval_every: int | None = None,
) -> LinearProbeResult:
    """Linear classifier on frozen, precomputed features; returns its test accuracy.

    ``logits = z W^T + b`` with ``W [C, D]``, ``b [C]`` initialised like
    ``torch.nn.Linear`` (``U(-1/sqrt(D), 1/sqrt(D))``, drawn from ``generator``), trained
    for ``epochs`` epochs over a fresh random permutation of the training features per
    epoch (batches of ``batch_size``, the last one partial) on the mean cross-entropy
    with Adam (``torch.optim.Adam`` rule, betas (0.9, 0.999), eps 1e-8, L2
    ``weight_decay``; :class:`contrafl.execution.optim.Adam`), constant ``lr``.

    This is FedU2's ``linear_eval.py`` (lines 43-72): features of the un-augmented
    images (``ToTensor`` only) extracted once in eval mode, not normalised, ``Linear(512,
    C)``, ``Adam(lr=3e-3)`` without weight decay or schedule, 200 epochs of shuffled
    batches of 512, test accuracy after the last epoch. No augmentation is involved
    there either, so this reproduces the protocol, not an approximation of it.
    ``eval_every`` additionally records the test accuracy every that many epochs.
    """
    device = train_features.device
    z = train_features.float()
    y = train_labels.to(device=device, dtype=torch.long)
    z_test = test_features.to(device).float()
    y_test = test_labels.to(device=device, dtype=torch.long)
    n, dim = z.shape
    if n == 0:
        raise ValueError("linear_probe needs at least one training sample")
    weight, bias = _linear_init(num_classes, dim, generator, device)
    params = [weight, bias]
    opt = Adam(lr, weight_decay=weight_decay)
    state = opt.init(params)
    history: list[tuple[int, float]] = []

    def test_acc() -> float:
        with torch.no_grad():
            return _accuracy(z_test @ weight.t() + bias, y_test)

    for epoch in range(1, epochs + 1):
        order = torch.randperm(n, generator=generator).to(device)
        for i in range(0, n, batch_size):
            rows = order[i : i + batch_size]
            w, b = weight.detach().requires_grad_(True), bias.detach().requires_grad_(True)
            loss = F.cross_entropy(z[rows] @ w.t() + b, y[rows])
            grads = torch.autograd.grad(loss, [w, b])
            opt.step(params, list(grads), state)
        if eval_every and epoch % eval_every == 0 and epoch != epochs:
            history.append((epoch, test_acc()))
    history.append((epochs, test_acc()))
    return LinearProbeResult(
        acc=history[-1][1],
        best_acc=max(a for _, a in history),
        history=history,
        weight=weight,
        bias=bias,
    )


# ----------------------------------------------------------------------------- fine-tuning


def select_labeled(
    labels: torch.Tensor, fraction: float, num_classes: int, generator: torch.Generator
) -> torch.Tensor:
    """Indices (int64, ascending, CPU) of a class-stratified random subset with
    ``floor(fraction * N)`` samples.

    What FedU2's ``semi_eval.py`` line 53 gets from scikit-learn's
    ``train_test_split(train_size=fraction, stratify=labels)``: class ``c`` with ``N_c``
    samples contributes ``n_c = floor(n * N_c / N)`` samples, and the ``n - sum n_c``
    left over go one each to the classes with the largest remainders ``n N_c / N - n_c``
    (ties in random order); within a class the samples are a uniform random choice. On a
    balanced data set this is exactly ``n / C`` per class (CIFAR-10 at 1 %: 50 per
    class; CIFAR-100 at 1 %: 5 per class). Randomness from ``generator`` only (the
    official code draws from NumPy's global state after ``set_seed(0)``, so its subsets
    cannot be reproduced here).
    """
    labels = labels.detach().to("cpu", torch.long)
    total = len(labels)
    n = math.floor(fraction * total)
    counts = torch.bincount(labels, minlength=num_classes)
    if len(counts) > num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes})")
    present = int((counts > 0).sum())
    if not 0 < fraction <= 1 or n < present:
        raise ValueError(
            f"fraction {fraction} of {total} samples gives {n} labelled samples, fewer than "
            f"the {present} classes present (or fraction not in (0, 1])"
        )
    exact = counts.double() * n / total
    alloc = exact.floor().long()
    need = n - int(alloc.sum())
    if need:
        remainder = exact - alloc.double()
        shuffled = torch.randperm(num_classes, generator=generator)  # random order among ties
        order = shuffled[torch.sort(remainder[shuffled], descending=True, stable=True).indices]
        alloc[order[:need]] += 1
    chosen = []
    for c in range(num_classes):
        if alloc[c]:
            members = torch.nonzero(labels == c).flatten()
            chosen.append(members[torch.randperm(len(members), generator=generator)[: int(alloc[c])]])
    return torch.sort(torch.cat(chosen)).values


class TrainTransform(Protocol):
    """A batched training transform (:class:`contrafl.data.augment.Transform`): random
    parameters drawn first, then applied."""

    def sample(self, n: int, generator: torch.Generator) -> Mapping[str, torch.Tensor]: ...

    def __call__(self, x: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor: ...


@dataclass
class FinetuneResult:
    """What :func:`finetune` returns.

    Attributes:
        acc: the best test accuracy over the evaluations (what FedU2's ``semi_eval.py``
            reports: the best of epochs 100 and 200).
        last_acc: the test accuracy after the last epoch.
        history: ``(epoch, test accuracy)`` at every evaluation.
        labeled: indices (ascending, CPU int64) of the labelled training samples used.
        params, buffers: the fine-tuned encoder (new tensors; the inputs are untouched).
        weight, bias: the trained head, ``logits = h @ weight.T + bias``.
        losses: mean training cross-entropy of every epoch.
    """

    acc: float
    last_acc: float
    history: list[tuple[int, float]]
    labeled: torch.Tensor
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    weight: torch.Tensor
    bias: torch.Tensor
    losses: list[float] = field(default_factory=list)


def finetune(
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    encode: Callable[..., torch.Tensor],
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    num_classes: int,
    *,
    transform: TrainTransform,
    test_transform: Callable[[torch.Tensor], torch.Tensor],
    generator: torch.Generator,
    label_fraction: float = 0.01,
    labeled: torch.Tensor | None = None,
    epochs: int = 200,
    batch_size: int = 128,
    encoder_lr: float = 1e-3,
    head_lr: float = 0.3,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    eval_every: int = 100,
    test_batch_size: int = 512,
) -> FinetuneResult:
    """Semi-supervised evaluation: fine-tune encoder + linear head on a labelled subset.

    ``encode(state, x, train=...) -> [B, D]`` is the encoder as a function of its state
    ``{**params, **buffers}`` (e.g. ``lambda s, x, train: net(s, x, train=train).h``
    with a :class:`contrafl.execution.executor.FunctionalNet`); a train-mode call uses batch
    statistics and updates the BatchNorm buffers it is given in place. The model is::

        logits = encode(state, transform(x, p), train=True) @ W^T + b
        loss   = mean cross-entropy over the batch

    with the head ``W [C, D]``, ``b [C]`` initialised like ``torch.nn.Linear`` from
    ``generator``. Each epoch visits the labelled samples in a fresh random order in
    batches of ``batch_size`` (last one partial), drawing the augmentation ``p =
    transform.sample(len(batch), generator)`` per batch. Updates: SGD with momentum
    (``torch.optim.SGD`` rule, :class:`contrafl.execution.optim.SGD`), ``encoder_lr`` for the
    encoder parameters and ``head_lr`` for the head, no schedule. The test accuracy (eval
    mode, ``test_transform``) is measured every ``eval_every`` epochs and after the last.

    The labelled subset is ``labeled`` if given, else :func:`select_labeled` (a
    class-stratified ``label_fraction`` of the training set, from ``generator``); it is
    returned so it can be saved and reused.

    Defaults are FedU2's ``semi_eval.py``: stratified subset (line 53), batch 128 with
    shuffling (55), ``Linear(512, C)`` head (56), encoder in train mode (59), SGD momentum
    0.9 with lr 1e-3 for the encoder and 0.3 for the head, no weight decay (61-64), 200
    epochs, test at epochs 100 and 200 and the best reported (80-95). Its augmentation is
    ``RandomResizedCrop(32, scale=(0.64, 1), ratio=(1, 1))`` + horizontal flip on
    ``ToTensor`` images, no normalisation (40-44): that is the caller's ``transform``.

    Draw order from ``generator``: labelled subset (if not given), head init, then per
    epoch the permutation followed by each batch's augmentation parameters. Dropout (none
    in ResNet-18) would draw from the global stream; seed it beforehand if needed.
    """
    names = list(params)
    device = x_train.device
    if labeled is None:
        labeled = select_labeled(y_train, label_fraction, num_classes, generator)
    labeled = labeled.detach().to("cpu", torch.long)
    if len(labeled) == 0:
        raise ValueError("finetune needs at least one labelled sample")
    enc = [params[k].detach().clone() for k in names]
    bufs = {k: v.detach().clone() for k, v in buffers.items()}

    def state(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**dict(zip(names, tensors)), **bufs}

    with torch.no_grad():
        dim = encode(state(enc), test_transform(x_train[labeled[:1].to(device)]), train=False).shape[1]
    weight, bias = _linear_init(num_classes, dim, generator, enc[0].device if enc else device)
    head = [weight, bias]
    enc_opt = SGD(encoder_lr, momentum, weight_decay)
    head_opt = SGD(head_lr, momentum, weight_decay)
    enc_state, head_state = enc_opt.init(enc), head_opt.init(head)
    y_train = y_train.to(device=device, dtype=torch.long)
    history: list[tuple[int, float]] = []
    losses: list[float] = []

    def test_acc() -> float:
        with torch.no_grad():
            correct = 0
            for i in range(0, len(x_test), test_batch_size):
                h = encode(state(enc), test_transform(x_test[i : i + test_batch_size]), train=False)
                pred = (h.float() @ weight.t() + bias).argmax(1)
                correct += int((pred == y_test[i : i + test_batch_size].to(pred.device)).sum())
            return correct / len(x_test) if len(x_test) else float("nan")

    for epoch in range(1, epochs + 1):
        order = labeled[torch.randperm(len(labeled), generator=generator)]
        total = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(0, len(order), batch_size):
            rows = order[i : i + batch_size]
            aug = transform.sample(len(rows), generator)
            rows = rows.to(device)
            ts = [t.requires_grad_(True) for t in (p.detach() for p in enc + head)]
            h = encode(state(ts[: len(enc)]), transform(x_train[rows], aug), train=True)
            loss = F.cross_entropy(h.float() @ ts[-2].t() + ts[-1], y_train[rows])
            grads = list(torch.autograd.grad(loss, ts, allow_unused=True))
            enc_opt.step(enc, grads[: len(enc)], enc_state)
            head_opt.step(head, grads[len(enc) :], head_state)
            total += loss.detach().double() * len(rows)
        losses.append(total.item() / len(order))
        if eval_every and epoch % eval_every == 0 and epoch != epochs:
            history.append((epoch, test_acc()))
    history.append((epochs, test_acc()))
    return FinetuneResult(
        acc=max(a for _, a in history),
        last_acc=history[-1][1],
        history=history,
        labeled=labeled,
        params=dict(zip(names, enc)),
        buffers=bufs,
        weight=weight,
        bias=bias,
        losses=losses,
    )


# ----------------------------------------------------------------------------- spectrum


class Spectrum(NamedTuple):
    """Singular values of a representation covariance, descending, and their natural
    logarithms (``-inf`` for exact zeros; numerically collapsed directions show as
    large negative values)."""

    singular_values: torch.Tensor
    log_singular_values: torch.Tensor


@torch.no_grad()
def singular_spectrum(features: torch.Tensor, normalize: bool = True, correction: int = 0) -> Spectrum:
    """Singular values of the covariance matrix of the representations ``[N, D]``::

        f_i = v_i / ||v_i||   (if normalize)      f_bar = mean_i f_i
        Cov = 1 / (N - correction) * sum_i (f_i - f_bar)(f_i - f_bar)^T      [D, D]
        sigma_1 >= ... >= sigma_D = singular values of Cov (= its eigenvalues, Cov is PSD)

    and ``log sigma``, computed in float64 on the device of ``features``.

    FedU2's Figure 3 plots the top-k (k = 100) *log* singular values of the covariance
    matrix of the representations of N test points, for the global and a local model,
    following Jing et al. (ICLR 2022) and FedDecorr; collapse shows as singular values
    dropping to ~0 (log -> -inf). The paper does not say whether the representations
    are l2-normalised and the official repository has no code for the figure;
    ``normalize=True`` (default) uses the l2-normalised representations that FedU2's
    objective and kNN evaluation work with, ``normalize=False`` the raw ones.
    ``correction=0`` is Jing et al.'s ``1/N`` covariance (``numpy.cov`` uses 1, which
    shifts every log value by ``log(N / (N - 1))``). Slice ``[:100]`` for the figure.
    """
    f = features.detach().to(torch.float64)
    if f.dim() != 2 or len(f) <= correction:
        raise ValueError(f"need a [N, D] matrix with N > {correction}, got {tuple(features.shape)}")
    if normalize:
        f = F.normalize(f, dim=1)
    centred = f - f.mean(0, keepdim=True)
    cov = centred.t() @ centred / (len(f) - correction)
    sigma = torch.linalg.svdvals(cov)
    return Spectrum(sigma, sigma.log())


# ----------------------------------------------------------------------------- helpers


def _linear_init(
    out_features: int, in_features: int, generator: torch.Generator, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.Linear``'s default initialisation, ``U(-1/sqrt(in), 1/sqrt(in))`` for
    weight and bias, drawn on the CPU from ``generator``."""
    bound = 1 / math.sqrt(in_features) if in_features else 0.0
    weight = (torch.rand(out_features, in_features, generator=generator) * 2 - 1) * bound
    bias = (torch.rand(out_features, generator=generator) * 2 - 1) * bound
    return weight.to(device), bias.to(device)


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    if len(labels) == 0:
        return float("nan")
    return (logits.argmax(1) == labels).double().mean().item()


