"""Names: case-insensitive components and choices, and did-you-mean suggestions."""

import pytest

from contrafl import cli
from contrafl import params as P
from contrafl.algorithms import ALGORITHMS
from contrafl.config import SETTINGS, COMPONENTS, load_config
from contrafl.data import augment
from contrafl.data.registry import DATASETS
from contrafl.engine.setup import prepare, resolve
from contrafl.errors import ConfigError
from contrafl.models import MODELS
from contrafl.registry import Registry

SETTING_NAMES = SETTINGS + list(COMPONENTS)


@pytest.mark.parametrize(
    "registry,typed,canonical",
    [
        (ALGORITHMS, "MOON", "moon"),
        (ALGORITHMS, "FedSiam-DA", "fedsiam_da"),
        (ALGORITHMS, "fedsiam-da", "fedsiam_da"),
        (DATASETS, "CIFAR10", "cifar10"),
        (DATASETS, "TinyImageNet", "tinyimagenet"),
        (MODELS, "ResNet18", "resnet18"),
        (MODELS, "moon-cnn", "moon_cnn"),
        (augment.AUGMENTATIONS, "Flip", "flip"),
    ],
)
def test_registry_names_are_case_and_dash_insensitive(registry, typed, canonical):
    assert registry.canonical(typed) == canonical
    assert registry.get(typed) is registry.get(canonical)
    assert typed in registry and canonical in registry.names() and typed not in registry.names()


@pytest.mark.parametrize(
    "registry,typed,fragment",
    [
        (DATASETS, "CIFAR1O", "(did you mean 'cifar10'?)"),
        (DATASETS, "Cifar", "(did you mean 'cifar10' or 'cifar100'?)"),
        (DATASETS, "MNST", "(did you mean 'mnist'?)"),
        (ALGORITHMS, "FedSiam", "(did you mean 'fedsiam_da'?)"),
        (ALGORITHMS, "Mooon", "(did you mean 'moon'?)"),
        (MODELS, "ResNet", "(did you mean 'resnet18' or 'resnet50'?)"),
    ],
)
def test_unknown_names_suggest_case_insensitively(registry, typed, fragment):
    with pytest.raises(ConfigError) as info:
        registry.get(typed)
    message = str(info.value)
    assert message.startswith(f"unknown {registry.kind} '{typed}' {fragment}; expected one of:")
    assert "\n" not in message


def test_registry_refuses_names_equal_up_to_case():
    registry: Registry[int] = Registry("thing")
    registry.add("a_b", 1)
    with pytest.raises(ValueError, match="registered twice"):
        registry.add("A-B", 2)
    assert registry.names() == ["a_b"] and registry.get("A_B") == 1


def test_unknown_names_with_odd_characters_stay_on_one_line():
    with pytest.raises(ConfigError) as info:
        ALGORITHMS.get("mo\non")
    assert "'mo\\non'" in str(info.value) and "\n" not in str(info.value)


def test_components_of_any_case_validate_and_resolve_to_canonical_names():
    cfg = load_config(
        None,
        ["dataset=Digits", "algorithm=MOON", "algorithm.loss=L2", "partition=Dirichlet", "model=MLP",
         "augment=None", "num_clients=4", "rounds=1", "local_epochs=1", "device=CPU"],
    )
    resolve(cfg)
    resolved = prepare(cfg).config
    assert resolved.algorithm.name == "moon" and resolved.algorithm.options["loss"] == "l2"
    assert (resolved.dataset.name, resolved.partition.name, resolved.model.name) == ("digits", "dirichlet", "mlp")
    assert resolved.augment == "none" and resolved.device == "cpu"


def test_component_options_survive_a_renaming_in_another_case(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: {name: moon, mu: 3}\n")
    assert load_config(path, ["algorithm=MOON"]).algorithm.options == {"mu": 3}
    assert load_config(path, ["algorithm=fedprox"]).algorithm.options == {}


@pytest.mark.parametrize(
    "override,value",
    [("optimizer=SGD", "sgd"), ("executor=Sequential", "sequential"), ("device=CPU", "cpu"), ("precision=BF16", "bf16")],
)
def test_choices_are_case_insensitive_and_normalised(override, value):
    key = override.partition("=")[0]
    assert getattr(load_config(None, [override]), key) == value


def test_choices_of_component_options_are_normalised():
    params = P.build(ALGORITHMS.get("moon").Params, {"loss": "Contrastive"}, "algorithm")
    assert params.loss == "contrastive"
    scaffold = P.build(ALGORITHMS.get("scaffold").Params, {"correction": "Post-Step"}, "algorithm")
    assert scaffold.correction == "post_step"


@pytest.mark.parametrize(
    "override,fragment",
    [
        (
            "executor=sequental",
            "executor='sequental' is invalid: expected one of auto, sequential, parallel, vectorized, distributed "
            "(did you mean 'sequential'?); set it with executor=VALUE",
        ),
        ("optimizer=adamw", "(did you mean 'adam'?)"),
        ("device=metal", "expected one of auto, cpu, cuda; set it"),
    ],
)
def test_bad_choices_suggest_the_closest(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "typed,expected",
    [
        ("fraction", " (did you mean 'sample_fraction' or 'test_fraction'?)"),
        ("fracton", " (did you mean 'sample_fraction' or 'test_fraction'?)"),
        ("epochs", " (did you mean 'local_epochs'?)"),
        ("batch", " (did you mean 'batch_size' or 'eval_batch_size'?)"),
        ("momentun", " (did you mean 'momentum' or 'server_momentum'?)"),
        ("rouns", " (did you mean 'rounds'?)"),
        ("Rounds", " (did you mean 'rounds'?)"),
        ("num-clients", " (did you mean 'num_clients'?)"),
        ("mu", ""),
        ("learning_rate", ""),
        ("", ""),
    ],
)
def test_suggest(typed, expected):
    assert P.suggest(typed, SETTING_NAMES) == expected


def test_suggest_lists_three_or_more_with_commas():
    assert P.suggest("fed", ["fedavg", "fedprox", "moon", "fedssc"]) == " (did you mean 'fedavg', 'fedprox' or 'fedssc'?)"


def test_suggest_accepts_non_string_names():
    assert P.suggest(1, ["a", "b"]) == "" and P.suggest(None, ["none"]) == " (did you mean 'none'?)"


def test_fold():
    assert P.fold("FedSiam-DA") == "fedsiam_da" and P.fold(3) == "3"


def test_misspelt_setting_lists_every_setting_containing_the_word(tmp_path, capsys):
    hint = r"\(did you mean 'sample_fraction' or 'test_fraction'\?\)"
    with pytest.raises(ConfigError, match=rf"unknown setting 'fraction' {hint}"):
        load_config(None, ["fraction=0"])
    path = tmp_path / "c.yaml"
    path.write_text("fraction: 0\n")
    with pytest.raises(ConfigError, match=rf"unknown setting 'fraction' in .*c.yaml {hint}"):
        load_config(path)
    assert cli.main(["run", "fraction=0"]) == 2
    err = capsys.readouterr().err
    assert err == "contrafl: error: unknown setting 'fraction' (did you mean 'sample_fraction' or 'test_fraction'?)\n"


def test_unknown_component_option_suggests_case_insensitively():
    with pytest.raises(ConfigError, match=r"unknown option 'algorithm.Mu' \(did you mean 'mu'\?\)"):
        P.build(ALGORITHMS.get("moon").Params, {"Mu": 1}, "algorithm")
    hint = r"\(did you mean 'mu_glob_end' or 'mu_glob_start'\?\)"
    with pytest.raises(ConfigError, match=rf"unknown option 'algorithm.glob' {hint}"):
        P.build(ALGORITHMS.get("fedssc").Params, {"glob": 1}, "algorithm")
