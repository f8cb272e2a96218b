"""Robust aggregation and Byzantine attacks as settings of a run (``aggregator=``,
``attack=``): the replacement of every reply's update by the rule's aggregate, the
attackers' crafted replies, what the rounds record, resume and the one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch

from contrafl.algorithms import attacks, robust
from contrafl.algorithms.base import Reply, ServerState
from contrafl.algorithms.fedavg import FedAvg
from contrafl.cli import main
from contrafl.config import Component, load_config
from contrafl.engine.attacking import Attack
from contrafl.engine.robustness import RobustAggregation, detection
from contrafl.engine.setup import prepare, resolve
from contrafl.engine.simulation import Simulation
from contrafl.errors import ConfigError
from contrafl.execution.context import Context
from test_resume import _killed_run, _uninterrupted

RUN = ["num_clients=6", "rounds=3", "local_epochs=1", "executor=sequential"]


def _replies(n: int = 5, d: int = 7, seed: int = 0) -> tuple[dict, list[Reply]]:
    g = torch.Generator().manual_seed(seed)
    message = {"model": {"w": torch.randn(d, generator=g), "b": torch.randn(2, generator=g)}}
    replies = [
        Reply(cid, 10 + cid, {"model": {k: v + torch.randn(v.shape, generator=g) for k, v in message["model"].items()},
                              "steps": torch.tensor(cid)})
        for cid in range(n)
    ]
    return message, replies


def _flat(payload: dict, message: dict) -> torch.Tensor:
    return torch.cat([payload["model"][k] - message["model"][k] for k in ("w", "b")])


@pytest.mark.parametrize("rule, options, direct", [
    ("median", {}, lambda u: robust.median(u)),
    ("trimmed_mean", {"f": 1}, lambda u: robust.trimmed_mean(u, f=1)),
    ("krum", {"f": 1}, lambda u: robust.krum(u, 1)),
    ("bulyan", {"f": 0}, lambda u: robust.bulyan(u, 0)),
    ("geometric_median", {}, lambda u: robust.geometric_median(u)),
    ("norm_bound", {"tau": 1.5}, lambda u: robust.norm_bound(u, 1.5)),
])
def test_every_reply_becomes_the_message_plus_the_rules_aggregate_of_the_updates(rule, options, direct):
    message, replies = _replies()
    out, _ = RobustAggregation(Component(rule, options)).apply(replies, {r.cid: message for r in replies})
    expected = direct(torch.stack([_flat(r.payload, message) for r in replies])).aggregate
    for before, after in zip(replies, out):
        torch.testing.assert_close(_flat(after.payload, message), expected, rtol=0, atol=1e-6)
        assert torch.equal(after.payload["steps"], before.payload["steps"])  # integer tensors stay the client's
    # the algorithm's weighted mean of equal payloads is the robust aggregate
    state = FedAvg(FedAvg.Params(), None).aggregate(ServerState(message["model"]), out, 0)
    torch.testing.assert_close(torch.cat([state.model[k] - message["model"][k] for k in ("w", "b")]), expected, rtol=0, atol=1e-5)


def test_each_label_row_is_the_rules_aggregate_over_the_clients_that_hold_the_label():
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([[3, 0, 1], [2, 2, 0], [0, 5, 4], [1, 1, 1]])
    replies = [Reply(i, int(c.sum()), {"prototypes": {"reps": torch.randn(3, 4, generator=g), "counts": c}}) for i, c in enumerate(counts)]
    out, report = RobustAggregation(Component("median")).apply(replies, {r.cid: {} for r in replies})
    assert report == {}
    for label in range(3):
        holders = [i for i in range(4) if counts[i, label] > 0]
        expected = robust.median(torch.stack([replies[i].payload["prototypes"]["reps"][label] for i in holders])).aggregate
        for i in range(4):
            row = out[i].payload["prototypes"]["reps"][label]
            if i in holders:
                torch.testing.assert_close(row, expected)
            else:  # a label the client does not hold keeps its row (weight 0 in the algorithm's mean)
                assert torch.equal(row, replies[i].payload["prototypes"]["reps"][label])
        assert all(torch.equal(o.payload["prototypes"]["counts"], r.payload["prototypes"]["counts"]) for o, r in zip(out, replies))


def test_a_round_with_too_few_replies_for_f_lowers_it_and_says_so():
    message, replies = _replies(n=4)
    out, report = RobustAggregation(Component("krum", {"f": 1})).apply(replies, {r.cid: message for r in replies})
    assert report["f"] == 0  # Krum needs n > 2f + 2: with 4 replies f = 0 ...
    _, report = RobustAggregation(Component("bulyan", {"f": 1})).apply(replies[:2], {r.cid: message for r in replies})
    assert report["f"] == -1  # ... and below f = 0 the coordinate-wise median


def test_multi_krum_of_every_update_weighted_by_samples_is_the_algorithms_weighted_mean():
    """aggregator=multi_krum with f=0, m=n and sample weights keeps everyone: the run equals
    the default's (FedAvg's weighted mean) to float rounding."""
    def final(extra):
        sim = Simulation(prepare(load_config(None, [*RUN, "rounds=2", *extra])))
        sim.run()
        return sim.server.model, sim.history
    plain, rows = final([])
    robust_model, robust_rows = final(["aggregator=multi_krum", "aggregator.f=0", "aggregator.m=6", "aggregator.weights=samples"])
    for k in plain:
        torch.testing.assert_close(robust_model[k].float(), plain[k].float(), rtol=1e-4, atol=1e-5)
    assert all(r["aggregator"]["flagged"] == [] for r in robust_rows)


def test_the_attackers_send_the_attack_of_the_honest_updates_and_the_aggregator_is_scored_against_them():
    message, replies = _replies(n=6)
    attack = Attack(Component("alie", {"clients": [1, 4]}), 6, 0, 1.0)
    assert attack.attackers(0, list(range(6))) == [1, 4]
    crafted = attack.craft(0, {r.cid: r for r in replies}, [1, 4], {c: message for c in range(6)})
    honest = torch.stack([_flat(r.payload, message) for r in replies if r.cid not in (1, 4)]).double()
    expected = attacks.alie(honest, 2)
    for cid in (1, 4):
        torch.testing.assert_close(_flat(crafted[cid].payload, message).double(), expected, rtol=0, atol=1e-6)
    assert detection([1, 3], [1, 4], list(range(6))) == {"precision": 0.5, "recall": 0.5}
    assert detection(None, [1], [1]) == {}


def test_prototype_poisoning_sends_each_labels_row_and_count_under_the_flipped_label():
    reps, counts = torch.arange(12.0).view(3, 4), torch.tensor([5, 0, 2])
    reply = Reply(0, 7, {"prototypes": {"reps": reps, "counts": counts}})
    crafted = Attack(Component("prototype_poisoning", {"clients": [0]}), 2, 0, 1.0).craft(0, {0: reply}, [0], {0: {}})[0]
    assert torch.equal(crafted.payload["prototypes"]["reps"], reps.flip(0))
    assert torch.equal(crafted.payload["prototypes"]["counts"], torch.tensor([2, 0, 5]))


def test_a_run_records_the_attackers_and_which_of_them_the_aggregator_caught(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "run"), *RUN, "aggregator=norm_bound", "attack=scaling", "attack.scale=100",
                 "attack.clients=[2]"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["attackers"] == [2] and r["aggregator"]["flagged"] == [2] for r in rows)
    assert all(r["aggregator"]["precision"] == 1.0 and r["aggregator"]["recall"] == 1.0 for r in rows)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["robustness"] == {"aggregator": "norm_bound", "attack": "scaling", "precision": 1.0, "recall": 1.0}
    assert "aggregator=norm_bound, attack=scaling (attackers found: precision 1.00; recall 1.00)" in capsys.readouterr().out


def test_secret_sampling_publishes_neither_the_attackers_nor_the_flagged_clients(tmp_path):
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *RUN, "rounds=1", "aggregator=krum", "attack=sign_flipping",
                 "sampling=secret", "sample_fraction=0.9"]) == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert "attackers" not in row and "flagged" not in row["aggregator"] and "recall" in row["aggregator"]


@pytest.mark.parametrize("settings, message", [
    (["aggregator=krum", "aggregator.f=2"], "aggregator=krum with f=2 needs n > 2f + 2 clients, got n=6: set aggregator.f to at most 1"),
    (["aggregator=bulyan"], "aggregator=bulyan with f=1 needs n >= 4f + 3 clients, got n=6: set aggregator.f to at most 0"),
    (["aggregator=median", "aggregator.f=1"], "aggregator.f has no effect with aggregator=median"),
    (["aggregator=krum", "aggregator.variant=recursive"], "aggregator.variant=recursive is not a variant of krum"),
    (["aggregator=trimmed_mean", "aggregator.f=1", "aggregator.beta=0.2"], "takes aggregator.f or aggregator.beta, not both"),
    (["aggregator=mean", "aggregator.f=1"], "aggregator=mean, which has no options"),
    (["aggregator=krun"], "did you mean 'krum'"),
    (["aggregator=median", "algorithm=fedu2"], "FedU2's EUA solves for weights from every client's update"),
    (["aggregator=median", "dp=central"], "a robust rule is not that sum; use dp=local"),
    (["attack=alie", "attack.fraction=0.5"], "attack.fraction='0.5' is invalid: expected >= 0 and < 0.5"),
    (["attack=alie", "attack.fraction=0.05"], "attack.fraction=0.05 of 6 clients makes no attacker"),
    (["attack=alie", "attack.clients=[7]"], "attack.clients names client 7, but the clients are 0..5"),
    (["attack=alie", "attack.sigma=2"], "attack.sigma has no effect with attack=alie (it is read by gaussian)"),
    (["attack=prototype_poisoning"], "this algorithm's replies have none"),
    (["attack=gaussian", "algorithm=solo"], "solo's clients send nothing"),
])
def test_settings_that_cannot_work_are_one_line_errors_before_anything_runs(tmp_path, capsys, settings, message):
    assert main(["run", "--out", str(tmp_path / "run"), *RUN, *settings]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_local_dp_with_a_robust_aggregator_is_allowed():
    cfg = resolve(load_config(None, [*RUN, "aggregator=median", "dp=local"]))
    assert cfg.aggregator.name == "median" and cfg.dp.name == "local"


def test_a_resolved_aggregator_and_attack_resolve_again_to_themselves():
    cfg = resolve(load_config(None, [*RUN, "aggregator=trimmed_mean", "aggregator.beta=0.2", "attack=gaussian", "attack.sigma=3"]))
    assert resolve(cfg).aggregator == cfg.aggregator and resolve(cfg).attack == cfg.attack
    assert cfg.aggregator.options == {"beta": 0.2}


@pytest.mark.slow
def test_an_attacked_run_with_centered_clipping_killed_in_a_round_resumes_exactly(tmp_path):
    """Centered clipping's previous aggregate is state: the checkpoint keeps it, and the
    resumed run equals the uninterrupted one byte for byte."""
    settings = [*RUN, "rounds=4", "num_clients=4", "aggregator=centered_clipping", "attack=alie", "attack.clients=[1]"]
    clean = _uninterrupted(tmp_path, settings)
    run = tmp_path / "run"
    _killed_run(run, "round", 2 * 4 + 2, settings)  # round 3, two clients done
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == clean


def test_a_crafted_aggregator_state_in_a_checkpoint_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *RUN, "rounds=1", "aggregator=centered_clipping"]) == 0
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=False)
    assert set(checkpoint["aggregator"]) == {"updates"}
    checkpoint["aggregator"]["updates"] = torch.full((3,), float("nan"))
    torch.save(checkpoint, run / "checkpoint.pt")
    assert main(["run", "--quiet", "--resume", str(run), "rounds=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "aggregator is" in err and "expected a dict of name -> finite 1-D float tensor" in err and len(err.splitlines()) == 1


def test_distributed_workers_send_single_replies_when_the_server_needs_them():
    for extra, sums in (([], True), (["aggregator=median"], False), (["attack=gaussian"], False)):
        sim = Simulation(prepare(load_config(None, [*RUN, *extra])))
        assert sim.sums_replies is sums, extra


def test_config_errors_name_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="aggregator=krum"):
        resolve(load_config(None, [*RUN, "aggregator=krum", "aggregator.f=3"]))


def test_data_attacks_poison_only_the_attackers_rows():
    setup = prepare(load_config(None, [*RUN]))
    data, partition = setup.data, setup.partition
    flipped = Attack(Component("label_flipping", {"clients": [1]}), 6, 0, 1.0).poisoned(data, partition)
    rows = torch.as_tensor(partition.train[1])
    others = torch.ones(len(data.train.y), dtype=torch.bool)
    others[rows] = False
    assert torch.equal(flipped.train.y[rows], 9 - data.train.y[rows])
    assert torch.equal(flipped.train.y[others], data.train.y[others]) and torch.equal(flipped.train.x, data.train.x)
    attack = Attack(Component("backdoor", {"clients": [2], "poison": 0.5, "target": 3, "trigger": 4}), 6, 0, 1.0)
    poisoned = attack.poisoned(data, partition)
    rows = torch.as_tensor(partition.train[2])
    changed = (poisoned.train.x != data.train.x).any(dim=1) | (poisoned.train.y != data.train.y)
    assert set(torch.nonzero(changed).flatten().tolist()) <= set(rows.tolist())
    marked = (poisoned.train.x[rows, -4:] == data.train.x.max()).all(dim=1)
    assert int(marked.sum()) >= round(0.5 * len(rows)) - int(((data.train.x[rows, -4:] == data.train.x.max()).all(dim=1)).sum())
    assert bool((poisoned.train.y[rows][marked & changed[rows]] == 3).all())
    test = attack.test_sets(data.test)["backdoor_success"]
    assert bool((test.y == 3).all()) and len(test.y) == int((data.test.y != 3).sum())
    assert bool((test.x[:, -4:] == data.test.x.max()).all())


def test_a_model_replacement_backdoor_succeeds_against_the_mean_and_fails_against_norm_bounding(tmp_path):
    """Bagdasaryan et al.'s attack on a small fixed case: one of six clients trains on
    half-backdoored data and, in the last round, scales its update by n / server_lr. The
    mean takes the backdoor (success rate above 0.9); norm bounding, with the median norm
    as its radius, keeps the clean accuracy and the success rate below 0.9."""
    settings = ["num_clients=6", "rounds=6", "lr=0.05", "executor=sequential", "attack=model_replacement", "attack.clients=[0]", "attack.rounds=[6]"]
    results = {}
    for aggregator in ("mean", "norm_bound"):
        out = tmp_path / aggregator
        assert main(["run", "--quiet", "--out", str(out), *settings, f"aggregator={aggregator}"]) == 0
        results[aggregator] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert results["mean"]["backdoor_success"] > 0.9
    assert results["norm_bound"]["backdoor_success"] < 0.9 and results["norm_bound"]["test_acc"] > 0.9
    assert 0 in results["norm_bound"]["aggregator"]["flagged"]  # the attacker, in the round it strikes


@pytest.mark.parametrize("settings, message", [
    (["attack=backdoor", "algorithm=fedbyol"], "poisons labels, and this algorithm learns without them"),
    (["attack=label_flipping", "attack.choice=per_round"], "cannot change from round to round; set attack.choice=fixed"),
    (["attack=backdoor", "attack.target=10"], "attack.target=10 is not a label of the dataset's 10"),
    (["attack=alie", "attack.rounds=[0]"], "must list rounds from 1"),
])
def test_data_attack_settings_that_cannot_work_are_one_line_errors(tmp_path, capsys, settings, message):
    assert main(["run", "--out", str(tmp_path / "run"), *RUN, *settings]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_encoder_collapse_pulls_every_weight_matrix_to_zero_and_keeps_the_vectors():
    message = {"model": {"w": torch.ones(3, 2), "b": torch.ones(3)}}
    replies = {c: Reply(c, 5, {"model": {"w": torch.full((3, 2), 2.0), "b": torch.full((3,), 2.0)}}) for c in range(4)}
    crafted = Attack(Component("encoder_collapse", {"clients": [0]}), 4, 0, 1.0).craft(0, replies, [0], {c: message for c in range(4)})[0]
    assert torch.equal(crafted.payload["model"]["w"], torch.full((3, 2), 1.0 - 4))  # m + n (0 - m), n = 4 replies
    assert torch.equal(crafted.payload["model"]["b"], torch.ones(3))  # the message's vectors


def test_the_backdoor_is_measured_on_the_personalised_models_of_every_client(tmp_path):
    """Ditto (every client keeps a personal model) under a backdoor of client 0: the run's
    ``personal_backdoor_success`` is the success rate of each client's own model on the
    triggered test images of other labels, weighted by their number, recomputed here from
    the clients' models; the attacker's model has learnt the backdoor, the honest ones
    have not."""
    cfg = load_config(None, ["num_clients=4", "rounds=2", "local_epochs=2", "lr=0.05", "executor=sequential", "algorithm=ditto",
                             "eval_personal=true", "attack=backdoor", "attack.clients=[0]", "attack.poison=1.0"])
    sim = Simulation(prepare(cfg))
    sim.run()
    last = sim.history[-1]
    test, target = sim.test, sim.attack.params.target
    others = test.y != target
    x = test.x[others].clone()
    x[..., -sim.attack.params.trigger:] = float(x.max())  # digits are vectors: the trigger is the last features
    rates, algo = [], sim.algorithm
    broadcast = algo.broadcast(sim.server, cfg.rounds)
    for cid in range(4):
        message = algo.message_for(broadcast, sim.server, cid, cfg.rounds)
        model = algo.personal_model(sim.store.get(cid)["algorithm"], message, Context(sim, cid, cfg.rounds))
        predicted = sim.net(model.state, sim.setup.eval_transform(x), train=False).logits.argmax(1)
        rates.append(float((predicted == target).float().mean()))
    assert last["personal_backdoor_success"] == pytest.approx(sum(rates) / 4)
    assert rates[0] > 0.9 and max(rates[1:]) < 0.5, rates
