"""A comparison's tables, one per metric family: global test accuracy, personalised
(client) accuracy, the kNN accuracy of self-supervised encoders, and what an attack
achieved (the backdoor's success rate, :data:`~contrafl.experiments.report.ATTACK_METRICS`).

A configuration appears in the table of every family its runs evaluated, and no table
holds two metrics. Every table has the same columns (:func:`family_table`): the seeds,
the final and the best round's value (mean over seeds with a bootstrap interval,
:mod:`contrafl.experiments.stats`), the paired difference of the final value to the
baseline on the seeds both ran, with whether its interval excludes 0, and what each
configuration spent to reach the target (the baseline's mean final value): rounds,
MiB sent both ways and seconds of its rounds, over the seeds that reached it. The
personalised table adds the spread over clients at the final round: their std (mean
over seeds) and the interval of the mean client accuracy over clients (every client of
every seed one value). A family where lower is better (an attack's success rate) shows
its lowest round as the best and has no target: it is no accuracy to reach.

Runs whose aggregator chooses clients add a table of their own
(:func:`detection_table`): the aggregator's precision and recall in finding the
attackers, each run's mean over its rounds, with intervals over seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .groups import PROBE_FILES, Group
from .report import ATTACK_METRICS, METRICS, Metric, Robustness, robustness
from .stats import CONFIDENCE, Interval, interval, paired_difference, reached

CI = f"{CONFIDENCE:.0%} CI"

FAMILIES = (*(m for key in ("test_acc", "personal_acc", "knn_acc") for m in METRICS if m.key == key), *ATTACK_METRICS)
"""The families in the order of their tables: global, personalised, self-supervised,
then the attacks' success."""


@dataclass(frozen=True)
class FamilyTable:
    """A family's table: its metric, a title, and its rows (header first)."""

    metric: Metric
    title: str
    rows: list[list[str]]


@dataclass(frozen=True)
class DetectionTable:
    """The table of :func:`detection_table`: a title and its rows (header first)."""

    title: str
    rows: list[list[str]]


def finals(group: Group, key: str) -> dict[int, float]:
    """Each completed seed's last evaluated value of ``key``."""
    return {r.seed: r.evaluated(key)[-1][key] for r in group.completed if r.evaluated(key)}


def bests(group: Group, key: str, lower_is_better: bool = False) -> dict[int, float]:
    """Each completed seed's best value of ``key`` over its rounds: the highest, or the
    lowest where lower is better."""
    best = min if lower_is_better else max
    return {r.seed: best(x[key] for x in r.evaluated(key)) for r in group.completed if r.evaluated(key)}


def baseline_for(group: Group, groups: Sequence[Group], baseline: str | None) -> Group | None:
    """The group ``group`` is compared with among ``groups`` (a family's): the one named
    ``baseline`` (by method, in the same setting of a suite with settings), else the
    first of its setting (a family the baseline did not evaluate has its own first)."""
    same = [g for g in groups if g.setting == group.setting]
    named = next((g for g in same if baseline is not None and baseline in (g.method, g.label)), None)
    return named or (same[0] if same else None)


def family_table(metric: Metric, groups: Sequence[Group], baseline: str | None = None) -> FamilyTable | None:
    """The table of ``metric`` over the groups that evaluated it (None if none did);
    the paired difference and the target against ``baseline`` (module docstring)."""
    family = [g for g in groups if metric in g.families]
    if not family:
        return None
    key = metric.key
    header = ["configuration", "seeds", f"final (%) [{CI}]", f"{'lowest' if metric.lower_is_better else 'best'} (%) [{CI}]"]
    if metric.std:
        header += ["client std (%)", f"client mean (%) [{CI} over clients]"]
    probes = [p for p in PROBE_FILES if key == "knn_acc" and any(r.probe(p) is not None for g in family for r in g.completed)]
    header += [f"{p} probe (%) [{CI}]" for p in probes]
    bases = {g.label: baseline_for(g, family, baseline) for g in family}
    named = {b.label for b in bases.values() if b is not None}
    header += [f"Δ final vs {' / '.join(sorted(named)) or 'baseline'} (pp) [{CI}]", "excludes 0"]
    targets = not metric.lower_is_better
    if targets:
        header += ["rounds to target", "MiB to target", "seconds to target"]
    rows = [header]
    for g in family:
        final, best = finals(g, key), bests(g, key, metric.lower_is_better)
        row = [g.label, ", ".join(map(str, sorted(final))), _cell(interval(list(final.values()))), _cell(interval(list(best.values())))]
        if metric.std:
            rows_at_end = [r.evaluated(key)[-1] for r in g.completed if r.evaluated(key)]
            stds = [x[metric.std] for x in rows_at_end if x.get(metric.std) is not None]
            clients = [a for x in rows_at_end for a in x.get("client_acc") or [] if a is not None]
            row += [f"{100 * sum(stds) / len(stds):.2f}" if stds else "-", _cell(interval(clients))]
        for p in probes:
            row.append(_cell(interval([v for v in (r.probe(p) for r in g.completed) if v is not None])))
        base = bases[g.label]
        if base is None or base is g:
            row += ["(baseline)" if base is g else "-", ""]
        else:
            diff = paired_difference(final, finals(base, key))
            row += [_cell(diff, signed=True), _excludes(diff)]
        rows.append(row + (_to_target(g, key, base) if targets else []))
    compared = sorted({b.label for b in bases.values() if b is not None})
    title = (f"{metric.title}: mean over seeds [{CI}: bootstrap over seeds]; Δ: paired difference to "
             f"{', '.join(compared) or 'the baseline'} on the seeds both ran"
             + ("; target: the baseline's mean final value" if targets else ""))
    return FamilyTable(metric, title, rows)


def family_tables(groups: Sequence[Group], baseline: str | None = None) -> list[FamilyTable]:
    """:func:`family_table` of every family any group evaluated, in :data:`FAMILIES` order."""
    return [t for t in (family_table(m, groups, baseline) for m in FAMILIES) if t is not None]


def group_robustness(group: Group) -> dict[int, Robustness]:
    """Each completed seed's :func:`~contrafl.experiments.report.robustness` (seeds
    without attackers or a robust aggregator left out)."""
    found = {r.seed: robustness(r.config, r.rows) for r in group.completed}
    return {seed: value for seed, value in found.items() if value is not None}


def detection_table(groups: Sequence[Group]) -> DetectionTable | None:
    """Per configuration whose aggregator chooses clients (None when none does: the
    mean and the coordinate-wise rules flag none): its aggregator and attack, the
    clients flagged a round, and the precision and recall of the flagged clients against
    the attackers, each seed's mean over its rounds, with the mean over seeds and its
    bootstrap interval; ``-`` where no round defines them (a precision needs a flagged
    client, a recall an attacker)."""
    found = {g.label: group_robustness(g) for g in groups}
    attacked = [g for g in groups if any(r.flagged is not None or r.recall is not None for r in found[g.label].values())]
    if not attacked:
        return None
    rows = [["configuration", "seeds", "aggregator", "attack", "flagged a round", f"precision (%) [{CI}]", f"recall (%) [{CI}]"]]
    for g in attacked:
        seeds = found[g.label]
        first = next(iter(seeds.values()))
        flagged = [r.flagged for r in seeds.values() if r.flagged is not None]
        rows.append([
            g.label,
            ", ".join(map(str, sorted(seeds))),
            first.aggregator,
            first.attack,
            f"{sum(flagged) / len(flagged):.2f}" if flagged else "-",
            _cell(interval([r.precision for r in seeds.values() if r.precision is not None])),
            _cell(interval([r.recall for r in seeds.values() if r.recall is not None])),
        ])
    title = (f"Attackers found by the aggregator: precision and recall of the clients it dropped or down-weighted, "
             f"each run's mean over its rounds, mean over seeds [{CI}: bootstrap over seeds]; "
             "-: no round defines it (no client flagged, no attacker); the mean and coordinate-wise rules flag none and are not listed")
    return DetectionTable(title, rows)


def markdown(table: FamilyTable | DetectionTable) -> str:
    """The table as markdown, its title in bold above it."""
    header, *body = table.rows
    lines = [f"**{table.title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])


def _cell(value: Interval | None, signed: bool = False) -> str:
    return "-" if value is None else value.text(signed=signed)


def _excludes(diff: Interval | None) -> str:
    if diff is None:
        return "no common seed"
    if not diff.known:
        return "unknown (1 seed)"
    return "yes" if diff.excludes_zero else "no"


def _to_target(group: Group, key: str, base: Group | None) -> list[str]:
    """Rounds, MiB and seconds to the baseline's mean final value (three cells)."""
    target = finals(base, key) if base is not None else {}
    if not target:
        return ["-", "-", "-"]
    value = sum(target.values()) / len(target)
    got = reached([(r.rows, r.round_seconds()) for r in group.completed if r.evaluated(key)], key, value)
    return [got.cell("rounds"), got.cell("bytes"), got.cell("seconds")]
