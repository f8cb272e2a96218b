"""FedCRL and FedProto: the shared label-prototype machinery, FedCRL's contrastive loss,
adaptive local aggregation and messages, FedProto's nearest-prototype prediction."""

from __future__ import annotations

import math

import pytest
import torch

from contrafl.algorithms.base import Batch, Federation, Reply, ServerState, TaskView
from contrafl.algorithms.fedcrl import FedCRL, FedCRLParams, adaptive_alpha
from contrafl.algorithms.fedpac import FedPAC, FedPACParams
from contrafl.algorithms.fedproto import FedProto, FedProtoParams
from contrafl.algorithms.prototypes import (
    aggregate_prototypes,
    contrastive_loss,
    label_sums,
    local_prototypes,
    nearest_prototype_scores,
    squared_distance_loss,
)
from contrafl.models.base import ModelOutput
from tests.conftest import simulate

PFL = ["test_fraction=0.25", "pool=true", "eval_personal=true", "num_clients=5"]


def test_contrastive_loss_matches_a_hand_computed_infonce():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    reps = torch.tensor([[1.0, 1.0], [0.0, 1.0], [-1.0, 0.0]])
    mask = torch.tensor([True, True, True])
    y = torch.tensor([0, 2])
    tau = 0.5
    s = 1 / math.sqrt(2)
    cos = [[s, 0.0, -1.0], [s, 1.0, 0.0]]  # cos(z_b, r^c), computed by hand

    def term(b: int) -> float:
        den = sum(math.exp(c / tau) for c in cos[b])
        return -math.log(math.exp(cos[b][y[b]] / tau) / den)

    expected = (term(0) + term(1)) / 2
    assert contrastive_loss(z, y, reps, mask, tau).item() == pytest.approx(expected, rel=1e-6)


def test_samples_whose_label_has_no_global_rep_are_skipped_and_absent_labels_are_no_negatives():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    reps = torch.tensor([[1.0, 1.0], [0.0, 1.0], [-1.0, 0.0]])
    y = torch.tensor([0, 2])
    mask = torch.tensor([True, True, False])  # label 2 has no global rep
    s = 1 / math.sqrt(2)
    # sample 1 is skipped; sample 0's negatives are label 1 only
    expected = -math.log(math.exp(s / 0.1) / (math.exp(s / 0.1) + math.exp(0.0)))
    assert contrastive_loss(z, y, reps, mask, 0.1).item() == pytest.approx(expected, abs=1e-6)
    none = contrastive_loss(z, torch.tensor([2, 2]), reps, mask, 0.1)
    assert none.item() == 0.0
    zz = z.clone().requires_grad_(True)
    contrastive_loss(zz, torch.tensor([2, 2]), reps, mask, 0.1).backward()
    assert torch.equal(zz.grad, torch.zeros_like(z))


def test_global_label_reps_are_the_label_volume_weighted_mean():
    a = {"reps": torch.tensor([[1.0, 0.0], [2.0, 2.0], [0.0, 0.0]]), "counts": torch.tensor([3, 1, 0])}
    b = {"reps": torch.tensor([[5.0, 4.0], [0.0, 0.0], [0.0, 0.0]]), "counts": torch.tensor([1, 0, 0])}
    out = aggregate_prototypes([a, b], "counts")
    assert torch.allclose(out["reps"][0], torch.tensor([(3 * 1.0 + 5.0) / 4, (0 + 4.0) / 4]))
    assert torch.allclose(out["reps"][1], torch.tensor([2.0, 2.0]))
    assert out["mask"].tolist() == [True, True, False]
    uniform = aggregate_prototypes([a, b], "uniform")
    assert torch.allclose(uniform["reps"][0], torch.tensor([3.0, 2.0]))
    # a label nobody holds this round keeps its previous global rep
    previous = {"reps": torch.tensor([[0.0, 0.0], [0.0, 0.0], [7.0, 7.0]]), "mask": torch.tensor([False, False, True])}
    kept = aggregate_prototypes([a, b], "counts", previous)
    assert kept["mask"].all() and torch.equal(kept["reps"][2], torch.tensor([7.0, 7.0]))


def test_local_prototypes_are_the_per_label_means_of_the_trained_representations():
    z1, y1 = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([1, 1])
    z2, y2 = torch.tensor([[5.0, 6.0], [7.0, 8.0]]), torch.tensor([0, 1])
    s1, s2 = label_sums(z1, y1, 3), label_sums(z2, y2, 3)
    stats = {k: s1[k] + s2[k] for k in s1}
    out = local_prototypes(stats, 3, 2)
    assert out["counts"].tolist() == [1, 3, 0]
    assert torch.allclose(out["reps"], torch.tensor([[5.0, 6.0], [11 / 3, 14 / 3], [0.0, 0.0]]))


def test_adaptive_alpha_is_in_unit_interval_and_decreasing_in_the_loss():
    for rule in ("exp", "power", "exp_inverse"):
        values = [adaptive_alpha(loss, 0.8, rule) for loss in (0.0, 0.1, 1.0, 3.0, 50.0)]
        assert all(0 <= a <= 1 for a in values)
        assert values == sorted(values, reverse=True) and values[0] == 1.0
    assert adaptive_alpha(2.0, 0.8, "exp") == pytest.approx(math.exp(-1.6))
    assert adaptive_alpha(2.0, 0.8, "power") == pytest.approx(0.64)
    assert adaptive_alpha(2.0, 0.8, "exp_inverse") == pytest.approx(math.exp(-2.5))


def _federation(names=("features.w", "l3.weight", "l3.bias"), classes=3, rep_dim=2) -> Federation:
    return Federation(4, classes, 2, 0.1, 1, 2, tuple(names), rep_dim=rep_dim)


class _Ctx:
    cid, round, num_samples = 0, 1, 10
    label_counts = torch.tensor([5, 5, 0])

    def initial_state(self):
        return {"features.w": torch.full((2,), 9.0), "l3.weight": torch.ones(3, 2), "l3.bias": torch.zeros(3)}


def test_local_mixing_is_alpha_local_plus_one_minus_alpha_global_and_the_head_is_kept():
    algo = FedCRL(FedCRLParams(s=0.8), _federation())
    local = {"features.w": torch.tensor([1.0, 3.0])}
    head = {"l3.weight": torch.full((3, 2), 2.0), "l3.bias": torch.ones(3)}
    glob = {"features.w": torch.tensor([5.0, -1.0])}
    state = {"body": local, "head": head, "crl_loss": torch.tensor(1.5)}
    task = algo.client_begin({"body": glob}, state, _Ctx())
    alpha = math.exp(-0.8 * 1.5)
    assert torch.allclose(task.params["body"]["features.w"], alpha * local["features.w"] + (1 - alpha) * glob["features.w"])
    assert torch.equal(task.params["head"]["l3.weight"], head["l3.weight"])
    # the evaluated model is the same mix with the client's head
    model = algo.personal_model(state, {"body": glob}, _Ctx()).state
    assert torch.allclose(model["features.w"], task.params["body"]["features.w"])
    # first participation: the global body and the client's own initial head
    first = algo.client_begin({"body": glob}, {}, _Ctx())
    assert torch.equal(first.params["body"]["features.w"], glob["features.w"])
    assert torch.equal(first.params["head"]["l3.weight"], torch.ones(3, 2))


def test_round_one_has_no_contrastive_term_and_the_reply_has_no_head():
    sim = simulate("algorithm=fedcrl", *PFL, "rounds=1", "executor=sequential")
    assert "prototypes" not in sim.algorithm.broadcast(ServerState(sim.setup.model.state_dict()), 0)
    states = [sim.store.get(cid)["algorithm"] for cid in range(5)]
    assert all("crl_loss" not in s for s in states)  # no contrastive loss was computed
    message = sim.algorithm.broadcast(sim.server, 1)
    assert "prototypes" in message and not any(k.startswith("l3.") for k in message["body"])
    assert sim.history[0]["bytes_up"].keys() == {"body", "prototypes"}
    body_bytes = sum(v.numel() * v.element_size() for k, v in sim.server.model.items() if not k.startswith("l3."))
    assert sim.history[0]["bytes_up"]["body"] == 5 * body_bytes


def test_fedcrl_trains_with_the_contrastive_term_from_round_two():
    sim = simulate("algorithm=fedcrl", *PFL, "rounds=3", "executor=sequential", "optimizer=adam", "lr=0.003", "persist_optimizer_state=true")
    states = [sim.store.get(cid)["algorithm"] for cid in range(5)]
    assert all(float(s["crl_loss"]) > 0 for s in states)
    last = sim.history[-1]
    assert last["personal_clients"] == 5 and 0 < last["personal_acc"] <= 1
    assert "test_acc" not in last  # no global classifier to evaluate


def test_fedcrl_sequential_and_vectorized_agree():
    args = ("algorithm=fedcrl", *PFL, "rounds=3", "sample_fraction=0.6")
    seq = simulate(*args, "executor=sequential")
    vec = simulate(*args, "executor=vectorized")
    for a, b in zip(seq.history, vec.history):
        assert a["personal_acc"] == pytest.approx(b["personal_acc"], abs=0.02)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
    for k, v in seq.server.model.items():
        assert torch.allclose(v, vec.server.model[k], atol=1e-4)


def test_every_client_is_evaluated_including_ones_never_sampled():
    sim = simulate("algorithm=fedcrl", *PFL, "rounds=1", "sample_fraction=0.4", "executor=sequential")
    assert len(sim.history[0]["clients"]) == 2
    assert sim.history[0]["personal_clients"] == 5


def test_prototype_regulariser_and_nearest_prototype_prediction():
    z = torch.tensor([[1.0, 1.0], [0.0, 3.0]])
    reps = torch.tensor([[1.0, 0.0], [0.0, 0.0], [5.0, 5.0]])
    mask = torch.tensor([True, False, True])
    y = torch.tensor([0, 1])
    # row 0 against r^0: (0^2 + 1^2); row 1 has no prototype: no contribution; mean over B x d = 4
    assert squared_distance_loss(z, y, reps, mask).item() == pytest.approx(1.0 / 4)
    scores = nearest_prototype_scores(z, reps, mask)
    assert scores.argmax(1).tolist() == [0, 0]  # label 1 (closer to sample 1) has no prototype
    assert scores[0, 0].item() == pytest.approx(-1.0 / 2) and scores[0, 1].item() == float("-inf")


def test_fedproto_predicts_by_the_nearest_prototype_and_shares_no_parameters():
    sim = simulate("algorithm=fedproto", *PFL, "rounds=2", "executor=sequential")
    assert sim.history[-1]["bytes_up"].keys() == {"prototypes"}
    message = sim.algorithm.broadcast(sim.server, 2)
    model = sim.algorithm.personal_model(sim.store.get(0)["algorithm"], message, None)
    out = ModelOutput(torch.zeros(1, 1), message["prototypes"]["reps"][[1]], torch.tensor([[9.0, 0.0] + [0.0] * 8]))
    assert model.scores(out).argmax(1).item() == 1  # its own prototype, whatever the logits say


def test_fedproto_loss_is_ce_plus_lambda_mse_to_the_global_prototypes():
    fed = _federation(names=("w", "l3.weight"), rep_dim=2)
    algo = FedProto(FedProtoParams(lam=2.0), fed)
    reps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    protos = {"reps": reps, "mask": torch.tensor([True, True, False])}
    z = torch.tensor([[0.5, 0.5], [2.0, 0.0]])

    def net(state, x, train):
        return ModelOutput(z, z, z @ state["l3.weight"].T)

    weight = torch.eye(3, 2)
    view = TaskView({"model": {"w": torch.zeros(1), "l3.weight": weight}}, {"model": {}}, {}, {"prototypes": protos})
    y = torch.tensor([0, 1])
    loss, stats = algo.local_loss(view, Batch(torch.zeros(2, 1), y), net)
    ce = torch.nn.functional.cross_entropy(z @ weight.T, y)
    mse = ((0.5 - 1) ** 2 + 0.5**2 + 2.0**2 + (0.0 - 1) ** 2) / 4
    assert loss.item() == pytest.approx(ce.item() + 2.0 * mse, rel=1e-6)
    assert stats["proto_count"].tolist() == [1.0, 1.0, 0.0]


def _proto_reply(cid: int, reps: list[list[float]], counts: list[int]) -> Reply:
    return Reply(cid, sum(counts), {"prototypes": {"reps": torch.tensor(reps), "counts": torch.tensor(counts)}})


@pytest.mark.parametrize("missing_label,kept", [("drop", False), ("keep", True)])
def test_a_label_no_client_of_the_round_holds(missing_label, kept):
    """PFLlib's FedProto and FedPAC rebuild the global prototypes from the round's uploads
    (serverproto.py, serverpac.py): a label only an unsampled client holds has none the
    next round (``missing_label=drop``, their default); ``keep`` (FedCRL's default,
    [infer]) keeps the previous round's."""
    algo = FedProto(FedProtoParams(missing_label=missing_label), _federation(names=("w",), rep_dim=2))
    server = algo.init_server({"w": torch.zeros(1)})
    first = algo.aggregate(server, [_proto_reply(0, [[1.0, 0.0], [0.0, 0.0], [3.0, 3.0]], [2, 0, 1])], 0)
    assert first.extras["prototypes"]["mask"].tolist() == [True, False, True]
    second = algo.aggregate(first, [_proto_reply(1, [[0.0, 1.0], [2.0, 2.0], [0.0, 0.0]], [1, 4, 0])], 1)
    protos = second.extras["prototypes"]
    assert protos["mask"].tolist() == [True, True, kept]
    torch.testing.assert_close(protos["reps"][:2], torch.tensor([[0.0, 1.0], [2.0, 2.0]]))
    if kept:
        torch.testing.assert_close(protos["reps"][2], torch.tensor([3.0, 3.0]))
    message = algo.broadcast(second, 2)["prototypes"]
    assert bool(message["mask"][2]) is kept  # a dropped label is not in the clients' loss or prediction


def test_missing_label_defaults_follow_the_reference_code():
    assert FedProtoParams().missing_label == "drop" and FedPACParams().missing_label == "drop"
    assert FedCRLParams().missing_label == "keep"


def test_fedpac_drops_a_label_no_client_of_the_round_holds():
    algo = FedPAC(FedPACParams(), _federation(names=("w", "l3.weight", "l3.bias"), rep_dim=2))
    server = ServerState({"w": torch.zeros(2), "l3.weight": torch.zeros(3, 2), "l3.bias": torch.zeros(3)},
                         {"prototypes": {"reps": torch.ones(3, 2), "mask": torch.tensor([True, True, True])}})
    reply = _proto_reply(0, [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], [2, 0, 0])
    reply.payload.update({
        "body": {"w": torch.ones(2)}, "head": {"l3.weight": torch.ones(3, 2), "l3.bias": torch.ones(3)},
        "stats": {"V": torch.tensor(0.5), "h": torch.ones(3, 2)},
    })
    new = algo.aggregate(server, [reply], 1)
    assert new.extras["prototypes"]["mask"].tolist() == [True, False, False]
