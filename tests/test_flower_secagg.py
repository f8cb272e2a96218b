"""SecAgg+ rounds (contrafl.flower.secagg.SecureRound) with nodes that stop answering,
clients that reject their own updates, refuse too small sums or a round unmasked before
over other clients, and payloads of every floating-point dtype.

The protocol runs for real, in one process: flwr's workflow on the server side, contrafl's
ClientApp mod (``secure_mod``, around flwr's ``secaggplus_mod``) on each node, every
message serialised to its protobuf and back as on the wire (the mod edits the configs
it receives; the setup stage sends all nodes the same content object). A node that drops
out simply sends no more replies, as when the workflow's timeout passes; an exception in
a node's mod comes back as an error reply, as a SuperNode sends it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from uuid import uuid4

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict  # noqa: E402
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402
from flwr.common.serde import message_from_proto, message_to_proto  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402

from conftest import error_reply  # noqa: E402
from contrafl.errors import ContraflError  # noqa: E402
from contrafl.flower.codec import decode, encode  # noqa: E402
from contrafl.flower.node import USER_ERROR  # noqa: E402
from contrafl.flower.packed import named_arrays  # noqa: E402
from contrafl.flower.secagg import (  # noqa: E402
    CLIPPING_RANGE, LEDGER, QUANTIZATION_RANGE, REJECTED, REST, SECURE, SecureRound, UpdateRejected, reply_fitres, request_fitins,
    secure_mod,
)
from contrafl.flower.secure_sums import STEP, SumRejected, SumSpec, rebuild, tensor_dtypes  # noqa: E402
from contrafl.flower.wire import unpack  # noqa: E402

pytestmark = pytest.mark.usefixtures("task_identity")

ClientApp = Callable[[Message], Message]


def wire(msg: Message) -> Message:
    return message_from_proto(message_to_proto(msg))


class LocalGrid:
    """Nodes ``1..len(apps)`` answering SecAgg+ in this process through contrafl's
    ClientApp mod; node ``i`` serves client ``i - 1`` of the run in ``run_dir`` (its
    ledger goes to ``run_dir/flower-clients``) and its ClientApp answers the collect
    stage with ``apps[i - 1](msg)``. ``drop_at`` maps a node to the stage from which it
    answers no more."""

    def __init__(self, apps: list[ClientApp], drop_at: dict[int, str], run_dir: Path) -> None:
        self.apps = dict(enumerate(apps, start=1))
        self.drop_at = drop_at
        self.gone: set[int] = set()
        self.contexts = {
            n: Context(run_id=1, node_id=n, node_config={"partition-id": n - 1, "run-dir": str(run_dir)}, state=RecordDict(), run_config={})
            for n in self.apps
        }

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
                reply = secure_mod(received, self.contexts[node], lambda m, _: self.apps[node](m))
            except Exception as exc:
                reply = error_reply(exc, received)
            replies.append(wire(reply))
        return replies


def trained(vector: np.ndarray, n: int) -> ClientApp:
    """A ClientApp that answers with ``vector`` weighted by ``n``."""

    def app(msg: Message) -> Message:
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([vector]), n, {})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)

    return app


def run_round(
    apps: list[ClientApp], drop_at: dict[int, str], run_dir: Path, max_weight: float, t: int = 0
) -> tuple[dict[int, FitRes], dict[int, Message]]:
    """Round ``t`` of SecAgg+ over a :class:`LocalGrid` of ``apps``, with the ``FitIns``
    the server sends (the request of client ``c`` and the round's participants)."""
    grid = LocalGrid(apps, drop_at, run_dir)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    node_of = {cid: cid + 1 for cid in range(len(apps))}
    participants = {node: cid for cid, node in node_of.items()}
    spec = SumSpec(max(1, round(max_weight)))
    fitins = {cid: request_fitins(encode({"round": t, "client": cid}), cid, participants, spec) for cid in node_of}
    return SecureRound(grid, context, timeout=5.0, spec=spec).exchange(t, node_of, fitins)


def secure_round(updates: list[tuple[np.ndarray, int]], drop_at: dict[int, str], run_dir: Path) -> tuple[dict[int, FitRes], dict[int, Message]]:
    return run_round([trained(v, n) for v, n in updates], drop_at, run_dir, float(max(n for _, n in updates)))


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
def test_a_secure_round_gives_the_mean_of_the_clients_that_sent_masked_vectors(tmp_path, clients, drop_at):
    """The unmasked parameters are the sample-weighted mean of exactly the clients that
    sent a masked vector (up to SecAgg+'s quantisation), whichever stage the others left
    at: each of them gets the mean, the others get nothing."""
    updates = make_updates(clients)
    results, errors = secure_round(updates, drop_at, tmp_path)
    kept = sorted(cid for cid in range(clients) if cid + 1 not in drop_at)
    assert sorted(results) == kept and not errors, errors
    expected = weighted_mean(updates, kept)
    for fitres in results.values():
        (mean,) = parameters_to_ndarrays(fitres.parameters)
        assert np.abs(mean - expected).max() < TOLERANCE
    assert np.abs(expected - weighted_mean(updates, list(range(clients)))).max() > 100 * TOLERANCE or not drop_at


def test_a_secure_round_with_too_few_clients_left_gives_no_results(tmp_path):
    """Below the reconstruction threshold (2/3 of the clients), the round ends without
    results rather than with a wrong mean."""
    results, _ = secure_round(make_updates(6), {1: "share_keys", 2: "collect_masked_vectors", 3: "collect_masked_vectors"}, tmp_path)
    assert results == {}


def rejecting(reason: str) -> ClientApp:
    """A ClientApp whose own check rejected its update (contrafl.flower.client_app.serve)."""
    return lambda msg: Message(Error(REJECTED, reason), reply_to=msg)


def test_a_rejected_update_enters_no_sum_and_the_others_mean_is_unmasked(tmp_path):
    """A client whose own check rejected its update sends the reason instead of a masked
    vector: the others' mean is unmasked without it, exactly as if it had dropped out,
    and the server has the reason from the client's node."""
    updates = make_updates(4)
    apps = [trained(v, n) for v, n in updates]
    apps[1] = rejecting("'model.w' has non-finite values (1 NaN, 0 infinite)")
    results, errors = run_round(apps, {}, tmp_path, float(max(n for _, n in updates)))
    assert sorted(results) == [0, 2, 3] and list(errors) == [1]
    assert errors[1].error.code == REJECTED and errors[1].error.reason == "'model.w' has non-finite values (1 NaN, 0 infinite)"
    for fitres in results.values():
        (mean,) = parameters_to_ndarrays(fitres.parameters)
        assert np.abs(mean - weighted_mean(updates, [0, 2, 3])).max() < TOLERANCE

    with np.errstate(all="raise"):  # every client rejected: no sum, and no mean divided by a total weight of 0
        results, errors = run_round([rejecting(f"reason {cid}") for cid in range(3)], {}, tmp_path / "all", 10.0)
    assert results == {} and {cid: reply.error.code for cid, reply in errors.items()} == {0: REJECTED, 1: REJECTED, 2: REJECTED}


def refusals(errors: dict[int, Message]) -> dict[int, str]:
    return {cid: str(reply.error.reason) for cid, reply in errors.items()}


def test_a_sum_of_2_clients_is_refused_by_each_client(tmp_path):
    """flwr 1.41's 32-bit mask seeds let the server recover each update of a sum of 2
    clients, so a client sends its masked vector only into a sum of 3 or more (the
    collect stage's key-share sources and itself), and its key shares only when 3 or
    more clients' vectors are in the sum (a curious server could end the protocol with
    2 active nodes after collecting 3 vectors)."""
    results, errors = secure_round(make_updates(2), {}, tmp_path)
    assert results == {} and sorted(errors) == [0, 1]
    assert all("asks for this client's masked update in a sum of 2 clients" in why and "flwrlabs/flower#7522" in why for why in refusals(errors).values())

    results, errors = secure_round(make_updates(3), {3: "collect_masked_vectors"}, tmp_path / "unmask")
    assert results == {} and sorted(errors) == [0, 1]
    assert all("asks this client to unmask a sum of 2 clients" in why for why in refusals(errors).values())


def test_a_client_unmasks_only_a_sum_it_sent_its_vector_into(tmp_path):
    """An unmask stage with no collect stage of the same protocol run before it (the
    SuperNode restarted, or a new setup stage came since) gets no key shares."""
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "run-dir": str(tmp_path)}, state=RecordDict(), run_config={})
    configs = ConfigRecord({Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: [1, 2, 3], Key.DEAD_NODE_ID_LIST: []})
    msg = wire(Message(RecordDict({RECORD_KEY_CONFIGS: configs}), dst_node_id=1, message_type=MessageType.TRAIN))
    reply = secure_mod(msg, context, lambda m, c: pytest.fail("the ClientApp is not called in the unmask stage"))
    assert reply.error.code == USER_ERROR and "unmask a round it sent no masked update in" in reply.error.reason
    assert not (tmp_path / "flower-clients").exists()


def ledger(run_dir: Path, cid: int) -> dict[str, list[int]]:
    return json.loads((run_dir / "flower-clients" / f"client-{cid}" / LEDGER).read_text())


def test_a_client_unmasks_a_round_again_only_over_the_same_clients(tmp_path):
    """A server that re-runs round 1 (it restarted) with other finishers would get two
    sums whose difference is one client's update: each client records the clients of
    the sum it unmasked in its ledger, before it sends its key shares, and refuses to
    unmask the round over other clients. The same clients again (the round a resumed
    server was in) are unmasked."""
    updates = make_updates(4)
    results, errors = secure_round(updates, {}, tmp_path)
    assert sorted(results) == [0, 1, 2, 3] and not errors
    assert all(ledger(tmp_path, cid) == {"1": [0, 1, 2, 3]} for cid in range(4))

    results, errors = secure_round(updates, {4: "collect_masked_vectors"}, tmp_path)  # a new SuperLink run: new contexts
    assert results == {} and sorted(errors) == [0, 1, 2]
    assert all("unmask a sum over clients [0, 1, 2], but it unmasked one over clients [0, 1, 2, 3] in this round already" in why
               for why in refusals(errors).values())
    assert all(ledger(tmp_path, cid) == {"1": [0, 1, 2, 3]} for cid in range(4))

    results, errors = secure_round(updates, {}, tmp_path)
    assert sorted(results) == [0, 1, 2, 3] and not errors
    (mean,) = parameters_to_ndarrays(results[0].parameters)
    assert np.abs(mean - weighted_mean(updates, [0, 1, 2, 3])).max() < TOLERANCE
    results, _ = run_round([trained(v, n) for v, n in updates], {}, tmp_path, 100.0, t=1)  # the next round has its own entry
    assert sorted(results) == [0, 1, 2, 3] and ledger(tmp_path, 0) == {"1": [0, 1, 2, 3], "2": [0, 1, 2, 3]}


def test_a_damaged_ledger_of_secure_sums_is_one_line_and_unmasks_nothing(tmp_path):
    """A client's ledger that is not JSON {round: [client ids]} (a list, ids as text)
    stops the client's unmasking with one line naming the file (issue #53, N8)."""
    from contrafl.flower.secagg import check_ledger

    path = tmp_path / LEDGER
    for text in ("[1, 2]", '{"1": ["0", "1", "2"]}', '{"1": 3}', "{"):
        path.write_text(text)
        with pytest.raises(ContraflError) as info:
            check_ledger(path, 1, [0, 1, 2])
        assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value) and "restore it" in str(info.value)
        assert path.read_text() == text


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64] + [
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
]
# How far a value of each dtype may be from the mean: the rounding to the dtype (half an
# ulp at 1: the values are in [-1, 1]), plus the quantisation.
ROUNDING = {dtype: torch.finfo(dtype).eps / 2 + TOLERANCE for dtype in FLOATS}


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def replying(tree: dict, seed: int, fitres_seen: list[FitRes]) -> ClientApp:
    """A ClientApp answering with the reply ``tree`` as contrafl's ClientApp sends it
    (:func:`reply_fitres`); the FitRes it made goes to ``fitres_seen``."""

    def app(msg: Message) -> Message:
        content = reply_fitres(encode(tree), seed, SumSpec(30))
        fitres_seen.append(compat.recorddict_to_fitres(content, keep_input=True))
        return Message(content, reply_to=msg)

    return app


def rebuilt(results: dict[int, FitRes], spec: SumSpec, expected: int | None = None) -> dict[int, dict]:
    """The replies the server rebuilds from a round's unmasked sums, decoded."""
    mean = parameters_to_ndarrays(next(iter(results.values())).parameters)
    rests = {cid: unpack(bytes(f.metrics[REST])) for cid, f in results.items()}
    layouts = {cid: str(f.metrics[SECURE]) for cid, f in results.items()}
    return {cid: decode(record) for cid, record in rebuild(mean, rests, layouts, spec, expected).items()}


def test_every_floating_point_tensor_is_masked_and_averaged_in_its_own_dtype(tmp_path):
    """float16 (which overflows SecAgg+'s quantisation in its own dtype), bfloat16 and the
    float8 types (carried as integers by the codec), float32 and float64 tensors go to
    SecAgg+ as float32 and come back as the mean, in their own dtypes; integer tensors
    travel in the clear, and nothing floating-point does: the FitRes's clear part holds
    integer tensors only (by the dtype its tree names)."""
    gen = torch.Generator().manual_seed(0)
    trees = [
        {
            "payload": {name(dtype): (torch.rand(5, generator=gen) * 2 - 1).to(dtype) for dtype in FLOATS}
            | {"steps": torch.tensor([cid, 2 * cid])},
            "num_samples": 10 * (cid + 1), "loss": 1.0, "steps": 3, "parts": {}, "time": None, "straggler": None,
        }
        for cid in range(3)
    ]
    seen: list[FitRes] = []
    results, errors = run_round([replying(tree, cid, seen) for cid, tree in enumerate(trees)], {}, tmp_path, 30.0)
    assert sorted(results) == [0, 1, 2] and not errors, errors
    total = sum(tree["num_samples"] for tree in trees)
    for fitres in seen:
        rest = unpack(bytes(fitres.metrics[REST]))
        dtypes = tensor_dtypes(json.loads(str(rest["tree"]["json"])))
        assert sorted(named_arrays(rest)) == ["payload/steps"] and dtypes["payload/steps"] == "int64"
        assert len(parameters_to_ndarrays(fitres.parameters)) == len(FLOATS) + 1  # and the whole numbers' digits
        assert fitres.num_examples == 30
    for cid, tree in rebuilt(results, SumSpec(30), expected=total).items():
        payload = tree["payload"]
        assert torch.equal(payload["steps"], trees[cid]["payload"]["steps"])
        for dtype in FLOATS:
            mean = sum(tree["payload"][name(dtype)].double() * tree["num_samples"] for tree in trees) / total
            assert payload[name(dtype)].dtype == dtype
            assert (payload[name(dtype)].double() - mean).abs().max() <= ROUNDING[dtype], (dtype, payload[name(dtype)], mean)


def test_a_rejected_or_uncarriable_reply_is_said_in_one_line():
    """The ClientApp turns a reply its client rejected into UpdateRejected (its error
    reply of code REJECTED carries the reason), and refuses a payload tensor that is
    neither floating-point nor integer (complex) with one line."""
    with pytest.raises(UpdateRejected, match=r"^'model.w' has non-finite values \(1 NaN, 0 infinite\)$"):
        reply_fitres(encode({"rejected": "'model.w' has non-finite values (1 NaN, 0 infinite)"}), 0, SumSpec(1))
    tree = {"payload": {"z": torch.zeros(2, dtype=torch.complex64)}, "num_samples": 1, "loss": 0.5, "steps": 1, "parts": {}}
    with pytest.raises(ContraflError, match="payload tensor 'payload/z' has dtype complex64, which secure aggregation cannot carry") as info:
        reply_fitres(encode(tree), 0, SumSpec(1))
    assert len(str(info.value).splitlines()) == 1


class AppGrid:
    """A Flower grid whose nodes ``1..clients`` run contrafl's ClientApp
    (``contrafl.flower.client_app.app``: its mod, then the ClientApp itself with the node
    config ``worker=false``) for clients ``0..clients-1`` of the run in ``run_dir``, in
    this process, every message through its protobuf; the replies wait to be pulled.
    ``online``: the nodes that are up."""

    def __init__(self, run_dir: Path, clients: int, online: list[int] | None = None) -> None:
        self.online = list(range(1, clients + 1)) if online is None else online
        node_config = {"run-dir": str(run_dir), "worker": False}
        self.contexts = {
            n: Context(run_id=1, node_id=n, node_config={**node_config, "partition-id": n - 1}, state=RecordDict(), run_config={})
            for n in self.online
        }
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return self.online

    def push_messages(self, messages: list[Message]) -> list[str]:
        from contrafl.flower.client_app import app

        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())  # as a grid does
            received = wire(msg)
            try:
                reply = app(received, self.contexts[msg.metadata.dst_node_id])
            except Exception as exc:
                reply = error_reply(exc, received)
            self.replies[msg.metadata.message_id] = wire(reply)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]


def secure_simulation(run_dir: Path, grid_of: Callable[[Path], object], *settings: str, min_replies: int = 4):
    """A run of FedAvg on 4 clients (digits) whose server trains through SecAgg+ on the
    grid ``grid_of(run_dir)`` (SecureTransport, as contrafl's ServerApp sets it)."""
    from contrafl.config import load_config
    from contrafl.engine.run_dir import RunDir
    from contrafl.engine.setup import prepare
    from contrafl.engine.resume import resume
    from contrafl.flower.deploy import prepare_run
    from contrafl.flower.server import SecureTransport, sum_spec

    overrides = ["algorithm=fedavg", "num_clients=4", "rounds=1", "local_epochs=1", "executor=sequential", "eval_personal=false", *settings]
    prepare_run(load_config(None, overrides), run_dir)
    setup = prepare(load_config(run_dir / "config.yaml"))
    sim = resume(setup, RunDir(run_dir, resume=True))
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    spec, weights = sum_spec(setup, None)
    sim.transport = SecureTransport(grid_of(run_dir), context, setup.config.seed, spec, weights, setup.config.num_clients, 30.0, min_replies, 0.5)
    return sim


@pytest.mark.parametrize("on_bad_update", ["stop", "skip"])
def test_a_nan_update_under_secure_aggregation_stops_the_run_or_is_left_out(tmp_path, monkeypatch, on_bad_update):
    """Client 1 trains to a NaN, through contrafl's real ClientApp: masked, it would
    become a finite mean of garbage that passes the server's validation. Its own check
    rejects it before masking, so the run stops at it naming the client
    (on_bad_update=stop), or leaves it out (skip): the global model is the others' mean
    and the round's row names the rejected client, as for a plain reply."""
    from contrafl.errors import ClientUpdateError
    from contrafl.flower.client import FlowerClient

    train, payloads = FlowerClient.train, {}

    def nan_for_client_1(self, t, message, checkpointed):
        tree = train(self, t, message, checkpointed)
        if self.cid == 1:
            tree["payload"] = {"model": dict(tree["payload"]["model"])}
            name = next(k for k, v in tree["payload"]["model"].items() if v.is_floating_point())
            tree["payload"]["model"][name] = tree["payload"]["model"][name].clone().fill_(float("nan"))
        payloads[self.cid] = (tree["payload"]["model"], tree["num_samples"])
        return tree

    monkeypatch.setattr(FlowerClient, "train", nan_for_client_1)
    sim = secure_simulation(tmp_path / "run", lambda run: AppGrid(run, 4), f"on_bad_update={on_bad_update}")
    if on_bad_update == "stop":
        with pytest.raises(ClientUpdateError, match=r"client 1's update in round 1 was rejected: '.+' has non-finite values \(\d+ NaN, 0 infinite\); training diverged"):
            sim.run()
        return
    sim.run()
    (row,) = sim.history
    assert [r["client"] for r in row["rejected"]] == [1] and "non-finite values" in row["rejected"][0]["reason"]
    total = sum(payloads[c][1] for c in (0, 2, 3))
    for name, value in sim.server.model.items():
        if value.is_floating_point():
            mean = sum(payloads[c][0][name].double() * payloads[c][1] for c in (0, 2, 3)) / total
            assert float((value.double() - mean).abs().max()) < TOLERANCE, name


def test_the_server_refuses_a_secure_round_of_fewer_than_3_clients(tmp_path):
    """The ServerApp's SecureTransport refuses settings that allow a round of 2 clients
    (2 clients in all, or min_replies=2), and starts no round of 2 sampled clients or
    with nodes for only 2 of them: one line each."""
    from contrafl.errors import ConfigError
    from contrafl.flower.server import SecureTransport

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    for clients, min_replies, why in ((2, 2, "a round of 2 clients is fewer than the 3 a secure sum needs"), (4, 2, "min_replies=2 lets a round end with fewer than the 3 updates")):
        with pytest.raises(ConfigError, match=why) as info:
            SecureTransport(AppGrid(tmp_path, 4), context, 0, SumSpec(10), None, clients, 30.0, min_replies)
        assert "flwrlabs/flower#7522" in str(info.value) and len(str(info.value).splitlines()) == 1
    transport = SecureTransport(AppGrid(tmp_path, 4, online=[1, 2]), context, 0, SumSpec(10), None, 4, 30.0, 3, 0.2)
    transport.partition_of = {1: 0, 2: 1}  # what nodes 1 and 2 answered to the server's query
    with pytest.raises(ContraflError, match="round 1: a round of 2 clients is fewer than the 3 a secure sum needs"):
        next(transport.train(0, [0, 1], lambda cid: {}, []))
    with pytest.raises(ContraflError, match=r"round 1: 2 of 4 clients have a SuperNode that can serve them \(a secure sum needs 3\)"):
        next(transport.train(0, [0, 1, 2, 3], lambda cid: {}, []))


def test_deploy_refuses_secure_aggregation_with_rounds_of_fewer_than_3_clients(tmp_path, capsys):
    """contrafl deploy --secure-aggregation refuses, with one line and exit status 2, a
    run that samples fewer than 3 clients a round or whose min_replies lets a round end
    with fewer; 3 clients are prepared, with --min-replies 3 by default."""
    from contrafl.cli import main

    def refused(*args: str) -> str:
        assert main(["deploy", "--secure-aggregation", "--prepare-only", "--insecure", "--out", str(tmp_path / "run"), *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1, (out, err)
        return err

    assert "a round of 2 clients is fewer than the 3 a secure sum needs" in refused("--min-replies", "2", "num_clients=2")
    assert "a round of 2 clients is fewer than the 3" in refused("--min-replies", "3", "num_clients=4", "sample_fraction=0.5")
    assert "a round of 2 clients is fewer than the 3" in refused("num_clients=2")  # --min-replies defaults to 3 here, at most the clients
    err = refused("--min-replies", "1", "num_clients=3")
    assert "min_replies=1 lets a round end with fewer than the 3 updates a secure sum needs" in err and "flwrlabs/flower#7522" in err
    assert "set min_replies to 3 or more (contrafl deploy --min-replies), or deploy without --secure-aggregation" in err
    assert not (tmp_path / "run").exists()
    assert main(["deploy", "--secure-aggregation", "--prepare-only", "--insecure", "--out", str(tmp_path / "run"), "num_clients=3"]) == 0
    assert "min-replies = 3" in (tmp_path / "run" / "flower-run.toml").read_text()


# -- the secure sums: what the server learns, and what a lying client can do -----------------
C, D = 4, 3  # labels, representation width of the FedCRL-like tables below


def table_tree(cid: int, gen: torch.Generator) -> dict:
    """A FedCRL-like train reply: a body, a per-label table whose counts sum to the
    client's sample count, and the scalars a reply carries."""
    counts = torch.randint(0, 9, (C,), generator=gen)
    counts[cid % C] = 0  # every client lacks a label
    return {
        "payload": {"body": {"w": torch.rand(5, generator=gen) * 2 - 1},
                    "prototypes": {"reps": torch.rand(C, D, generator=gen) * 2 - 1, "counts": counts}},
        "num_samples": int(counts.sum()), "loss": 3.25 * (cid + 1), "steps": 7 + cid, "parts": {"ce": 1.5 * cid, "con": -0.25},
        "time": None, "straggler": None,
    }


def sum_round(tmp_path, trees: list[dict], spec: SumSpec, change=None) -> tuple[dict[int, FitRes], list[FitRes]]:
    """A SecAgg+ round of contrafl's ClientApp split (:func:`reply_fitres`) of each of
    ``trees``; ``change(cid, parameters)`` may alter what a client masks (a lying
    client, which skips its own checks)."""
    seen: list[FitRes] = []

    def app_of(cid: int, tree: dict) -> ClientApp:
        def app(msg: Message) -> Message:
            fitres = compat.recorddict_to_fitres(reply_fitres(encode(tree), cid, spec), keep_input=True)
            if change is not None:
                fitres.parameters = ndarrays_to_parameters(change(cid, parameters_to_ndarrays(fitres.parameters)))
            seen.append(fitres)
            return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)
        return app

    results, errors = run_round([app_of(cid, tree) for cid, tree in enumerate(trees)], {}, tmp_path, spec.max_weight)
    assert sorted(results) == list(range(len(trees))) and not errors, errors
    return results, seen


def test_secure_sums_give_the_weighted_means_and_per_label_means_and_hide_every_count(tmp_path):
    """Label tables go through the secure sum: each label's mean weighted by the clients'
    counts (FedCRL's eq. 6), the label totals as counts, the body's sample-weighted mean,
    the round's total samples, steps and loss shared out. A curious server that reads
    every field it receives (the clear rest, the layout, the sums) finds no client's
    sample count, label counts, steps or loss."""
    gen = torch.Generator().manual_seed(3)
    trees = [table_tree(cid, gen) for cid in range(3)]
    spec = SumSpec(40)
    results, seen = sum_round(tmp_path, trees, spec)
    total = sum(t["num_samples"] for t in trees)
    out = rebuilt(results, spec, expected=total)
    counts = sum(t["payload"]["prototypes"]["counts"] for t in trees)
    for cid, tree in out.items():
        protos = tree["payload"]["prototypes"]
        assert torch.equal(protos["counts"], counts) and protos["counts"].dtype == torch.int64
        for label in range(C):
            if counts[label]:
                mean = sum(t["payload"]["prototypes"]["counts"][label] * t["payload"]["prototypes"]["reps"][label].double() for t in trees) / counts[label]
                assert (protos["reps"][label].double() - mean).abs().max() < 3 * STEP * spec.max_weight / int(counts[label]) + 1e-6
            else:
                assert not protos["reps"][label].any()
        body = sum(t["payload"]["body"]["w"].double() * t["num_samples"] for t in trees) / total
        assert (tree["payload"]["body"]["w"].double() - body).abs().max() < 3 * STEP * spec.max_weight / total + 1e-6
    assert sum(t["num_samples"] for t in out.values()) == total and sum(t["steps"] for t in out.values()) == sum(t["steps"] for t in trees)
    assert sum(t["loss"] for t in out.values()) == pytest.approx(sum(t["loss"] for t in trees), abs=1e-4)
    assert sum(t["parts"]["con"] for t in out.values()) == pytest.approx(-0.75, abs=1e-4)

    def values(node):  # every scalar of a codec tree's JSON
        if "value" in node:
            return [node["value"]]
        subs = [sub for _, sub in node["dict"]] if "dict" in node else node.get("list", node.get("tuple", []))
        return [v for sub in subs for v in values(sub)]

    assert len({str(f.metrics[SECURE]) for f in seen}) == 1  # the layout is the same for every client: it tells nothing of one
    for fitres in seen:  # the curious server: all it gets in the clear is the structure
        rest = unpack(bytes(fitres.metrics[REST]))
        assert set(values(json.loads(str(rest["tree"]["json"])))) == {None} and named_arrays(rest) == {}
        assert fitres.num_examples == spec.max_weight and set(fitres.metrics) == {REST, SECURE}


def test_a_client_that_skips_its_checks_or_lies_about_its_weight_gets_the_round_rejected(tmp_path):
    """Issue #53 N6/D5: what a lying client sends enters only sums, which the server
    checks: NaN values (its own check skipped), values pushed outside the clipping
    range, a tripled weight where the server knows the clients' counts, and forged label
    counts each reject the round's sum with one line; an honest round passes."""
    gen = torch.Generator().manual_seed(5)
    trees = [table_tree(cid, gen) for cid in range(3)]
    spec, total = SumSpec(40), sum(t["num_samples"] for t in trees)
    results, _ = sum_round(tmp_path / "honest", trees, spec)
    rebuilt(results, spec, expected=total)

    def nan(cid, params):
        return [np.full_like(p, np.nan) if cid == 1 else p for p in params]

    def pushed(cid, params):  # client 1's weighted body times 1000 (SecAgg+'s mod then clips it to +-8)
        return [p * 1000 if cid == 1 and i == len(params) - 2 else p for i, p in enumerate(params)]

    forged = {**trees[2], "payload": {**trees[2]["payload"], "prototypes": {**trees[2]["payload"]["prototypes"]}}}
    forged["payload"]["prototypes"]["counts"] = trees[2]["payload"]["prototypes"]["counts"].clone()
    forged["payload"]["prototypes"]["counts"][0] = 10**12
    cases = {  # what is rejected: (the replies, how a client alters its masked part, the public spec, the known total)
        "its securely summed counts are not whole numbers in range": (trees, nan, spec, total),
        "its mean of 'payload/body/w' leaves the clipping range": (trees, pushed, spec, total),
        f"its securely summed weight is {total + 2 * trees[1]['num_samples']}, but its clients hold {total} samples":
            ([*trees[:1], {**trees[1], "num_samples": 3 * trees[1]["num_samples"]}, *trees[2:]], None, SumSpec(200), total),
        "its summed label counts": ([*trees[:2], forged], None, SumSpec(10**13), None),
    }
    for k, (case, (sent, change, case_spec, expected)) in enumerate(cases.items()):
        results, _ = sum_round(tmp_path / str(k), sent, case_spec, change)
        with pytest.raises(SumRejected) as info:
            rebuilt(results, case_spec, expected=expected)
        assert case in str(info.value) and "\n" not in str(info.value), (case, str(info.value))


def test_a_replayed_masked_vector_gets_the_round_rejected(tmp_path):
    """A client that sends, in round 2, the masked vector it sent in round 1 (a replay:
    it skips its training) enters a sum whose masks no longer cancel, since every
    protocol run has new keys: the unmasked sums are garbage, which the server's checks
    find, and the round is rejected with one line rather than aggregated."""
    gen = torch.Generator().manual_seed(7)
    trees = [table_tree(cid, gen) for cid in range(3)]
    spec = SumSpec(40)
    kept: dict[str, Message] = {}

    class Replaying(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            replies = super().send_and_receive(messages, timeout=timeout)
            out = []
            for reply in replies:
                stage = next((m for m in messages if m.metadata.dst_node_id == reply.metadata.src_node_id), None)
                collect = stage is not None and stage.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE] == Stage.COLLECT_MASKED_VECTORS
                if collect and reply.metadata.src_node_id == 2:
                    if "old" in kept:  # the round-1 vector again, as the reply to this round's message
                        reply = Message(kept["old"].content, reply_to=stage)
                        reply.metadata.__dict__["_src_node_id"] = 2
                    else:
                        kept["old"] = reply
                out.append(reply)
            return out

    def app_of(cid: int, tree: dict) -> ClientApp:
        return lambda msg: Message(reply_fitres(encode(tree), cid, spec), reply_to=msg)

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    grid = Replaying([app_of(cid, tree) for cid, tree in enumerate(trees)], {}, tmp_path)
    participants = {cid + 1: cid for cid in range(3)}
    total = sum(t["num_samples"] for t in trees)
    for t in (0, 1):
        fitins = {cid: request_fitins(encode({"round": t, "client": cid}), cid, participants, spec) for cid in range(3)}
        secure = SecureRound(grid, context, timeout=5.0, spec=spec)
        if t == 0:
            replies, errors = secure.run(t, {cid: cid + 1 for cid in range(3)}, fitins, lambda cids: total)
            assert sorted(replies) == [0, 1, 2] and not errors
        else:
            with pytest.raises(SumRejected) as info:
                secure.run(t, {cid: cid + 1 for cid in range(3)}, fitins, lambda cids: total)
            assert "\n" not in str(info.value) and info.value.clients == [0, 1, 2], str(info.value)


def test_federated_evaluation_through_secure_sums_gives_the_rounds_means_and_no_clients_scores(tmp_path):
    """The global model evaluated by each client through SecAgg+ (contrafl's real
    ClientApp, in this process): the server's test accuracy is exactly the round's
    (correct predictions over test samples, summed), its loss the round's to the fixed
    point's 2^-16, and every client's scores are shares of the totals, not its own."""
    from contrafl.engine.simulation import Simulation

    sim = secure_simulation(tmp_path / "run", lambda run: AppGrid(run, 4), "global_eval=federated", "test_fraction=0.25")
    plain = dict(Simulation.evaluate_model_locally(sim, 1, [0, 1, 2, 3], sim.server.model))
    assert all(plain[c]["n"] for c in plain)
    secure = dict(sim.transport.evaluate_model(1, [0, 1, 2, 3], sim.server.model))
    total = sum(s["n"] for s in plain.values())
    assert sum(s["n"] for s in secure.values()) == total
    assert sum(round(s["acc"] * s["n"]) for s in secure.values()) == sum(round(s["acc"] * s["n"]) for s in plain.values())
    loss = sum(s["loss"] * s["n"] for s in plain.values()) / total
    assert sum(s["loss"] * s["n"] for s in secure.values()) / total == pytest.approx(loss, abs=1e-4)
    assert [s["n"] for s in secure.values()] != [s["n"] for s in plain.values()]  # shares of the total, not the clients' own
    ledger = json.loads((tmp_path / "run" / "flower-clients" / "client-0" / LEDGER).read_text())
    assert ledger == {"the evaluation after round 1": [0, 1, 2, 3]}


def test_a_client_that_took_no_step_adds_nothing_to_the_loss(tmp_path):
    """A site with fewer samples than a batch (drop_last) trains no step and reports no
    loss (None): it adds 0 to the secure sum of losses and its samples to the weight,
    as a plain round counts it (found following docs/flower.md's command on small sites)."""
    gen = torch.Generator().manual_seed(11)
    trees = [table_tree(cid, gen) for cid in range(3)]
    trees[0] = {**trees[0], "loss": None, "steps": 0, "parts": {"ce": None, "con": None}}
    spec = SumSpec(40)
    results, _ = sum_round(tmp_path, trees, spec)
    out = rebuilt(results, spec, expected=sum(t["num_samples"] for t in trees))
    assert sum(t["steps"] for t in out.values()) == sum(t["steps"] for t in trees[1:])
    assert sum(t["loss"] for t in out.values()) == pytest.approx(sum(t["loss"] for t in trees[1:]), abs=1e-4)


def test_a_site_with_more_samples_than_the_max_weight_refuses_without_telling_its_count():
    """The refusal goes to the server as the client's error reply: it names the public
    bound, not the site's count."""
    tree = table_tree(0, torch.Generator().manual_seed(2))
    tree = {**tree, "num_samples": 57}
    with pytest.raises(ContraflError) as info:
        reply_fitres(encode(tree), 0, SumSpec(40))
    assert "more training samples than the run's secure-aggregation max weight 40" in str(info.value)
    assert "57" not in str(info.value) and "\n" not in str(info.value)
