"""The server side of a contrafl run on Flower: the simulator's round loop with its
clients reached through a Flower grid.

:class:`GridTransport` is a :class:`contrafl.execution.outcomes.Transport`: it sends each
sampled client its message (the algorithm's broadcast or per-client message) as a train
message to the SuperNode serving that client's partition, and turns the replies into
:class:`~contrafl.execution.outcomes.ClientOutcome` s; with ``eval_personal``, every
client gets an evaluate message and answers with its personal model's scores.
Everything else (sampling, validation of the replies, aggregation, the server
optimiser, evaluation of the global model, metrics and checkpoints) is the simulator's
own code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..algorithms.base import Phase, Reply
from ..execution.outcomes import ClientOutcome, Scores
from ..errors import ConfigError, ContraflError
from ..rng import derive_seed
from .codec import decode, encode  # first: a clear error when flwr is missing
from flwr.app import Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from .node import USER_ERROR
from .secagg import MIN_CLIENTS, REJECTED, SecureRound, request_fitins, round_refusal
from .secure_sums import SumRejected, SumSpec

POLL_S = 0.2
STALE_S = 10.0
"""A train or evaluate message expires at the SuperLink ``round_timeout + STALE_S``
seconds after it is made: a node that was away longer (its network down) does not get,
when it is back, the work of a round the server has stopped waiting for."""


class GridTransport:
    """The server's clients on a Flower grid (a :class:`~contrafl.execution.outcomes.Transport`).

    Args:
        grid: the ServerApp's grid.
        num_clients: the run's clients (``0..num_clients-1``, the partitions).
        round_timeout: seconds a round (or an evaluation) waits for replies; its
            messages expire at the SuperLink :data:`STALE_S` later.
        min_replies: the fewest replies a round needs (all the sampled clients when fewer
            are sampled), whatever keeps the others from replying (no SuperNode, a
            SuperNode that cannot serve its client, an error, no reply within
            ``round_timeout``); with fewer the run stops, resumable from its last
            checkpoint. Otherwise the others are recorded as lost.
        wait_nodes: seconds to wait for a node of a client to come online, for a client
            whose node the server has not seen yet (the SuperNodes start). A client
            whose node stopped answering (no reply within ``round_timeout``, Flower's
            "node unavailable", or the SuperLink lists its node offline: its heartbeats
            stopped) is *offline*: later rounds and evaluations leave it out at once,
            as lost, until a node serving it says so again: a restarted SuperNode (a
            new node id), or the same node once it answers (it was only slow, or its
            network was down), each asked which partition it serves without being
            waited for. A dead site thus costs one ``round_timeout``, once.
        checkpointed: the round of the server's last checkpoint, sent with each train
            message (the clients keep the state a server resuming from it needs).
        waited: told the seconds a round waited for nodes to say whom they serve (the
            SuperNodes start, their clients load): a progress that leaves them out of
            its pace (:meth:`contrafl.engine.progress.Progress.waited`).
        secret: the round's clients are a secret (``sampling=secret``): an error that
            stops a round names none of them.
    """

    runtime = "flower"

    def __init__(
        self, grid: Grid, num_clients: int, round_timeout: float, min_replies: int, wait_nodes: float = 120.0,
        checkpointed: Callable[[], int] = lambda: 0, waited: Callable[[float], None] = lambda seconds: None,
        secret: bool = False,
    ) -> None:
        self.grid = grid
        self.waited = waited
        self.secret = secret
        self.num_clients = num_clients
        self.round_timeout = round_timeout
        self.min_replies = min_replies
        self.wait_nodes = wait_nodes
        self.checkpointed = checkpointed
        self.partition_of: dict[int, int] = {}  # node id -> client id
        self.unfit: dict[int, tuple[int | None, str]] = {}  # node id -> (its partition-id, why it cannot serve it)
        self.queries: dict[str, int] = {}  # message id of an unanswered query -> node id
        self.offline: dict[int, str] = {}  # client id -> why it is offline (its node stopped answering)
        self.suspect: set[int] = set()  # nodes that stopped answering: asked again, but not waited for
        self.gone: set[int] = set()  # online nodes that Flower found unavailable: not asked again while listed online
        self.last_look = 0.0  # when the server last looked for new nodes

    def train(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], phases: list[Phase]
    ) -> Iterator[ClientOutcome]:
        """Train messages to the nodes of ``cids``; their outcomes as the replies arrive,
        then the clients lost (no node, a node that cannot serve them, an error, or no
        reply within ``round_timeout``). Raises :class:`ContraflError` when fewer than
        ``min_replies`` replied (as soon as that is certain)."""
        cid_of, lost = self.send(t, cids, message_for, MessageType.TRAIN, {"checkpointed": self.checkpointed()})
        needed = min(self.min_replies, len(cids))
        if len(cid_of) < needed:
            raise self.too_few(t, f"{len(cid_of)} of {len(cids)} clients have a SuperNode that can serve them", lost)
        ok = 0
        for cid, reply in self.answers(t, cid_of, lost, "reply"):
            ok += 1  # a node that answered, if only that its client missed the deadline
            yield outcome_of(cid, decode(reply.content))
        if ok < needed:
            raise self.too_few(t, f"{ok} of {len(cids)} clients replied", lost)
        if cids and not ok:
            print(f"round {t + 1}: no client replied (min_replies={self.min_replies}); the global model stays as it was", flush=True)
        for cid, why in sorted(lost.items()):
            yield ClientOutcome(cid, None, lost=why)

    def too_few(self, t: int, replies: str, lost: dict[int, str]) -> ContraflError:
        """The error that stops round ``t`` with ``replies`` (how many clients replied, or
        could), fewer than it needs; ``lost``: why the others did not."""
        if self.secret:
            why = "; ".join(sorted(set(lost.values())))
        else:
            why = "; ".join(f"client {cid}: {reason}" for cid, reason in sorted(lost.items()))
        return ContraflError(
            f"round {t + 1}: {replies}, fewer than min_replies={self.min_replies} ({why}); "
            "resume the run once their SuperNodes are up and fit the run"
        )

    def evaluate(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]]
    ) -> Iterator[tuple[int, Scores | None]]:
        """Evaluate messages to the nodes of ``cids``; the scores of those that reply
        within ``round_timeout``."""
        return self.evaluations(t, cids, message_for, {})

    def evaluate_model(self, t: int, cids: list[int], state: dict[str, Any]) -> Iterator[tuple[int, Scores | None]]:
        """Evaluate messages carrying the model ``state`` (``global``) to the nodes of
        ``cids``, which evaluate it on their own test data; the scores of those that reply
        within ``round_timeout``."""
        return self.evaluations(t, cids, lambda _: {"model": state}, {"global": True})

    def evaluations(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], extra: dict[str, Any]
    ) -> Iterator[tuple[int, Scores | None]]:
        """Evaluate messages of ``message_for`` (and ``extra``) to the nodes of ``cids``
        (``t``: the rounds done); the scores of those that reply within
        ``round_timeout``. Raises :class:`ContraflError` once they are in when fewer than
        ``min_replies`` replied (all of ``cids`` when fewer): ``min_replies`` holds for
        every exchange of a round, so that a run never goes on with an evaluation of
        fewer clients than it asks for."""
        cid_of, lost = self.send(t, cids, message_for, MessageType.EVALUATE, extra)
        replied = 0
        for cid, reply in self.answers(t - 1, cid_of, lost, "evaluation reply"):
            replied += 1
            yield cid, decode(reply.content) or None
        if replied < min(self.min_replies, len(cids)):
            raise self.too_few(t - 1, f"{replied} of {len(cids)} clients answered its evaluation", lost)

    def answers(self, t: int, cid_of: dict[str, int], lost: dict[int, str], what: str) -> Iterator[tuple[int, Message]]:
        """``(cid, reply)`` of the replies without error to the messages ``cid_of`` of
        round ``t``, as they arrive; the other clients go to ``lost`` with why (their
        error, or no ``what`` within ``round_timeout``) and their nodes are forgotten:
        offline when they stopped answering (no reply, or Flower's node unavailable)."""
        answered: set[str] = set()
        for reply in self.replies(list(cid_of), self.round_timeout):
            answered.add(reply.metadata.reply_to_message_id)
            cid = cid_of[reply.metadata.reply_to_message_id]
            if reply.has_error():
                lost[cid] = reason_of(reply)
                self.forget(cid, t, lost[cid] if reply.error.code == ErrorCode.NODE_UNAVAILABLE else None)
            else:
                yield cid, reply
        for message_id in set(cid_of) - answered:
            lost[cid_of[message_id]] = f"no {what} within {self.round_timeout:g}s"
            self.forget(cid_of[message_id], t, lost[cid_of[message_id]])

    def send(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], kind: str, extra: dict[str, Any]
    ) -> tuple[dict[str, int], dict[int, str]]:
        """Push a ``kind`` message for round ``t`` to the node of each of ``cids``:
        ``({message id: cid}, {client without a node: why})``."""
        node_of = self.nodes(cids)
        sent = [
            (cid, Message(self.request(t, cid, message_for, extra), dst_node_id=node_of[cid], message_type=kind, group_id=str(t),
                          ttl=self.round_timeout + STALE_S))
            for cid in cids
            if cid in node_of
        ]
        cid_of = dict(zip(self.grid.push_messages([m for _, m in sent]), (cid for cid, _ in sent)))
        return cid_of, self.missing(cids, node_of)

    def request(self, t: int, cid: int, message_for: Callable[[int], dict[str, Any]], extra: dict[str, Any]) -> RecordDict:
        """The content of client ``cid``'s message of round ``t``."""
        return encode({"round": t, "client": cid, "message": message_for(cid), **extra})

    def missing(self, cids: list[int], node_of: dict[int, int]) -> dict[int, str]:
        """``{client without a node: why}`` among ``cids``. Where no node serves a client,
        the reason also names the SuperNodes that were asked and have not said which
        partition they serve (online, but their ClientApps do not run) and those that
        said nothing usable, with why: one of them may be the node meant for it."""
        unfit = {cid: why for cid, why in self.unfit.values() if cid is not None}
        absent = f"waited wait-nodes={self.wait_nodes:g}s"
        if silent := sorted(set(self.queries.values()) - self.gone):  # online, asked, no answer: their ClientApps do not run
            absent += f"; SuperNode {', '.join(map(str, silent))} did not say which partition {'it serves' if len(silent) == 1 else 'they serve'}"
        for node, (cid, why) in sorted(self.unfit.items()):
            if cid is None:  # a node whose partition nobody knows may be the one meant for it
                absent += f"; SuperNode {node} is not used: {why}"
        return {cid: self.offline.get(cid) or unfit.get(cid, f"no SuperNode serves partition {cid} ({absent})") for cid in cids if cid not in node_of}

    def replies(self, message_ids: list[str], timeout: float) -> Iterator[Message]:
        """The replies to ``message_ids`` as they arrive (:func:`pull_replies`). Answers to
        queries that come in meanwhile are collected too (an unfit SuperNode is reported
        as soon as it says so)."""
        return pull_replies(self.grid, message_ids, timeout, while_waiting=self.look_for_nodes)

    def nodes(self, cids: list[int]) -> dict[int, int]:
        """``{client id: node id}`` of the online SuperNodes the server knows, waiting
        up to ``wait_nodes`` seconds for a node of each client whose node it has not
        seen yet, but not for offline clients (unless a node that came online has not
        said yet which client it serves: a restarted SuperNode), nor for clients whose
        online nodes have all answered and cannot serve them; a client whose known node
        the SuperLink no longer lists (its heartbeats stopped) goes offline. Nodes not
        seen before are asked which partition they serve (a query message); their
        answers are collected as they come, so a node that never answers (it died)
        delays nothing."""
        began = time.monotonic()
        deadline = began + self.wait_nodes
        while True:
            expired = time.monotonic() > deadline  # the last look is taken after the deadline
            online = self.look_for_nodes(force=True)
            node_of = {cid: node for node, cid in self.partition_of.items() if node in online}
            for node, cid in list(self.partition_of.items()):
                if node not in online and cid not in node_of and cid in cids:
                    self.forget(cid, None, "its SuperNode went offline (the SuperLink missed its heartbeats)")
            loading = set(self.queries.values()) & online - self.suspect  # nodes up that have not said yet whom they serve
            unfit = {cid for node, (cid, _) in self.unfit.items() if node in online} if not loading else set()
            if all(cid in node_of or cid in unfit or cid in self.offline and not loading for cid in cids) or expired:
                if (spent := time.monotonic() - began) > POLL_S:  # it had to wait
                    self.waited(spent)
                return node_of
            time.sleep(POLL_S)

    def look_for_nodes(self, force: bool = False) -> set[int]:
        """The online nodes; those not seen before are asked which partition they serve,
        and the answers so far collected. At most once a second unless ``force`` (while
        a round waits for its replies, a restarted SuperNode is found and asked)."""
        self.collect_answers()
        if not force and time.monotonic() - self.last_look < 1.0:
            return set()
        self.last_look = time.monotonic()
        online = {int(n) for n in self.grid.get_node_ids()}
        self.gone &= online  # a node that went offline and comes back (its network was down) is asked anew
        asked = set(self.queries.values())
        new = sorted(n for n in online if n not in self.partition_of and n not in self.unfit and n not in asked and n not in self.gone)
        if new:
            messages = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in new]
            self.queries.update(zip(self.grid.push_messages(messages), new))
        return online

    def collect_answers(self) -> None:
        """The answers to the queries so far: the partition each node serves, or why it
        cannot serve it (said once in the server's log; the node is not used)."""
        for reply in self.grid.pull_messages(list(self.queries)) if self.queries else []:
            node = self.queries.pop(reply.metadata.reply_to_message_id, None)
            if node is None:
                continue
            self.suspect.discard(node)
            if reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE:
                self.gone.add(node)  # it died before it answered; asked again should it come back online
                continue
            info = {} if reply.has_error() else reply.content["info"]
            cid = int(info["partition-id"]) if "partition-id" in info else None
            if reply.has_error():
                why = f"it did not say which partition it serves ({reason_of(reply)})"
            elif "problem" in info:
                why = str(info["problem"])
            elif cid is None:
                why = "it did not say which partition it serves"
            elif not 0 <= cid < self.num_clients:
                why = f"node config partition-id={cid} is not a client of the run (0..{self.num_clients - 1}); restart the SuperNode with the partition-id of the client it serves"
            else:
                self.partition_of[node] = cid
                if self.offline.pop(cid, None) is not None:
                    print(f"client {cid} is back (SuperNode {node})", flush=True)
                continue
            self.unfit[node] = (cid, why)
            print(f"SuperNode {node}{'' if cid is None else f' (partition-id={cid})'} is not used: {why}", flush=True)

    def forget(self, cid: int, t: int | None = None, offline: str | None = None) -> None:
        """Drop the node of client ``cid`` (a restarted SuperNode comes back with a new
        id); with ``offline`` (why its node stopped answering, in round ``t``), the
        client is offline until a node serving it comes back."""
        for node in [node for node, c in self.partition_of.items() if c == cid]:
            del self.partition_of[node]
            if offline is not None:  # asked again whom it serves: a node that was only slow answers once free
                self.suspect.add(node)
        if offline is not None and cid not in self.offline:
            since = "" if t is None else f" in round {t + 1}"
            self.offline[cid] = f"offline: {offline}{since}; left out until its SuperNode is back"


def pull_replies(
    grid: Grid, message_ids: Iterable[str], timeout: float | None, while_waiting: Callable[[], None] = lambda: None
) -> Iterator[Message]:
    """The replies to ``message_ids`` as they arrive, pulled every :data:`POLL_S`, until
    all are in or ``timeout`` seconds have passed (``None``: no limit); ``while_waiting``
    runs before each wait."""
    pending = set(message_ids)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        for reply in grid.pull_messages(list(pending)):
            if reply.metadata.reply_to_message_id in pending:
                pending.discard(reply.metadata.reply_to_message_id)
                yield reply
        if pending:
            if deadline is not None and time.monotonic() > deadline:
                return
            while_waiting()
            time.sleep(POLL_S)


class PolledGrid:
    """``grid`` whose ``send_and_receive`` pulls the replies every :data:`POLL_S`
    (:func:`pull_replies`), for Flower's SecAgg+ workflow.

    flwr 1.41's ``Grid.send_and_receive`` sleeps 3 s after every pull that leaves a reply
    missing, and the first pull comes right after the push, before any node can have
    answered: each of SecAgg+'s four stages took at least 3 s, 12 s a round. Everything
    else is ``grid``'s own."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return list(pull_replies(self.grid, self.grid.push_messages(messages), timeout))


class SecureTransport(GridTransport):
    """A :class:`GridTransport` whose training rounds and federated evaluations run
    through Flower's SecAgg+ (:mod:`contrafl.flower.secagg`): the server sees each
    client's reply rebuilt from the round's sums (the weighted means in place of its
    tensors, a share of the totals), each client's evaluation as a share of the round's
    totals, and the updates its clients rejected before masking as rejected. Personal
    evaluations (``eval_personal``) go as before. Every round has at least
    :data:`~contrafl.flower.secagg.MIN_CLIENTS` clients.

    Args (beyond :class:`GridTransport`'s):
        context: the ServerApp's context (the workflow runs in a legacy context over it).
        seed: the run's seed, for each client's stochastic rounding.
        spec: the public parameters of the secure sums (:func:`sum_spec`).
        weights: each client's weight (``num_samples``) where the server knows it (it
            holds the data, or ``dp=local`` weighs every reply 1): a round's summed
            weight must then be that of its clients. None where the sites keep their
            data.

    A round whose sums fail the server's checks
    (:class:`~contrafl.flower.secure_sums.SumRejected`) has every client of the sum
    rejected, with the reason (the run stops, or leaves them out and follows
    ``min_replies``).

    Raises :class:`ConfigError` when ``num_clients`` or ``min_replies`` allow a round of
    fewer clients (:func:`~contrafl.flower.secagg.round_refusal`).
    """

    sums = True  # replies rebuilt from the round's secure sums

    def __init__(self, grid: Grid, context: Any, seed: int, spec: SumSpec, weights: list[int] | None, *args: Any, **kwargs: Any) -> None:
        super().__init__(grid, *args, **kwargs)
        why = round_refusal(self.num_clients, self.min_replies)
        if why is not None:
            raise ConfigError(f"secure-aggregation=true: {why}")
        self.seed, self.spec, self.weights = seed, spec, weights
        self.secure = SecureRound(PolledGrid(grid), context, self.round_timeout, spec)

    def train(
        self, t: int, cids: list[int], message_for: Callable[[int], dict[str, Any]], phases: list[Phase]
    ) -> Iterator[ClientOutcome]:
        """Round ``t``'s train messages through SecAgg+; the updates the clients rejected
        (before masking, with their reasons), the clients' outcomes, then the clients
        lost (no node, an error, or the protocol did not finish). Raises
        :class:`ContraflError` before the round when it has fewer than
        :data:`~contrafl.flower.secagg.MIN_CLIENTS` clients (or nodes for them), and as
        :meth:`GridTransport.train` when fewer than ``min_replies`` replied (a rejected
        update counts as a reply, as a plain reply that fails validation)."""
        why = round_refusal(len(cids), self.min_replies)
        if why is not None:
            raise ContraflError(f"round {t + 1}: {why}")
        node_of = self.nodes(cids)
        lost = self.missing(cids, node_of)
        needed = min(self.min_replies, len(cids))
        if len(node_of) < max(needed, MIN_CLIENTS):
            raise self.too_few(t, f"{len(node_of)} of {len(cids)} clients have a SuperNode that can serve them (a secure sum needs {MIN_CLIENTS})", lost)
        extra = {"checkpointed": self.checkpointed(), "secure": True}
        participants = {node: cid for cid, node in node_of.items()}
        fitins = {
            cid: request_fitins(self.request(t, cid, message_for, extra), derive_seed(self.seed, "secagg", t, cid), participants, self.spec)
            for cid in sorted(node_of)
        }
        weights = self.weights
        try:
            replies, errors = self.secure.run(t, node_of, fitins, (lambda cids: sum(weights[c] for c in cids)) if weights else lambda cids: None)
        except SumRejected as exc:
            replies, errors = {}, exc.errors
            rejected_sum = {cid: f"round {t + 1}'s secure sum over clients {exc.clients} was rejected: {exc}" for cid in exc.clients}
        else:
            rejected_sum = {}
        rejected = {cid: str(reply.error.reason) for cid, reply in errors.items() if reply.error.code == REJECTED} | rejected_sum
        for cid in sorted(rejected):
            yield ClientOutcome(cid, None, rejected=rejected[cid])
        for cid in sorted(set(node_of) - set(replies) - set(rejected)):
            self.forget(cid)
            if cid in errors:
                lost[cid] = reason_of(errors[cid])
            else:
                lost[cid] = f"no answer to SecAgg+ within {self.round_timeout:g}s" if replies else "no masked reply: SecAgg+ did not finish"
        if len(replies) + len(rejected) < needed:
            why_not = {**lost, **{cid: f"its update was rejected: {reason}" for cid, reason in rejected.items()}}
            raise self.too_few(t, f"{len(replies) + len(rejected)} of {len(cids)} clients replied", why_not)
        for cid in sorted(replies):
            yield outcome_of(cid, decode(replies[cid]))
        for cid, why in sorted(lost.items()):
            yield ClientOutcome(cid, None, lost=why)


    def evaluate_model(self, t: int, cids: list[int], state: dict[str, Any]) -> Iterator[tuple[int, Scores | None]]:
        """Federated evaluation through SecAgg+: the global model ``state`` to the nodes
        of ``cids``, each of which evaluates it on its own test data and sends its test
        samples, correct predictions and loss into the round's secure sums; the scores
        rebuilt from the sums (:func:`~contrafl.flower.secure_sums.rebuild_scores`: the
        totals shared out, so the server's means are the round's). Raises
        :class:`ContraflError` when fewer than ``min_replies`` (or
        :data:`~contrafl.flower.secagg.MIN_CLIENTS`) clients can answer, or when the
        sums fail the server's checks."""
        node_of = self.nodes(cids)
        lost = self.missing(cids, node_of)
        needed = min(self.min_replies, len(cids))
        if len(node_of) < max(needed, MIN_CLIENTS):
            raise self.too_few(t - 1, f"{len(node_of)} of {len(cids)} clients have a SuperNode for its evaluation (a secure sum needs {MIN_CLIENTS})", lost)
        participants = {node: cid for cid, node in node_of.items()}
        fitins = {
            cid: request_fitins(self.request(t, cid, lambda _: {"model": state}, {"global": True}), derive_seed(self.seed, "secagg-evaluate", t, cid),
                                participants, self.spec)
            for cid in sorted(node_of)
        }
        try:
            scores, errors = self.secure.run_scores(t, node_of, fitins)
        except SumRejected as exc:
            raise ContraflError(f"the evaluation after round {t}: its secure sum over clients {exc.clients} was rejected: {exc}") from None
        for cid in sorted(set(node_of) - set(scores)):
            self.forget(cid)
            lost[cid] = reason_of(errors[cid]) if cid in errors else f"no answer to SecAgg+ within {self.round_timeout:g}s"
        if len(scores) < needed:
            raise self.too_few(t - 1, f"{len(scores)} of {len(cids)} clients answered its evaluation", lost)
        yield from sorted(scores.items())


def outcome_of(cid: int, tree: dict[str, Any]) -> ClientOutcome:
    """A decoded reply (``payload``, ``num_samples``, ``loss``, ``steps``, the loss's
    ``parts``, ``time``, ``straggler``; or ``lost``: the client missed the round's
    deadline) as the client's outcome; the reply names the client it came from, for the
    engine's validation."""
    timing = {"time": tree.get("time"), "straggler": tree.get("straggler")}
    if "lost" in tree:
        return ClientOutcome(cid, None, lost=str(tree["lost"]), **timing)
    reply = Reply(cid, tree["num_samples"], tree["payload"])
    return ClientOutcome(cid, reply, tree["loss"], int(tree["steps"]), parts=tree["parts"], **timing)


def reason_of(reply: Message) -> str:
    """Why a client could not answer, from its error reply: a ClientApp's own one-line
    message (:data:`USER_ERROR`), else Flower's error code and reason."""
    error = reply.error
    return str(error.reason) if error.code == USER_ERROR else f"error {error.code}: {error.reason}"


def sum_spec(setup: Any, max_weight: int | None) -> tuple[SumSpec, list[int] | None]:
    """The public parameters of a run's secure sums, and each client's weight where the
    server knows it: under ``dp=local`` every reply weighs 1 (``max_weight`` 1, weights
    1; a label count is 1 with ``dp.labels=hide``, else at most the bound below); where
    the server holds the data, the clients' sample counts (``max_weight``: the largest);
    where the sites keep theirs (``node_data=own``), ``max_weight`` as given (``contrafl
    deploy --max-weight``) and no weights. Label tables are weighted as the
    algorithm weighs them (:meth:`~contrafl.algorithms.base.Algorithm.label_weighting`)."""
    cfg, algorithm = setup.config, setup.algorithm
    labels = type(algorithm).label_weighting(algorithm.params)
    own = cfg.node_data == "own"
    if own and not max_weight and not (cfg.dp.name == "local" and cfg.dp.options.get("labels", "hide") == "hide"):
        raise ConfigError("secure aggregation with node_data=own needs the run config's max-weight (contrafl deploy --max-weight N)")
    sizes = None if own else [len(rows) for rows in setup.partition.train]
    largest = int(max_weight) if own else max(1, max(sizes))
    epochs = int(cfg.local_epochs)
    if cfg.dp.name == "local":  # every reply weighs 1; label counts are 1 (dp.labels=hide) or the true ones
        hide = cfg.dp.options.get("labels", "hide") == "hide"
        return SumSpec(1, labels, counts_are_samples=False, epochs=epochs, max_count=1 if hide else largest * epochs), [1] * cfg.num_clients
    return SumSpec(largest, labels, epochs=epochs), sizes
