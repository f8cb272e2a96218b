"""Augmentations and the data they get: a pipeline that cannot take the dataset's samples
is a configuration error before anything runs, self-supervised algorithms get a two-view
augmentation by default, and SCARF's feature corruption (``augment=scarf``) for data that
are not images."""

import pytest
import torch

from contrafl.config import load_config
from contrafl.data import augment
from contrafl.data.augment import FeatureCorruption, Transform
from contrafl.engine.setup import prepare, resolve
from contrafl.errors import ConfigError

from test_cli import run_cli


def test_feature_corruption_follows_its_formula():
    """out[i, j] = x[d_ij, j] where u_ij < rate, else x[i, j], with (u_ij, d_ij) the
    hashed draws of (seed_i, j), recomputed here element by element."""
    op = FeatureCorruption(0.6)
    x = torch.randn(16, 64)
    seed = op.sample(16, torch.Generator().manual_seed(0))["seed"]
    out = op.apply(x, {"seed": seed})
    replaced = 0
    for i in range(16):
        for j in range(64):
            key = augment._hash32(torch.tensor(2 * j))
            u = float(augment._unit_interval(seed[i], key))
            donor = min(int(float(augment._unit_interval(seed[i], augment._hash32(torch.tensor(2 * j + 1)))) * 16), 15)
            expected = x[donor, j] if u < 0.6 else x[i, j]
            assert out[i, j] == expected
            replaced += u < 0.6
    assert 0.5 < replaced / (16 * 64) < 0.7  # about the rate


def test_feature_corruption_rates_and_layouts():
    x = torch.randn(3, 8, 20)
    g = torch.Generator().manual_seed(1)
    seed = torch.stack([FeatureCorruption().sample(8, g)["seed"] for _ in range(3)])
    assert torch.equal(FeatureCorruption(0.0).apply(x, {"seed": seed}), x)
    full = FeatureCorruption(1.0).apply(x, {"seed": seed})
    for k in range(3):  # every value comes from the same feature of the same client's batch
        for j in range(20):
            assert set(full[k, :, j].tolist()) <= set(x[k, :, j].tolist())
    assert not torch.equal(full, x)
    # [K, B, D] in one call equals each client's batch on its own (vectorized vs sequential)
    op = FeatureCorruption(0.6)
    batched = op.apply(x, {"seed": seed})
    for k in range(3):
        assert torch.equal(batched[k], op.apply(x[k], {"seed": seed[k]}))
    with pytest.raises(ValueError, match="one row per sample"):
        op.apply(x[0], {"seed": seed[0, :4]})


@pytest.mark.parametrize(
    "name,shape,problem",
    [
        ("simclr", (64,), "RandomResizedCrop resizes images [C, H, W] to 32 x 32"),
        ("simclr", (3, 64, 64), "RandomResizedCrop resizes images [C, H, W] to 32 x 32"),
        ("simclr", (3, 32, 32), None),
        ("cifar10", (1, 28, 28), None),  # pad-crop and flip keep any image's size
        ("cifar10", (60,), "RandomCrop works on images [C, H, W]"),
        ("orchestra", (1, 32, 32), "ColorJitter works on RGB images [3, H, W]"),
        ("scarf", (3, 32, 32), "FeatureCorruption works on feature vectors [D]"),
        ("scarf", (64,), None),
        ("none", (64,), None),
        ("none", (3, 32, 32), None),
    ],
)
def test_pipelines_say_which_inputs_they_take(name, shape, problem):
    assert augment.AUGMENTATIONS.get(name)(None, None).input_problem(shape) == problem


def test_normalize_needs_one_mean_per_channel():
    norm = Transform(augment.Normalize((0.5,) * 3, (0.5,) * 3))
    assert norm.input_problem((3, 32, 32)) is None
    assert "3 channel means" in norm.input_problem((1, 28, 28))


def test_image_augmentation_of_features_is_a_config_error():
    """The issue's runs: fedu2 and fedavg with augment=simclr on digits (feature vectors)
    stop before training with the reason, instead of a worker's traceback."""
    for algorithm in ("fedu2", "fedavg"):
        with pytest.raises(ConfigError, match=r"augment=simclr cannot augment dataset digits: RandomResizedCrop .* shape \[64\]; use augment=scarf"):
            prepare(load_config(None, [f"algorithm={algorithm}", "augment=simclr", "rounds=1"]))


def test_self_supervised_algorithms_get_two_view_augmentation():
    """augment=auto: the dataset's pipeline for supervised algorithms, its two-view pipeline
    for self-supervised ones; without one the run must name its augmentation."""
    assert resolve(load_config(None, ["algorithm=fedbyol"])).augment == "scarf"
    assert resolve(load_config(None, ["algorithm=fedavg"])).augment == "none"
    assert resolve(load_config(None, ["algorithm=fedu2", "dataset=cifar10", "data_dir=/tmp"])).augment == "simclr"
    assert resolve(load_config(None, ["algorithm=moon", "dataset=cifar10", "data_dir=/tmp"])).augment == "cifar10"
    with pytest.raises(ConfigError, match="dataset mnist has no default two-view augmentation; set augment=NAME"):
        resolve(load_config(None, ["algorithm=fedsimclr", "dataset=mnist", "data_dir=/tmp"]))
    assert resolve(load_config(None, ["algorithm=fedsimclr", "dataset=mnist", "data_dir=/tmp", "augment=none"])).augment == "none"


def test_identical_views_only_when_asked_and_with_a_warning():
    asked = prepare(load_config(None, ["algorithm=fedbyol", "augment=none", "rounds=1"]))
    assert any("augment=none gives fedbyol's views of a sample the same input" in w for w in asked.warnings)
    default = prepare(load_config(None, ["algorithm=fedbyol", "rounds=1"]))
    assert not any("augment=none" in w for w in default.warnings)


@pytest.mark.slow
def test_new_user_runs_on_digits(tmp_path):
    """The issue's acceptance: `contrafl run algorithm=fedu2 augment=simclr rounds=1` ends
    with one line and exit 2; `contrafl run algorithm=fedbyol rounds=1` trains on SCARF
    views, which differ, and reports its kNN accuracy."""
    bad = run_cli("run", "--out", str(tmp_path / "bad"), "algorithm=fedu2", "augment=simclr", "rounds=1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()
    ok = run_cli("run", "--out", str(tmp_path / "ok"), "algorithm=fedbyol", "rounds=1", "num_clients=3", "local_epochs=1")
    assert ok.returncode == 0, ok.stderr
    assert "augment: scarf" in (tmp_path / "ok" / "config.yaml").read_text()
    assert "kNN accuracy" in ok.stdout and "warning" not in ok.stderr
