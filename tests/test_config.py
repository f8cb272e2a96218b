"""Configuration parsing, overrides and validation messages."""

import pytest

from contrafl.config import Component, load_config
from contrafl.errors import ConfigError


def test_defaults():
    cfg = load_config()
    assert cfg.dataset == Component("digits")
    assert cfg.algorithm == Component("fedavg")
    assert cfg.num_clients is None and cfg.partition.name == "auto"  # the files' clients, else 10 and dirichlet
    assert cfg.rounds is None  # auto


def test_overrides_convert_types_and_components():
    cfg = load_config(None, ["rounds=5", "lr=0.1", "drop_last=false", "algorithm.mu=5", "algorithm=moon"])
    assert cfg.rounds == 5 and cfg.lr == 0.1 and cfg.drop_last is False
    assert cfg.algorithm == Component("moon", {"mu": "5"})  # options are validated by the component


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 3\nalgorithm: {name: moon, mu: 1}\npartition:\n  name: dirichlet\n  beta: 0.1\n")
    cfg = load_config(path, ["algorithm.temperature=0.2"])
    assert cfg.rounds == 3
    assert cfg.algorithm == Component("moon", {"mu": 1, "temperature": "0.2"})
    assert cfg.partition.options == {"beta": 0.1}
    # changing a component's name drops the previous component's options
    cfg = load_config(path, ["algorithm=fedavg"])
    assert cfg.algorithm == Component("fedavg")


@pytest.mark.parametrize(
    "override,fragment",
    [
        (["lr=-1"], "lr='-1' is invalid: expected > 0"),
        (["rounds=two"], "rounds='two' is invalid: expected an integer"),
        (["rouns=3"], "did you mean 'rounds'"),
        (["mu=3"], "algorithm.mu=5"),
        (["sample_fraction=0"], "sample_fraction='0' is invalid"),
        (["executor=gpu"], "expected one of auto, sequential, parallel, vectorized"),
        (["rounds"], "expected KEY=VALUE"),
        (["learning.rate=1"], "only dataset, partition, model, algorithm, dp, aggregator, attack have options"),
    ],
)
def test_errors_are_one_line_and_name_the_value(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    unknown = tmp_path / "u.yaml"
    unknown.write_text("epochs: 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'epochs'"):
        load_config(unknown)


def test_auto_keyword():
    cfg = load_config(None, ["rounds=auto", "augment=auto", "server_momentum=auto"])
    assert cfg.rounds is None and cfg.augment == "auto" and cfg.server_momentum is None


def test_the_vectorized_executors_settings_elsewhere_are_warnings():
    """vectorize_memory_gb, pad_finished_clients and cuda_graphs are read by the vectorized
    executor only: set where clients are trained one at a time (or cuda_graphs on the
    CPU), each is a warning naming why, and left at its default it is not."""
    from conftest import setup_warnings

    def warnings(*overrides: str) -> list[str]:
        found = setup_warnings("num_clients=4", "rounds=1", *overrides)
        return [w for w in found if "has no effect with executor" in w or "cuda_graphs" in w]

    assert warnings("executor=sequential", "pad_finished_clients=true", "vectorize_memory_gb=1") == [
        "vectorize_memory_gb=1.0 has no effect with executor=sequential: only the vectorized executor reads it "
        "(executor=vectorized, or rank_executor=vectorized with executor=distributed)",
        "pad_finished_clients=true has no effect with executor=sequential: only the vectorized executor reads it "
        "(executor=vectorized, or rank_executor=vectorized with executor=distributed)",
    ]
    assert warnings("executor=distributed", "workers=2", "cuda_graphs=false")[0].startswith(
        "cuda_graphs=false has no effect with executor=distributed rank_executor=sequential:")
    assert warnings("executor=vectorized", "cuda_graphs=false") == [
        "cuda_graphs=false has no effect on device=cpu: CUDA graphs are for device=cuda"
    ]
    assert warnings("executor=vectorized", "pad_finished_clients=true", "vectorize_memory_gb=1") == []
    assert warnings("executor=distributed", "workers=2", "rank_executor=vectorized", "pad_finished_clients=true") == []
    assert warnings("executor=sequential") == []
