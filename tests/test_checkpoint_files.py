"""Crafted and malformed checkpoint files (issue #33, item 8): each is one
CheckpointError line that names the file, the value and what was expected, never a
traceback, and a refused checkpoint changes no file, in its run or in another one."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contrafl.cli import main
from contrafl.config import load_config
from contrafl.engine.checkpoint import CHECKPOINT_KEYS, FOREIGN, check_client_state, history_rows, load_safe, pack_history
from contrafl.engine.client_store import ClientStore
from contrafl.engine.run_dir import RunDir
from contrafl.engine.setup import prepare
from contrafl.engine.resume import load_checkpoint, read_only, resume
from contrafl.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = ["rounds=2", "num_clients=4", "local_epochs=1", "executor=sequential", "algorithm=moon"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A MOON run (every client keeps a state) as if stopped after round 1 of 2: its
    checkpoint and summary say 1 round."""
    run = tmp_path_factory.mktemp("base") / "run"
    assert main(["run", "--quiet", "--out", str(run), *SETTINGS]) == 0
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
    assert len(checkpoint["clients"]["files"]) == 4
    torch.save({**checkpoint, "round": 1, "history": pack_history(history_rows(checkpoint)[:1])}, run / "checkpoint.pt")
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "status": "interrupted", "checkpointed_rounds": 1}))
    return run


@pytest.fixture
def run(stopped, tmp_path) -> Path:
    """A copy of the stopped run, to edit."""
    return Path(shutil.copytree(stopped, tmp_path / "run"))


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (but the lock) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def _edit(run: Path, change) -> None:
    """Rewrite the run's checkpoint with ``change`` applied to its content."""
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
    torch.save(change(checkpoint), run / "checkpoint.pt")


def _refused(run: Path, *fragments: str) -> str:
    """Resume ``run``: one CheckpointError line containing ``fragments``, no file changed."""
    before = _files(run)
    run_dir = RunDir(run, resume=True)
    try:
        with pytest.raises(CheckpointError) as info:
            resume(prepare(load_config(run / "config.yaml")), run_dir)
    finally:
        run_dir.close()
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    for fragment in fragments:
        assert fragment in message, message
    assert _files(run) == before
    return message


def test_the_stopped_run_resumes(run, capsys):
    """The control: the unedited checkpoint resumes and completes the run."""
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_client_state_names_outside_the_run_are_refused(stopped, tmp_path):
    """A manifest naming ``../../other/client-state/...`` would let the resumed run read
    another run's client state and remove it at its next checkpoint."""
    one, other = (Path(shutil.copytree(stopped, tmp_path / name)) for name in ("one", "other"))
    victim = torch.load(other / "checkpoint.pt", weights_only=True)["clients"]["files"][0]
    crafted = f"../../other/client-state/{victim}"
    assert (one / "client-state" / crafted).resolve() == (other / "client-state" / victim).resolve()

    def point_elsewhere(checkpoint):
        checkpoint["clients"]["files"][0] = crafted
        return checkpoint

    _edit(one, point_elsewhere)
    before, mine = _files(other), _files(one)
    # through the CLI (a run that went on would remove the file at its next checkpoint):
    # one line, status 2, no traceback, nothing changed in either run
    proc = subprocess.run(
        [sys.executable, "-m", "contrafl", "run", "--resume", str(one)], capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert (other / "client-state" / victim).is_file() and _files(other) == before and _files(one) == mine
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("contrafl: error: ") and repr(crafted) in lines[0], proc.stderr
    message = _refused(one, str(one / "checkpoint.pt"), repr(crafted), "client-0-<k>.pt", FOREIGN)
    assert "client 0" in message and _files(other) == before


@pytest.mark.parametrize(
    "key,name,fragment",
    [
        (0, "/etc/passwd", "'/etc/passwd' for client 0"),
        (0, "client-0-1.pt/../client-0-1.pt", "for client 0"),
        (0, "client-1-1.pt", "'client-1-1.pt' for client 0"),  # another client's file
        (0, "client-0-99.pt", "k in 1..8"),  # a serial the store never reached
        (0, "client-0-0.pt", "k in 1..8"),
        (0, 5, "names 5 for client 0"),
        (7, "client-7-1.pt", "the key 7, expected a client id in 0..3"),  # not a client of the run
        (-1, "client--1-1.pt", "the key -1"),
        ("x", "client-x-1.pt", "the key 'x'"),
        ("1", "client-1-1.pt", "the key '1', expected a client id in 0..3 (each once)"),  # 1 and '1'
        (2.5, "client-2-1.pt", "the key 2.5"),
    ],
)
def test_manifest_entries_must_be_the_stores_own_names(run, key, name, fragment):
    def craft(checkpoint):
        checkpoint["clients"]["files"][key] = name
        return checkpoint

    _edit(run, craft)
    _refused(run, str(run / "checkpoint.pt"), fragment, FOREIGN)


def test_a_checkpoint_that_is_a_list_is_refused(run):
    torch.save([1, 2, 3], run / "checkpoint.pt")
    _refused(run, str(run / "checkpoint.pt"), "the file's content is a list of 3 items, expected a dict of format, round")


@pytest.mark.parametrize("key", CHECKPOINT_KEYS)
def test_a_checkpoint_without_an_entry_is_refused(run, key):
    _edit(run, lambda checkpoint: {k: v for k, v in checkpoint.items() if k != key})
    _refused(run, str(run / "checkpoint.pt"), f"has no {key!r} entry", FOREIGN)


def _set(path: str, value):
    """A change of the checkpoint entry at ``path`` (keys joined by dots)."""

    def change(checkpoint):
        *parents, last = path.split(".")
        node = checkpoint
        for key in parents:
            node = node[key]
        node[last] = value(node[last]) if callable(value) else value
        return checkpoint

    return change


def _rows(value):
    """A change of the checkpoint's metrics rows (packed as contrafl packs them)."""
    return _set("history", lambda packed: pack_history(value(history_rows({"history": packed}))))


class _Exploit:
    """A pickle that runs ``touch MARKER`` when it is unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize(
    "change,fragment",
    [
        (_set("format", 3), "has format 3, not 1 or 2: it was written by another contrafl version"),
        (_set("round", -1), "round is -1, expected the rounds done, a whole number in 0..2"),
        (_set("round", 3), "round is 3, expected"),
        (_set("round", "1"), "round is '1', expected"),
        (_set("round", 1.0), "round is 1.0, expected"),
        (_set("history", {}), "history is a dict with keys [], expected the metrics rows of the rounds done, pickled (bytes)"),
        (_set("history", b"not a pickle"), "history is not a pickle of plain values"),
        (_rows(lambda h: {}), "history is a dict with keys [], expected a list of 1 rows"),
        (_rows(lambda h: []), "history is a list of 0 items, expected a list of 1 rows"),
        (_rows(lambda h: [[1]]), "history row 1 is a list of 1 items, expected a metrics row"),
        (_rows(lambda h: [{**h[0], "round": 5}]), "history row 1 is a dict"),
        (_rows(lambda h: [{**h[0], "loss": torch.zeros(2)}]), "history is not a pickle of plain values (it names torch._utils"),
        (_rows(lambda h: [{**h[0], "loss": {1, 2}}]), "history row 1 is a dict"),
        (_set("server", [1]), "server is a list of 1 items, expected a dict of 'model'"),
        (_set("server.extras", None), "server is a dict with keys ['model', 'extras']"),
        (_set("server.model", lambda m: {**m, "extra.weight": torch.zeros(1)}), "server.model['extra.weight'] is a float32 tensor of shape [1], expected only tensors of the run's model"),
        (_set("server.model", lambda m: dict(list(m.items())[1:])), "server.model has no"),
        (_set("server.model", lambda m: {k: v[:1] if v.dim() else v for k, v in m.items()}), "expected a float32 tensor of shape"),
        (_set("server.model", lambda m: {k: v.double() for k, v in m.items()}), "is a float64 tensor"),
        (_set("server.model", lambda m: {k: v.tolist() for k, v in m.items()}), "is a list of"),
        (_set("server_optimizer", None), "server_optimizer is None, expected a dict of 'velocity'"),
        (_set("server_optimizer.velocity", {"nothing": torch.zeros(2)}), "server_optimizer.velocity['nothing']"),
        (_set("clients", []), "clients is a list of 0 items, expected {'files'"),
        (_set("clients.serial", -1), "clients is a dict with keys ['files', 'serial']"),
        (_set("comm_total", {"down": {}}), "comm_total is a dict with keys ['down'], expected {'down': {kind: bytes}"),
        (_set("comm_total.up", {"model": -5}), "comm_total is a dict"),
        (_set("wall_time_s", "long"), "wall_time_s is 'long', expected the seconds the run took"),
        (_set("wall_time_s", float("nan")), "wall_time_s is nan"),
        (_set("config", [1]), "config is a list of 1 items"),
        (_set("fingerprint", 7), "fingerprint is 7, expected the configuration's hash"),
        (_set("placement", [1]), "placement is a list of 1 items, expected a dict of client (0..3) -> the rank above 0"),
        (_set("placement", {4: 1}), "placement is a dict with keys [4], expected a dict of client (0..3)"),
        (_set("placement", {0: 0}), "placement is a dict with keys [0], expected"),
        (_set("placement", {0: "1"}), "placement is a dict with keys [0], expected"),
    ],
)
def test_wrong_values_are_refused(run, change, fragment):
    _edit(run, change)
    _refused(run, str(run / "checkpoint.pt"), fragment)


def test_a_history_that_would_run_code_runs_nothing(run, tmp_path):
    """The metrics rows are a pickle of their own, read without finding any function:
    one that calls ``os.system`` is refused and calls nothing."""
    marker = tmp_path / "pwned"
    _edit(run, _set("history", pickle.dumps([_Exploit(marker)])))
    _refused(run, "history is not a pickle of plain values (it names posix.system", FOREIGN)
    assert not marker.exists()


def test_a_checkpoint_of_format_1_resumes_as_its_own_format_would(run, stopped, tmp_path):
    """A run stopped by a contrafl that wrote the rows themselves (format 1) resumes and
    ends as the same run resumed from this version's checkpoint."""
    _edit(run, lambda checkpoint: {**checkpoint, "format": 1, "history": history_rows(checkpoint)})
    assert main(["run", "--quiet", "--resume", str(run)]) == 0
    now = Path(shutil.copytree(stopped, tmp_path / "now"))
    assert main(["run", "--quiet", "--resume", str(now)]) == 0
    assert (run / "metrics.jsonl").read_bytes() == (now / "metrics.jsonl").read_bytes()
    a, b = (torch.load(path / "checkpoint.pt", weights_only=True) for path in (run, now))
    assert a["format"] == 2 and history_rows(a) == history_rows(b) and len(history_rows(a)) == 2


def test_another_configuration_is_named_before_its_model_shapes(run):
    """A checkpoint of another model size is reported as another configuration."""
    _edit(run, _set("fingerprint", "0" * 16))
    _refused(run, "the checkpoint belongs to another configuration", "own config.yaml")


def _not_a_checkpoint(run: Path, write) -> str:
    write(run / "checkpoint.pt")
    message = _refused(run, f"checkpoint {run / 'checkpoint.pt'} cannot be loaded", "it is not a contrafl checkpoint")
    assert "could run code" not in message
    return message


def test_random_bytes_are_not_a_checkpoint(run):
    for seed in range(40):  # torch fails on random bytes in many ways (most: an unsupported pickle operand)
        data = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
        (run / "checkpoint.pt").write_bytes(data.numpy().tobytes())
        with pytest.raises(CheckpointError) as info:
            load_safe(run / "checkpoint.pt", "checkpoint")
        message = str(info.value)
        assert len(message.splitlines()) == 1 and "it is not a contrafl checkpoint" in message, message
        assert "could run code" not in message and "Weights only load failed" not in message, message
    _not_a_checkpoint(run, lambda p: None)  # the last of them, through a resume


def test_an_empty_file_is_not_a_checkpoint(run):
    assert "(the file is empty)" in _not_a_checkpoint(run, lambda p: p.write_bytes(b""))


def test_a_truncated_checkpoint_is_not_a_checkpoint(run):
    data = (run / "checkpoint.pt").read_bytes()
    message = _not_a_checkpoint(run, lambda p: p.write_bytes(data[: len(data) // 2]))
    assert "failed finding central directory" in message and "internal miniz error" not in message


def test_a_text_file_or_a_plain_pickle_is_not_a_checkpoint(run):
    _not_a_checkpoint(run, lambda p: p.write_text("round: 1\nserver: model\n"))
    message = _not_a_checkpoint(run, lambda p: p.write_bytes(pickle.dumps({"round": 1}, protocol=4)))
    assert "Unsupported operand" in message and "Weights only load failed" not in message


class _Object:
    pass


def test_only_a_refused_python_object_could_run_code(tmp_path):
    torch.save({"model": _Object()}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError) as info:
        load_safe(tmp_path / "c.pt", "checkpoint")
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert f"names the Python object {__name__}._Object" in message and "refused: loading could run code" in message


@pytest.mark.parametrize("state", [[1, 2], {"algorithm": {}}, {"algorithm": [], "optimizer": None}, {"algorithm": {}, "optimizer": 3}])
def test_a_client_state_that_is_not_an_entry_is_refused_where_it_is_read(tmp_path, state):
    store = ClientStore(1e9, tmp_path / "clients", keep=True)
    store.put(0, {"algorithm": {"w": torch.zeros(2)}, "optimizer": None})
    manifest = store.checkpoint()
    store.commit(manifest)
    path = tmp_path / "clients" / manifest["files"][0]
    torch.save(state, path)
    again = ClientStore(1e9, tmp_path / "clients", keep=True)
    again.restore(manifest, check_client_state)
    with pytest.raises(CheckpointError, match=f"client 0's state {re.escape(str(path))} is .*, expected a dict of 'algorithm'"):
        again.get(0)


def test_read_only_refuses_crafted_names_and_client_states(run):
    """``contrafl eval-repr``'s view of a run checks the manifest and the states it reads."""
    setup = prepare(load_config(run / "config.yaml"))
    checkpoint = load_checkpoint(run)
    checkpoint["clients"]["files"][0] = "../checkpoint.pt"
    with pytest.raises(CheckpointError, match="names '../checkpoint.pt' for client 0"):
        read_only(setup, run, checkpoint, [0])
    checkpoint = load_checkpoint(run)
    torch.save([1], run / "client-state" / checkpoint["clients"]["files"][1])
    before = _files(run)
    with pytest.raises(CheckpointError, match="client 1's state .* is a list of 1 items"):
        read_only(setup, run, checkpoint, [1])
    assert _files(run) == before


def test_eval_repr_reports_a_malformed_checkpoint_in_one_line(run, capsys):
    _edit(run, _set("server.model", lambda m: {k: v.double() for k, v in m.items()}))
    before = _files(run)
    assert main(["eval-repr", str(run), "--protocol", "knn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("contrafl: error: checkpoint ") and "float64 tensor" in err[0], err
    assert _files(run) == before
