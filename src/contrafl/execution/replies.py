"""The server's checks of client replies, where the replies are made or arrive.

A reply is checked against the algorithm's :meth:`~contrafl.algorithms.base.Algorithm.
reply_spec` of its message and the counts the server knows
(:mod:`~contrafl.execution.validate`); the server checks the replies that reach it, and a
rank of the distributed executor checks its clients' replies before it sums them
(:mod:`~contrafl.execution.partial`), so the server need not see them one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..algorithms.base import Reply
from .validate import PendingCheck, begin_check, count_problem, finish_checks


class ReplyChecks:
    """The reply checks of a process that holds the run's configuration, algorithm,
    clients' rows and DP settings (:class:`~contrafl.execution.clients.LocalClients`)."""

    def begin_reply_check(self, cid: int, reply: Reply, message: dict[str, Any], specs: dict[int, Any]) -> PendingCheck:
        """The check of client ``cid``'s ``reply`` to ``message`` begun
        (:func:`~contrafl.execution.validate.begin_check`; :meth:`reply_problems` finishes
        it): the reply must name its client and match the algorithm's
        :meth:`~contrafl.algorithms.base.Algorithm.reply_spec` of ``message`` (kept in
        ``specs`` by the message's ``id``, for the messages of one round)."""
        if reply.cid != cid:
            return PendingCheck(f"the reply names client {reply.cid!r}")
        spec = specs.get(id(message))
        if spec is None:
            spec = specs[id(message)] = self.algorithm.reply_spec(message)
        return begin_check(reply, spec)

    def reply_problems(
        self,
        checks: dict[int, tuple[PendingCheck, Reply]],
        message_of: Callable[[int], dict[str, Any]],
        sums: bool = False,
    ) -> dict[int, str]:
        """``{cid: why}`` for the replies whose begun checks fail
        (:func:`~contrafl.execution.validate.finish_checks`: their values tested together),
        or, with ``dp=local``, :meth:`Privacy.check_local` against ``message_of(cid)``;
        otherwise a reply's ``num_samples`` must be the client's where the server holds
        the data, and its label counts possible
        (:func:`~contrafl.execution.validate.count_problem`)."""
        reasons = finish_checks([check for check, _ in checks.values()])
        problems = {}
        epochs = int(self.cfg.local_epochs)
        for (cid, (_, reply)), reason in zip(checks.items(), reasons):
            if reason is None and self.privacy is not None and self.privacy.mode == "local":
                reason = self.privacy.check_local(reply, message_of(cid))
                if reason is None and self.cfg.node_data != "own":  # true counts with weight 1 (dp.labels=clear): at most the largest client's
                    reason = count_problem(reply.payload, max(map(len, self.rows), default=0) * epochs)
            elif reason is None and not sums:
                held = len(self.rows[cid]) if self.cfg.node_data != "own" else None  # the server holds the data: it knows the count
                if held is not None and reply.num_samples != held:
                    reason = f"num_samples={reply.num_samples}, but the client holds {held} training samples (a client that lies about its weight)"
                else:
                    reason = count_problem(reply.payload, reply.num_samples * epochs)
            if reason is not None:
                problems[cid] = reason
        return problems

    @property
    def sums_replies(self) -> bool:
        """Whether the server may get the valid replies of a share of a round's clients as
        their sample-weighted mean (:mod:`contrafl.execution.partial`): the algorithm's
        aggregate needs no more (``beyond_weighted_mean``), and no setting looks at single
        updates (differential privacy, ``update_outlier_factor``, a robust ``aggregator``,
        an ``attack``)."""
        algo = self.algorithm
        cfg = self.cfg
        singles = cfg.update_outlier_factor or cfg.aggregator.name != "mean" or cfg.attack.name != "none"
        return algo.beyond_weighted_mean(algo.params) is None and self.privacy is None and not singles
