"""A finished (or stopped) run extended to more rounds: `contrafl run --resume RUN rounds=N`.

The extended run's metrics.jsonl equals, byte for byte, that of a run started with
rounds=N where nothing depends on the total rounds; where something does (an
algorithm's schedule over them, the evaluation of the former last round), the extension
still runs, says what differs in one line and records it in summary.json.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from contrafl.algorithms.fedprox import FedProx
from contrafl.cli import main
from contrafl.engine.simulation import Simulation

TINY = ["dataset=digits", "num_clients=3", "local_epochs=1", "executor=sequential"]


def _run(path, *settings: str) -> None:
    assert main(["run", "--quiet", "--out", str(path), *TINY, *settings]) == 0


def _summary(path) -> dict:
    return json.loads((path / "summary.json").read_text())


def _fresh(tmp_path, rounds: int, settings) -> bytes:
    _run(tmp_path / "fresh", f"rounds={rounds}", *settings)
    return (tmp_path / "fresh" / "metrics.jsonl").read_bytes()


CASES = {
    "fedavg": ["algorithm=fedavg"],
    "moon": ["algorithm=moon"],  # client state (previous local models)
    "scaffold": ["algorithm=scaffold", "eval_personal=true"],  # client control variates
    "sampled": ["algorithm=fedprox", "sample_fraction=0.67"],  # 2 of 3 clients a round
    "dp": ["algorithm=fedavg", "sample_fraction=0.67", "dp=central", "dp.clip=0.5", "dp.noise_multiplier=0.5", "dp.noise=reproducible"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_extended_run_equals_a_fresh_run(tmp_path, case, capsys):
    settings = CASES[case]
    fresh = _fresh(tmp_path, 4, settings)
    run = tmp_path / "run"
    _run(run, "rounds=2", *settings)
    assert _summary(run)["status"] == "completed"
    capsys.readouterr()
    assert main(["run", "--resume", str(run), "rounds=4"]) == 0
    out, err = capsys.readouterr()
    assert f"extending {run} from 2 to 4 rounds, after round 2 of 4" in out
    assert "warning" not in err
    assert (run / "metrics.jsonl").read_bytes() == fresh
    assert yaml.safe_load((run / "config.yaml").read_text())["rounds"] == 4
    summary, clean = _summary(run), _summary(tmp_path / "fresh")
    assert summary["status"] == "completed" and summary["rounds_completed"] == summary["rounds"] == 4
    assert summary["fingerprint"] == clean["fingerprint"]
    assert summary["extended"] == {
        "from": 2, "to": 4, "equal_to_fresh_run": True, "why": None, "extensions": [{"from": 2, "to": 4, "after": 2}],
    }
    timing = [json.loads(line)["round"] for line in (run / "timing.jsonl").read_text().splitlines()]
    assert timing == [1, 2, 3, 4]
    if case == "dp":  # the ledger goes on: the same releases, the same epsilon as the fresh run's
        assert summary["dp"] == clean["dp"] and summary["dp"]["epsilon"] > 0
        assert (run / "dp_ledger.jsonl").read_bytes() == (tmp_path / "fresh" / "dp_ledger.jsonl").read_bytes()
    assert main(["run", "--resume", str(run), "rounds=4"]) == 0  # done: nothing to resume
    assert "nothing to resume" in capsys.readouterr().out


def test_extension_of_an_extended_run_and_of_a_stopped_one(tmp_path, capsys):
    settings = ["algorithm=moon", "sample_fraction=0.67"]
    fresh = _fresh(tmp_path, 5, settings)
    run = tmp_path / "run"
    _run(run, "rounds=2", *settings)
    assert main(["run", "--quiet", "--resume", str(run), "rounds=3"]) == 0
    assert main(["run", "--quiet", "--resume", str(run), "rounds=5"]) == 0
    assert (run / "metrics.jsonl").read_bytes() == fresh
    extended = _summary(run)["extended"]
    assert extended["from"] == 2 and extended["to"] == 5 and extended["equal_to_fresh_run"]
    assert extended["extensions"] == [{"from": 2, "to": 3, "after": 2}, {"from": 3, "to": 5, "after": 3}]

    # a run of 3 rounds stopped (Ctrl-C) in round 3: extended from its checkpoint of round 2
    stopped = tmp_path / "stopped"
    run_round = Simulation.run_round

    def interrupted(sim, t):
        if t == 2:
            raise KeyboardInterrupt
        return run_round(sim, t)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Simulation, "run_round", interrupted)
        assert main(["run", "--quiet", "--out", str(stopped), *TINY, "rounds=3", *settings]) == 130
    assert _summary(stopped)["status"] == "interrupted" and _summary(stopped)["checkpointed_rounds"] == 2
    assert main(["run", "--quiet", "--resume", str(stopped), "rounds=5"]) == 0
    assert (stopped / "metrics.jsonl").read_bytes() == fresh
    assert _summary(stopped)["extended"]["extensions"] == [{"from": 3, "to": 5, "after": 2}]
    assert _summary(stopped)["extended"]["equal_to_fresh_run"]


def test_an_extension_interrupted_before_its_first_checkpoint_resumes(tmp_path):
    """config.yaml already says rounds=4, the checkpoint is the 2-round run's: a plain
    --resume continues the extension."""
    settings = ["algorithm=scaffold"]
    fresh = _fresh(tmp_path, 4, settings)
    run = tmp_path / "run"
    _run(run, "rounds=2", *settings)
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "rounds": 4}, sort_keys=False))
    summary = _summary(run)
    (run / "summary.json").write_text(json.dumps({**summary, "status": "interrupted", "rounds": 4}))
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == fresh
    assert _summary(run)["extended"]["extensions"] == [{"from": 2, "to": 4, "after": 2}]


def test_what_depends_on_the_total_rounds_is_said_and_recorded(tmp_path, capsys, monkeypatch):
    reason = "FedProx's test schedule decays mu over the total rounds"
    monkeypatch.setattr(FedProx, "depends_on_total_rounds", classmethod(lambda cls, params: reason))
    run = tmp_path / "run"
    _run(run, "rounds=2", "algorithm=fedprox")
    capsys.readouterr()
    assert main(["run", "--quiet", "--resume", str(run), "rounds=4"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0] == (
        "contrafl: warning: the run extended from 2 to 4 rounds differs from a run started with rounds=4: "
        f"{reason}, and rounds 1-2 ran with rounds=2"
    )
    extended = _summary(run)["extended"]
    assert extended["equal_to_fresh_run"] is False and extended["why"] == f"{reason}, and rounds 1-2 ran with rounds=2"
    # the evaluation of the former last round, which eval_every=3 would not make
    monkeypatch.undo()
    run = tmp_path / "eval"
    _run(run, "rounds=2", "eval_every=3")
    capsys.readouterr()
    assert main(["run", "--quiet", "--resume", str(run), "rounds=4"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "round 2 of metrics.jsonl has the evaluation of the run's last round" in err[0]
    assert "eval_every=3" in err[0] and "the training is the same" in err[0]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert ["test_acc" in r for r in rows] == [False, True, True, True]
    assert _summary(run)["extended"]["equal_to_fresh_run"] is False


def test_fewer_rounds_and_other_changes_are_refused(tmp_path, capsys):
    run = tmp_path / "run"
    _run(run, "rounds=3", "algorithm=fedavg")
    before = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["run", "--resume", str(run), "rounds=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rounds=2 is fewer than the 3 rounds of" in err[0] and "to extend a run" in err[0]
    assert main(["run", "--resume", str(run), "rounds=5", "lr=0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lr=0.5 would change what the resumed run computes" in err[0]
    assert (run / "metrics.jsonl").read_bytes() == before
    assert yaml.safe_load((run / "config.yaml").read_text())["rounds"] == 3
    # a checkpoint of another configuration stays refused, also with more rounds
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "lr": 0.5}, sort_keys=False))
    assert main(["run", "--resume", str(run), "rounds=5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the checkpoint belongs to another configuration (lr: 0.01 -> 0.5)" in err[0]


def test_edited_extensions_in_the_checkpoint_are_refused(tmp_path, capsys):
    run = tmp_path / "run"
    _run(run, "rounds=2")
    assert main(["run", "--quiet", "--resume", str(run), "rounds=3"]) == 0
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
    assert checkpoint["extensions"] == [{"from": 2, "to": 3, "after": 2}]
    checkpoint["extensions"] = [{"from": 2, "to": 5, "after": 2}]  # not the checkpoint's rounds
    torch.save(checkpoint, run / "checkpoint.pt")
    capsys.readouterr()
    assert main(["run", "--quiet", "--resume", str(run), "rounds=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "extensions is a list of 1 items, expected" in err[0]
