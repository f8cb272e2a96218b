"""Byzantine SuperNodes (docs/flower.md, "Byzantine SuperNodes"): a SuperNode whose node
config names an attack crafts its own reply with the simulator's attack code, from its
own update alone, and poisons its own data; the server's config says attack=none and
its robust aggregator meets the crafted reply as any other. A run with such a node is
the simulation of its config with ``attack.clients=[K] attack.omniscient=false``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from contrafl.cli import main  # noqa: E402
from contrafl.config import load_config  # noqa: E402
from contrafl.errors import ConfigError  # noqa: E402
from contrafl.flower.byzantine import split  # noqa: E402
from contrafl.flower.deploy import Settings, shared_cores  # noqa: E402
from contrafl.flower.node import NodeSettings  # noqa: E402
from conftest import torch_threads  # noqa: E402
from test_flower_server import SETTINGS, rows, run_on  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "task_identity", "worker_dir")

ROBUST = [*SETTINGS, "aggregator=median"]
SIMULATED = ["attack.clients=[1]", "attack.omniscient=false"]
"""What the simulation of a run with client 1's SuperNode attacking adds to its config."""


def accuracies(path: Path) -> list[float]:
    return [row["test_acc"] for row in rows(path)]


def simulated(path: Path, settings: list[str]) -> list[dict]:
    """The rows of `contrafl run` of ``settings``."""
    assert main(["run", "--quiet", "--out", str(path), *settings]) == 0
    return rows(path)


def nodes(attack: dict, worker: bool = False) -> dict[int, dict]:
    """Three SuperNodes, client 1's with the node config keys ``attack``."""
    return {11: {"partition-id": 0, "worker": worker}, 12: {"partition-id": 1, "worker": worker, **attack}, 13: {"partition-id": 2, "worker": worker}}


@pytest.mark.parametrize("attack, keys", [
    ("sign_flipping", {"attack": "sign_flipping"}),
    ("scaling", {"attack": "scaling", "attack-scale": 5}),
    ("label_flipping", {"attack": "label_flipping", "attack-rounds": "[2]"}),
])
def test_an_attacking_supernode_gives_the_simulation_of_its_non_omniscient_attacker(tmp_path, attack, keys):
    """The ServerApp's loop on three SuperNodes (in this process), client 1's attacking,
    aggregator=median: the rows of `contrafl run` with attack.clients=[1]
    attack.omniscient=false, but for what only the simulator knows (``attackers`` and the
    aggregator's precision and recall against them)."""
    options = [f"attack.{k[len('attack-'):]}={v}" for k, v in keys.items() if k != "attack"]
    extra = [f"attack={attack}", "attack.clients=[1]", *(["attack.omniscient=false"] if attack == "sign_flipping" else []), *options]
    expected = simulated(tmp_path / "sim", [*ROBUST, *extra])
    assert run_on(tmp_path / "flower", nodes(keys), min_replies=3, settings=ROBUST)["status"] == "completed"
    got = rows(tmp_path / "flower")
    assert load_config(tmp_path / "flower" / "config.yaml").attack.name == "none"  # the server knows nothing of it
    assert all(row["attackers"] == [1] for row in expected) and not any("attackers" in row for row in got)
    known = [{k: v for k, v in row.items() if k not in ("attackers", "aggregator")} for row in expected]
    assert got == known
    honest = simulated(tmp_path / "honest", ROBUST)
    assert [r["train_loss"] for r in honest] != [r["train_loss"] for r in got]  # the attack changed the run


def context(node_config: dict) -> Context:
    return Context(1, 11, node_config, RecordDict(), {"run-dir": "/nowhere"})


@pytest.mark.parametrize("node_config, message", [
    ({"attack-scale": 5}, "node config attack-scale=5 sets an option of no attack; add attack='NAME'"),
    ({"attack.scale": 5}, "node config key 'attack.scale' is not read: a SuperNode's attack options are written attack-OPTION"),
    ({"attack": "scaling", "attack-clients": "[0]"}, "node config attack-clients='[0]': a Byzantine SuperNode attacks as the client it serves"),
    ({"attack": "scaling", "attack-fraction": 0.3}, "node config attack-fraction=0.3: a Byzantine SuperNode attacks as the client it serves"),
    ({"attack": "sign_flipping", "attack-omniscient": True}, "node config attack-omniscient=true: a SuperNode sees only its own update"),
    ({"attack": 3}, "node config attack=3 is not an attack's name"),
])
def test_node_config_attack_keys_that_cannot_work_are_one_line(node_config, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
        NodeSettings.of(context({"partition-id": 0, **node_config}))


def test_node_config_attack_keys_are_read():
    settings = NodeSettings.of(context({"partition-id": 2, "attack": "backdoor", "attack-target": 3, "attack-rounds": [2, 3],
                                        "attack-omniscient": False}))
    assert (settings.attack, settings.attack_options) == ("backdoor", {"target": 3, "rounds": "[2,3]"})
    assert NodeSettings.from_dict(json.loads(json.dumps(settings.as_dict()))) == settings  # as the worker gets them
    assert NodeSettings.of(context({"partition-id": 0, "attack": "none"})).attack is None


@pytest.mark.parametrize("keys, problem", [
    ({"attack": "alie"}, "node config attack='alie': attack=alie needs the spread of several updates"),
    ({"attack": "scaling"}, "node config attack='scaling': attack=scaling scales the update by n / server_lr unless attack-scale is set"),
    ({"attack": "gaussian", "attack-sigma": -1}, "node config attack='gaussian' attack-sigma=-1: attack-sigma=-1"),
    ({"attack": "signflipping"}, "node config attack='signflipping': attack='signflipping' is invalid"),
    ({"attack": "gaussian", "attack-scale": 2}, "node config attack='gaussian' attack-scale=2: attack-scale has no effect with attack=gaussian"),
])
def test_a_supernode_whose_attack_cannot_work_is_not_used_and_says_why(tmp_path, capsys, keys, problem):
    """Client 1's SuperNode says why in one line, at the server's first query (as a
    worker does: tests/test_flower_worker.py); the run goes on with the others."""
    run = tmp_path / "run"
    assert run_on(run, nodes(keys), min_replies=2, settings=[*SETTINGS, "rounds=1"])["status"] == "completed"
    (row,) = rows(run)
    assert [x["client"] for x in row["lost"]] == [1] and row["lost"][0]["reason"].startswith(problem), row["lost"]
    assert f"SuperNode 12 (partition-id=1) is not used: {problem}" in capsys.readouterr().out


def test_a_server_that_simulates_attackers_refuses_attacking_supernodes(tmp_path, capsys):
    run = tmp_path / "run"
    assert run_on(run, nodes({"attack": "scaling", "attack-scale": 2}), min_replies=2, settings=[*SETTINGS, "rounds=1", "attack=gaussian", "attack.clients=[0]"])["status"] == "completed"
    assert rows(run)[0]["lost"][0]["reason"].startswith(
        "node config attack='scaling', and the run's config.yaml has attack=gaussian, whose attackers the server simulates")


@pytest.mark.parametrize("settings, message", [
    ([], "--byzantine-nodes makes the config's attackers SuperNodes, and the config has attack=none"),
    (["attack=sign_flipping", "attack.clients=[1]"], "--byzantine-nodes: attack=sign_flipping sees the round's honest updates unless attack.omniscient=false"),
    (["attack=gaussian", "attack.choice=per_round"], "--byzantine-nodes: attack.choice=per_round draws the attackers each round"),
    (["attack=min_max", "attack.omniscient=false"], "--byzantine-nodes: attack=min_max needs the spread of several updates"),
    (["attack=model_replacement"], "--byzantine-nodes: attack=model_replacement scales the update by n / server_lr unless attack.scale is set"),
])
def test_deploy_byzantine_nodes_refuses_what_a_supernode_cannot_do(tmp_path, capsys, settings, message):
    assert main(["deploy", "--byzantine-nodes", "--out", str(tmp_path / "run"), *SETTINGS, *settings]) == 2
    assert capsys.readouterr().err.startswith(f"contrafl: error: {message}")
    assert not (tmp_path / "run" / "flower").exists()  # nothing started


def test_byzantine_nodes_split_the_attack_from_the_servers_config():
    cfg = load_config(None, [*SETTINGS, "num_clients=10", "attack=backdoor", "attack.fraction=0.2", "attack.target=3", "attack.rounds=[2,4]"])
    server, keys, attackers = split(cfg)
    assert server.attack.name == "none" and server.num_clients == 10
    assert keys == {"attack": "backdoor", "attack-rounds": "[2,4]", "attack-target": 3, "attack-poison": 0.5, "attack-trigger": 3}
    from contrafl.engine.attacking import Attack

    assert list(attackers) == Attack.of(cfg).fixed and len(attackers) == 2  # the simulator's draw from the seed


@pytest.mark.slow  # real SuperLink and SuperNode processes
def test_contrafl_deploy_with_a_byzantine_supernode_equals_its_simulation(tmp_path, capsys):
    """The issue's acceptance: `contrafl deploy --byzantine-nodes` of a config with
    attack=sign_flipping attack.clients=[1] attack.omniscient=false and aggregator=median:
    three SuperNodes, client 1's with attack='sign_flipping' in its node config (the only
    one), the server's config.yaml attack=none; its test accuracies are those of `contrafl
    run` of the same config (its rows too, but for the simulator's own record of the
    attackers), and differ from the honest run's."""
    settings = [*ROBUST, "attack=sign_flipping", *SIMULATED]
    run = tmp_path / "flower-run"
    assert main(["deploy", "--byzantine-nodes", "--round-timeout", "120", "--out", str(run), *settings]) == 0
    assert ", Byzantine SuperNode of client 1 (sign_flipping);" in capsys.readouterr().out
    configs = [(run / "flower" / "config" / f"node-{i}.toml").read_text() for i in range(3)]
    assert ['attack = "sign_flipping"' in text for text in configs] == [False, True, False]
    assert load_config(run / "config.yaml").attack.name == "none"
    assert Settings.read(run).attackers == (1,) and Settings.read(run).node_attack == {"attack": "sign_flipping"}
    logs = sorted((run / "flower" / "logs").glob("*.log"))
    assert not [p.name for p in logs if "Traceback" in p.read_text()]
    with torch_threads(shared_cores(3)[0]["threads"]):  # each client's threads in the deployment
        expected = simulated(tmp_path / "sim", settings)
        honest = simulated(tmp_path / "honest", ROBUST)
    got = rows(run)
    assert accuracies(run) == [row["test_acc"] for row in expected] != [row["test_acc"] for row in honest]
    assert got == [{k: v for k, v in row.items() if k not in ("attackers", "aggregator")} for row in expected]


def test_deploy_prepare_only_names_the_byzantine_supernodes_node_config(tmp_path, capsys):
    """Several machines: the commands say which SuperNodes add which attack keys; the
    server's config.yaml has no attack."""
    run = tmp_path / "run"
    assert main(["deploy", "--prepare-only", "--insecure", "--byzantine-nodes", "--out", str(run), *ROBUST,
                 "attack=scaling", "attack.scale=5", "attack.clients=[0,2]", "attack.rounds=[2]"]) == 0
    out = capsys.readouterr().out
    assert ("(Byzantine SuperNodes: the SuperNodes of clients 0, 2 add attack='scaling' attack-rounds='[2]' attack-scale=5.0 "
            "to its --node-config; the server's config.yaml says attack=none") in out
    assert load_config(run / "config.yaml").attack.name == "none"
    from flwr.common.config import parse_config_args  # what flower-supernode --node-config does with them

    keys = out.split(" add ")[1].split(" to its --node-config")[0]
    settings = NodeSettings.of(context(parse_config_args([f"partition-id=0 {keys}"])))
    assert (settings.attack, settings.attack_options) == ("scaling", {"rounds": "[2]", "scale": 5.0})


def test_settings_keep_the_byzantine_supernodes_for_a_resume(tmp_path):
    settings = Settings(attackers=(0, 2), node_attack={"attack": "scaling", "attack-scale": 5.0})
    settings.write(tmp_path)
    assert Settings.read(tmp_path) == settings
