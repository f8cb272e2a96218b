"""SecAgg+ rounds (contrafl.flower.secagg.SecureRound) with nodes that stop answering.

The protocol runs for real, in one process: flwr's workflow on the server side, flwr's
``secaggplus_mod`` on each node, every message serialised to its protobuf and back as
on the wire (the mod edits the configs it receives; the setup stage sends all nodes the
same content object). A node that drops out simply sends no more replies, as when the
workflow's timeout passes; an exception in a node's mod comes back as an error reply, as
a SuperNode sends it.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402
from flwr.common.serde import message_from_proto, message_to_proto  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402

from conftest import error_reply  # noqa: E402
from contrafl.flower.secagg import CLIPPING_RANGE, QUANTIZATION_RANGE, SecureRound  # noqa: E402

pytestmark = pytest.mark.usefixtures("task_identity")


def wire(msg: Message) -> Message:
    return message_from_proto(message_to_proto(msg))


class LocalGrid:
    """Nodes ``1..len(updates)`` answering SecAgg+ in this process; node ``i`` trains to
    ``updates[i - 1]`` (a vector and its sample count). ``drop_at`` maps a node to the
    stage from which it answers no more."""

    def __init__(self, updates: list[tuple[np.ndarray, int]], drop_at: dict[int, str]) -> None:
        self.updates = dict(enumerate(updates, start=1))
        self.drop_at = drop_at
        self.gone: set[int] = set()
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={}) for n in self.updates}

    def fit(self, msg: Message, context: Context) -> Message:
        vector, n = self.updates[context.node_id]
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([vector]), n, {})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if self.drop_at.get(node) == msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]:
                self.gone.add(node)
            if node in self.gone:
                continue
            received = wire(msg)
            try:
                reply = secaggplus_mod(received, self.contexts[node], self.fit)
            except Exception as exc:
                reply = error_reply(exc, received)
            replies.append(wire(reply))
        return replies


def secure_round(updates: list[tuple[np.ndarray, int]], drop_at: dict[int, str]) -> tuple[dict[int, FitRes], list[str]]:
    grid = LocalGrid(updates, drop_at)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    fitins = {cid: FitIns(Parameters([], ""), {}) for cid in range(len(updates))}
    node_of = {cid: cid + 1 for cid in fitins}
    return SecureRound(grid, context, timeout=5.0, max_weight=float(max(n for _, n in updates))).exchange(0, node_of, fitins)


def weighted_mean(updates: list[tuple[np.ndarray, int]], cids: list[int]) -> np.ndarray:
    return sum(updates[c][0] * updates[c][1] for c in cids) / sum(updates[c][1] for c in cids)


def make_updates(k: int) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(k)
    return [(rng.uniform(-1, 1, size=7).astype(np.float32), int(rng.integers(10, 100))) for _ in range(k)]


# One quantisation step of a value, times a margin for the rounding of the weights.
TOLERANCE = 4 * 2 * CLIPPING_RANGE / QUANTIZATION_RANGE


@pytest.mark.parametrize(
    ("clients", "drop_at"),
    [
        (4, {}),
        (4, {2: "setup"}),  # before it sent its public keys
        (4, {3: "share_keys"}),  # before it shared its keys: flwr 1.41's workflow fails here
        (4, {1: "collect_masked_vectors"}),  # after it shared its keys, before its masked vector
        (6, {2: "share_keys", 5: "collect_masked_vectors"}),  # both kinds: only the second is unmasked
    ],
)
def test_a_secure_round_gives_the_mean_of_the_clients_that_sent_masked_vectors(clients, drop_at):
    """The unmasked parameters are the sample-weighted mean of exactly the clients that
    sent a masked vector (up to SecAgg+'s quantisation), whichever stage the others left
    at: each of them gets the mean, the others get nothing."""
    updates = make_updates(clients)
    results, failures = secure_round(updates, drop_at)
    kept = sorted(cid for cid in range(clients) if cid + 1 not in drop_at)
    assert sorted(results) == kept, failures
    expected = weighted_mean(updates, kept)
    for fitres in results.values():
        (mean,) = parameters_to_ndarrays(fitres.parameters)
        assert np.abs(mean - expected).max() < TOLERANCE
    assert np.abs(expected - weighted_mean(updates, list(range(clients)))).max() > 100 * TOLERANCE or not drop_at


def test_a_secure_round_with_too_few_clients_left_gives_no_results():
    """Below the reconstruction threshold (2/3 of the clients), the round ends without
    results rather than with a wrong mean."""
    results, _ = secure_round(make_updates(3), {1: "share_keys", 2: "collect_masked_vectors"})
    assert results == {}
