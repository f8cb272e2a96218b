"""A deployment's settings are part of its run: recorded when it starts
(``flower/deployment.json``) and kept by ``contrafl deploy --resume``, which refuses, in
one line and before anything starts, to drop TLS, SuperNode authentication or secure
aggregation unless asked to with --allow-weaker-security. (The resumed deployment
itself: tests/test_flower_faults.py.)"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr")

from contrafl.cli import main  # noqa: E402
from contrafl.config import load_config  # noqa: E402
from contrafl.errors import ConfigError  # noqa: E402
from contrafl.flower.deploy import SETTINGS, Settings, prepare_run  # noqa: E402

SMALL = ["algorithm=fedavg", "num_clients=3", "rounds=2", "local_epochs=1"]


def deployed(tmp_path, settings: Settings):
    """A run directory as `contrafl deploy` leaves it once its deployment started."""
    run = tmp_path / "run"
    prepare_run(load_config(None, SMALL), run)
    settings.write(run)
    return run


@pytest.mark.parametrize("recorded, asked, setting", [
    (Settings(tls=True), ["--insecure"], "TLS, which --insecure"),
    (Settings(tls=True, auth=True), ["--no-auth"], "SuperNode authentication, which --no-auth"),
    (Settings(secure_aggregation=True, min_replies=3), ["--no-secure-aggregation"], "secure aggregation, which --no-secure-aggregation"),
])
def test_a_resume_that_would_drop_a_security_setting_is_refused_in_one_line(tmp_path, capsys, recorded, asked, setting):
    run = deployed(tmp_path, recorded)
    assert main(["deploy", "--resume", str(run), *asked]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"contrafl: error: --resume {run}: the run was deployed with {setting} would drop; "
        f"leave {asked[0]} out to keep it, or add --allow-weaker-security to resume without it\n"
    )
    assert not (run / "flower" / "logs").exists()  # nothing started


def test_a_resume_keeps_what_is_not_given_and_takes_what_is():
    recorded = Settings(tls=True, auth=True, secure_aggregation=True, round_timeout=90.0, min_replies=3, node_data=("a", "b", "c"))
    assert recorded.overridden("run", {"tls": None, "auth": None, "round_timeout": None}, False) == recorded
    assert recorded.overridden("run", {"round_timeout": 30.0, "min_replies": 4}, False) == Settings(
        tls=True, auth=True, secure_aggregation=True, round_timeout=30.0, min_replies=4, node_data=("a", "b", "c"))
    weaker = recorded.overridden("run", {"tls": False, "auth": False}, True)
    assert not weaker.tls and not weaker.auth and weaker.secure_aggregation
    assert Settings().overridden("run", {"tls": True, "secure_aggregation": True}, False) == Settings(tls=True, secure_aggregation=True)


def test_settings_round_trip_and_a_run_deployed_before_they_were_recorded(tmp_path):
    settings = Settings(tls=True, auth=False, secure_aggregation=True, round_timeout=45.5, min_replies=3, wait_nodes=30.0,
                        supernode_poll=0.5, node_data=("/srv/a", "/srv/b"))
    settings.write(tmp_path)
    assert Settings.read(tmp_path) == settings
    legacy = tmp_path / "legacy"
    (legacy / "flower" / "certs").mkdir(parents=True)
    (legacy / "flower" / "node-data.json").write_text(json.dumps(["/x", "/y"]))
    assert Settings.read(legacy) == Settings(tls=True, node_data=("/x", "/y"))


@pytest.mark.parametrize("text", ["[1, 2]", '{"tls": "yes"}', '{"tls": true, "colour": 3}', "{", '{"node_data": [1]}'])
def test_a_malformed_settings_file_is_one_line(tmp_path, text):
    (tmp_path / "flower").mkdir()
    (tmp_path / "flower" / SETTINGS).write_text(text)
    with pytest.raises(ConfigError, match=rf"^--resume {tmp_path}: {tmp_path / 'flower' / SETTINGS} is not a deployment's settings \(.+\); "):
        Settings.read(tmp_path)


def test_a_refusal_tells_the_server_no_path_of_the_site(tmp_path, capsys):
    """The SuperNode's log has the whole message; the server gets it with the node
    config's paths replaced by their keys."""
    from types import SimpleNamespace

    from contrafl.errors import DataError
    from contrafl.flower.node import reported

    data = tmp_path / "hospital" / "images"
    context = SimpleNamespace(node_config={"partition-id": 1, "data": str(data) + "/", "state-dir": str(tmp_path / "state")})
    exc = DataError(f"{data / 'train' / 'horse' / '1.png'}: class 'horse' is not in dataset.classes; state in {tmp_path / 'state'}")
    told = reported(exc, context)
    assert told == "<data>/train/horse/1.png: class 'horse' is not in dataset.classes; state in <state-dir>"
    assert capsys.readouterr().err == f"contrafl: {exc}\n"
