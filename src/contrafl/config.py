"""Run configuration: YAML files, ``key=value`` overrides, validation and ``auto`` values.

A configuration is a flat set of settings plus seven *components*: ``dataset``,
``partition``, ``model``, ``algorithm``, ``dp`` (differential privacy: ``none``,
``central`` or ``local``, :mod:`contrafl.engine.privacy`), ``aggregator`` (a robust rule in
place of the algorithm's means, :mod:`contrafl.engine.robustness`) and ``attack``
(Byzantine clients, :mod:`contrafl.engine.attacking`). A component is written either as a name
(``algorithm: moon``) or as a mapping with a ``name`` and the component's own options
(``algorithm: {name: moon, mu: 5}``). On the command line ``algorithm=moon`` sets the name
and ``algorithm.mu=5`` an option; changing a component's name drops options given for
the previous component earlier in the file.

Settings whose value is ``auto`` are filled in by :func:`resolve` from the dataset's
recommendations (model, batch size, rounds, local epochs, augmentation), the dataset's
files (``partition=natural`` and their clients for files split per client, else
:data:`DEFAULT_PARTITION` and :data:`DEFAULT_CLIENTS`) and the algorithm (server
momentum); the resolved configuration is what a run directory records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import params as P
from .errors import ConfigError
from .speeds import SpeedSpec

COMPONENTS = ("dataset", "partition", "model", "algorithm", "dp", "aggregator", "attack")
DEFAULT_PARTITION = "dirichlet"
"""The partition of ``partition=auto`` for data that are not split per client by their files."""
DEFAULT_CLIENTS = 10
"""The clients of ``num_clients=auto`` for data that are not split per client by their files."""


@dataclass(frozen=True)
class Component:
    """A named, configurable part of a run (dataset, partition, model, algorithm)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def as_yaml(self) -> Any:
        return {"name": self.name, **self.options} if self.options else self.name


def component_name(component: Component, key: str, names: Sequence[str], how: str) -> str:
    """The name ``component`` gives among ``names`` (folded, :func:`contrafl.params.fold`),
    or a one-line error naming the value, the choices and ``how`` to set it."""
    name = P.fold(component.name)
    if name not in names:
        raise ConfigError(f"{key}={component.name!r} is invalid: expected one of {', '.join(names)}{P.suggest(component.name, list(names))}; {how}")
    return name


def without_options(component: Component, key: str, off: str, advice: str, note: str = "") -> Component:
    """``Component(off)`` for a component set to its option-less value ``off`` (``dp=none``),
    or a one-line error naming the first option given, ``note`` on ``off`` and ``advice``."""
    if component.options:
        raise ConfigError(f"{key}.{next(iter(component.options))} is set but {key}={off}{note}; {advice}")
    return Component(off)


_pos = P.Interval(0, None, "neither")
_nonneg = P.Interval(0, None)

TRACKERS = ("tensorboard", "mlflow", "csv")  # contrafl.engine.tracking writes them


@dataclass(frozen=True)
class Trackers(P.OneOf):
    """``none`` or a comma-separated list of trackers, recorded in canonical form
    (lower case, each once, in the order of ``choices``: ``MLflow,csv`` -> ``mlflow,csv``)."""

    choices: tuple = ("none", *TRACKERS)

    def names(self, value: str) -> list[str]:
        return [P.fold(v.strip()) for v in value.split(",")]

    def __call__(self, value: Any) -> bool:
        if not isinstance(value, str):
            return False
        names = self.names(value)
        return names == ["none"] or all(n in TRACKERS for n in names)

    def canonical(self, value: Any) -> Any:
        if not self(value):
            return value
        names = set(self.names(value))
        return ",".join(n for n in self.choices if n in names)

    def __str__(self) -> str:
        return f"none or a comma-separated list of {', '.join(TRACKERS)}"


@dataclass(frozen=True)
class Config:
    """Every setting of a run. ``None`` means ``auto`` where the doc says so."""

    dataset: Component = field(default_factory=lambda: Component("digits"))
    partition: Component = field(default_factory=lambda: Component("auto"))
    model: Component = field(default_factory=lambda: Component("auto"))
    algorithm: Component = field(default_factory=lambda: Component("fedavg"))
    dp: Component = field(default_factory=lambda: Component("none"))
    aggregator: Component = field(default_factory=lambda: Component("mean"))
    attack: Component = field(default_factory=lambda: Component("none"))

    seed: int = P.param(0, P.Interval(0, 2**63 - 1), "seed of every random stream of the run")
    data_dir: str | None = P.param(None, None, "directory of the dataset files")
    allow_subset: bool = P.param(False, None, "accept well-formed files that fail the official checksum (subsets)")
    download: bool = P.param(False, None, "download missing official files into data_dir")
    node_data: str = P.param(
        "shared", P.OneOf(("shared", "own")),
        "where a Flower deployment's clients get their data: shared (every SuperNode holds the whole dataset and partition.json "
        "and cuts out its client's rows: a simulation spread over machines) or own (each SuperNode holds only its own data, "
        "node config data=PATH, and the server none: a federation; docs/flower.md)",
    )
    server_test: str | None = P.param(
        None, None, "node_data=own: a test set the server holds (in the dataset's format), on which it evaluates the global model; none = federated evaluation",
    )
    global_eval: str = P.param(
        "auto", P.OneOf(("auto", "server", "federated")),
        "where the global model is evaluated: server (on the test set) or federated (every client on its local test split, "
        "the sample-weighted mean, as Flower's evaluate round); auto: federated with node_data=own and no server_test, else server "
        "(with partition=natural on clients with test data of their own, the test set is their union: the same test_acc as federated)",
    )
    num_clients: int | None = P.param(
        None, P.Interval(1, None),
        f"number of clients N (auto: the clients of data split per client by its files, one per PFLlib file pair, LEAF user or "
        f"client folder; else {DEFAULT_CLIENTS})",
    )
    test_fraction: float = P.param(0.0, P.Interval(0, 1, "left"), "per-client test split (PFLlib uses 0.25); 0 = none")
    pool: bool = P.param(False, None, "pool the official train and test sets before partitioning (PFLlib); needs test_fraction > 0")
    normalize: str = P.param("dataset", P.OneOf(("dataset", "half", "none")), "input normalisation: the dataset's channel mean/std, 0.5/0.5 (PFLlib) or none (pixels in [0, 1], FedU2)")
    sample_fraction: float = P.param(1.0, P.Interval(0, 1, "right"), "fraction of clients sampled per round")
    sampling: str = P.param(
        "seeded", P.OneOf(("seeded", "secret")),
        "how a round's clients are drawn: seeded (from the seed, listed in metrics.jsonl: reproducible and public) or secret "
        "(from the OS CSPRNG at the server, written nowhere: dp=central then counts amplification by sampling; docs/privacy.md)",
    )
    client_dropout: float = P.param(
        0.0, P.Interval(0, 1, "left"),
        "probability that a sampled client does not reply in a round (drawn from the seed): it trains nothing, keeps its state, and is recorded as lost",
    )
    client_speed: str = P.param(
        "constant", SpeedSpec(),
        "speed distribution of the clients (local steps per unit of simulated time), drawn once per client from the seed: constant, lognormal:SIGMA, uniform:LOW,HIGH or slow:FRACTION,FACTOR (docs/unreliable.md)",
    )
    speed_jitter: float = P.param(
        0.0, _nonneg,
        "round-to-round variation of each client's speed: in round t client i runs at s_i * exp(speed_jitter * z), z ~ N(0, 1) drawn from the seed; 0 = the same speed every round",
    )
    round_deadline: float | None = P.param(
        None, _pos,
        "simulated time a round waits for replies, in local steps of a speed-1 client; a client whose planned steps take longer is a straggler (see stragglers); none = no deadline",
    )
    stragglers: str = P.param(
        "drop", P.OneOf(("drop", "partial")),
        "what becomes of a client that misses round_deadline: drop (its reply never counts, it keeps its state) or partial (it replies with the steps it finished, for algorithms that accept partial work: FedProx)",
    )
    rounds: int | None = P.param(None, P.Interval(1, None), "communication rounds (auto: the dataset's)")
    local_epochs: int | None = P.param(None, P.Interval(1, None), "local epochs per round (auto: the dataset's)")
    batch_size: int | None = P.param(None, P.Interval(1, None), "local batch size (auto: the dataset's)")
    drop_last: bool = P.param(True, None, "drop each epoch's incomplete last batch (MOON's DataLoader)")
    augment: str = P.param("auto", None, "training augmentation pipeline (auto: the dataset's)")
    optimizer: str = P.param("sgd", P.OneOf(("sgd", "adam")), "client optimiser")
    lr: float = P.param(0.01, _pos, "client learning rate")
    momentum: float = P.param(0.9, P.Interval(0, 1, "left"), "SGD momentum")
    weight_decay: float = P.param(1e-5, _nonneg, "L2 weight decay")
    persist_optimizer_state: bool = P.param(False, None, "keep each client's optimiser state across rounds")
    server_lr: float = P.param(1.0, _pos, "server learning rate on the aggregate")
    server_momentum: float | None = P.param(None, P.Interval(0, 1, "left"), "server momentum beta (FedAvgM; auto: the algorithm's)")
    executor: str = P.param(
        "auto", P.OneOf(("auto", "sequential", "parallel", "vectorized", "distributed")),
        "how clients are trained (distributed: persistent processes on torch.distributed, docs/distributed.md)",
    )
    workers: int | None = P.param(
        None, P.Interval(1, None),
        "processes of the parallel executor, or ranks of the distributed one, the server's included (auto: the CPU cores; for the distributed executor at most the clients of a round)",
    )
    rank_executor: str = P.param(
        "auto", P.OneOf(("auto", "sequential", "vectorized")),
        "executor=distributed: how each rank trains its share of a round's clients, one after the other (sequential) or stacked (vectorized; CUDA graphs on a GPU); auto: vectorized on a GPU where the algorithm allows, and on a CPU where the model has a stacked forward and the clients step together (docs/performance.md), else sequential",
    )
    device: str = P.param("auto", P.OneOf(("auto", "cpu", "cuda")), "where training runs")
    precision: str = P.param(
        "fp32", P.OneOf(("fp32", "bf16", "auto")),
        "bf16: local training under bfloat16 autocast (a GPU, or a CPU with AMX or AVX512-BF16); auto: bf16 where the device has it, else fp32",
    )
    eval_every: int = P.param(1, P.Interval(1, None), "evaluate every this many rounds (and the last)")
    eval_batch_size: int = P.param(1000, P.Interval(1, None), "batch size of evaluation")
    knn_every: int | None = P.param(None, P.Interval(0, None), "kNN accuracy of the global encoder every this many rounds (and the last); 0 = off (auto: eval_every for self-supervised algorithms, else off)")
    knn_k: int = P.param(200, P.Interval(1, None), "neighbours of the kNN evaluation")
    knn_temperature: float = P.param(0.1, _pos, "temperature of the kNN evaluation's weights exp(sim / t)")
    eval_personal: bool | None = P.param(None, None, "evaluate every client's own model: its personal model, else its last local model (auto: if the algorithm is personalised)")
    target_accuracy: float | None = P.param(None, P.Interval(0, 1), "report the first round reaching this test accuracy")
    client_memory_gb: float = P.param(4.0, _pos, "memory for client states before spilling to disk")
    checkpoint_every: int = P.param(1, P.Interval(1, None), "write a resumable checkpoint every this many rounds (and after the last)")
    on_bad_update: str = P.param("stop", P.OneOf(("stop", "skip")), "a client update that fails validation stops the run, or is left out of the round's aggregate")
    update_outlier_factor: float = P.param(0.0, _nonneg, "reject an update whose norm is more than this many times the round's median update norm; 0 = off")
    vectorize_memory_gb: float = P.param(2.0, _pos, "memory budget of one vectorized chunk of clients")
    cuda_graphs: bool = P.param(True, None, "vectorized executor on a GPU: replay each training step as a CUDA graph (a step that cannot be captured runs eagerly, with a warning)")
    pad_finished_clients: bool = P.param(False, None, "vectorized executor: clients that have finished their steps keep computing, their updates discarded, so that every step of a phase has one shape (one CUDA graph instead of one per number of clients still training)")
    tracking: str = P.param("none", Trackers(), "where else to log the config, every round's metrics and the summary: none, or tensorboard, mlflow, csv, several comma-separated (docs/tracking.md; pip install \"contrafl[tracking]\")")
    tracking_uri: str | None = P.param(None, None, "MLflow tracking URI (auto: $MLFLOW_TRACKING_URI, else a SQLite store in RUN_DIR/mlflow)")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.as_yaml() if isinstance(v, Component) else v
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SETTINGS = [f.name for f in dataclasses.fields(Config) if f.name not in COMPONENTS]

# Settings that say where and how a run executes, not what it computes: left out of the
# fingerprint, and the only ones a resumed run may change. The executor, workers and
# device change results at float tolerance only (README, "Speed").
EXECUTION_SETTINGS = (
    "data_dir",
    "download",
    "executor",
    "workers",
    "rank_executor",
    "device",
    "eval_batch_size",
    "client_memory_gb",
    "vectorize_memory_gb",
    "cuda_graphs",
    "pad_finished_clients",
    "checkpoint_every",
    "tracking",
    "tracking_uri",
)


# Settings and component options added after runs were first recorded, with the value
# that computes what runs did before they existed. At that value they are left out of
# the fingerprint, so that older runs keep theirs (and are still reused and reported).
NEUTRAL_VALUES: dict[str, Any] = {
    "pool": False,
    "normalize": "dataset",
    "knn_every": 0,
    "knn_k": 200,
    "knn_temperature": 0.1,
    "model.projection_hidden": None,
    "model.projection_bn": False,
    "model.projection_bias": True,
    "model.projection_out_bn": False,
    "algorithm.missing_label": "keep",
    "client_dropout": 0.0,
    "sampling": "seeded",
    "client_speed": "constant",
    "speed_jitter": 0.0,
    "round_deadline": None,
    "stragglers": "drop",
    "dp": "none",
    "aggregator": "mean",
    "attack": "none",
    "node_data": "shared",
    "server_test": None,
    "global_eval": "server",
    "algorithm.rotation_head": "train",  # the self-supervised baselines trained their rotation heads
    "algorithm.variant": "fedu2",  # Orchestra as FedU2's code runs it
}


def _neutral(key: str, value: Any) -> bool:
    """``key`` (a setting, or ``component.option``) holds its :data:`NEUTRAL_VALUES` value."""
    return key in NEUTRAL_VALUES and value == NEUTRAL_VALUES[key]


def fingerprint(config: Config | Mapping[str, Any]) -> str:
    """A hash of the settings of a resolved configuration that determine its results
    (all but :data:`EXECUTION_SETTINGS`, and those of :data:`NEUTRAL_VALUES` at their
    neutral value): two runs with equal fingerprints compute the same thing. A model of
    the user's code (``model=FILE.py:FACTORY``, ``model=MODULE:FACTORY``) adds the SHA-256
    of the file that defines it, so that editing the file makes another configuration."""
    from .usercode import is_reference, parse, source_digest

    tree = config.to_dict() if isinstance(config, Config) else dict(config)
    kept: dict[str, Any] = {}
    for k, v in tree.items():
        if k in EXECUTION_SETTINGS or _neutral(k, v):
            continue
        if isinstance(v, Mapping):
            v = {o: x for o, x in v.items() if not _neutral(f"{k}.{o}", x)}
        kept[k] = v
    model = tree.get("model")
    name = model.get("name") if isinstance(model, Mapping) else model
    if is_reference(name):
        try:
            kept["model.source_sha256"] = source_digest(parse(name))
        except ConfigError:  # not a valid reference: the name alone
            pass
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def flat_settings(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A configuration dict's fingerprinted settings, one level: ``{"lr": 0.01,
    "algorithm": "moon", "algorithm.mu": 5, ...}`` (:data:`EXECUTION_SETTINGS` left out)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if k in EXECUTION_SETTINGS:
            continue
        if isinstance(v, Mapping):
            out[k] = v.get("name")
            out.update({f"{k}.{o}": x for o, x in v.items() if o != "name"})
        else:
            out[k] = v
    return out


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``["algorithm.mu: 1.0 -> 5.0", ...]``: the fingerprinted settings that differ
    between two configuration dicts (components compared option by option)."""
    a, b = (
        {k: v for k, v in flat_settings(tree).items() if not _neutral(k, v)}
        for tree in (old, new)
    )
    return [f"{k}: {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
# ``auto`` is accepted for the settings whose default is None or "auto"
_AUTO = {f.name for f in dataclasses.fields(Config) if f.name in SETTINGS and f.default in (None, "auto")}


def _component(value: Any, key: str) -> Component:
    if isinstance(value, Component):
        return value
    if isinstance(value, str):
        return Component(value)
    if isinstance(value, Mapping):
        if "name" not in value:
            raise ConfigError(f"{key} needs a name, e.g. '{key}: {{name: ..., ...}}' or '{key}=NAME'")
        options = {k: v for k, v in value.items() if k != "name"}
        return Component(str(value["name"]), options)
    raise ConfigError(f"{key}={value!r} is invalid: expected a name or a mapping with a name")


def merge(tree: dict[str, Any], updates: Mapping[str, Any], source: str) -> None:
    """Merge a parsed YAML mapping into ``tree`` (components are replaced or extended)."""
    for key, value in updates.items():
        if key in COMPONENTS:
            new = _component(value, key)
            old = tree.get(key)
            if isinstance(old, Component) and P.fold(old.name) == P.fold(new.name) and isinstance(value, Mapping):
                new = Component(new.name, {**old.options, **new.options})
            tree[key] = new
        elif key in SETTINGS:
            tree[key] = value
        else:
            raise ConfigError(f"unknown setting {str(key)!r} in {source}{_hint(key)}")


def parse_overrides(items: Sequence[str]) -> list[tuple[str, str]]:
    """``["a=1", "algorithm.mu=5"]`` → ``[("a", "1"), ("algorithm.mu", "5")]``."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"cannot read override {item!r}: expected KEY=VALUE, e.g. rounds=20 or algorithm.mu=5")
        pairs.append((key.strip(), value.strip()))
    return pairs


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The configuration of a run: defaults, then the YAML file, then ``key=value`` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}; give the path of a YAML file or only KEY=VALUE overrides")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path} ({exc}); give a readable UTF-8 YAML file") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path} is not valid YAML{where}; fix the syntax") from None
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path} must contain a mapping of settings, not {type(data).__name__}")
        merge(tree, data, str(path))
    apply_overrides(tree, overrides)
    return build_config(tree)


def apply_overrides(tree: dict[str, Any], overrides: Sequence[str]) -> None:
    """Apply ``key=value`` overrides to a settings tree (:func:`apply_settings`)."""
    apply_settings(tree, parse_overrides(overrides))


def apply_settings(tree: dict[str, Any], pairs: Sequence[tuple[str, Any]]) -> None:
    """Apply ``(key, value)`` settings to a settings tree, component names first, so that
    ``algorithm.mu=5 algorithm=moon`` keeps ``mu``. An option of the run's algorithm may
    also be written with the algorithm's name, ``moon.mu=5`` with ``algorithm=moon``, as
    ``contrafl compare`` takes it. Values are strings from the command line or parsed
    YAML values (a component given as a mapping merges as in a YAML file)."""
    for key, value in sorted(pairs, key=lambda kv: "." in kv[0]):
        if key in COMPONENTS and not isinstance(value, str):
            merge(tree, {key: value}, f"{key}={value}")
            continue
        head, dot, option = key.partition(".")
        if dot and head not in COMPONENTS:
            algorithm = tree.get("algorithm") or Config().algorithm
            if P.fold(head) != P.fold(algorithm.name):
                close = P.suggest(head, list(COMPONENTS))
                raise ConfigError(
                    f"unknown setting {key!r}{close}; only {', '.join(COMPONENTS)} have options"
                    + ("" if close else f", and NAME.OPTION sets an option of the run's algorithm NAME, here "
                       f"{algorithm.name} (to run {head}: algorithm={head} {key}={value})")
                )
            head = "algorithm"
        if dot:
            old = tree.get(head) or getattr(Config(), head)
            tree[head] = Component(old.name, {**old.options, option: value})
        elif key in COMPONENTS:
            old = tree.get(key)
            keep = old.options if isinstance(old, Component) and P.fold(old.name) == P.fold(value) else {}
            tree[key] = Component(value, keep)
        elif key in SETTINGS:
            tree[key] = value
        else:
            raise ConfigError(f"unknown setting {key!r}{_hint(key)}")


def _hint(key: Any) -> str:
    close = P.suggest(key, SETTINGS + list(COMPONENTS))
    if close:
        return close
    return (
        "; options of a component are written with its name, e.g. algorithm.mu=5 or "
        "partition.beta=0.1 (see `contrafl list` and `contrafl run --help`)"
    )


def build_config(tree: Mapping[str, Any]) -> Config:
    """Validate a mapping of settings and components into a :class:`Config`."""
    settings = {}
    for key, value in tree.items():
        if key in COMPONENTS:
            continue
        if key in _AUTO and isinstance(value, str) and value.lower() == "auto":
            value = None if getattr(Config(), key) is None else "auto"
        settings[key] = value
    components = {k: _component(v, k) for k, v in tree.items() if k in COMPONENTS}
    settings_cls = _settings_class()
    built = P.build(settings_cls, settings, "")
    return Config(**components, **{f.name: getattr(built, f.name) for f in dataclasses.fields(built)})


def _settings_class() -> type:
    """Config without its components, for :func:`contrafl.params.build`."""
    fields = [
        (f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
        for f in dataclasses.fields(Config)
        if f.name in SETTINGS
    ]
    return dataclasses.make_dataclass("Settings", fields, frozen=True, namespace={"__module__": __name__})
