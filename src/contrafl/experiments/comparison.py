"""A comparison's tables, one per metric family: global test accuracy, personalised
(client) accuracy, and the kNN accuracy of self-supervised encoders.

A configuration appears in the table of every family its runs evaluated, and no table
holds two metrics. Every table has the same columns (:func:`family_table`): the seeds,
the final and the best round's value (mean over seeds with a bootstrap interval,
:mod:`contrafl.experiments.stats`), the paired difference of the final value to the
baseline on the seeds both ran, with whether its interval excludes 0, and what each
configuration spent to reach the target (the baseline's mean final value): rounds,
MiB sent both ways and seconds of its rounds, over the seeds that reached it. The
personalised table adds the spread over clients at the final round: their std (mean
over seeds) and the interval of the mean client accuracy over clients (every client of
every seed one value).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .groups import PROBE_FILES, Group
from .report import METRICS, Metric
from .stats import CONFIDENCE, Interval, interval, paired_difference, reached

CI = f"{CONFIDENCE:.0%} CI"

FAMILIES = tuple(m for key in ("test_acc", "personal_acc", "knn_acc") for m in METRICS if m.key == key)
"""The families in the order of their tables: global, personalised, self-supervised."""


@dataclass(frozen=True)
class FamilyTable:
    """A family's table: its metric, a title, and its rows (header first)."""

    metric: Metric
    title: str
    rows: list[list[str]]


def finals(group: Group, key: str) -> dict[int, float]:
    """Each completed seed's last evaluated value of ``key``."""
    return {r.seed: r.evaluated(key)[-1][key] for r in group.completed if r.evaluated(key)}


def bests(group: Group, key: str) -> dict[int, float]:
    """Each completed seed's best value of ``key`` over its rounds."""
    return {r.seed: max(x[key] for x in r.evaluated(key)) for r in group.completed if r.evaluated(key)}


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
    header = ["configuration", "seeds", f"final (%) [{CI}]", f"best (%) [{CI}]"]
    if metric.std:
        header += ["client std (%)", f"client mean (%) [{CI} over clients]"]
    probes = [p for p in PROBE_FILES if key == "knn_acc" and any(r.probe(p) is not None for g in family for r in g.completed)]
    header += [f"{p} probe (%) [{CI}]" for p in probes]
    bases = {g.label: baseline_for(g, family, baseline) for g in family}
    named = {b.label for b in bases.values() if b is not None}
    header += [f"Δ final vs {' / '.join(sorted(named)) or 'baseline'} (pp) [{CI}]", "excludes 0",
               "rounds to target", "MiB to target", "seconds to target"]
    rows = [header]
    for g in family:
        final, best = finals(g, key), bests(g, key)
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
            row += ["(baseline)" if base is g else "-", "", *_to_target(g, key, base)]
        else:
            diff = paired_difference(final, finals(base, key))
            row += [_cell(diff, signed=True), _excludes(diff), *_to_target(g, key, base)]
        rows.append(row)
    targets = sorted({b.label for b in bases.values() if b is not None})
    title = (f"{metric.title}: mean over seeds [{CI}: bootstrap over seeds]; Δ: paired difference to "
             f"{', '.join(targets) or 'the baseline'} on the seeds both ran; target: the baseline's mean final value")
    return FamilyTable(metric, title, rows)


def family_tables(groups: Sequence[Group], baseline: str | None = None) -> list[FamilyTable]:
    """:func:`family_table` of every family any group evaluated, in :data:`FAMILIES` order."""
    return [t for t in (family_table(m, groups, baseline) for m in FAMILIES) if t is not None]


def markdown(table: FamilyTable) -> str:
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
