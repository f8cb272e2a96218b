"""What the user sees of a run: ``summary.json`` (how the run stands, its final and best
values, its costs) and the rows of ``metrics.jsonl`` as ``sampling=secret`` publishes
them."""

from __future__ import annotations

from typing import Any

from ..metrics.history import rounds_to_reach


class Outputs:
    """The summary part of :class:`~contrafl.engine.simulation.Simulation`."""

    def summary(self, status: str, seconds: float, error: str | None = None) -> dict[str, Any]:
        evaluated = [r for r in self.history if "test_acc" in r or "personal_acc" in r or "knn_acc" in r]
        last = evaluated[-1] if evaluated else {}
        summary: dict[str, Any] = {"status": status}
        if error is not None:
            summary["error"] = error
        summary |= {
            "algorithm": self.cfg.algorithm.name,
            "dataset": self.cfg.dataset.name,
            "rounds_completed": self.rounds_done,
            "checkpointed_rounds": self.checkpointed,
            "rounds": self.cfg.rounds,
            "final": {k: v for k, v in last.items() if k not in ("clients", "bytes_down", "bytes_up") and not k.startswith("client_")},
        }
        accs = [r["test_acc"] for r in evaluated if "test_acc" in r]
        if accs:
            best = max(range(len(accs)), key=accs.__getitem__)
            summary["best_test_acc"] = accs[best]
            summary["best_round"] = [r for r in evaluated if "test_acc" in r][best]["round"]
        knn = [r for r in evaluated if "knn_acc" in r]
        if knn:
            best_row = max(knn, key=lambda r: r["knn_acc"])
            summary["best_knn_acc"] = best_row["knn_acc"]
            summary["best_knn_round"] = best_row["round"]
        personal = [r for r in evaluated if "personal_acc" in r]
        if personal:  # PFLlib reports the best round
            best_row = max(personal, key=lambda r: r["personal_acc"])
            summary["best_personal_acc"] = best_row["personal_acc"]
            summary["best_personal_acc_std"] = best_row["personal_acc_std"]
            summary["best_personal_round"] = best_row["round"]
        if self.cfg.target_accuracy is not None:
            summary["target_accuracy"] = self.cfg.target_accuracy
            summary["rounds_to_target"] = rounds_to_reach(self.history, self.cfg.target_accuracy)
        seconds += self.wall_time_before
        summary["rejected_updates"] = sum(len(r.get("rejected", [])) for r in self.history)
        if self.privacy is not None:
            summary["dp"] = self.privacy.summary()
        if self.cfg.aggregator.name != "mean" or self.cfg.attack.name != "none":
            summary["robustness"] = self.robustness()
        if self.timed:
            summary["simulated_time"] = round(sum(r["round_time"] for r in self.history), 6)
            summary["straggler_replies"] = {
                "dropped": sum(1 for r in self.history for c in r.get("stragglers", []) if not c["done"]),
                "partial": sum(1 for r in self.history for c in r.get("stragglers", []) if c["done"]),
            }
        summary["bytes_total"] = self.comm_total
        summary["executor"] = getattr(self.transport, "runtime", self.executor_name)
        summary["device"] = str(self.device)
        summary["fingerprint"] = self.fingerprint
        summary["wall_time_s"] = round(seconds, 3)
        summary["checkpoint_time_s"] = round(self.checkpoint_seconds, 3)
        summary["seconds_per_round"] = round(seconds / self.rounds_done, 3) if self.rounds_done else None
        if self.estimated_time_s is not None:
            summary["estimated_time_s"] = self.estimated_time_s
        if self.extensions:
            summary["extended"] = self.extension()
        return summary

    def robustness(self) -> dict[str, Any]:
        """The run's aggregator and attack, and the mean over rounds of the aggregator's
        precision and recall in finding the attackers (None where no round defines one:
        a rule that chooses no client, no attacker)."""
        out: dict[str, Any] = {"aggregator": self.cfg.aggregator.name, "attack": self.cfg.attack.name}
        for key in ("precision", "recall"):
            values = [r["aggregator"][key] for r in self.history if r.get("aggregator", {}).get(key) is not None]
            out[key] = sum(values) / len(values) if values else None
        return out

    def extension(self) -> dict[str, Any] | None:
        """How the run was extended to more rounds, None if it never was: ``{"from": the
        rounds it started with, "to": its rounds now, "equal_to_fresh_run": whether its
        metrics are those of a run started with that many, "why": what differs and why
        (None when equal), "extensions": :attr:`extensions`}``. Client sampling, DP
        accounting and every random stream do not depend on the total rounds; what
        does: an algorithm's schedule over them
        (:meth:`~contrafl.algorithms.base.Algorithm.depends_on_total_rounds`), for the
        rounds computed before an extension, and the evaluation of a run's last round
        when ``eval_every`` (``knn_every``) would not evaluate it."""
        if not self.extensions:
            return None
        cfg, why = self.cfg, []
        reason = type(self.algorithm).depends_on_total_rounds(self.algorithm.params)
        spans, start = [], 1
        for e in self.extensions:
            if e["after"] >= start:
                done = f"round {start}" if start == e["after"] else f"rounds {start}-{e['after']}"
                spans.append(f"{done} ran with rounds={e['from']}")
                start = e["after"] + 1
        if reason and spans:
            why.append(f"{reason}, and {', '.join(spans)}")
        ends = [e["from"] for e in self.extensions if e["after"] == e["from"]]  # evaluated as the last round
        extra = [m for m in ends if m % cfg.eval_every or (cfg.knn_every and m % cfg.knn_every)]
        if extra:
            every = f"eval_every={cfg.eval_every}" + (f", knn_every={cfg.knn_every}" if cfg.knn_every else "")
            rows = f"round {extra[0]} of metrics.jsonl has" if len(extra) == 1 else f"rounds {', '.join(map(str, extra))} of metrics.jsonl have"
            why.append(f"{rows} the evaluation of the run's last round, which a fresh run with {every} does not make (the training is the same)")
        return {
            "from": self.extensions[0]["from"], "to": cfg.rounds, "equal_to_fresh_run": not why,
            "why": "; ".join(why) or None, "extensions": self.extensions,
        }


def without_clients(row: dict[str, Any]) -> dict[str, Any]:
    """A round's row that does not say which clients took part (``sampling=secret``): no
    ``clients`` list, no ``attackers`` or clients the aggregator flagged, rejected and lost replies without their client, stragglers as
    whether they replied (their speed and planned steps would name them)."""
    out = {k: v for k, v in row.items() if k not in ("clients", "attackers")}
    if "aggregator" in out:
        out["aggregator"] = {k: v for k, v in out["aggregator"].items() if k != "flagged"}
    for key in ("rejected", "lost"):
        if key in out:
            out[key] = [{"reason": item["reason"]} for item in out[key]]
    if "stragglers" in out:
        out["stragglers"] = [{"done": item["done"] > 0} for item in out["stragglers"]]
    return out
