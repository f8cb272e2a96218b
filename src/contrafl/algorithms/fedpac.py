"""FedPAC: personalised FL with feature alignment and classifier collaboration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import params as P
from .aggregation import sample_weights, weighted_average
from .base import (
    Algorithm,
    Batch,
    ClientContext,
    LocalTask,
    Network,
    Phase,
    PersonalModel,
    Reply,
    ServerState,
    Stage,
    StateDict,
    TaskView,
    TensorSpec,
    TrainResult,
    model_state,
    spec_of,
)
from .prototypes import (
    MISSING_LABEL,
    MISSING_LABEL_DOC,
    aggregate_prototypes,
    predicted_prototypes,
    previous_for,
    prototype_message,
    squared_distance_loss,
)
from .prototypes import reply_spec as prototype_spec
from .registry import ALGORITHMS
from .split import body_head_forward, body_head_task, split_head


@dataclass(frozen=True)
class FedPACParams:
    lam: float = P.param(1.0, P.Interval(0, None), "weight lambda of the feature alignment term lambda * MSE(phi(x), c^y) (PFLlib -lam 1.0)")
    head_epochs: int = P.param(1, P.Interval(1, None), "epochs of the head-only phase before the body epochs (FedPAC's and PFLlib's code: 1)")
    weighting: str = P.param("uniform", P.OneOf(("counts", "uniform")), "global prototypes: uniform mean over the clients holding the label (PFLlib) or label-count weighted")
    missing_label: str = P.param("drop", MISSING_LABEL, MISSING_LABEL_DOC)
    eps: float = P.param(1e-3, P.Interval(0, 1, "left"), "combination weights <= eps are set to 0 (FedPAC's code: 1e-3)")
    eig_floor: float = P.param(0.01, P.Interval(0, None), "a P with a negative eigenvalue is rebuilt from its eigenpairs >= eig_floor (FedPAC's code: 0.01)")
    renormalize: bool = P.param(True, None, "rescale the weights to sum 1 after zeroing the small ones (FedPAC's and PFLlib's code do not)")


# -- client statistics ----------------------------------------------------------------------
def feature_statistics(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FedPAC's statistics of a client's features ``z`` ``[n, d]`` with labels ``y``:
    ``(V, h)`` with ``h`` ``[C, d]`` and ``V`` a scalar (both in ``z``'s dtype)::

        p(k) = n^k / n,   mu^k = mean_{x in k} z(x),   h[k] = p(k) mu^k   (0 for absent k)
        V = ( sum_k p(k) mean_{x in k} ||z(x)||^2 - sum_k p(k)^2 ||mu^k||^2 ) / n

    as FedPAC's code (``statistics_extraction``, copied by PFLlib) computes them.
    """
    n = len(y)
    zz = z.double()
    onehot = F.one_hot(y, num_classes).to(zz.dtype)  # [n, C]
    counts = onehot.sum(0)
    p = counts / max(n, 1)
    mu = (onehot.T @ zz) / counts.clamp(min=1).unsqueeze(1)
    sq = (onehot.T @ (zz**2).sum(1)) / counts.clamp(min=1)  # mean ||z||^2 per class
    v = ((p * sq).sum() - (p**2 * (mu**2).sum(1)).sum()) / max(n, 1)
    return v.to(z.dtype), (p.unsqueeze(1) * mu).to(z.dtype)


# -- server: the combination weights -------------------------------------------------------
def combination_matrix(variances: torch.Tensor, hs: torch.Tensor, i: int) -> torch.Tensor:
    """``P^(i) = diag(V) + D^(i)`` (float64 ``[M, M]``) with
    ``D_{j1 j2} = sum_k (h_i[k] - h_j1[k]) . (h_i[k] - h_j2[k])`` for the ``M`` clients'
    variances ``V`` ``[M]`` and statistics ``h`` ``[M, C, d]``: ``a^T P a`` is FedPAC's
    estimate ``sum_j a_j^2 V_j + ||h_i - sum_j a_j h_j||^2`` (for ``sum_j a_j = 1``) of
    client ``i``'s test loss under the combination ``a``."""
    diff = (hs[i].unsqueeze(0) - hs).double().flatten(1)  # [M, C d]
    return (torch.diag(variances.double()) + diff @ diff.T).cpu()


def repair_psd(p: torch.Tensor, floor: float) -> torch.Tensor:
    """FedPAC's "numerical stability" step: a symmetric ``P`` with a negative eigenvalue
    is replaced by ``sum_{e: lambda_e >= floor} lambda_e v_e v_e^T``; a PSD one is kept."""
    p = p.double().cpu()
    evals, evecs = torch.linalg.eigh(p)
    if bool((evals >= 0).all()):
        return p
    keep = evals >= floor
    return (evecs[:, keep] * evals[keep]) @ evecs[:, keep].T


def _affine_min(q: torch.Tensor) -> torch.Tensor:
    """The weights ``mu`` (summing to 1, any sign) minimising ``mu^T Q mu``: the
    solution of ``[[Q, 1], [1^T, 0]] [mu; -nu] = [0; 1]`` (least squares if singular)."""
    m = q.shape[0]
    kkt = torch.zeros(m + 1, m + 1, dtype=q.dtype)
    kkt[:m, :m] = q
    kkt[:m, m] = kkt[m, :m] = 1.0
    rhs = torch.zeros(m + 1, 1, dtype=q.dtype)
    rhs[m] = 1.0
    sol, info = torch.linalg.solve_ex(kkt, rhs)
    if int(info) != 0 or not bool(torch.isfinite(sol).all()):
        sol = torch.linalg.lstsq(kkt, rhs, driver="gelsd").solution
    sol = sol[:m, 0]
    return sol / sol.sum()


def simplex_qp(p: torch.Tensor, tol: float = 1e-12, max_iter: int | None = None) -> torch.Tensor:
    """``argmin_a a^T P a`` over the simplex ``{a >= 0, sum_j a_j = 1}`` for a PSD ``P``
    ``[M, M]`` (float64 weights ``[M]``), by Wolfe's minimum-norm-point algorithm (Wolfe
    1976): ``P`` is the Gram matrix of points ``x_j`` and ``a^T P a = ||sum_j a_j x_j||^2``
    the squared norm of a point of their convex hull. A finite active-set method: the
    support grows by the point most opposed to the current one, and inner steps solve
    the equality-constrained problem on the support exactly (dropping points whose
    weight reaches 0); it stops when no point improves, ``X^T X - min_j x_j^T X <= tol *
    max_j P_jj`` (the optimality condition of the simplex QP).
    """
    p = p.double().cpu()
    p = (p + p.T) / 2
    m = p.shape[0]
    scale = max(float(p.diagonal().abs().max()), 1e-300)
    support = [int(torch.argmin(p.diagonal()))]
    weights = torch.zeros(m, dtype=torch.float64)
    weights[support[0]] = 1.0
    previous = float("inf")
    for _ in range(max_iter or 50 * m + 50):
        g = p @ weights  # x_j^T X for every j
        norm2 = float(weights @ g)
        j = int(torch.argmin(g))
        if norm2 - float(g[j]) <= tol * scale or j in support or norm2 >= previous:
            break  # optimal (or, through round-off, no further progress)
        previous = norm2
        support.append(j)
        while True:  # minor cycle: move towards the affine minimiser of the support
            idx = torch.tensor(support)
            mu = _affine_min(p[idx][:, idx])
            lam = weights[idx]
            if bool((mu > 0).all()):
                weights[idx] = mu
                break
            # the largest step from lam towards mu that keeps every weight >= 0
            neg = torch.nonzero(mu <= 0).flatten()
            ratios = lam[neg] / (lam[neg] - mu[neg])
            k = int(torch.argmin(ratios))
            lam = (lam + float(ratios[k]) * (mu - lam)).clamp(min=0)
            lam[neg[k]] = 0.0  # exactly: the point leaves the support
            weights[idx] = lam
            support = [s for s in support if float(weights[s]) > 0]
    return weights / weights.sum()


def combination_weights(
    variances: torch.Tensor, hs: torch.Tensor, i: int, eps: float = 1e-3, floor: float = 0.01, renormalize: bool = True
) -> torch.Tensor | None:
    """Client ``i``'s head-combination weights ``alpha_i`` (float64 ``[M]``): the simplex
    QP on :func:`repair_psd` (:func:`combination_matrix`), weights ``<= eps`` zeroed and,
    with ``renormalize``, rescaled to sum 1; None when every weight was zeroed."""
    alpha = simplex_qp(repair_psd(combination_matrix(variances, hs, i), floor))
    alpha = torch.where(alpha > eps, alpha, torch.zeros_like(alpha))
    if float(alpha.sum()) <= 0:
        return None
    return alpha / alpha.sum() if renormalize else alpha


def combine_heads(heads: Sequence[Mapping[str, torch.Tensor]], alpha: torch.Tensor) -> StateDict:
    """``sum_j alpha_j head_j`` entry by entry (new tensors; the heads are not modified)."""
    out: StateDict = {}
    for key, ref in heads[0].items():
        if ref.is_floating_point():
            out[key] = sum(float(a) * h[key].double() for a, h in zip(alpha, heads)).to(ref.dtype)
        else:
            out[key] = ref.clone()
    return out


@ALGORITHMS.register("fedpac")
class FedPAC(Algorithm):
    """FedPAC (Xu, Tong, Huang, ICLR 2023).

    The body ``phi`` is shared (FedAvg); the head ``psi_i`` is personal and, after each
    round, replaced by a client-specific combination of the round's heads. Round ``t``,
    client ``i`` receives ``phi^t``, the global prototypes ``c^k`` and, if the server
    computed one for it, its combined head (else it keeps its own):

    1. statistics of ``phi^t`` over its training data (eval mode, :func:`feature_statistics`):
       ``h_i[k] = p_i(k) mu_i^k``,
       ``V_i = (sum_k p_i(k) mean_{x in k} ||phi(x)||^2 - sum_k p_i(k)^2 ||mu_i^k||^2) / n_i``;
    2. ``head_epochs`` (1) epochs training ``psi_i`` alone (``phi`` frozen) on
       ``CE(psi(phi(x)), y)``;
    3. the run's local epochs training ``phi`` alone (``psi_i`` frozen) on
       ``CE(psi(phi(x)), y) + lambda * MSE(phi(x), c^y)`` (FedProto's regulariser,
       :func:`~contrafl.algorithms.prototypes.squared_distance_loss`; none before the
       first global prototypes);
    4. local prototypes ``r_i^k`` = class means of the trained ``phi`` (eval mode);
       upload of ``phi_i``, ``psi_i``, ``r_i`` (with counts) and ``(V_i, h_i)``.

    Server, over the round's ``M`` replies: ``phi^{t+1} = sum_i n_i/n phi_i``; global
    prototypes ``c^k`` = uniform mean of the ``r_i^k`` (PFLlib; ``weighting=counts``
    weights by ``n_i^k``); for each replying client ``i``::

        P^(i) = diag(V_1..V_M) + D^(i),  D_{j1 j2} = sum_k (h_i[k] - h_j1[k]) . (h_i[k] - h_j2[k])
        alpha_i = argmin_{alpha >= 0, sum alpha = 1} alpha^T P^(i) alpha
        psi_i <- sum_j alpha_ij psi_j

    with ``P`` rebuilt from its eigenpairs ``>= 0.01`` when it has a negative eigenvalue
    (FedPAC's code), the QP solved exactly (:func:`simplex_qp`), weights ``<= 1e-3``
    zeroed and, by default, the rest renormalised to sum 1. Evaluation: ``phi^{t+1}``
    with the client's combined head, else its own head (its own initialisation before
    it trains).

    Differences from PFLlib (``docs/developer/pfllib_reference.md`` §B.11): the statistics,
    variances and heads of client ``i`` are aligned by client id (PFLlib pairs the
    statistics of its selected clients with the heads of a random permutation of them),
    every combination uses the heads as uploaded (PFLlib overwrites them in place one
    client after the other), the weights are renormalised after zeroing
    (``renormalize=false``: not), a repaired ``P`` is always solved (PFLlib re-tests
    the repaired matrix with a strict ``>= 0`` eigenvalue test, which round-off can fail,
    and then keeps the client's own head), the QP is solved by our own exact solver
    instead of cvxpy, and the statistics and prototypes use all the client's training
    samples (PFLlib's loader drops the last incomplete batch). A client's first head is
    its own random initialisation (PFLlib: the common one).
    """

    name = "fedpac"
    summary = "FedPAC: FedAvg body with prototype alignment; per-client head combination by a QP on feature statistics"
    paper = "Xu, Tong, Huang, Personalized Federated Learning with Feature Alignment and Classifier Collaboration, ICLR 2023"
    Params = FedPACParams
    evaluates_global = False
    personalized = True

    # -- server ------------------------------------------------------------------------
    def init_server(self, model: StateDict) -> ServerState:
        self._head_spec = spec_of(split_head(model)[1])
        return ServerState(model, {"heads": {}})

    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        body, _ = split_head(server.model)
        return {"body": body, **prototype_message(server.extras)}

    def message_for(self, message: dict[str, Any], server: ServerState, cid: int, round: int) -> dict[str, Any]:
        heads = server.extras.get("heads", {})
        return {**message, "head": heads[cid]} if cid in heads else message

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        dtype = next(v.dtype for v in message["body"].values() if v.is_floating_point())
        head = spec_of(message["head"]) if "head" in message else self._head_spec
        C = self.federation.num_classes
        return {
            "body": spec_of(message["body"]),
            "head": head,
            "prototypes": prototype_spec(C, dtype),
            "stats": {"V": TensorSpec((), dtype), "h": TensorSpec((C, None), dtype)},
        }

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        return "FedPAC's server combines heads per client from each client's feature statistics"

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        body = weighted_average([r.payload["body"] for r in replies], sample_weights(replies))
        prototypes = aggregate_prototypes(
            [r.payload["prototypes"] for r in replies], self.params.weighting, previous_for(server.extras, self.params.missing_label)
        )
        variances = torch.stack([r.payload["stats"]["V"] for r in replies])
        hs = torch.stack([r.payload["stats"]["h"] for r in replies])
        uploaded = [r.payload["head"] for r in replies]
        heads = dict(server.extras.get("heads", {}))
        weights = dict(server.extras.get("head_weights", {}))
        cids = torch.tensor([r.cid for r in replies])
        p = self.params
        for i, r in enumerate(replies):
            alpha = combination_weights(variances, hs, i, p.eps, p.eig_floor, p.renormalize)
            if alpha is None:  # nothing to combine: the client keeps its own head
                heads.pop(r.cid, None)
                weights.pop(r.cid, None)
                continue
            heads[r.cid] = combine_heads(uploaded, alpha)
            row = torch.zeros(self.federation.num_clients, dtype=torch.float64)
            row[cids] = alpha
            weights[r.cid] = row
        extras = {**server.extras, "prototypes": prototypes, "heads": heads, "head_weights": weights}
        return ServerState({**server.model, **body}, extras)

    # -- client ------------------------------------------------------------------------
    def head(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> StateDict:
        """The combined head received, else the client's own, else its initialisation."""
        if "head" in message:
            return message["head"]
        if "head" in state:
            return state["head"]
        return split_head(ctx.initial_state())[1]

    def client_begin(self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext) -> LocalTask:
        task = body_head_task(self.federation, message["body"], self.head(message, state, ctx))
        if "prototypes" in message:
            task.consts["prototypes"] = message["prototypes"]
        return task

    def phases(self, round: int) -> list[Phase]:
        return [
            Phase((Stage(self.head_loss, trains=("head",)),), epochs=self.params.head_epochs, name="head"),
            Phase((Stage(self.body_loss, trains=("body",)),), name="body"),
        ]

    def head_loss(self, task: TaskView, batch: Batch, net: Network):
        ce = F.cross_entropy(body_head_forward(task, batch, net).logits, batch.y)
        return ce, {"loss": ce.detach(), "ce": ce.detach()}

    def body_loss(self, task: TaskView, batch: Batch, net: Network):
        out = body_head_forward(task, batch, net)
        ce = F.cross_entropy(out.logits, batch.y)
        if "prototypes" not in task.consts:
            return ce, {"loss": ce.detach(), "ce": ce.detach()}
        protos = task.consts["prototypes"]
        align = squared_distance_loss(out.z, batch.y, protos["reps"], protos["mask"])
        loss = ce + self.params.lam * align
        return loss, {"loss": loss.detach(), "ce": ce.detach(), "align": align.detach()}

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        C = self.federation.num_classes
        # statistics of the received body (the task's starting point; executors never
        # modify a task's tensors)
        received = {**task.params["body"], **task.buffers["body"], **task.params["head"], **task.buffers["head"]}
        out, y = ctx.predict(received)
        v, h = feature_statistics(out.z, y, C)
        body, head = model_state(result, "body"), model_state(result, "head")
        prototypes = predicted_prototypes(ctx, {**body, **head}, C)
        payload = {"body": body, "head": head, "prototypes": prototypes, "stats": {"V": v, "h": h}}
        return Reply(ctx.cid, ctx.num_samples, payload), {"head": head}

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel:
        return PersonalModel({**message["body"], **self.head(message, state, ctx)})
