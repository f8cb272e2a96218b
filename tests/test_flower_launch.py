"""Tests of :mod:`contrafl.flower.launch`: real local Flower deployments running the echo app
in ``tests/flower_echo_app`` (about 25 s each), plus fast checks of TOML quoting and errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'contrafl[flower]')")

from flwr.common.config import parse_config_args  # noqa: E402

from contrafl.errors import ConfigError  # noqa: E402
from contrafl.flower.lifetime import descendants  # noqa: E402
from contrafl.flower.launch import (  # noqa: E402
    FLWR_EXECUTABLES,
    FlowerLaunchError,
    LocalDeployment,
    oversubscribed,
    toml_document,
    toml_value,
)

ECHO_APP = Path(__file__).parent / "flower_echo_app"
# Values that an inline flwr ``k=v`` string cannot carry: spaces, both quote kinds, a
# backslash, a newline, '=' and a '.toml' suffix.
LABEL = """two words "double" 'single' back\\slash
new line a=b x.toml"""
MESSAGE = """it's a "message" with = and \\"""


def _stat(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for a reaper is not)."""
    stat = _stat(pid)
    return stat is not None and stat[stat.rindex(")") + 2] != "Z"


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _run_echo(tmp_path: Path, tls: bool) -> None:
    """Start 2 nodes (insecure: kill one's ClientApp runner), run the echo app, check its output, restart a node (and, insecure,
    the SuperLink), check that stop() leaves no process behind. The nodes are
    ``contrafl-supernode`` s, whose ClientApps of any app run in one process each (the
    echo app's replies count the rounds in ``context.state``, which its SuperNode keeps
    from one message to the next)."""
    out = tmp_path / "out.json"
    dep = LocalDeployment(
        tmp_path / "deploy", 2, tls=tls, node_configs=[{"label": LABEL}, {"label": "plain"}], supernode_poll=0.2,
    )
    with dep:
        assert all(dep.node_ids)
        if not tls:  # a runner killed: its SuperNode starts a new one, whose ClientApps answer the run's messages
            (runner,) = [pid for pid, _ in descendants(dep._nodes[1].popen.pid) if _argv(pid)[1:3] == ["-m", "contrafl.flower.runner"]]
            os.kill(runner, signal.SIGKILL)
        for node in dep._nodes:  # two SuperNodes with torch's default threads: more than the cores
            environ = Path(f"/proc/{node.popen.pid}/environ").read_bytes().split(b"\0")
            assert f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}".encode() in environ
        assert (tmp_path / "deploy" / "logs" / "superlink.log").is_file()
        result = dep.run(ECHO_APP, {"out": str(out), "message": MESSAGE}, timeout=90)
        assert result.returncode == 0 and result.status == "finished:completed"
        assert str(result.run_id) in result.log_path.read_text()
        if not tls:
            log = (tmp_path / "deploy" / "logs" / "supernode-1.log").read_text()
            assert f"its ClientApp runner (pid {runner}) was killed by SIGKILL" in log and "starting a new one" in log
        print(f"echo run ({'TLS' if tls else 'insecure'}): {result.seconds:.1f} s")

        old_id = dep.node_ids[1]
        dep.kill_node(1, signal.SIGTERM)
        assert dep.node_ids[1] is None
        new_id = dep.restart_node(1)
        assert new_id != old_id and dep.node_ids[1] == new_id
        online = {int(n["node-id"]) for n in dep.list_nodes() if n["status"] == "online"}
        assert {dep.node_ids[0], new_id} <= online

        if not tls:
            dep.kill_superlink()
            dep.restart_superlink()  # restarts the nodes as well: they exit on HTTP 401
            online = {int(n["node-id"]) for n in dep.list_nodes() if n["status"] == "online"}
            assert set(dep.node_ids) == online and new_id not in online

        pids = dep.pids()
        assert len(pids) >= 6  # SuperLink, 2 SuperNodes and a ClientApp runner for each
    assert pids and not [p for p in pids if _running(p)]
    assert dep.pids() == set()
    restarts = [(tmp_path / "deploy" / "logs" / f"supernode-{i}.log").read_text().count("starting a new one") for i in (0, 1)]
    assert restarts == [0, 1 if not tls else 0]  # none when a SuperNode was stopped (SIGTERM) or exited (its SuperLink restarted)

    data = json.loads(out.read_text())
    assert data["message"] == MESSAGE
    replies = {(r["round"], r["partition-id"]): r for r in data["replies"]}
    assert sorted(replies) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for (rnd, partition), reply in replies.items():
        assert reply["counter"] == rnd
        assert reply["num-partitions"] == 2
        assert reply["message"] == MESSAGE
        assert reply["label"] == (LABEL if partition == 0 else "plain")


def test_supernodes_wait_passively_when_their_threads_exceed_the_cores(monkeypatch) -> None:
    monkeypatch.setattr("contrafl.flower.launch.cpu_cores", lambda: 4)
    assert oversubscribed([{}, {}])  # torch's default: 4 threads each
    assert oversubscribed([{"threads": 2}, {"threads": 3}])
    assert not oversubscribed([{"threads": 2}, {"threads": 2}]) and not oversubscribed([{"threads": "1"}] * 4)
    assert not oversubscribed([{}]) and oversubscribed([{"threads": "x"}, {"threads": 1}])  # not a number: the default


@pytest.mark.slow
def test_insecure_deployment_runs_echo_app(tmp_path: Path) -> None:
    _run_echo(tmp_path, tls=False)


@pytest.mark.parametrize(
    "value", [LABEL, MESSAGE, "", "ünï ☃ 😀", "\x00\x1f\x7f", 0, -3, 2**62, 1.5, 1e-5, -0.0,
              float("inf"), True, False],
)
def test_toml_values_round_trip_through_flwr(value: object, tmp_path: Path) -> None:
    config = {"partition-id": 1, "dotted.key": "k", "key with space": value, "v": value}
    path = tmp_path / "c.toml"
    path.write_text(toml_document(config))
    assert tomllib.loads(path.read_text()) == config
    parsed = parse_config_args([str(path)])
    assert parsed == config and type(parsed["v"]) is type(value)


def test_toml_value_formats() -> None:
    assert toml_value("a b") == '"a b"'
    assert toml_value('say "hi"') == '"say \\"hi\\""'
    assert toml_value(3) == "3" and toml_value(3.0) == "3.0" and toml_value(True) == "true"
    with pytest.raises(ConfigError, match="str, int, float or bool"):
        toml_value([1, 2])  # type: ignore[arg-type]


def test_bad_arguments_are_rejected_before_starting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one per node"):
        LocalDeployment(tmp_path, 2, node_configs=[{}])
    with pytest.raises(ConfigError, match="str, int, float or bool"):
        LocalDeployment(tmp_path, 1, node_configs=[{"x": None}])  # type: ignore[dict-item]
    assert not (tmp_path / "logs").exists()


def test_missing_flwr_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(FlowerLaunchError, match=r'pip install "contrafl\[flower\]"') as err:
        LocalDeployment(tmp_path, 1, python_bin_dir=tmp_path).start()
    assert "\n" not in str(err.value)


def test_early_exit_shows_log_tail(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in FLWR_EXECUTABLES:
        (bin_dir / name).write_text("#!/bin/sh\necho 'boom: cannot start'\nexit 3\n")
        (bin_dir / name).chmod(0o755)
    with pytest.raises(FlowerLaunchError, match="superlink exited with status 3 while starting") as err:
        LocalDeployment(tmp_path / "deploy", 1, python_bin_dir=bin_dir).start()
    assert "boom: cannot start" in str(err.value)
    assert str(tmp_path / "deploy" / "logs" / "superlink.log") in str(err.value)


def test_port_in_use_is_reported(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(FlowerLaunchError, match=f"127.0.0.1:{port}"):
            LocalDeployment(tmp_path, 1, port=port).start()


def test_certificates_name_the_given_hosts_and_only_those(tmp_path: Path) -> None:
    from cryptography import x509

    from contrafl.flower.tls import LOCAL_HOSTS, make_certificates

    def names(files) -> set[str]:
        cert = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {*san.get_values_for_type(x509.DNSName), *(str(a) for a in san.get_values_for_type(x509.IPAddress))}

    assert names(make_certificates(tmp_path / "local")) == set(LOCAL_HOSTS)
    assert names(make_certificates(tmp_path / "server", ["server.example.org", "10.0.0.5", "fd00::1"])) == {"server.example.org", "10.0.0.5", "fd00::1"}
    with pytest.raises(ConfigError, match="server host 'no/such host' is neither an IP address nor a DNS name"):
        make_certificates(tmp_path / "bad", ["no/such host"])
    assert not (tmp_path / "bad").exists()


def test_the_servers_output_is_echoed_without_colour_codes_off_a_terminal_and_without_empty_log_lines() -> None:
    from contrafl.flower.launch import echoed

    coloured = "\x1b[92mINFO \x1b[0m:      Start `flwr-serverapp` process\n"
    assert echoed(coloured, terminal=False) == "INFO :      Start `flwr-serverapp` process\n"
    assert echoed(coloured, terminal=True) == coloured
    assert echoed("\x1b[92mINFO \x1b[0m:      \n", terminal=False) is None
    assert echoed("round 1/1  |####|  loss 2.19\n", terminal=False) == "round 1/1  |####|  loss 2.19\n"


def test_flowers_exit_code_notice_after_a_serverapp_error_is_not_echoed() -> None:
    """contrafl's ServerApp says its error in one line; flwr's notice that follows is
    kept in the log, not echoed."""
    from contrafl.flower.launch import echoed

    for line in ["\x1b[91mERROR \x1b[0m:     Exit Code: 201\n", "\n", "An unhandled exception occurred in the ServerApp.\n",
                 "For more information, visit: <https://flower.ai/docs/framework/1.41/en/ref-exit-codes/201.html>\n"]:
        assert echoed(line, terminal=False) is None, line
    error = "\x1b[91mERROR \x1b[0m:     contrafl: error: client 2's update in round 2 was rejected\n"
    assert echoed(error, terminal=False) == "ERROR :     contrafl: error: client 2's update in round 2 was rejected\n"
