"""Secure aggregation on Flower: the server learns only sums over a round's clients (the
weighted mean of their updates, per-label means, the totals of their sample counts,
steps, losses and label counts), through Flower's SecAgg+ (flwr 1.41's
``SecAggPlusWorkflow`` and ``secaggplus_mod``).

flwr 1.41 runs SecAgg+ for its legacy message flow: the workflow asks a ``Strategy`` for
each node's ``FitIns``, runs the protocol's four stages (setup, share keys, collect
masked vectors, unmask) over the grid, and hands the strategy every client's ``FitRes``
with its parameters replaced by the unmasked ``sum_i n_i p_i / sum_i n_i`` (``n_i`` its
``num_examples``). The client's mod answers the first two stages itself and, in the
third, calls the ClientApp and masks the float arrays of its ``FitRes``.

contrafl fits its round into that flow:

- the server wraps each client's train message (the request :class:`GridTransport`
  would send, :mod:`contrafl.flower.wire`-packed, marked ``secure``) into a ``FitIns``
  config value, with the seed of the client's stochastic rounding and the round's
  participants, ``{node id: client id}`` (:func:`request_fitins`);
- the client checks its reply before anything is masked, as the server checks a plain
  one (:meth:`contrafl.flower.client.FlowerClient.checked`): a masked sum would hide a
  bad update (a NaN becomes a finite mean of garbage) from the server's own check. A
  reply that fails enters no sum: the client answers the collect stage with an error
  reply of code :data:`REJECTED` and the reason, and SecAgg+ unmasks the others' mean
  as for a client that dropped out; the server records the update as rejected, as a
  plain reply that failed validation (the run stops, or leaves it out);
- otherwise the ClientApp puts its reply into the round's secure sums
  (:func:`reply_fitres`, :mod:`contrafl.flower.secure_sums`): its floating-point
  tensors clipped to +-``CLIPPING_RANGE`` and weighted by ``num_samples / max_weight``
  (a per-label table's rows by the label's count), and its whole numbers (sample
  count, steps, loss, label counts) exactly, as base-256 digits; each ``FitRes`` has
  weight 1, so SecAgg+ unmasks the plain sum over the clients. The structure, the
  integer payload tensors outside label tables and the simulated time travel in the
  clear; no sample count, loss, steps or label count does. ``max_weight`` is public: the
  largest client's sample count where the server holds the data, ``--max-weight`` where
  the sites keep theirs (``node_data=own``), 1 under ``dp=local``;
- the server checks the sums and rebuilds each client's reply with the weighted means
  in place of its tensors and its share of the totals
  (:func:`~contrafl.flower.secure_sums.rebuild`): the algorithm's aggregate of equal
  payloads is that mean, so it gives the plain deployment's model up to the protocol's
  quantisation (each value rounded stochastically to ``2 * CLIPPING_RANGE /
  QUANTIZATION_RANGE``, times ``max_weight`` over the round's total weight) and the
  rounding to the tensor's dtype. Sums that fail a check (not finite, a mean outside
  the clipping range, a total weight that is not the round's) reject the round's
  aggregate with one line.

The stochastic rounding draws from numpy's global generator, which the client seeds
from ``(seed, "secagg", round, client)`` before the mod quantises: the masks cancel
exactly, so a run is reproducible. Algorithms whose server needs more than these sums
refuse (:func:`refusal`). A federated evaluation of the global model runs the same way
(:meth:`SecureRound.run_scores`): each client's test samples, correct predictions and
loss enter a sum of their own, with its own ledger entry.

**At least 3 clients** (:data:`MIN_CLIENTS`). flwr 1.41's SecAgg+ draws every mask from
a Mersenne Twister seeded with 32 bits (``pseudo_rand_gen`` XORs the key down to 32
bits; flwrlabs/flower#7522), and the server learns each active client's private-mask
seed when it unmasks. In a sum of 2 clients, each one's vector is then its update plus
one pairwise mask of a 32-bit seed: the server recovers the update in about 2^32 tries.
So no sum holds fewer than 3 updates: ``contrafl deploy`` refuses a run that samples
fewer clients per round or whose ``min_replies`` lets a round end with fewer
(:func:`round_refusal`; the ServerApp refuses such a ``min_replies`` when it starts), the
server starts no round with fewer clients or nodes, and each client's mod (:func:`secure_mod`) sends its masked vector only into a sum of at least 3
clients and its key shares only when at least 3 clients' vectors are in the sum (a
curious server could otherwise end the protocol with 2). A client that rejected its own
update sends no vector, so it never counts as one of the 3. The rule can go with a flwr
whose mask generator takes the whole seed.

**One sum per round.** A server that restarts trains the rounds after its checkpoint
again. Two sums of one round over different clients give it their difference, a single
update when the sets differ by one client. So each client keeps a ledger
(:func:`check_ledger`) of the clients whose vectors were in each round's sum it
unmasked, written before it sends its key shares, and refuses to unmask that round
over another set; the same set again (the round a resumed server was in when it died)
is allowed.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import require_flwr

require_flwr()
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict  # noqa: E402
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402

from ..errors import ClientUpdateError, ContraflError  # noqa: E402
from ..files import write_atomic  # noqa: E402
from .node import USER_ERROR, NodeSettings, client_state_dir, reported  # noqa: E402
from .secure_sums import (  # noqa: E402
    CLIPPING_RANGE, QUANTIZATION_RANGE, SumRejected, SumSpec, client_sums, rebuild, rebuild_scores, score_sums,
)
from .wire import pack, unpack  # noqa: E402

#: The share of a client's key shares that rebuild it: up to a third of the round's clients
#: may drop out during the protocol and the others' mean is still unmasked.
RECONSTRUCTION = 2 / 3
#: The fewest clients whose updates a secure sum may hold (see the module docstring).
MIN_CLIENTS = 3
REJECTED = 101
"""The code of a client's error reply to SecAgg+'s collect stage when its own update
failed the server's validation before masking; its reason is the validation's one line
(:data:`~contrafl.flower.node.USER_ERROR` is 100, Flower's own codes are below)."""
WHY_THREE = (
    "flwr 1.41's SecAgg+ seeds its masks with 32 bits, so the server can recover each update "
    f"of a sum of fewer than {MIN_CLIENTS} clients (flwrlabs/flower#7522)"
)
LEDGER = "secagg-ledger.json"
REQUEST = "contrafl-request"
ROUNDING_SEED = "contrafl-rounding-seed"
PARTICIPANTS = "contrafl-participants"
REST = "contrafl-rest"
SECURE = "contrafl-secure"
SPEC = "contrafl-sum-spec"
#: What a client's mod keeps of the collect stage for the unmask stage (in its context's state).
ROUND_STATE = "contrafl-secagg-round"


def refusal(algo_cls: type, algo_params: Any, cfg: Any) -> str | None:
    """Why a run cannot use secure aggregation, or None: its algorithm's server must need
    only the sample-weighted mean of the replies (``Algorithm.beyond_weighted_mean``), and
    its settings nothing of single updates."""
    why = algo_cls.beyond_weighted_mean(algo_params)
    if why is not None:
        return why
    if cfg.dp.name == "central":
        return "dp=central clips each update at the server, which secure aggregation hides from it (dp=local adds the noise on the clients)"
    if cfg.aggregator.name != "mean":
        return f"aggregator={cfg.aggregator.name} needs every client's update, and secure aggregation gives the server only their sum; use aggregator=mean"
    if cfg.attack.name != "none":
        return f"attack={cfg.attack.name} is crafted at the server from the clients' single replies, which secure aggregation hides; simulate it without secure aggregation"
    if cfg.round_deadline is not None:
        return "a straggler dropped at round_deadline sends no update for SecAgg+ to mask"
    if cfg.client_speed != "constant" or cfg.speed_jitter > 0:
        return "client_speed and speed_jitter simulate each client's time from its steps, which a secure sum hides"
    return None


def round_refusal(per_round: int, min_replies: int) -> str | None:
    """Why rounds of ``per_round`` clients that need ``min_replies`` replies cannot be
    secure, or None: every secure sum must hold at least :data:`MIN_CLIENTS` updates."""
    if per_round < MIN_CLIENTS:
        return f"a round of {per_round} client{'' if per_round == 1 else 's'} is fewer than the {MIN_CLIENTS} a secure sum needs: {WHY_THREE}; sample more clients per round"
    if min_replies < MIN_CLIENTS:
        return (
            f"min_replies={min_replies} lets a round end with fewer than the {MIN_CLIENTS} updates a secure sum needs: {WHY_THREE}; "
            f"set min_replies to {MIN_CLIENTS} or more (contrafl deploy --min-replies)"
        )
    return None


# -- client ----------------------------------------------------------------------------------
def is_secure_request(content: RecordDict) -> bool:
    """Whether a train message's content is a SecAgg+ collect stage's ``FitIns`` made by
    :func:`request_fitins`."""
    return "fitins.config" in content.config_records and REQUEST in content.config_records["fitins.config"]


def unwrap_request(content: RecordDict) -> tuple[RecordDict, int, SumSpec]:
    """The plain train request inside a secure ``FitIns``, the rounding seed and the
    run's public parameters of the secure sums."""
    config = content.config_records["fitins.config"]
    return unpack(bytes(config[REQUEST])), int(config[ROUNDING_SEED]), SumSpec.from_json(str(config[SPEC]))


class UpdateRejected(ClientUpdateError):
    """A client's own update that failed the server's validation before masking (the
    message is the validation's reason): it enters no secure sum."""


def tree_nodes(record: RecordDict) -> dict[str, Any]:
    """``{key: JSON node}`` of the root of a :mod:`~contrafl.flower.codec` tree (read
    without torch)."""
    return dict(json.loads(str(record["tree"]["json"]))["dict"])


def reply_fitres(reply: RecordDict, rounding_seed: int, spec: SumSpec) -> RecordDict:
    """A client's plain train reply (or its evaluation of the global model:
    :func:`~contrafl.flower.secure_sums.score_sums`) as the ``FitRes`` SecAgg+ masks:
    what it puts into the round's secure sums
    (:func:`~contrafl.flower.secure_sums.client_sums`) as parameters,
    each of weight 1 (``num_examples`` is the max weight, which SecAgg+ divides by); the
    rest, in the clear, and the layout of the sums packed in the metrics. Raises
    :class:`UpdateRejected` for a reply the client rejected
    (:meth:`~contrafl.flower.client.FlowerClient.checked`). Seeds numpy's global
    generator for the mod's stochastic rounding."""
    top = tree_nodes(reply)
    if "rejected" in top:
        raise UpdateRejected(str(top["rejected"]["value"]))
    masked, rest, layout = client_sums(reply, spec) if "payload" in top else score_sums(reply)
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(masked), spec.max_weight, {REST: pack(rest), SECURE: layout})
    np.random.seed(rounding_seed % 2**32)
    return compat.fitres_to_recorddict(fitres, keep_input=True)


class _ErrorReply(Exception):
    """The ClientApp's error reply, carried through Flower's ``secaggplus_mod`` (which
    reads a reply's content)."""

    def __init__(self, error: Error) -> None:
        super().__init__(error.reason)
        self.error = error


def secure_mod(msg: Message, context: Any, call_next: Callable) -> Message:
    """A ClientApp mod: Flower's ``secaggplus_mod`` for the messages of a SecAgg+
    workflow, the others straight through. The client sends its masked vector and its
    key shares only as :func:`collect_refusal` and :func:`unmask_refusal` allow, and
    otherwise answers with a one-line error; the ClientApp's own error reply (a user
    error, a rejected update) is the mod's reply."""
    from flwr.client.mod import secaggplus_mod

    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)

    def relay(message: Message, ctx: Any) -> Message:
        reply = call_next(message, ctx)
        if reply.has_error():
            raise _ErrorReply(reply.error)
        return reply

    stage = msg.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)
    try:
        if stage == Stage.SETUP:  # a new protocol run: nothing of an earlier one's collect stage holds
            context.state.config_records.pop(ROUND_STATE, None)
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            collect_refusal(msg, context)
        elif stage == Stage.UNMASK:
            unmask_refusal(msg, context)
        return secaggplus_mod(msg, context, relay)
    except _ErrorReply as exc:
        return Message(exc.error, reply_to=msg)
    except ContraflError as exc:
        return Message(Error(USER_ERROR, reported(exc, context)), reply_to=msg)


def collect_refusal(msg: Message, context: Any) -> None:
    """:class:`ContraflError` unless the client may send its masked vector in the
    collect stage ``msg``: into a sum of at least :data:`MIN_CLIENTS` clients (those
    whose key shares it received, and itself). Keeps the round and its participants
    (``{node id: client id}``, from the server's ``FitIns``) in the context's state for
    the unmask stage."""
    request, _, _ = unwrap_request(msg.content)
    t = int(tree_nodes(request)["round"]["value"]) + 1
    key = f"the evaluation after round {t - 1}" if is_evaluation(request) else str(t)  # an evaluation's sum has its own entry
    clients = len(msg.content.config_records[RECORD_KEY_CONFIGS][Key.SOURCE_LIST]) + 1
    if clients < MIN_CLIENTS:
        raise ContraflError(f"{_what(key)}: SecAgg+ asks for this client's masked update in a sum of {clients} clients; it sends it only into one of {MIN_CLIENTS} or more: {WHY_THREE}")
    participants = str(msg.content.config_records["fitins.config"][PARTICIPANTS])
    context.state.config_records[ROUND_STATE] = ConfigRecord({"round": key, "participants": participants})


def unmask_refusal(msg: Message, context: Any) -> None:
    """:class:`ContraflError` unless the client may send its key shares in the unmask
    stage ``msg``: for a sum of at least :data:`MIN_CLIENTS` clients (its active nodes),
    all of them participants of the round it sent its vector in, over the clients its
    ledger allows for the round (:func:`check_ledger`)."""
    active = list(msg.content.config_records[RECORD_KEY_CONFIGS][Key.ACTIVE_NODE_ID_LIST])
    state = context.state.config_records.get(ROUND_STATE)
    if state is None:
        raise ContraflError("SecAgg+ asks this client to unmask a round it sent no masked update in (did its SuperNode restart?); it sends no key shares")
    t = str(state["round"])
    if len(active) < MIN_CLIENTS:
        raise ContraflError(f"{_what(t)}: SecAgg+ asks this client to unmask a sum of {len(active)} clients; it unmasks only one of {MIN_CLIENTS} or more: {WHY_THREE}")
    client_of = {int(node): int(cid) for node, cid in json.loads(str(state["participants"])).items()}
    unknown = sorted(node for node in active if node not in client_of)
    if unknown:
        raise ContraflError(f"{_what(t)}: SecAgg+ asks this client to unmask a sum with node {unknown[0]}, which is not among the round's participants (nodes {sorted(client_of)}); it sends no key shares")
    check_ledger(ledger_file(NodeSettings.of(context)), t, sorted(client_of[node] for node in active))


def _what(key: int | str) -> str:
    """A ledger key as words: ``round 3``, or ``the evaluation after round 2``."""
    return f"round {key}" if str(key).isdigit() else str(key)


def ledger_file(settings: NodeSettings) -> Path:
    """The client's ledger of secure sums: ``secagg-ledger.json`` in its state folder
    (:func:`~contrafl.flower.node.client_state_dir`, as
    :class:`~contrafl.flower.client.FlowerClient`'s)."""
    return client_state_dir(settings.run_dir, settings.partition_id, settings.state_dir) / LEDGER


def check_ledger(path: Path, t: int | str, clients: list[int]) -> None:
    """Let the client unmask round ``t``'s sum over ``clients`` (sorted ids), or raise
    :class:`ContraflError`: a client unmasks each round over one set of clients only,
    which its ledger at ``path`` (JSON ``{round: clients}``; an evaluation's sum under
    ``"the evaluation after round T"``) records, atomically, before it sends its key shares. The same set
    again is allowed."""
    try:
        ledger = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as exc:
        raise ContraflError(f"{path}: cannot read this client's ledger of secure sums ({exc}); restore it (deleting it lets the server unmask the rounds again)") from None
    if not isinstance(ledger, dict) or not all(isinstance(v, list) and all(type(c) is int for c in v) for v in ledger.values()):
        raise ContraflError(
            f"{path}: this client's ledger of secure sums is not JSON {{round: [client ids]}} ({json.dumps(ledger)[:60]}); "
            "restore it (deleting it lets the server unmask the rounds again)"
        )
    before = ledger.get(str(t))
    if before is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: f.write(json.dumps({**ledger, str(t): clients}).encode()))
    elif before != clients:
        raise ContraflError(
            f"{_what(t)}: SecAgg+ asks this client to unmask a sum over clients {clients}, but it unmasked one over clients {before} "
            f"in this round already ({path}), and the two sums would give the server their difference; "
            "resume the run when the same clients can finish the round"
        )


# -- server ----------------------------------------------------------------------------------
def is_evaluation(request: RecordDict) -> bool:
    """Whether a request (a :mod:`~contrafl.flower.codec` tree) asks the client to
    evaluate the global model (federated evaluation) rather than to train."""
    return "global" in tree_nodes(request)


def request_fitins(request: RecordDict, rounding_seed: int, participants: dict[int, int], spec: SumSpec) -> FitIns:
    """The ``FitIns`` carrying a client's train request, with the seed of its rounding, the
    round's ``participants`` (``{node id: client id}``; see the module docstring) and
    the public parameters of the run's secure sums."""
    return FitIns(Parameters([], ""), {
        REQUEST: pack(request), ROUNDING_SEED: rounding_seed, PARTICIPANTS: json.dumps({str(n): c for n, c in participants.items()}),
        SPEC: spec.to_json(),
    })


class SecureRound:
    """One round of SecAgg+ over ``grid`` for the nodes ``node_of`` of contrafl's clients,
    with ``fitins`` for each client: the unmasked replies ``{cid: RecordDict}`` (empty
    when the protocol could not finish: fewer than its threshold of clients answered),
    and the error replies ``{cid: Message}`` of the clients that sent one."""

    def __init__(self, grid: Any, context: Any, timeout: float, spec: SumSpec) -> None:
        self.grid, self.context, self.timeout, self.spec = grid, context, timeout, spec

    def run(
        self, t: int, node_of: dict[int, int], fitins: dict[int, FitIns], expected: Callable[[list[int]], int | None] = lambda cids: None,
    ) -> tuple[dict[int, RecordDict], dict[int, Message]]:
        """The replies rebuilt from the round's secure sums
        (:func:`~contrafl.flower.secure_sums.rebuild`; ``expected``: the total weight of
        the clients whose vectors are in the sum, where the server knows it), and the
        error replies. :class:`~contrafl.flower.secure_sums.SumRejected` when the sums
        fail the server's checks, naming the ``clients`` of the sum and carrying the
        round's ``errors``."""
        return self.summed(t, node_of, fitins, lambda mean, results: rebuild(
            mean, {cid: unpack(bytes(f.metrics[REST])) for cid, f in results.items()}, layouts(results), self.spec, expected(sorted(results))))

    def run_scores(self, t: int, node_of: dict[int, int], fitins: dict[int, FitIns]) -> tuple[dict[int, dict | None], dict[int, Message]]:
        """A federated evaluation through SecAgg+: the clients' scores rebuilt from the
        round's sums (:func:`~contrafl.flower.secure_sums.rebuild_scores`), and the error
        replies; :class:`~contrafl.flower.secure_sums.SumRejected` as :meth:`run`."""
        return self.summed(t, node_of, fitins, lambda mean, results: rebuild_scores(mean, sorted(results), layouts(results)))

    def summed(self, t: int, node_of: dict[int, int], fitins: dict[int, FitIns], build: Callable[[list, dict[int, FitRes]], dict]) -> tuple[dict, dict[int, Message]]:
        """:meth:`exchange`, then ``build(mean, results)`` from the unmasked mean (the
        workflow gives every ``FitRes`` the same one) and the clients' results; a
        :class:`~contrafl.flower.secure_sums.SumRejected` gets the sum's ``clients`` and
        the round's ``errors``."""
        results, errors = self.exchange(t, node_of, fitins)
        if not results:
            return {}, errors
        try:
            return build(parameters_to_ndarrays(next(iter(results.values())).parameters), results), errors
        except SumRejected as exc:
            exc.clients, exc.errors = sorted(results), errors
            raise

    def exchange(self, t: int, node_of: dict[int, int], fitins: dict[int, FitIns]) -> tuple[dict[int, FitRes], dict[int, Message]]:
        """The protocol itself: each client's ``FitRes`` with the unmasked weighted mean
        as its parameters (none when it could not finish), and the clients' error
        replies (the last of each)."""
        from flwr.server import ServerConfig
        from flwr.server.client_manager import SimpleClientManager
        from flwr.server.compat.grid_client_proxy import GridClientProxy
        from flwr.server.compat.legacy_context import LegacyContext
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

        cid_of = {node: cid for cid, node in node_of.items()}
        grid = _ErrorsSeen(self.grid)
        proxies = {node: GridClientProxy(node, grid, self.context.run_id) for node in cid_of}
        strategy = _OneRound([(proxies[node_of[cid]], fitins[cid]) for cid in sorted(fitins)])
        manager = SimpleClientManager()
        for proxy in proxies.values():
            manager.register(proxy)
        legacy = LegacyContext(self.context, ServerConfig(num_rounds=t + 1), strategy, manager)
        legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: t + 1})
        legacy.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        workflow = _drop_tolerant_workflow()(  # every client shares its keys with all; 2/3 of the shares rebuild them
            num_shares=1.0, reconstruction_threshold=RECONSTRUCTION, max_weight=float(self.spec.max_weight),
            clipping_range=CLIPPING_RANGE, quantization_range=QUANTIZATION_RANGE, timeout=self.timeout,
        )
        state = random.getstate()
        try:
            random.seed(t)  # the workflow shuffles the nodes with Python's generator
            workflow(grid, legacy)
        finally:
            random.setstate(state)
        results = {cid_of[proxy.node_id]: fitres for proxy, fitres in strategy.results}
        return results, {cid_of[node]: reply for node, reply in grid.errors.items() if node in cid_of}


def layouts(results: dict[int, FitRes]) -> dict[int, str]:
    """Each client's layout of what it masked (from its ``FitRes`` metrics)."""
    return {cid: str(f.metrics[SECURE]) for cid, f in results.items()}


class _ErrorsSeen:
    """``grid`` whose ``send_and_receive`` keeps the last error reply of each node
    (``errors``): Flower's workflow keeps the errors without their node."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid
        self.errors: dict[int, Message] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.errors.update({reply.metadata.src_node_id: reply for reply in replies if reply.has_error()})
        return replies


@functools.cache
def _drop_tolerant_workflow() -> type:
    """flwr's ``SecAggPlusWorkflow``, made to survive nodes that drop out before they
    have shared their keys (the class is made on the first call, not at import: the
    ClientApp imports this module, and ``flwr.server`` is the server's).

    flwr 1.41, and its later releases, count every node of the setup stage that sends
    no masked vector as dead in the unmask stage, and ask the others for the shares of
    its secret key. A node that stopped answering in the setup or share-keys stage
    never sent those shares: each other node's mod then fails looking for one
    (``KeyError`` in ``sk1_share_dict``), and the server would remove pairwise masks
    that nobody added, since the other nodes mask only with the nodes whose shares they
    received. So, once the keys are shared, the nodes that shared them become the
    round's sampled nodes and each one's only neighbours; a node dropping later is
    unmasked as flwr does it.
    """
    from flwr.server.workflow import SecAggPlusWorkflow

    class DropTolerantSecAggPlus(SecAggPlusWorkflow):
        def share_keys_stage(self, grid: Any, context: Any, state: Any) -> bool:
            super().share_keys_stage(grid, context, state)
            shared = set(state.active_node_ids)
            state.sampled_node_ids = shared
            state.nid_to_neighbours = {nid: nbrs & shared for nid, nbrs in state.nid_to_neighbours.items() if nid in shared}
            return self._check_threshold(state)

    return DropTolerantSecAggPlus


class _OneRound:
    """The legacy ``Strategy`` the workflow drives: the round's ``FitIns`` as given, and
    the unmasked results kept."""

    def __init__(self, instructions: list[tuple[Any, FitIns]]) -> None:
        self.instructions = instructions
        self.results: list[tuple[Any, FitRes]] = []

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[tuple[Any, FitIns]]:
        return self.instructions

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        self.results = list(results)
        return None, {}
