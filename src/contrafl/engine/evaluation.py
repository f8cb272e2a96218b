"""What the round loop evaluates, and when: the global model on the test set or on
the clients' test splits, every client's personal model, the kNN accuracy of the global
model's representation."""

from __future__ import annotations

from typing import Any

import torch

from ..metrics.evaluate import evaluate
from ..metrics.history import mean_std
from ..metrics.knn import bank_and_queries, extract_features, knn_accuracy


class Evaluation:
    """The evaluation part of :class:`~contrafl.engine.simulation.Simulation`."""

    def evaluate_round(self, t: int) -> dict[str, Any]:
        """What round ``t`` (0-based) evaluates once its model is made: :meth:`evaluate`
        every ``eval_every`` rounds, the kNN accuracy every ``knn_every`` rounds, both
        after the last round."""
        cfg, row = self.cfg, {}
        if (t + 1) % cfg.eval_every == 0 or t + 1 == cfg.rounds:
            row.update(self.evaluate(t + 1))
        if cfg.knn_every and ((t + 1) % cfg.knn_every == 0 or t + 1 == cfg.rounds):
            row["knn_acc"] = self.evaluate_knn()
        return row

    def evaluate(self, next_round: int) -> dict[str, Any]:
        """The global model on the test set (when there is one) and on an attack's test
        sets (``backdoor_success``) and, with ``eval_personal``, every client's model on
        its own test data."""
        out: dict[str, Any] = {}
        bs, tf = self.cfg.eval_batch_size, self.setup.eval_transform
        if self.algorithm.evaluates_global and self.algorithm.supervised:
            if self.cfg.global_eval == "federated":
                out.update(self.evaluate_federated(next_round))
            elif len(self.test.y):
                res = evaluate(self.net, self.server.model, self.test.x, self.test.y, tf, bs)
                out["test_acc"], out["test_loss"] = res["acc"], res["loss"]
            for name, data in self.attack_tests.items():  # an attack's own measure, e.g. the backdoor's success rate
                if len(data.y):
                    out[name] = evaluate(self.net, self.server.model, data.x, data.y, tf, bs)["acc"]
        if self.cfg.eval_personal:
            out.update(self.evaluate_clients(next_round))
        return out

    def evaluate_federated(self, next_round: int) -> dict[str, Any]:
        """Federated evaluation of the global model, as Flower's evaluate round: every
        client evaluates it on its local test split, and ``test_acc`` is
        ``sum_i correct_i / sum_i n_i``, ``test_loss`` the sample-weighted mean loss, over
        the clients that replied (``test_clients``), summed in client order."""
        evaluate_round = self.transport.evaluate_model if self.transport is not None else self.evaluate_model_locally
        clients = list(range(self.cfg.num_clients))
        scores = dict(evaluate_round(next_round, clients, self.server.model))
        scored = [scores[cid] for cid in clients if scores.get(cid) is not None and scores[cid]["n"]]
        if not scored:
            return {}
        total = sum(res["n"] for res in scored)
        return {
            "test_acc": sum(round(res["acc"] * res["n"]) for res in scored) / total,
            "test_loss": sum(res["loss"] * res["n"] for res in scored) / total,
            "test_clients": len(scored),
        }

    def evaluate_knn(self) -> float:
        """Weighted kNN accuracy of the global model's encoder features ``h``
        (:func:`~contrafl.metrics.knn.knn_scores`, ``knn_k`` neighbours,
        ``knn_temperature``): the memory bank is the union of the clients' training sets,
        the queries the test set (the clients' test splits when the test set is pooled
        into them), both without augmentation."""
        cfg, tf = self.cfg, self.setup.eval_transform
        x_bank, y_bank, x_test, y_test = bank_and_queries(self.train, self.test, self.setup.partition)

        def encode(x: torch.Tensor) -> torch.Tensor:
            return self.net(self.server.model, x, train=False).h

        with torch.no_grad():
            bank = extract_features(encode, x_bank, tf, cfg.eval_batch_size)
            queries = extract_features(encode, x_test, tf, cfg.eval_batch_size)
        return knn_accuracy(bank, y_bank, queries, y_test, self.setup.data.num_classes, cfg.knn_k, cfg.knn_temperature)

    def evaluate_clients(self, next_round: int) -> dict[str, Any]:
        """PFLlib's personalised evaluation: every client, sampled or not, is evaluated
        with the model it holds at the start of ``next_round``
        (:meth:`~contrafl.algorithms.base.Algorithm.personal_model`) on its local test
        split (the global test set without one). ``personal_acc`` is the sample-weighted
        accuracy ``sum_i correct_i / sum_i n_i``, ``personal_acc_std`` the population std
        of the clients' accuracies, ``personal_acc_mean`` their unweighted mean and
        ``personal_loss`` the sample-weighted loss (when every client's model has one;
        FedProto's prototype distances have none); sums in client order, whatever order
        the scores arrive in. ``client_acc``, ``client_loss`` and ``client_n`` list every
        client's own values by client id (``None`` for a client without a personal model,
        test samples or reply). With an attack's probes (the clients' :attr:`probes`),
        ``personal_<name>`` is each probe's sample-weighted accuracy over the clients, e.g.
        ``personal_backdoor_success``, the backdoor's success rate on the personal models."""
        algo = self.algorithm
        message = algo.broadcast(self.server, next_round)
        evaluate_round = self.transport.evaluate if self.transport is not None else self.evaluate_locally
        clients = list(range(self.cfg.num_clients))
        scores = dict(evaluate_round(next_round, clients, lambda cid: algo.message_for(message, self.server, cid, next_round)))
        scored = [scores[cid] for cid in clients if scores.get(cid) is not None and scores[cid]["n"]]
        if not scored:
            return {}
        accs = [res["acc"] for res in scored]
        total = sum(res["n"] for res in scored)
        mean, std = mean_std(accs)
        out: dict[str, Any] = {
            "personal_acc": sum(res["acc"] * res["n"] for res in scored) / total,
            "personal_acc_std": std,
            "personal_acc_mean": mean,
        }
        if all(res["loss"] is not None for res in scored):
            out["personal_loss"] = sum(res["loss"] * res["n"] for res in scored) / total
        out["personal_clients"] = len(scored)
        for name in sorted({name for res in scored for name in res.get("probes", {})}):  # e.g. the backdoor's success rate
            probed = [res["probes"][name] for res in scored if res.get("probes", {}).get(name, {}).get("n")]
            if probed:
                out[f"personal_{name}"] = sum(p["acc"] * p["n"] for p in probed) / sum(p["n"] for p in probed)
        for key in ("acc", "loss", "n"):
            out[f"client_{key}"] = [None if scores.get(cid) is None else scores[cid][key] for cid in clients]
        return out
