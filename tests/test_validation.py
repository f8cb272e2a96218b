"""Client-update validation, safe loading of checkpoints, and engine fixes of issue #9."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from contrafl.algorithms.aggregation import sample_weights, weighted_average
from contrafl.algorithms.base import Reply, TensorSpec, spec_of
from contrafl.cli import main
from contrafl.engine.checkpoint import history_rows, load_safe, pack_history
from contrafl.config import load_config
from contrafl.engine.setup import prepare
from contrafl.engine.simulation import Simulation
from contrafl.execution.validate import begin_check, check_reply, finish_checks, norm_outliers, update_norm
from contrafl.errors import CheckpointError, ClientUpdateError

from conftest import FAST, simulate


def _model(value: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), value), "steps": torch.tensor(4)}


def test_check_reply_names_what_is_wrong():
    spec = {"model": spec_of(_model()), "reps": {"r": TensorSpec((None, 3), torch.float32)}}
    good = {"model": _model(1.0), "reps": {"r": torch.zeros(5, 3)}}
    assert check_reply(Reply(0, 10, good), spec) is None
    cases = {
        "'model.w' has non-finite values (2 NaN, 2 infinite)": {**good, "model": {**_model(), "w": torch.tensor([[float("nan"), float("inf"), 0.0]] * 2)}},
        "'model.w' has shape [3, 2], expected float32[2, 3]": {**good, "model": {**_model(), "w": torch.zeros(3, 2)}},
        "'model.w' has dtype float64, expected float32": {**good, "model": {**_model(), "w": torch.zeros(2, 3, dtype=torch.float64)}},
        "'reps.r' has shape [5, 4], expected float32[*, 3]": {**good, "reps": {"r": torch.zeros(5, 4)}},
        "'model.steps' is missing": {**good, "model": {"w": torch.zeros(2, 3)}},
        "'extra' is not expected": {**good, "extra": torch.zeros(1)},
        "'model.w' is a list, expected a tensor float32[2, 3]": {**good, "model": {**_model(), "w": [0.0]}},
    }
    for reason, payload in cases.items():
        assert check_reply(Reply(0, 10, payload), spec) == reason
    assert check_reply(Reply(0, -1, good), spec) == "num_samples=-1, expected a non-negative integer"


def test_finite_values_whose_sum_overflows_pass():
    """The fused finiteness test sums squares; finite tensors whose sum overflows their
    dtype (float16 past 65504, float32 past 3.4e38) are cleared by the exact scan,
    and the first non-finite tensor in payload order is the one named."""
    spec = {"a": TensorSpec((4,), torch.float16), "b": TensorSpec((2,), torch.float32), "c": TensorSpec((2,), torch.float32)}
    huge = {"a": torch.full((4,), 60000.0, dtype=torch.float16), "b": torch.full((2,), 3e38), "c": torch.full((2,), 1e20)}
    assert check_reply(Reply(0, 1, huge), spec) is None
    bad = {**huge, "c": torch.tensor([float("-inf"), 0.0])}
    assert check_reply(Reply(0, 1, bad), spec) == "'c' has non-finite values (0 NaN, 1 infinite)"


def test_replies_checked_together_get_each_its_own_reason():
    """finish_checks tests the values of many replies in one pass, and names for each
    reply what check_reply alone would: its structure's fault, its first non-finite
    tensor (not another reply's), a per-label table's rows, or None."""
    spec = {"a": TensorSpec((3,), torch.float32), "b": TensorSpec((2,), torch.float32)}
    table_spec = {"t": {"reps": TensorSpec((None, 2), torch.float32), "counts": TensorSpec((4,), torch.int64)}}
    good = {"a": torch.ones(3), "b": torch.full((2,), 3e38)}  # finite, though its squares overflow
    cases = [
        (Reply(0, 5, good), spec),
        (Reply(1, 5, {**good, "b": torch.tensor([1.0, float("nan")])}), spec),
        (Reply(2, 5, {"a": torch.ones(3)}), spec),
        (Reply(3, 5, {"a": torch.tensor([float("inf"), 0.0, 0.0]), "b": torch.ones(2)}), spec),
        (Reply(4, 5, {"t": {"reps": torch.ones(3, 2), "counts": torch.ones(4, dtype=torch.int64)}}), table_spec),
        (Reply(5, 5, good), spec),
    ]
    alone = [check_reply(reply, s) for reply, s in cases]
    assert alone == [None, "'b' has non-finite values (1 NaN, 0 infinite)", "'b' is missing",
                     "'a' has non-finite values (0 NaN, 1 infinite)", "a per-label table has 3 rows for 4 labels (4 marked)", None]
    assert finish_checks([begin_check(reply, s) for reply, s in cases]) == alone
    assert finish_checks([begin_check(cases[0][0], spec)] * 3) == [None] * 3
    assert finish_checks([]) == []


class _Waits(TorchDispatchMode):
    """Counts the operations that wait for a tensor's value (on a GPU, for the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__ in ("_local_scalar_dense", "is_nonzero", "item", "equal")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_a_round_reads_its_replies_values_and_losses_at_once(executor):
    """The replies' checks and the clients' losses (MOON's and its two parts) are read
    with a fixed number of waits a round, not a few per client: 3 clients or 6, the
    same (on a GPU, each wait stops the host until the device has caught up)."""
    waits = []
    for clients in (3, 6):
        sim = Simulation(prepare(load_config(None, [*FAST, f"num_clients={clients}", f"executor={executor}", "algorithm=moon"])))
        sim.run_round(0)
        with _Waits() as counted:
            row = sim.run_round(1)
        assert row["train_loss"] > 0 and set(row["loss_parts"]) == {"ce", "con"}
        waits.append(counted.count)
    assert waits[0] == waits[1] <= 3  # the replies' values once, the evaluation's accuracy and loss


def test_norm_outlier_rule_against_the_median():
    message = {"model": _model(1.0)}
    replies = [Reply(c, 10, {"model": _model(1.0 + d)}) for c, d in enumerate([0.1, 0.2, 0.15, 3.0])]
    norms = [update_norm(r.payload, message) for r in replies]
    assert norms[0] == pytest.approx(0.1 * 6**0.5)  # ||w_k - w||, integer buffers left out
    median = sorted(norms)[1:3]
    median = sum(median) / 2
    out = norm_outliers(replies, message, factor=5.0)
    assert list(out) == [3] and "limit 5" in out[3] and norms[3] > 5 * median
    assert norm_outliers(replies, message, factor=0.0) == {}
    assert norm_outliers(replies, message, factor=100.0) == {}


def _corrupting(sim: Simulation, corrupt: dict[int, callable], captured: list[Reply]) -> None:
    """Make the algorithm corrupt some clients' replies in round 1 and record every reply."""
    algo = sim.algorithm
    client_end = algo.client_end

    def patched(task, result, state, ctx):
        reply, new_state = client_end(task, result, state, ctx)
        if ctx.round == 0 and ctx.cid in corrupt:
            reply.payload = corrupt[ctx.cid](reply.payload)
        captured.append(reply)
        return reply, new_state

    algo.client_end = patched


def _nan(payload):
    model = dict(payload["model"])
    key = next(k for k, v in model.items() if v.is_floating_point())
    model[key] = torch.full_like(model[key], float("nan"))
    return {**payload, "model": model}


def _wrong_shape(payload):
    model = dict(payload["model"])
    key = next(k for k, v in model.items() if v.dim() == 2)
    model[key] = model[key].T.contiguous()
    return {**payload, "model": model}


def test_bad_updates_are_skipped_and_the_aggregate_equals_the_one_without_them():
    sim = Simulation(prepare(load_config(None, [*FAST, "rounds=1", "executor=sequential", "on_bad_update=skip"])))
    captured: list[Reply] = []
    _corrupting(sim, {1: _nan, 2: _wrong_shape}, captured)
    sim.run()
    row = sim.history[0]
    assert [r["client"] for r in row["rejected"]] == [1, 2]
    assert "non-finite" in row["rejected"][0]["reason"] and "has shape" in row["rejected"][1]["reason"]
    valid = [r for r in captured if r.cid in (0, 3)]
    expected = weighted_average([r.payload["model"] for r in valid], sample_weights(valid))
    for k, v in expected.items():
        torch.testing.assert_close(sim.server.model[k], v, rtol=0, atol=0)


def test_bad_update_stops_the_run_by_default():
    sim = Simulation(prepare(load_config(None, [*FAST, "rounds=1", "executor=sequential"])))
    _corrupting(sim, {2: _wrong_shape}, [])
    with pytest.raises(ClientUpdateError, match="client 2's update in round 1 was rejected: 'model.features.fc1.weight' has shape \\[64, 200\\], expected float32\\[200, 64\\]"):
        sim.run()


def test_under_secret_sampling_the_stop_error_names_no_client():
    """The clients of a round are a secret under ``sampling=secret``: the error that
    stops the run names the round, not the client (issue #53, N9)."""
    sim = Simulation(prepare(load_config(None, [*FAST, "rounds=1", "executor=sequential", "sampling=secret"])))
    _corrupting(sim, {c: _wrong_shape for c in range(sim.cfg.num_clients)}, [])
    with pytest.raises(ClientUpdateError) as info:
        sim.run()
    assert str(info.value).startswith("a client's update in round 1 was rejected: ") and "client 2" not in str(info.value)


class _Exploit:
    """Unpickling this calls ``open(marker, "w")``: code execution on load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_checkpoint_executes_nothing_and_gives_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *FAST, "rounds=2"]) == 0
    marker = tmp_path / "pwned"
    payload = torch.load(run / "checkpoint.pt", weights_only=True)
    payload["round"] = 1
    payload["history"] = pack_history(history_rows(payload)[:1])
    payload["server"]["extras"] = {"x": _Exploit(marker)}
    torch.save(payload, run / "checkpoint.pt")
    summary = json.loads((run / "summary.json").read_text())  # as a run stopped after round 1
    (run / "summary.json").write_text(json.dumps({**summary, "status": "interrupted", "checkpointed_rounds": 1}))
    torch.load(run / "checkpoint.pt", weights_only=False)  # unsafe loading runs the code...
    assert marker.exists()
    marker.unlink()
    assert main(["run", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be loaded" in err[0] and "refused: loading could run code" in err[0]
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        load_safe(run / "checkpoint.pt", "checkpoint")
    assert not marker.exists()


def test_malicious_client_state_file_executes_nothing(tmp_path):
    from contrafl.engine.client_store import ClientStore

    store = ClientStore(1e9, tmp_path / "clients", keep=True)
    store.put(0, {"w": torch.zeros(3)})
    manifest = store.checkpoint()
    store.commit(manifest)
    marker = tmp_path / "pwned"
    torch.save({"w": _Exploit(marker)}, tmp_path / "clients" / manifest["files"][0])
    again = ClientStore(1e9, tmp_path / "clients", keep=True)
    again.restore(manifest)
    with pytest.raises(CheckpointError, match="client 0's state .* cannot be loaded"):
        again.get(0)
    assert not marker.exists()


def test_vectorized_equals_sequential_with_sampling_and_persisted_adam():
    common = [
        *FAST, "rounds=3", "num_clients=6", "sample_fraction=0.5", "optimizer=adam", "lr=0.003",
        "persist_optimizer_state=true", "algorithm=fedprox",
    ]
    seq = simulate(*common, "executor=sequential")
    vec = simulate(*common, "executor=vectorized")
    assert [r["clients"] for r in seq.history] == [r["clients"] for r in vec.history]
    # Adam turns float noise in gradients that are ~0 (constant pixels of digits) into
    # steps of ~lr/100, so models agree to 1e-3 here; the optimiser states are compared
    # exactly (step counts) and to float tolerance (moments).
    for k, v in seq.server.model.items():
        torch.testing.assert_close(vec.server.model[k], v, rtol=0, atol=1e-3)
    seen = sorted({c for r in seq.history for c in r["clients"]})
    for cid in seen:
        a, b = seq.store.get(cid)["optimizer"][0], vec.store.get(cid)["optimizer"][0]
        assert [float(t) for t in a["step"]] == [float(t) for t in b["step"]]
        for x, y in zip(a["exp_avg_sq"], b["exp_avg_sq"]):
            torch.testing.assert_close(y, x, rtol=1e-3, atol=1e-7)
    # a client trained in two rounds has two rounds of Adam steps
    twice = [c for c in seen if sum(c in r["clients"] for r in seq.history) >= 2]
    assert twice and all(float(seq.store.get(c)["optimizer"][0]["step"][0]) > 0 for c in twice)


def test_solo_trains_every_client_whatever_sample_fraction_says():
    sim = simulate("algorithm=solo", "num_clients=6", "sample_fraction=0.2", "rounds=2", "eval_personal=auto")
    assert sim.cfg.sample_fraction == 1.0
    assert all(r["clients"] == list(range(6)) for r in sim.history)
    assert sim.history[-1]["personal_clients"] == 6
    assert any("sample_fraction is ignored" in w for w in sim.setup.warnings)


def test_summary_records_failure_of_an_unexpected_error(tmp_path, capsys, monkeypatch):
    def boom(self, t):
        if t == 1:
            raise MemoryError("CUDA out of memory (simulated)")
        return original(self, t)

    original = Simulation.run_round
    monkeypatch.setattr(Simulation, "run_round", boom)
    run = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run), *FAST, "rounds=3"]) == 1
    err = capsys.readouterr().err
    assert "MemoryError" in err and f"contrafl run --resume {run}` continues from round 2" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "MemoryError: CUDA out of memory (simulated)"
    assert summary["rounds_completed"] == 1


def test_forged_label_counts_are_refused_and_honest_ones_pass():
    """Issue #53, N2: FedCRL weighs each client's label row by its count, so a count of
    1e12 made the global row the forger's. A table that counts more samples than the
    client trained on (its samples times the local epochs), or a negative count, is
    refused with the reason; under dp=local with dp.labels=clear the bound is the
    largest client's."""
    from contrafl.execution.validate import count_problem

    for extra in ([], ["dp=local", "dp.labels=clear", "dp.clip=5", "dp.noise_multiplier=0.01"]):
        sim = Simulation(prepare(load_config(None, [*FAST, "algorithm=fedcrl", "rounds=1", "executor=sequential", "local_epochs=2", *extra])))
        message = sim.algorithm.broadcast(sim.server, 0)
        honest = [o.reply for o in sim.train_locally(0, [0, 1], lambda c: sim.algorithm.message_for(message, sim.server, c, 0), sim.algorithm.phases(0))]
        checks = {r.cid: (sim.begin_reply_check(r.cid, r, message, {}), r) for r in honest}
        assert sim.reply_problems(checks, lambda c: message) == {}
        forged = honest[0].payload["prototypes"]["counts"].clone()
        forged[0] = 10**12
        bad = Reply(0, honest[0].num_samples, {**honest[0].payload, "prototypes": {**honest[0].payload["prototypes"], "counts": forged}})
        why = sim.reply_problems({0: (sim.begin_reply_check(0, bad, message, {}), bad)}, lambda c: message)[0]
        assert why.startswith("a per-label table counts 1000000000") and "more than the" in why, why
    assert count_problem({"p": {"reps": torch.zeros(2, 1), "counts": torch.tensor([-1, 3])}}, 10) == "a per-label table has a negative count"


def test_a_client_that_lies_about_its_sample_count_is_refused_where_the_server_holds_the_data():
    """A tripled weight (issue #53): where the server holds the data it knows each
    client's count, and a reply claiming another is refused with the reason."""
    sim = Simulation(prepare(load_config(None, [*FAST, "rounds=1", "executor=sequential"])))
    message = sim.algorithm.broadcast(sim.server, 0)
    (honest,) = [o.reply for o in sim.train_locally(0, [1], lambda c: message, sim.algorithm.phases(0))]
    assert sim.reply_problems({1: (sim.begin_reply_check(1, honest, message, {}), honest)}, lambda c: message) == {}
    heavy = Reply(1, 3 * honest.num_samples, honest.payload)
    why = sim.reply_problems({1: (sim.begin_reply_check(1, heavy, message, {}), heavy)}, lambda c: message)[1]
    assert why == f"num_samples={3 * honest.num_samples}, but the client holds {honest.num_samples} training samples (a client that lies about its weight)"
