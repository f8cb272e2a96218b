"""Byzantine-robust aggregation as a setting of every algorithm (``aggregator=NAME``).

The server of an algorithm whose aggregate needs only weighted means of the replies'
payloads (:meth:`~contrafl.algorithms.base.Algorithm.beyond_weighted_mean` is None: the
algorithms secure aggregation serves) computes, from equal payloads, that payload; one
whose aggregate is an affine function of their sum
(:meth:`~contrafl.algorithms.base.Algorithm.individual_updates` is None: SCAFFOLD's
control variates) computes it of ``n`` times the payload. So a
robust rule replaces the means without the algorithm knowing: before
:meth:`~contrafl.algorithms.base.Algorithm.aggregate`, every reply's update becomes the
rule's aggregate of the round's updates::

    u_i = p_i - m_i            (m_i: client i's message where it has the tensor, else 0)
    u*  = rule(u_1, ..., u_n)  (one vector per client: every floating-point tensor of its
                                payload but the per-label tables)
    p_i <- m_i + u*

and every row ``c`` of a per-label table (prototypes) becomes the rule's aggregate of the
rows of the clients that hold label ``c``. Integer tensors stay each client's own. The
algorithm's means of equal payloads are then ``u*`` (its weights do not matter), as
FedAvg's, SCAFFOLD's control variates, FedCRL's body and prototypes, BYOL's encoder and
target alike. The rules are :mod:`contrafl.algorithms.robust`'s.

``aggregator=mean`` (the default) is the algorithm's own aggregation, untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import params as P
from ..algorithms import robust
from ..algorithms.base import Reply
from ..config import Component, component_name, without_options
from ..errors import ConfigError
from ..execution.validate import is_label_table, update_vector, updates, with_update

AGGREGATORS = {
    "mean": "the algorithm's own aggregation (FedAvg's sample-weighted mean; the default)",
    "median": "coordinate-wise median (Yin et al. 2018; Flower's FedMedian)",
    "trimmed_mean": "coordinate-wise mean without the f smallest and f largest values (Yin et al. 2018; Flower's FedTrimmedAvg with beta)",
    "krum": "the update closest to its n - f - 2 nearest neighbours (Blanchard et al. 2017)",
    "multi_krum": "the mean of the m updates with the best Krum scores (Blanchard et al. 2017)",
    "bulyan": "Krum selection of n - 2f, then a trimmed mean around the median (El Mhamdi et al. 2018)",
    "geometric_median": "smoothed Weiszfeld iterations (Pillutla et al. 2022, RFA)",
    "centered_clipping": "updates clipped around the previous aggregate (Karimireddy et al. 2021)",
    "norm_bound": "every update clipped to an l2 bound, then averaged (Sun et al. 2019)",
    "mda": "the mean of the n - f updates of smallest diameter (El Mhamdi et al. 2020; small n)",
}
NAMES = tuple(AGGREGATORS)
F_RULES = ("trimmed_mean", "krum", "multi_krum", "bulyan", "mda")
VARIANTS = {"krum": ("blanchard", "byzfl"), "multi_krum": ("blanchard", "byzfl"), "bulyan": ("recursive", "multi_krum")}
WEIGHTED = ("multi_krum", "geometric_median", "centered_clipping", "norm_bound")


@dataclass(frozen=True)
class AggregatorParams:
    """Options of the ``aggregator`` setting (each rule reads those :data:`READS` lists)."""

    f: int = P.param(1, P.Interval(0, None), "Byzantine clients the rule tolerates (trimmed_mean, krum, multi_krum, bulyan, mda); "
                     "a round with too few replies for f uses the largest f they allow, and the median below that")
    beta: float | None = P.param(None, P.Interval(0, 0.5, "left"), "trimmed_mean: trim floor(beta n) values at each end (Flower's FedTrimmedAvg) instead of f")
    m: int | None = P.param(None, P.Interval(1, None), "multi_krum: updates averaged (none: n - f)")
    variant: str = P.param(
        "auto", P.OneOf(("auto", "blanchard", "byzfl", "recursive", "multi_krum")),
        "krum, multi_krum: blanchard (n - f - 2 neighbours, the paper and Flower) or byzfl (n - f - 1); bulyan: recursive (the paper, "
        "Flower's aggregate_bulyan) or multi_krum (one Krum scoring, Flower's serverapp Bulyan); auto: the first",
    )
    tau: float | None = P.param(
        None, P.Interval(0, None, "neither"),
        "norm_bound, centered_clipping: the clipping radius (none: the median norm of the round's updates, around the previous aggregate for centered_clipping)",
    )
    L: int = P.param(1, P.Interval(1, None), "centered_clipping: clipping iterations per round")
    nu: float = P.param(0.1, P.Interval(0, None, "neither"), "geometric_median: smoothing of the Weiszfeld weights")
    T: int = P.param(3, P.Interval(1, None), "geometric_median: Weiszfeld iterations")
    weights: str = P.param(
        "uniform", P.OneOf(("uniform", "samples")),
        "multi_krum, geometric_median, centered_clipping, norm_bound: every update counts alike (uniform: a sample count is the "
        "client's claim) or by its sample count",
    )


READS = {
    "median": (),
    "trimmed_mean": ("f", "beta"),
    "krum": ("f", "variant"),
    "multi_krum": ("f", "m", "variant", "weights"),
    "bulyan": ("f", "variant"),
    "geometric_median": ("nu", "T", "weights"),
    "centered_clipping": ("tau", "L", "weights"),
    "norm_bound": ("tau", "weights"),
    "mda": ("f",),
}


def resolve_aggregator(component: Component, algo_cls: type, algo_params: Any, dp: str, clients_per_round: int) -> Component:
    """The ``aggregator`` component validated and in canonical form; one-line errors for
    an unknown rule, an option the rule does not read, an ``f`` the round's clients
    cannot support, an algorithm whose server needs more than weighted means, and
    ``dp=central`` (its noise is calibrated to a sum)."""
    name = component_name(component, "aggregator", NAMES, "set it with aggregator=NAME (docs/robustness.md)")
    if name == "mean":
        return without_options(component, "aggregator", "mean", "choose a robust rule, e.g. aggregator=median", ", which has no options")
    options = P.build(AggregatorParams, component.options, "aggregator")
    ignored = [k for k in component.options if k not in READS[name]]
    if ignored:
        readers = [rule for rule, keys in READS.items() if ignored[0] in keys]
        raise ConfigError(f"aggregator.{ignored[0]} has no effect with aggregator={name} (it is read by {', '.join(readers)}); remove it")
    if options.variant != "auto" and options.variant not in VARIANTS.get(name, ()):
        raise ConfigError(
            f"aggregator.variant={options.variant} is not a variant of {name}; "
            + (f"expected one of {', '.join(VARIANTS[name])}" if name in VARIANTS else "remove it")
        )
    if name == "trimmed_mean" and options.beta is not None and "f" in component.options:
        raise ConfigError("aggregator=trimmed_mean takes aggregator.f or aggregator.beta, not both; remove one")
    if name in F_RULES and not (name == "trimmed_mean" and options.beta is not None):
        try:
            robust.check_f(name, clients_per_round, options.f)
        except ValueError as exc:
            raise ConfigError(f"{exc} (sample_fraction x num_clients)") from None
    if name == "multi_krum" and options.m is not None and options.m > clients_per_round:
        raise ConfigError(f"aggregator.m={options.m} is more than the {clients_per_round} clients of a round; set aggregator.m <= {clients_per_round}")
    why = algo_cls.beyond_weighted_mean(algo_params) and algo_cls.individual_updates(algo_params)
    if why is not None:
        raise ConfigError(f"aggregator={name} replaces the weighted means of the replies with a robust estimate, but {why}; use aggregator=mean with this algorithm")
    if dp == "central":
        raise ConfigError(f"aggregator={name} with dp=central: the noise is calibrated to the sum of the clipped updates, and a robust rule is not that sum; use dp=local (allowed with robust rules) or aggregator=mean")
    kept = {k: v for k, v in P.to_dict(options).items() if k in READS[name]}
    if "variant" in kept and kept["variant"] == "auto":
        kept["variant"] = VARIANTS[name][0]
    if name == "trimmed_mean":
        del kept["f" if options.beta is not None else "beta"]
    return Component(name, kept)


def largest_f(rule: str, n: int) -> int:
    """The most Byzantine clients ``rule`` tolerates among ``n`` (:func:`robust.check_f`)."""
    a, b, _ = robust._REQUIREMENTS[rule]
    return (n - b - 1) // a


class RobustAggregation:
    """A run's robust rule (``aggregator`` other than ``mean``), applied to a round's
    replies before the algorithm aggregates them (the module doc). Centered clipping's
    previous aggregates are its state (:meth:`state_dict`), kept in checkpoints."""

    def __init__(self, component: Component) -> None:
        self.name = component.name
        self.params: AggregatorParams = P.build(AggregatorParams, component.options, "aggregator")
        self.centers: dict[str, torch.Tensor] = {}

    @classmethod
    def of(cls, component: Component) -> RobustAggregation | None:
        """The run's rule, or None for ``aggregator=mean``."""
        return None if component.name == "mean" else cls(component)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Centered clipping's previous aggregate of each vector it clips (``updates``,
        ``table{j}/label{c}``), for the checkpoint."""
        return dict(self.centers)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (a resumed run)."""
        self.centers = dict(state)

    def rule(self, updates: torch.Tensor, weights: torch.Tensor | None, key: str) -> tuple[robust.Robust, int | None]:
        """The rule on ``updates`` ``[n, d]``, and the ``f`` it used where a round with
        few replies made it lower the configured one (else None). ``key`` names the
        centered-clipping state of this vector."""
        p, n, name = self.params, len(updates), self.name
        weights = weights if p.weights == "samples" else None
        f = p.f
        if name in F_RULES and not (name == "trimmed_mean" and p.beta is not None) and f > largest_f(name, n):
            f = largest_f(name, n)
            if f < 0:
                return robust.median(updates), f
        lowered = f if f != p.f else None
        variant = p.variant if p.variant != "auto" else VARIANTS.get(name, ("",))[0]
        if name == "median":
            return robust.median(updates), None
        if name == "trimmed_mean":
            return (robust.trimmed_mean(updates, beta=p.beta) if p.beta is not None else robust.trimmed_mean(updates, f=f)), lowered
        if name == "krum":
            return robust.krum(updates, f, variant), lowered
        if name == "multi_krum":
            return robust.multi_krum(updates, f, min(p.m, n) if p.m else None, weights, variant), lowered
        if name == "bulyan":
            return robust.bulyan(updates, f, variant), lowered
        if name == "mda":
            return robust.mda(updates, f), lowered
        if name == "geometric_median":
            return robust.geometric_median(updates, p.nu, p.T, weights), None
        center = self.centers.get(key)
        if name == "centered_clipping":
            v = torch.zeros_like(updates[0]) if center is None else center.to(updates)
            tau = p.tau if p.tau is not None else _median_norm(updates - v)
            out = robust.CenteredClipping(tau, p.L, v)(updates, weights)
            self.centers[key] = out.aggregate.detach().clone()
            return out, None
        tau = p.tau if p.tau is not None else _median_norm(updates)
        return robust.norm_bound(updates, tau, weights), None

    def apply(self, replies: Sequence[Reply], message_of: Mapping[int, Any]) -> tuple[list[Reply], dict[str, Any]]:
        """``replies`` with every update replaced by the rule's aggregate (the module
        doc), each measured against its client's message ``message_of[cid]``; and what
        the rule did: the clients it dropped or down-weighted (``flagged``, for rules
        that choose among clients) and the ``f`` it used when it had to lower it."""
        replies = list(replies)
        if not replies:
            return replies, {}
        bare, tables = zip(*(_without_tables(r.payload) for r in replies))
        first = updates(bare[0], message_of[replies[0].cid])
        report: dict[str, Any] = {}
        new_bare = list(bare)
        if first:
            dtype = torch.promote_types(*{u.dtype for u in first}, torch.float32)
            stacked = torch.stack([update_vector(b, message_of[r.cid], dtype) for b, r in zip(bare, replies)])
            samples = torch.tensor([float(r.num_samples) for r in replies], dtype=dtype)
            out, f = self.rule(stacked, samples if bool(samples.sum() > 0) else None, "updates")
            new_bare = [with_update(b, message_of[r.cid], out.aggregate) for b, r in zip(bare, replies)]
            chosen = flagged(out, samples if self.params.weights == "samples" else None, [r.cid for r in replies])
            if chosen is not None:
                report["flagged"] = chosen
            if f is not None:
                report["f"] = f
        new_tables = self._tables([list(t) for t in tables], replies)
        payloads = [_with_tables(b, t) for b, t in zip(new_bare, new_tables)]
        return [dataclasses.replace(r, payload=p) for r, p in zip(replies, payloads)], report

    def _tables(self, tables: list[list[dict[str, Any]]], replies: Sequence[Reply]) -> list[list[dict[str, Any]]]:
        """Each per-label table's rows, label by label, replaced by the rule's aggregate
        over the clients that hold the label (rows are values: no message subtracted)."""
        out = [list(ts) for ts in tables]
        for j in range(len(tables[0])):
            rows = [_full_rows(ts[j]) for ts in tables]  # ([C, d], bool [C]) per client
            if not rows:
                continue
            for c in range(rows[0][0].shape[0]):
                holders = [i for i, (_, held) in enumerate(rows) if bool(held[c])]
                if not holders:
                    continue
                stacked = torch.stack([rows[i][0][c] for i in holders])
                weights = torch.tensor([float(replies[i].num_samples) for i in holders], dtype=stacked.dtype)
                value = self.rule(stacked, weights if bool(weights.sum() > 0) else None, f"table{j}/label{c}")[0].aggregate
                for i in holders:
                    out[i][j] = _set_row(out[i][j], c, value)
        return out


def flagged(out: robust.Robust, weights: torch.Tensor | None, cids: Sequence[int]) -> list[int] | None:
    """The clients a rule dropped (not ``kept``) or down-weighted (a coefficient below
    half its share of the input ``weights``, uniform when None); None for a rule that
    treats every coordinate alone (median, trimmed mean): it chooses no client."""
    if out.kept is None and out.weights is None:
        return None
    n = len(cids)
    drop = torch.zeros(n, dtype=torch.bool) if out.kept is None else ~out.kept.cpu()
    if out.weights is not None:
        share = torch.full((n,), 1.0 / n, dtype=torch.float64) if weights is None else (weights / weights.sum()).double().cpu()
        drop |= out.weights.double().cpu() < share / 2
    return [cid for cid, d in zip(cids, drop.tolist()) if d]


def detection(flagged_cids: Sequence[int] | None, attackers: Sequence[int], replied: Sequence[int]) -> dict[str, float | None]:
    """Precision and recall of ``flagged_cids`` against the true ``attackers`` among the
    clients that ``replied`` (None where undefined: nothing flagged, no attacker)."""
    if flagged_cids is None:
        return {}
    hit = len(set(flagged_cids) & set(attackers))
    present = len(set(attackers) & set(replied))
    return {
        "precision": hit / len(flagged_cids) if flagged_cids else None,
        "recall": hit / present if present else None,
    }


def _median_norm(updates: torch.Tensor) -> float:
    norms = updates.double().norm(dim=1)
    median = float(norms.median())
    return median if median > 0 else float(norms.max()) or 1.0


TABLE = "<per-label table>"


def _without_tables(payload: Any) -> tuple[Any, list[dict[str, Any]]]:
    leaves, spec = pytree.tree_flatten(payload, is_leaf=is_label_table)
    tables = [leaf for leaf in leaves if is_label_table(leaf)]
    return pytree.tree_unflatten([TABLE if is_label_table(leaf) else leaf for leaf in leaves], spec), tables


def _with_tables(bare: Any, tables: Sequence[dict[str, Any]]) -> Any:
    it = iter(tables)
    return pytree.tree_map(lambda leaf: next(it) if isinstance(leaf, str) and leaf == TABLE else leaf, bare)


def _full_rows(table: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A table's rows by label ``[C, d]`` and which labels the client holds: ``counts > 0``,
    or its ``mask`` (compact tables, FedSSC's, hold only the marked labels' rows)."""
    reps = table["reps"]
    held = table["counts"] > 0 if isinstance(table.get("counts"), torch.Tensor) else table["mask"].bool()
    if reps.shape[0] == held.shape[0]:
        return reps, held
    full = reps.new_zeros((held.shape[0], reps.shape[1]))
    full[held] = reps
    return full, held


def _set_row(table: dict[str, Any], label: int, value: torch.Tensor) -> dict[str, Any]:
    reps = table["reps"].clone()
    held = table["counts"] > 0 if isinstance(table.get("counts"), torch.Tensor) else table["mask"].bool()
    row = label if reps.shape[0] == held.shape[0] else int(held[:label].sum())
    reps[row] = value.to(reps)
    return {**table, "reps": reps}
