"""FedALA: adaptive local aggregation for personalized federated learning."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from .. import params as P
from .base import (
    ClientContext,
    Federation,
    LocalTask,
    PersonalModel,
    Reply,
    StateDict,
    TrainResult,
    model_state,
)
from .fedavg import FedAvg
from .registry import ALGORITHMS
from .split import head_logits, is_head


@dataclass(frozen=True)
class FedALAParams:
    eta: float = P.param(1.0, P.Interval(0, None, "neither"), "learning rate of the aggregation weights W (PFLlib -et 1.0)")
    rand_percent: int = P.param(80, P.Interval(0, 100, "right"), "percent s of the client's training data ALA learns W on (PFLlib -s 80)")
    layers: int = P.param(2, P.Interval(0, None), "p: ALA on the last p parameter tensors (2: the classifier's weight and bias; 0: all), the rest is taken from the global model (PFLlib -p 2)")
    threshold: float = P.param(0.1, P.Interval(0, None), "first ALA: stop when the std of the last num_pre_loss recorded losses is below this (ALA.py: 0.1)")
    num_pre_loss: int = P.param(10, P.Interval(1, None), "first ALA: number of recorded losses whose std is tested (ALA.py: 10)")
    max_passes: int = P.param(1000, P.Interval(1, None), "first ALA: at most this many passes over the slice (safety cap; PFLlib has none)")


@dataclass
class ALAResult:
    """The outcome of one adaptive local aggregation."""

    model: StateDict  # the initialised local model (full state dict)
    weights: StateDict  # W after learning, for the upper parameter tensors
    losses: list[float]  # the last batch's loss of every pass
    passes: int


class ALAMemo:
    """The adaptive local aggregations of one round, kept for when the same one is asked
    again: the personalised evaluation after round ``t`` runs every client's ALA of round
    ``t + 1`` (:meth:`FedALA.personal_model`, the model the client would start that
    round with), and a client training in round ``t + 1`` then starts with that very ALA
    in :meth:`FedALA.client_begin`: the same state, global model and random slice.

    :meth:`FedALA.ala` is a pure function of its inputs and the client's context, so a
    result is given back only for the same client, round, random stream and forward,
    with inputs that are the very same tensors, unmodified since (weak references and
    PyTorch's version counters: nothing is kept alive, and a state reloaded from disk
    is a miss). Each result is given back once; a new round's first result clears the
    others; results stop being kept past ``max_bytes`` (64 MiB: the classifiers and W of
    some 1,600 clients of FedAvgCNN; with thousands of clients, the first ones evaluated
    are kept, and the others run their ALA again when they train).
    """

    def __init__(self, max_bytes: int = 2**26) -> None:
        self.max_bytes = max_bytes
        self.entries: dict[tuple[int, int], tuple[tuple, ALAResult]] = {}
        self.bytes = 0

    @staticmethod
    def key(ctx: ClientContext, *states: StateDict | None) -> tuple:
        """What an ALA depends on: the client's random stream, the forward, and each
        input tensor by weak reference with its version counter."""
        tensors = tuple(
            (name, weakref.ref(t), t._version) for state in states if state is not None for name, t in state.items()
        )
        return ctx.generator("ala").initial_seed(), weakref.ref(ctx.net), tensors

    @staticmethod
    def _same(kept: tuple, asked: tuple) -> bool:
        """Whether two keys name the same stream, the same live forward and the same live,
        unmodified tensors."""
        (seed, net, tensors), (seed_asked, net_asked, tensors_asked) = kept, asked
        if seed != seed_asked or net() is None or net() is not net_asked() or len(tensors) != len(tensors_asked):
            return False
        return all(
            name == name_asked and ref() is not None and ref() is ref_asked() and version == version_asked
            for (name, ref, version), (name_asked, ref_asked, version_asked) in zip(tensors, tensors_asked)
        )

    def take(self, ctx: ClientContext, key: tuple) -> ALAResult | None:
        entry = self.entries.pop((ctx.cid, ctx.round), None)
        return entry[1] if entry is not None and self._same(entry[0], key) else None

    def keep(self, ctx: ClientContext, key: tuple, result: ALAResult) -> None:
        if self.entries and next(iter(self.entries))[1] != ctx.round:
            self.entries.clear()
            self.bytes = 0
        size = 2 * sum(t.numel() * t.element_size() for t in result.weights.values())  # W and the upper layers
        if self.bytes + size <= self.max_bytes:
            self.entries[(ctx.cid, ctx.round)] = (key, result)
            self.bytes += size


@dataclass
class FedALATask(LocalTask):
    """A :class:`LocalTask` that also carries the client's ALA weights from
    :meth:`FedALA.client_begin` to :meth:`FedALA.client_end` (executors ignore it)."""

    ala_weights: StateDict | None = field(default=None)


@ALGORITHMS.register("fedala")
class FedALA(FedAvg):
    """FedALA (J. Zhang, Hua, Wang, Song, Xue, Ma, Guan, AAAI 2023).

    The server averages full models as FedAvg. Client ``i`` with its model ``theta``
    from its last participation initialises its local model from the received global
    model ``theta_g`` by Adaptive Local Aggregation (ALA) before training (and is
    evaluated with that model):

    * lower layers (all but the last ``p`` = ``layers`` parameter tensors) and all
      buffers: ``theta^low <- theta_g^low``;
    * upper layers: ``theta_hat = theta + (theta_g - theta) * W`` with the client's
      persistent element-wise weights ``W`` (all ones at first);
    * on a contiguous slice of ``s``% (``rand_percent``) of the client's training data
      with a random start (``ctx.generator("ala")``), in order, in batches of the run's
      batch size (the last one kept), for every batch::

          W <- clip(W - eta * (dL/d theta_hat) * (theta_g - theta), 0, 1)
          theta_hat = theta + (theta_g - theta) * W

      with ``L`` the cross-entropy of ``f_{theta_hat}``; the loss of each pass's last
      batch is recorded. The first ALA of a client repeats passes until more than
      ``num_pre_loss`` losses are recorded and the population std of the last
      ``num_pre_loss`` is below ``threshold`` (at most ``max_passes``); later ones make
      one pass;
    * the local model is ``theta_hat`` (upper) with the global lower layers.

    Local training is then plain cross-entropy SGD from that model; the client uploads
    the full model and keeps it with ``W``. A client without a previous model (first
    participation) starts from the global model and runs no ALA (PFLlib skips ALA while
    the local and global models coincide, i.e. in round 0).

    Choices where PFLlib (``system/utils/ALA.py``, docs/developer/pfllib_reference.md B.8)
    does not decide or differs: ALA's forwards are eval-mode (PFLlib runs its temporary
    model in the mode it was left in, train mode after training; its CNN has neither
    BatchNorm nor dropout, so both agree there), which keeps ALA deterministic and
    BatchNorm statistics untouched; buffers come from the global model with the lower
    layers (PFLlib's models have none). PFLlib runs ALA for every client every round,
    also for clients that do not train, and keeps the result; here a client's state
    changes only when it trains, and its evaluation runs ALA without changing the state
    (the same under full participation). That evaluation, after round
    ``t``, is the client's ALA of round ``t + 1`` (its random slice included), which a
    client training in round ``t + 1`` would run again in :meth:`client_begin`: it is
    kept and reused (:class:`ALAMemo`), the same numbers with half the ALAs under full
    participation. ALA uses ordinary autograd in
    :meth:`client_begin`; the local training is FedAvg's and vectorizable. When ``W``
    weighs the classifier ``l3`` alone (``layers`` 1 or 2, the default), its input ``z``
    does not change during ALA: it is computed once per batch and every pass runs the
    classifier alone (the same numbers in fp32; with ``precision=bf16`` the classifier
    then runs in float32).
    """

    name = "fedala"
    summary = "FedALA: FedAvg + adaptive local aggregation of the upper layers (element-wise W in [0,1]) before local training"
    paper = "J. Zhang, Hua, Wang, Song, Xue, Ma, Guan, FedALA: Adaptive Local Aggregation for Personalized Federated Learning, AAAI 2023"
    Params = FedALAParams
    personalized = True

    def __init__(self, params: FedALAParams, federation: Federation) -> None:
        super().__init__(params, federation)
        self.memo = ALAMemo()

    # -- ALA ---------------------------------------------------------------------------
    def upper_names(self) -> tuple[str, ...]:
        """The parameter tensors ALA weighs (the last ``layers``; all when 0)."""
        names = self.federation.param_names
        return names[-self.params.layers :] if self.params.layers else names

    def ala(self, local: StateDict, global_: StateDict, weights: StateDict | None, ctx: ClientContext) -> ALAResult:
        """Adaptive local aggregation of ``local`` towards ``global_`` (pure: the same
        inputs and ``ctx`` give the same result). ``weights=None`` is the first ALA."""
        p = self.params
        upper = self.upper_names()
        start_phase = weights is None
        theta = {k: local[k].detach() for k in upper}
        diff = {k: global_[k].detach() - theta[k] for k in upper}
        w = {k: torch.ones_like(theta[k]) for k in upper} if weights is None else {k: weights[k].clone() for k in upper}
        lower = {k: v for k, v in global_.items() if k not in diff}
        hat = {k: theta[k] + diff[k] * w[k] for k in upper}

        x, y = ctx.train_data()
        n = len(y)
        count = int(p.rand_percent / 100 * n)
        start = int(torch.randint(0, n - count + 1, (1,), generator=ctx.generator("ala")))
        xs, ys = x[start : start + count], y[start : start + count]
        bs = self.federation.batch_size
        batches = [(xs[i : i + bs], ys[i : i + bs]) for i in range(0, count, bs)]

        features = None
        if batches and all(is_head(k) for k in upper):  # W weighs the classifier alone: z is fixed
            with torch.no_grad():
                features = [ctx.net({**lower, **hat}, xb, train=False).z for xb, _ in batches]

        losses: list[float] = []
        passes = 0
        if batches:
            with torch.enable_grad():
                while passes < p.max_passes:
                    for i, (xb, yb) in enumerate(batches):
                        leaves = {k: v.clone().requires_grad_(True) for k, v in hat.items()}
                        if features is None:
                            logits = ctx.net({**lower, **leaves}, xb, train=False).logits
                        else:
                            logits = head_logits(features[i], {**lower, **leaves})
                        loss = F.cross_entropy(logits, yb)
                        grads = torch.autograd.grad(loss, list(leaves.values()))
                        for k, g in zip(leaves, grads):
                            w[k] = torch.clamp(w[k] - p.eta * (g * diff[k]), 0, 1)
                            hat[k] = theta[k] + diff[k] * w[k]
                    losses.append(loss.item())
                    passes += 1
                    if not start_phase:
                        break
                    if len(losses) > p.num_pre_loss and np.std(losses[-p.num_pre_loss :]) < p.threshold:
                        break
        model = {k: (hat[k] if k in hat else v) for k, v in global_.items()}
        return ALAResult(model, w, losses, passes)

    def initialised_model(
        self, state: dict[str, Any], global_: StateDict, ctx: ClientContext, *, keep: bool = False
    ) -> tuple[StateDict, StateDict | None]:
        """The client's model at the start of ``ctx.round`` and its W (None: no ALA).
        With ``keep`` the ALA is kept for the client's next call of that round
        (:class:`ALAMemo`)."""
        if "model" not in state:
            return global_, None
        local, weights = state["model"], state.get("ala_weights")
        key = ALAMemo.key(ctx, local, global_, weights)
        res = self.memo.take(ctx, key)
        if res is None:
            res = self.ala(local, global_, weights, ctx)
            if keep:
                self.memo.keep(ctx, key, res)
        return res.model, res.weights

    # -- client ------------------------------------------------------------------------
    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        model, weights = self.initialised_model(state, message["model"], ctx)
        params, buffers = self.federation.split(model)
        return FedALATask(params={"model": params}, buffers={"model": buffers}, ala_weights=weights)

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        model = model_state(result)
        new_state: dict[str, Any] = {"model": {k: v.clone() for k, v in model.items()}}
        weights = getattr(task, "ala_weights", None)
        if weights is None:
            weights = state.get("ala_weights")
        if weights is not None:
            new_state["ala_weights"] = weights
        return Reply(ctx.cid, ctx.num_samples, {"model": model}), new_state

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        """The post-ALA model the client would start its next round with. The client's
        state is left as it is; the ALA is kept for that round's :meth:`client_begin`
        (:class:`ALAMemo`)."""
        return PersonalModel(self.initialised_model(state, message["model"], ctx, keep=True)[0])
