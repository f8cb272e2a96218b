"""Property-based tests (hypothesis) of the partitioners and of configuration errors.

Partitioners: every registered one either returns a partition that assigns each training
sample to exactly one client, honours its options and is the same for the same seed, or
raises :class:`ConfigError`; never another exception, never a wrong partition.

Configuration: random invalid settings, overrides and YAML files make ``contrafl run`` exit
with status 2 and one ``contrafl: error:`` line, without a traceback and without starting a run.
"""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import contrafl.engine.simulation as simulation_module
from contrafl import cli
from contrafl import params as P
from contrafl.algorithms import ALGORITHMS
from contrafl.config import COMPONENTS, SETTINGS, Config, load_config
from contrafl.data import augment
from contrafl.data.partition import PARTITIONS, Partition, make_partition

OWN_PARTITIONS = [m for m in PARTITIONS.names() if not m.startswith("flwr_")]
"""contrafl's own partitioners, which give every sample to a client (Flower Datasets'
may leave samples out, e.g. the shard partitioner's remainder: test_huggingface.py checks
them against flwr-datasets itself)."""
from contrafl.data.registry import DATASETS
from contrafl.errors import ConfigError
from contrafl.models import MODELS

FAST = settings(max_examples=60, deadline=None, database=None)
CLI = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# --------------------------------------------------------------------------------------------
# Partitioners


@st.composite
def label_sets(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """``(labels, num_classes)``: up to 120 samples drawn from a random subset of the classes,
    sometimes dominated by one class."""
    num_classes = draw(st.integers(1, 12))
    present = sorted(draw(st.sets(st.integers(0, num_classes - 1), min_size=1)))
    n = draw(st.integers(1, 120))
    if draw(st.booleans()):
        labels = draw(st.lists(st.sampled_from(present), min_size=n, max_size=n))
    else:  # very unbalanced: one class and a few samples of the others
        rest = draw(st.lists(st.sampled_from(present), max_size=max(1, n // 20)))
        labels = [present[0]] * (n - len(rest)) + rest
    return np.array(labels, dtype=np.int64), num_classes


def options_for(method: str, n: int, clients: int) -> st.SearchStrategy[dict]:
    """Options of ``method``, feasible and infeasible ones."""
    per_client = max(1, n // clients)
    if method in ("dirichlet", "quantity"):
        return st.fixed_dictionaries(
            {
                "beta": st.sampled_from([0.01, 0.1, 0.5, 1.0, 100.0]),
                "min_size": st.integers(0, per_client + 2),
            }
        )
    if method == "pathological":
        return st.fixed_dictionaries(
            {
                "classes_per_client": st.integers(1, 13),
                "balance": st.booleans(),
                "least_samples": st.integers(0, 50),
            }
        )
    return st.just({})


@st.composite
def requests(draw: st.DrawFn, method: str) -> dict:
    """Keyword arguments of :func:`make_partition` for ``method``."""
    labels, num_classes = draw(label_sets())
    n = len(labels)
    clients = draw(st.one_of(st.integers(1, min(n, 12)), st.sampled_from([1, n, n + 1])))
    kwargs = dict(
        labels=labels,
        num_clients=clients,
        method=method,
        options=draw(options_for(method, n, clients)),
        seed=draw(st.integers(0, 2**40)),
        test_fraction=draw(st.sampled_from([0.0, 0.0, 0.25, 0.5])),
        num_classes=num_classes,
    )
    if method == "natural":  # a random split into min(clients, n) parts
        rng = np.random.RandomState(draw(st.integers(0, 1000)))
        cuts = np.sort(rng.choice(np.arange(1, n), min(clients, n) - 1, replace=False))
        kwargs["natural"] = [idx.tolist() for idx in np.split(rng.permutation(n), cuts)]
    return kwargs


def partition_or_none(kwargs: dict) -> Partition | None:
    """The partition, or ``None`` when the request is refused with a one-line ConfigError."""
    try:
        return make_partition(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message
        return None


def assert_valid(partition: Partition, kwargs: dict) -> None:
    """Each sample in exactly one client's train or test list; every client holds samples."""
    n, clients = len(kwargs["labels"]), kwargs["num_clients"]
    assert partition.method == kwargs["method"] and partition.num_clients == clients
    parts = list(partition.train) + list(partition.test or [])
    assert all(idx.dtype == np.int64 and idx.ndim == 1 for idx in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))
    assert all(len(idx) > 0 for idx in partition.train)
    assert (partition.test is not None) == (kwargs["test_fraction"] > 0)


def held(partition: Partition) -> list[np.ndarray]:
    """Each client's samples before the local test split."""
    test = partition.test or [np.empty(0, np.int64)] * partition.num_clients
    return [np.concatenate([a, b]) for a, b in zip(partition.train, test)]


@pytest.mark.parametrize("method", OWN_PARTITIONS)
@FAST
@given(data=st.data())
def test_partition_is_valid_deterministic_or_a_config_error(method, data):
    kwargs = data.draw(requests(method))
    partition = partition_or_none(kwargs)
    if kwargs["num_clients"] > len(kwargs["labels"]):
        assert partition is None
    if partition is None:
        return
    assert_valid(partition, kwargs)
    again = make_partition(**kwargs)
    first, second = partition.train + (partition.test or []), again.train + (again.test or [])
    assert len(first) == len(second) and all(np.array_equal(a, b) for a, b in zip(first, second))
    sizes = [len(idx) for idx in held(partition)]
    options = partition.options
    if "min_size" in options:
        assert min(sizes) >= options["min_size"]
    if method == "iid":
        assert max(sizes) - min(sizes) <= 1
    if method == "pathological":
        labels = kwargs["labels"]
        assert all(len(np.unique(labels[idx])) <= options["classes_per_client"] for idx in held(partition))
    if method == "natural":
        assert [sorted(idx.tolist()) for idx in held(partition)] == [sorted(idx) for idx in kwargs["natural"]]


@st.composite
def feasible_requests(draw: st.DrawFn) -> dict:
    """Requests with a wide margin: at least 100 samples, every class held by at least
    ``num_clients`` of them, ``min_size`` a quarter of the even share at most, and for
    ``pathological`` balanced shares with ``num_clients * classes_per_client`` a multiple of
    the classes (PFLlib's rule then deals every class)."""
    method = draw(st.sampled_from([m for m in OWN_PARTITIONS if m != "natural"]))
    num_classes, clients = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    labels = np.array(draw(st.permutations(list(range(num_classes)) * clients)) + draw(
        st.lists(st.integers(0, num_classes - 1), min_size=100, max_size=150)
    ))
    options: dict = {}
    if method in ("dirichlet", "quantity"):
        beta = draw(st.sampled_from([0.5, 1.0, 10.0]))
        options = {"beta": beta, "min_size": draw(st.integers(0, len(labels) // clients // 4))}
    if method == "pathological":
        per_client = draw(st.sampled_from([k for k in range(1, num_classes + 1) if clients * k % num_classes == 0]))
        options = {"classes_per_client": per_client, "balance": True}
    seed = draw(st.integers(0, 99))
    return dict(labels=labels, num_clients=clients, method=method, options=options, seed=seed, test_fraction=0.0)


@FAST
@given(kwargs=feasible_requests())
def test_feasible_requests_succeed(kwargs):
    assert_valid(make_partition(**kwargs), kwargs)


EDGE_LABELS = np.array([3, 3, 3, 3, 3, 3, 3, 7, 7, 0], dtype=np.int64)  # unbalanced, classes missing
ONE_CLIENT = {"dirichlet": {}, "quantity": {}, "pathological": {"classes_per_client": 10}, "iid": {}, "natural": {}}


@pytest.mark.parametrize("method", OWN_PARTITIONS)
def test_one_client_holds_everything(method):
    natural = [list(range(10))] if method == "natural" else None
    partition = make_partition(EDGE_LABELS, 1, method, ONE_CLIENT[method], natural=natural, num_classes=10)
    assert sorted(partition.train[0].tolist()) == list(range(10))


@pytest.mark.parametrize("method", OWN_PARTITIONS)
def test_as_many_clients_as_samples(method):
    options = {"min_size": 1} if method in ("dirichlet", "quantity") else {}
    natural = [[i] for i in range(10)] if method == "natural" else None
    kwargs = dict(labels=EDGE_LABELS, num_clients=10, method=method, options=options, natural=natural, num_classes=10)
    partition = partition_or_none(kwargs)
    if method in ("iid", "natural"):
        assert partition is not None
    if partition is not None:
        assert_valid(partition, {**kwargs, "test_fraction": 0.0})


def test_infeasible_requests_are_config_errors():
    labels = np.repeat(np.arange(3), 4)
    with pytest.raises(ConfigError, match="num_clients=13"):
        make_partition(labels, 13, "iid")
    with pytest.raises(ConfigError, match="classes_per_client=4"):
        make_partition(labels, 2, "pathological", {"classes_per_client": 4})
    with pytest.raises(ConfigError, match="min_size=5"):
        make_partition(labels, 3, "dirichlet", {"min_size": 5})
    with pytest.raises(ConfigError, match="min_size=7"):
        make_partition(labels, 2, "quantity", {"min_size": 7})
    with pytest.raises(ConfigError, match="partition=natural"):
        make_partition(labels, 2, "natural")
    with pytest.raises(ConfigError, match="num_clients=3"):
        make_partition(labels, 3, "natural", natural=[list(range(12))])


@pytest.mark.parametrize("beta", ["inf", "nan", "1e400", "-1", "0"])
def test_non_finite_and_non_positive_beta_are_rejected(beta):
    with pytest.raises(ConfigError, match="partition.beta="):
        make_partition(np.repeat(np.arange(3), 4), 2, "dirichlet", {"beta": beta})


@pytest.mark.parametrize("method", ["dirichlet", "quantity"])
def test_min_size_zero_redraws_empty_clients(method):
    """A skewed draw that leaves a client empty is redrawn, not refused."""
    labels = np.repeat(np.arange(4), 10)
    for seed in range(20):
        partition = make_partition(labels, 8, method, {"beta": 0.3, "min_size": 0}, seed=seed)
        assert min(len(idx) for idx in partition.train) >= 1


def test_tiny_beta_gives_up_with_a_config_error():
    """Dirichlet draws with a tiny concentration underflow to NaN: bounded redraws, then an error."""
    for method in ("dirichlet", "quantity"):
        with pytest.raises(ConfigError, match="draws"):
            make_partition(np.repeat(np.arange(3), 10), 3, method, {"beta": 1e-300, "min_size": 1})


def test_method_is_recorded_canonically():
    partition = make_partition(np.repeat(np.arange(3), 4), 2, "Dirichlet", {"min_size": 1})
    assert partition.method == "dirichlet"


# --------------------------------------------------------------------------------------------
# Configuration errors


def _folded_names() -> set[str]:
    registries = [ALGORITHMS, DATASETS, MODELS, PARTITIONS, augment.AUGMENTATIONS]
    return {P.fold(name) for registry in registries for name in registry.names()} | {"auto"}


NAMES = _folded_names()
FIELDS = {f.name: f for f in dataclasses.fields(Config) if f.name in SETTINGS}
HINTS = typing.get_type_hints(Config)
WORDS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
NOT_A_NUMBER = st.sampled_from(["abc", "", "1,5", "one", "0x", "[1]", "1..2", "true"])


def _invalid_for_interval(check: P.Interval, integer: bool) -> list[str]:
    """Values outside ``check``: just outside each bound, and the bound itself when open."""
    out = []
    step = 1 if integer else 0.5
    if check.low is not None:
        out.append(check.low - step)
        if check.closed in ("right", "neither"):
            out.append(check.low)
    if check.high is not None:
        out.append(check.high + step)
        if check.closed in ("left", "neither"):
            out.append(check.high)
    return [str(int(v)) if integer and float(v).is_integer() else repr(float(v)) for v in out]


def invalid_values(name: str) -> st.SearchStrategy[str]:
    """Strings that setting ``name`` must reject, derived from its type and constraint."""
    tp = HINTS[name]
    base = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
    check = FIELDS[name].metadata.get("check")
    if base is bool:
        readable = ("true", "false", "yes", "no", "1", "0", "on", "off", "none", "null", "auto")
        return WORDS.filter(lambda v: v.strip().lower() not in readable)
    if isinstance(check, P.OneOf):
        choices = {P.fold(c) for c in check.choices}
        return WORDS.filter(lambda v: P.fold(v.strip()) not in choices | {"none", "null"})
    if base in (int, float):
        options = [NOT_A_NUMBER, st.sampled_from(["nan", "inf", "-inf", "1e400"])]
        if base is int:
            options.append(st.sampled_from(["1.5", "2.25"]))
        if isinstance(check, P.Interval):
            outside = _invalid_for_interval(check, base is int)
            if outside:
                options.append(st.sampled_from(outside))
        return st.one_of(options).filter(lambda v: v.lower() not in ("auto", "none", "null", ""))
    return st.nothing()


CHECKED = [name for name in SETTINGS if not invalid_values(name).is_empty]


@st.composite
def bad_settings(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(CHECKED))
    return f"{name}={draw(invalid_values(name))}"


@st.composite
def unknown_keys(draw: st.DrawFn) -> str:
    key = draw(WORDS.filter(lambda k: "=" not in k and k.strip() and not k.startswith("-")))
    head = key.strip().partition(".")[0]
    assume(key.strip() not in SETTINGS and key.strip() not in COMPONENTS and head not in COMPONENTS)
    return f"{key}={draw(st.sampled_from(['1', 'x', '']))}"


@st.composite
def bad_component_names(draw: st.DrawFn) -> str:
    name = draw(WORDS.filter(lambda v: P.fold(v.strip()) not in NAMES))
    return f"{draw(st.sampled_from(COMPONENTS))}={name}"


BAD_OPTIONS = [
    "algorithm=moon algorithm.mu=-1",
    "algorithm=moon algorithm.temperature=0",
    "algorithm=MOON algorithm.loss=cosine",
    "algorithm=fedprox algorithm.mu=abc",
    "partition.beta=0",
    "partition.beta=inf",
    "partition.min_size=-1",
    "partition=pathological partition.classes_per_client=0",
    "model.dropout=1",
    "model.projection_dim=0",
    "model.projection=maybe",
    "algorithm.nonexistent=1",
    "dataset.foo=1",
    "partition.=1",
    "algorithm.=5",
]
MALFORMED = ["=5", " =5", "=", "rounds", "algorithm.mu", "algo rithm"]


def overrides() -> st.SearchStrategy[list[str]]:
    """Override lists with at least one invalid item."""
    bad = st.one_of(
        bad_settings(),
        unknown_keys(),
        bad_component_names(),
        st.sampled_from(BAD_OPTIONS).map(str.split),
        st.sampled_from(MALFORMED),
    ).map(lambda item: item if isinstance(item, list) else [item])
    valid = st.lists(st.sampled_from(["rounds=1", "num_clients=4", "lr=0.1", "local_epochs=1"]), max_size=2)
    return st.tuples(valid, bad).map(lambda t: t[0] + t[1])


@pytest.fixture
def no_runs(monkeypatch):
    """Fail instead of starting a simulation."""

    def refuse(*args, **kwargs):
        raise AssertionError("an invalid configuration reached the simulation")

    monkeypatch.setattr(simulation_module, "Simulation", refuse)


def assert_one_line_error(code: int, capsys) -> str:
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.startswith("contrafl: error:") and err.endswith("\n"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@CLI
@given(items=overrides())
def test_invalid_overrides_exit_2_with_one_line(items, no_runs, capsys):
    capsys.readouterr()
    assert_one_line_error(cli.main(["run", *items]), capsys)


@FAST
@given(item=st.one_of(bad_settings(), unknown_keys(), st.sampled_from(MALFORMED).filter(lambda i: "=" in i)))
def test_load_config_raises_config_error(item):
    with pytest.raises(ConfigError) as info:
        load_config(None, [item])
    assert "\n" not in str(info.value)


@CLI
@given(name=st.sampled_from(CHECKED), data=st.data())
def test_invalid_values_in_yaml_exit_2(name, data, tmp_path, no_runs, capsys):
    value = data.draw(invalid_values(name))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({name: value}), encoding="utf-8")
    with pytest.raises(ConfigError):
        load_config(path)
    capsys.readouterr()
    assert_one_line_error(cli.main(["run", str(path)]), capsys)


YAML_SCALARS = st.one_of(
    st.integers(), st.floats(allow_nan=False), st.booleans(), st.text(max_size=10), st.lists(st.integers(), max_size=3)
)
BROKEN_YAML = [
    "rounds: [1,\n",
    "rounds: 3\n  lr: 0.1\n",
    "a: b: c\n",
    "rounds: 'unterminated\n",
    "- 1\nrounds: 2\n",
    "{rounds: 3\n",
    "rounds: 3\n\t lr: 1\n",
    "? [a, b]\n: 1\n",
    "rounds: !!python/object:os.system x\n",
    "rounds: *alias\n",
]


UNKNOWN_KEYS = st.dictionaries(st.one_of(st.integers(), st.booleans(), st.none(), WORDS), st.integers(), min_size=1)
LATE = "{name: moon, 1: 2}"  # a component's name and options are checked when the run is prepared


@CLI
@given(
    document=st.one_of(
        YAML_SCALARS.map(yaml.safe_dump),
        st.sampled_from(BROKEN_YAML),
        UNKNOWN_KEYS.filter(lambda d: not set(d) <= set(SETTINGS) | set(COMPONENTS)).map(
            lambda d: yaml.safe_dump(d, sort_keys=False)
        ),
        st.sampled_from(COMPONENTS).map(lambda c: f"{c}: {LATE}\n"),
        st.sampled_from(COMPONENTS).map(lambda c: f"{c}: [1, 2]\n"),
        st.sampled_from(COMPONENTS).map(lambda c: f"{c}: {{mu: 1}}\n"),
    ).map(str.encode)
    | st.binary(max_size=4).map(lambda b: b"rounds: 3\n\xff" + b),  # not UTF-8
)
def test_invalid_yaml_files_exit_2(document, tmp_path, no_runs, capsys):
    path = tmp_path / "config.yaml"
    path.write_bytes(document)
    if LATE.encode() not in document:
        with pytest.raises(ConfigError):
            load_config(path)
    capsys.readouterr()
    assert_one_line_error(cli.main(["run", str(path)]), capsys)


def test_empty_yaml_file_is_the_defaults(tmp_path):
    for text in ("", "# nothing\n", "null\n", "~\n"):
        path = tmp_path / "empty.yaml"
        path.write_text(text)
        assert load_config(path) == load_config()


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_non_finite_numbers_are_rejected(value):
    with pytest.raises(ConfigError, match=f"lr='{value}' is invalid: expected a finite number"):
        load_config(None, [f"lr={value}"])
