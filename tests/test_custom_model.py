"""``model=FILE.py:FACTORY`` / ``model=MODULE:FACTORY``: the user's encoder wrapped as the
built-in backbones, one-line errors for every way it can be wrong, a fingerprint that
follows the file, resumable runs, and the vectorization probe. The encoder is the one of
docs/extending.md, read from the page."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from contrafl.cli import main
from contrafl.config import Component, Config, fingerprint, load_config
from contrafl.engine.setup import check_vectorizable, resolve
from contrafl.errors import ConfigError
from contrafl.models.base import FedModel
from contrafl.models.custom import vectorizable
from contrafl.models.build import build_model, model_spec
from test_resume import KILLER

DOCS = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def docs_file(name: str) -> str:
    """The code block of docs/extending.md marked ``<!-- file: name -->``."""
    match = re.search(rf"<!-- file: {re.escape(name)} -->\n```\w*\n(.*?)```\n", DOCS.read_text(), re.S)
    assert match, f"docs/extending.md has no block for {name}"
    return match.group(1)


SMALL = ["dataset=digits", "rounds=1", "local_epochs=1", "num_clients=3", "batch_size=32", "executor=sequential", "knn_k=5"]


@pytest.fixture
def nets(tmp_path) -> Path:
    path = tmp_path / "nets.py"
    path.write_text(docs_file("nets.py"))
    return path


def run(out: Path, *settings: str) -> int:
    return main(["run", "--quiet", "--out", str(out), *settings])


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "algorithm,extra",
    [
        ("moon", []),
        ("fedcrl", []),
        ("fedu2", ["model.projection_hidden=16", "model.projection_dim=8", "algorithm.predictor_hidden=16"]),
    ],
)
def test_runs_with_the_users_encoder(tmp_path, nets, algorithm, extra):
    out = tmp_path / "run"
    assert run(out, f"model={nets}:make_encoder", "model.width=32", f"algorithm={algorithm}", *SMALL, *extra) == 0
    (row,) = rows(out)
    assert row["train_loss"] == row["train_loss"]  # finite, not NaN
    model = (out / "config.yaml").read_text()
    assert f"name: {nets}:make_encoder" in model and "width: 32" in model


def test_relative_path_is_recorded_absolute_and_options_are_converted(tmp_path, nets, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve(load_config(None, ["model=./nets.py:make_encoder", "model.width=16", "model.projection=false"]))
    assert cfg.model.name == f"{nets}:make_encoder"
    assert cfg.model.options["width"] == 16 and cfg.model.options["projection"] is False
    model = build_model(cfg.model.name, (64,), 10, cfg.model.options)
    assert model.feature_dim == 16 and model(torch.zeros(3, 64)).logits.shape == (3, 10)


def test_factory_gets_input_shape_num_classes_and_yaml_values(tmp_path):
    path = tmp_path / "shapes.py"
    path.write_text(textwrap.dedent(
        """
        from torch import nn
        seen = {}

        def make(input_shape, num_classes, sizes, scale=None):
            seen.update(input_shape=input_shape, num_classes=num_classes, sizes=sizes, scale=scale)
            return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], sizes[-1]))
        """
    ))
    spec = model_spec(f"{path}:make")
    model = build_model(spec.name, (64,), 7, {"sizes": "[8, 4]", "scale": "0.5"})
    seen = sys.modules[spec.features.args[1].__module__].seen
    assert seen == {"input_shape": (64,), "num_classes": 7, "sizes": [8, 4], "scale": 0.5}
    assert model.feature_dim == 4


BAD = textwrap.dedent(
    """
    import torch
    from torch import nn

    def raises(width: int = 3):
        raise ValueError("width must be even")

    def not_module():
        return 42

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("kaboom")

    def image():
        return nn.Unflatten(1, (4, 16))

    def batch_sum():
        return nn.Sequential(nn.Flatten(0))

    def pair():
        return nn.ModuleList()

    def needs(width):
        return nn.Flatten()

    def takes_dropout(dropout=0.1):
        return nn.Flatten()

    def hidden_kw(**kwargs):
        return nn.Linear(64, 4, bias=True, **kwargs)

    NOT_CALLABLE = 3
    """
)


@pytest.mark.parametrize(
    "settings,fragment",
    [
        (["model=./missing.py:make"], "missing.py does not exist"),
        (["model=no_such_module_xyz:make"], "no module named 'no_such_module_xyz'"),
        (["model=./syntax.py:make"], "syntax.py line 1: SyntaxError"),
        (["model=./fails.py:make"], "importing {tmp}/fails.py raised KeyError: 'oops' at {tmp}/fails.py line 3"),
        (["model=./bad.py:nope"], "has no attribute 'nope'"),
        (["model=./bad.py:NOT_CALLABLE"], "NOT_CALLABLE in {tmp}/bad.py is not callable (type int)"),
        (["model=./bad.py:raises"], "the factory raises() raised ValueError: width must be even at {tmp}/bad.py line 6"),
        (["model=./bad.py:not_module"], "returned a value of type int, expected a torch.nn.Module"),
        (["model=./bad.py:Boom"], "forward pass on a batch of shape [2, 64] (the dataset's samples) raised RuntimeError: kaboom"),
        (["model=./bad.py:image"], "returned shape [2, 4, 16] for a batch of shape [2, 64], expected [2, D] (flat features); flatten them, e.g. end the encoder with nn.Flatten()"),
        (["model=./bad.py:batch_sum"], "returned shape [128] for a batch of shape [2, 64]"),
        (["model=./bad.py:pair"], "raised NotImplementedError"),
        (["model=./bad.py:image", "model.widht=3"], "unknown option 'model.widht' for model {tmp}/bad.py:image: its factory is image()"),
        (["model=./bad.py:raises", "model.widht=3"], "unknown option 'model.widht' (did you mean 'width'?)"),
        (["model=./bad.py:raises", "model.width=abc"], "model.width='abc' is invalid: expected an integer"),
        (["model=./bad.py:needs"], "needs model.width: its factory is needs(width)"),
        (["model=./bad.py:takes_dropout"], "parameter 'dropout' has the name of the head option model.dropout"),
        (["model=./bad.py:hidden_kw", "model.colour=3"], "got an unexpected keyword argument 'colour'; the factory is hidden_kw(**kwargs)"),
        (["model=./bad.py:image", "model.input_shape=[3]"], "model.input_shape is set by contrafl"),
        (["model=./bad.py:"], "expected MODULE:FACTORY or FILE.py:FACTORY"),
    ],
)
def test_bad_user_code_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, settings, fragment):
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "syntax.py").write_text("def make(:\n    pass\n")
    (tmp_path / "fails.py").write_text("import torch\n\nraise KeyError('oops')\n")
    monkeypatch.chdir(tmp_path)
    assert run(tmp_path / "run", *settings, *SMALL) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("contrafl: error: "), err
    assert fragment.format(tmp=tmp_path) in err[0]
    assert not (tmp_path / "run").exists()


def test_errors_through_the_command_line_have_no_traceback(tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    proc = subprocess.run(
        [sys.executable, "-m", "contrafl", "run", "--out", str(tmp_path / "run"), "model=bad.py:image", *SMALL],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "nn.Flatten()" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_fingerprint_follows_the_file(tmp_path, nets):
    cfg = resolve(load_config(None, [f"model={nets}:make_encoder", "device=cpu"]))
    before = fingerprint(cfg)
    assert fingerprint(cfg.to_dict()) == before  # from a recorded config.yaml too
    nets.write_text(nets.read_text().replace("nn.ReLU()", "nn.GELU()"))
    changed = fingerprint(cfg)
    assert changed != before
    nets.write_text(nets.read_text().replace("nn.GELU()", "nn.ReLU()"))
    assert fingerprint(cfg) == before
    nets.unlink()
    assert fingerprint(cfg) not in (before, changed)  # a missing file: another fingerprint, no error


def test_fingerprint_of_a_module_hashes_its_source(tmp_path, monkeypatch):
    package = tmp_path / "mynets"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "enc.py").write_text(docs_file("nets.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = resolve(load_config(None, ["model=mynets.enc:make_encoder", "device=cpu"]))
    assert cfg.model.name == "mynets.enc:make_encoder"
    before = fingerprint(cfg)
    (package / "enc.py").write_text(docs_file("nets.py") + "\n# changed\n")
    assert fingerprint(cfg) != before


@pytest.mark.slow
def test_killed_run_resumes_from_another_directory(tmp_path, nets, monkeypatch, capsys):
    """A run of ``model=./nets.py:...`` killed in round 2 is not resumed after the file
    changed, and resumes from another working directory, the file as it was, to the
    metrics of the uninterrupted run."""
    settings = ["model=./nets.py:make_encoder", "model.width=32", "algorithm=moon", "num_clients=3", "rounds=3",
                "local_epochs=1", "batch_size=32", "executor=sequential", "dataset=digits"]
    monkeypatch.chdir(tmp_path)
    assert run(tmp_path / "clean", *settings) == 0
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, "round", "4", "--quiet", "--out", str(tmp_path / "run"), *settings],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    original = nets.read_text()
    nets.write_text(original.replace("nn.ReLU()", "nn.GELU()"))
    assert main(["run", "--quiet", "--resume", str(tmp_path / "run")]) == 2
    assert "the checkpoint belongs to another configuration" in capsys.readouterr().err
    nets.write_text(original)
    assert main(["run", "--quiet", "--resume", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == (tmp_path / "clean" / "metrics.jsonl").read_bytes()


class Branchy(nn.Module):
    """Data-dependent control flow: torch.func cannot vmap it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h if h.sum() > 0 else -h


class Cache(nn.Module):
    """An in-place update of a tensor that is not a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.last = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.last.copy_(h.mean(0).detach())
        return h


class RunningMean(nn.Module):
    """An in-place update of a registered buffer, as BatchNorm's: vectorisable."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.mean.mul_(0.9).add_(0.1 * h.mean(0).detach())
        return h


def test_vectorizable_probe():
    good = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.ReLU())
    assert vectorizable(FedModel(good, 4, 3), (8,)) is None
    assert vectorizable(FedModel(RunningMean(), 4, 3), (8,)) is None
    assert "data-dependent control flow" in vectorizable(FedModel(Branchy(), 4, 3), (8,))
    assert "in-place operation" in vectorizable(FedModel(Cache(), 4, 3), (8,))
    model = FedModel(Cache(), 4, 3)
    vectorizable(model, (8,))
    assert model.training and not model.features.last.any()  # the probe ran on a copy


def test_auto_falls_back_to_sequential_for_a_model_torch_func_cannot_vectorise():
    chosen = dataclasses.replace(Config(), model=Component("/x/nets.py:make"), executor="vectorized")
    model = FedModel(Branchy(), 4, 3)
    cfg, notes = check_vectorizable(Config(executor="auto"), chosen, model, (8,))
    assert cfg.executor == "sequential" and len(notes) == 1
    assert "executor=auto: torch.func cannot vectorise model /x/nets.py:make (RuntimeError: vmap" in notes[0]
    with pytest.raises(ConfigError, match="executor=vectorized cannot train model /x/nets.py:make"):
        check_vectorizable(Config(executor="vectorized"), chosen, model, (8,))
    good = FedModel(RunningMean(), 4, 3)
    assert check_vectorizable(Config(executor="auto"), chosen, good, (8,)) == (chosen, [])


def test_executor_vectorized_refuses_a_model_it_cannot_train(tmp_path, monkeypatch, capsys):
    (tmp_path / "branchy.py").write_text(textwrap.dedent(
        """
        from torch import nn

        class Branchy(nn.Module):
            def __init__(self, input_shape):
                super().__init__()
                self.fc = nn.Linear(input_shape[0], 16)

            def forward(self, x):
                h = self.fc(x)
                return h if h.sum() > 0 else -h
        """
    ))
    monkeypatch.chdir(tmp_path)
    settings = [s for s in SMALL if not s.startswith("executor")]
    assert run(tmp_path / "run", "model=branchy.py:Branchy", "executor=vectorized", *settings) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "executor=vectorized cannot train model" in err[0] and "branchy.py line 11" in err[0]
    assert not (tmp_path / "run").exists()

