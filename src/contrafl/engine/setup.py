"""From a configuration to the components of a simulation.

:func:`prepare` validates every component's options, fills the ``auto`` settings
(dataset recommendations, the algorithm's server momentum, the device), loads the data,
partitions it and builds the algorithm. The returned :class:`Setup` carries the *resolved*
configuration, which is what a run directory records.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import params as P
from ..algorithms import ALGORITHMS, Algorithm
from ..algorithms.base import Federation
from ..config import DEFAULT_CLIENTS, DEFAULT_PARTITION, Component, Config, component_name, without_options
from ..cores import cpu_cores
from ..data import augment
from ..data.base import ArrayDataset, FederatedDataset
from ..data.partition import PARTITIONS, Partition, make_partition
from ..data.registry import DATASETS, DatasetSpec, LoadRequest
from ..errors import ConfigError, DataError
from ..models import build_model
from ..models.custom import from_user, vectorizable
from ..models.build import model_spec as lookup_model
from ..models.registry import split_options
from ..models.base import FedModel, smallest_batch
from ..models.stacked import stacked_forward
from ..rng import derive_seed
from ..words import count
from ..execution.context import Setup
from ..execution.distributed import can_fork, launched
from ..execution.stacked import STACK_WIDTH, stack_width
from .sampling import clients_per_round
from .attacking import Attack, resolve_attack
from .privacy import MODES, DPParams
from .robustness import resolve_aggregator


def resolve_device(name: str) -> torch.device:
    if P.fold(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but PyTorch sees no CUDA device; use device=cpu or device=auto")
    return torch.device(name)


CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""The CPU features (``/proc/cpuinfo`` flags) of native bfloat16 arithmetic."""


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux's ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively: a CUDA GPU that supports it, or a
    CPU with AMX or AVX512-BF16 (where oneDNN's bf16 kernels run)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and any(flag in cpu_flags() for flag in CPU_BF16_FLAGS)


def resolve_precision(name: str, device: torch.device) -> str:
    """``fp32`` or ``bf16`` for the setting ``name`` on ``device``: ``auto`` takes bf16
    where the device has it natively; bf16 on a device without it is a
    :class:`ConfigError` (emulated, it would be slower than fp32)."""
    native = native_bf16(device)
    if name == "auto":
        return "bf16" if native else "fp32"
    if name == "bf16" and not native:
        where = "this CPU has neither AMX nor AVX512-BF16" if device.type == "cpu" else f"{device.type} has no native bfloat16"
        raise ConfigError(f"precision=bf16 but {where}; use precision=fp32, or precision=auto (bf16 where the device has it)")
    return name


def load_data(cfg: Config) -> tuple[FederatedDataset, Component]:
    """Load the configured dataset; returns it and its validated component."""
    spec = DATASETS.get(cfg.dataset.name)
    options = P.build(spec.options, cfg.dataset.options, "dataset")
    data_dir = check_data_dir(cfg)
    request = LoadRequest(
        data_dir=data_dir,
        allow_subset=cfg.allow_subset,
        download=cfg.download,
        options=options,
        num_clients=cfg.num_clients,
        seed=cfg.seed,
    )
    return spec.load(request), Component(spec.name, P.to_dict(options))


def check_data_dir(cfg: Config) -> Path | None:
    """The configured data directory of a simulation, checked to exist when the dataset
    needs one (a config of ``node_data=own``, a federation whose nodes hold the data, is
    no simulation)."""
    if cfg.node_data == "own":
        raise ConfigError(
            "node_data=own: each Flower SuperNode holds its own data, which a simulation does not have; simulate the "
            "federation on copies of the sites' data (data_dir=ROOT partition=natural, ROOT/clients/<site>/...), or "
            "deploy it (contrafl deploy ... --node-data PATH per site)"
        )
    spec = DATASETS.get(cfg.dataset.name)
    data_dir = Path(cfg.data_dir).expanduser() if cfg.data_dir else None
    get = (
        f"get the files with `contrafl data download {spec.name} --data-dir DIR`" if spec.download is not None
        else f"point it to your files (`contrafl list datasets` shows the layouts {spec.name} reads)"
    )
    if spec.needs_data_dir and data_dir is None:
        raise ConfigError(f"dataset {spec.name} needs data_dir=PATH; {get}")
    if data_dir is not None and spec.needs_data_dir and not data_dir.exists() and not cfg.download:
        raise ConfigError(f"data_dir={cfg.data_dir} does not exist; {get.replace('DIR', str(cfg.data_dir))}")
    return data_dir


def resolve(cfg: Config) -> Config:
    """``cfg`` with every component validated and canonically named and every ``auto``
    setting filled in, without loading any data (so that a suite of runs fails at once
    on a typo in its last run): the configuration a run directory records and
    fingerprints (:func:`contrafl.config.fingerprint`)."""
    algo_cls = ALGORITHMS.get(cfg.algorithm.name)
    algo_params = P.build(algo_cls.Params, cfg.algorithm.options, "algorithm")
    spec = DATASETS.get(cfg.dataset.name)
    dataset_options = P.build(spec.options, cfg.dataset.options, "dataset")
    model_spec = lookup_model(spec.default_model if P.fold(cfg.model.name) == "auto" else cfg.model.name)
    head, backbone = split_options(model_spec, cfg.model.options)
    augment_name = augment.AUGMENTATIONS.canonical(resolve_augment(cfg.augment, spec, algo_cls))
    partition_name, num_clients = natural_split(cfg, fixed_clients(cfg, spec, dataset_options))
    partition = PARTITIONS.get(partition_name)
    partition_options = P.build(partition.options, cfg.partition.options, "partition")
    if cfg.pool and cfg.test_fraction == 0:
        raise ConfigError(
            "pool=true puts the official test set into the clients' data and leaves no test set; "
            "set test_fraction=0.25 (PFLlib) so that each client keeps a local test split"
        )
    if cfg.stragglers == "partial" and cfg.round_deadline is None:
        raise ConfigError("stragglers=partial keeps the work clients finish by round_deadline, which is not set; set round_deadline=T (local steps of a speed-1 client)")
    if cfg.stragglers == "partial" and not algo_cls.partial_work:
        takes = ", ".join(sorted(name for name, cls in ALGORITHMS.items() if cls.partial_work))
        raise ConfigError(
            f"stragglers=partial but {algo_cls.name} counts only complete local work (algorithms that accept partial work: {takes}); "
            "use stragglers=drop, or algorithm=fedprox (algorithm.mu=0 is FedAvg that keeps partial work)"
        )
    dp = resolve_dp(cfg.dp, algo_cls, algo_params)
    per_round = clients_per_round(num_clients, cfg.sample_fraction if algo_cls.samples_clients else 1.0)
    aggregator = resolve_aggregator(cfg.aggregator, algo_cls, algo_params, dp.name, per_round)
    attack = resolve_attack(cfg.attack, num_clients, per_round)
    if attack.name != "none" and not algo_cls.samples_clients:
        raise ConfigError(f"attack={attack.name} crafts what clients send, and {algo_cls.name}'s clients send nothing; leave attack unset")
    if dp.name == "central" and cfg.update_outlier_factor > 0:
        raise ConfigError(
            f"update_outlier_factor={cfg.update_outlier_factor:g} judges updates by their norms before dp=central clips them, "
            "so one client's data could remove other clients from the sum (beyond the sensitivity epsilon assumes) and the "
            "rejections would publish exact norms; set update_outlier_factor=0 (clipping to dp.clip already bounds every update)"
        )
    if not algo_cls.supervised and cfg.eval_personal:
        raise ConfigError(
            f"eval_personal=true evaluates classifiers, and {algo_cls.name} learns representations without one; "
            "leave eval_personal unset: the run reports kNN accuracy (knn_every)"
        )
    knn_every = cfg.knn_every if cfg.knn_every is not None else (0 if algo_cls.supervised else cfg.eval_every)
    if cfg.node_data == "own":
        check_own_data(cfg, spec, dataset_options)
        why = algo_cls.needs_all_clients_data(algo_params)
        if why is not None:
            raise ConfigError(f"node_data=own: the nodes share nothing about their data, and {why}")
        knn_every = 0
    elif cfg.server_test is not None:
        raise ConfigError(
            f"server_test={cfg.server_test} is the test set of a server whose nodes hold their own data; "
            "set node_data=own, or drop server_test (the dataset's test split is the server's)"
        )
    global_eval = cfg.global_eval
    if global_eval == "auto":
        global_eval = "federated" if cfg.node_data == "own" and cfg.server_test is None else "server"
    if global_eval == "server" and cfg.node_data == "own" and cfg.server_test is None:
        raise ConfigError(
            "global_eval=server but the server of node_data=own holds no test set; give it one with server_test=PATH, "
            "or set global_eval=federated (the clients evaluate the global model on their test splits)"
        )
    device = resolve_device(cfg.device)
    rec = spec.recommended
    cfg = dataclasses.replace(
        cfg,
        dataset=Component(spec.name, P.to_dict(dataset_options)),
        model=Component(model_spec.name, {**P.to_dict(head), **P.to_dict(backbone)}),
        algorithm=Component(algo_cls.name, P.to_dict(algo_params)),
        dp=dp,
        aggregator=aggregator,
        attack=attack,
        data_dir=str(Path(cfg.data_dir).expanduser().resolve()) if cfg.data_dir else None,
        num_clients=num_clients,
        rounds=cfg.rounds if cfg.rounds is not None else rec["rounds"],
        local_epochs=cfg.local_epochs if cfg.local_epochs is not None else rec["local_epochs"],
        batch_size=cfg.batch_size if cfg.batch_size is not None else max(rec["batch_size"], algo_cls.min_batch_size),
        augment=augment_name,
        sample_fraction=cfg.sample_fraction if algo_cls.samples_clients else 1.0,
        server_momentum=(
            cfg.server_momentum if cfg.server_momentum is not None else algo_cls.default_server_momentum
        ),
        device=device.type,
        precision=resolve_precision(cfg.precision, device),
        eval_personal=(
            cfg.eval_personal if cfg.eval_personal is not None
            else algo_cls.supervised and (algo_cls.personalized or cfg.test_fraction > 0)
        ),
        knn_every=knn_every,
        global_eval=global_eval,
        partition=Component("natural") if cfg.node_data == "own" else Component(partition.name, P.to_dict(partition_options)),
        server_test=str(Path(cfg.server_test).expanduser().resolve()) if cfg.server_test else None,
    )
    executor = choose_executor(cfg, algo_cls, device)
    if executor == "distributed" and launched() is not None:  # the ranks torchrun started
        workers = launched()[1]
    else:
        workers = cfg.workers or default_workers(cfg, executor)
    return dataclasses.replace(cfg, executor=executor, workers=workers, rank_executor=choose_rank_executor(cfg, executor, algo_cls, device))


def fixed_clients(cfg: Config, spec: DatasetSpec, options: Any) -> list[str] | None:
    """The clients the files at ``cfg.data_dir`` are split into (:attr:`DatasetSpec.clients`,
    read without decoding a sample), or ``None``: a dataset whose files never fix its
    clients, a layout that is not split per client, or ``node_data=own`` (the server holds
    no files)."""
    if spec.clients is None or cfg.node_data == "own":
        return None
    data_dir = check_data_dir(cfg)
    return spec.clients(LoadRequest(data_dir=data_dir, options=options, seed=cfg.seed))


def natural_split(cfg: Config, clients: list[str] | None) -> tuple[str, int]:
    """``(partition, num_clients)`` of ``cfg``. For files split per client (``clients``,
    :func:`fixed_clients`): ``natural`` and the number of clients, which ``partition`` and
    ``num_clients``, when set, must be (a one-line :class:`ConfigError` naming both values,
    before any sample is read); otherwise the settings, ``auto`` being
    :data:`~contrafl.config.DEFAULT_PARTITION` and :data:`~contrafl.config.DEFAULT_CLIENTS`."""
    name, given = cfg.partition.name, cfg.num_clients
    if clients is None:
        return (DEFAULT_PARTITION if P.fold(name) == "auto" else name), (DEFAULT_CLIENTS if given is None else given)
    shown = ", ".join(clients[:5]) + (", ..." if len(clients) > 5 else "")
    data = f"the files of data_dir={cfg.data_dir}" if cfg.data_dir else f"the data of dataset={cfg.dataset.name}"
    held = f"{data} are split into {count(len(clients), 'client')} ({shown})"
    if P.fold(name) not in ("auto", "natural"):
        raise ConfigError(f"partition={name}, but {held}, whose partition is natural; leave partition unset or set partition=natural")
    if given is not None and given != len(clients):
        raise ConfigError(f"num_clients={given}, but {held}; leave num_clients unset or set num_clients={len(clients)}")
    return "natural", len(clients)


def resolved_clients(cfg: Config) -> int:
    """The number of clients :func:`resolve` gives ``cfg`` (:func:`natural_split`), for
    checks made before it runs."""
    spec = DATASETS.get(cfg.dataset.name)
    return natural_split(cfg, fixed_clients(cfg, spec, P.build(spec.options, cfg.dataset.options, "dataset")))[1]


def choose_rank_executor(cfg: Config, executor: str, algo_cls: type[Algorithm], device: torch.device) -> str:
    """How each rank of the distributed executor trains its share of a round's clients
    (``rank_executor``; the setting as given for the other executors, which do not read
    it). ``auto``: stacked (the vectorized executor) on a GPU where the algorithm allows,
    as ``executor=auto`` trains them in one process there; one after the other on a CPU,
    unless :func:`choose_stacking`, which sees the model and the partition, stacks them."""
    if executor != "distributed":
        return cfg.rank_executor
    if cfg.rank_executor == "vectorized" and not algo_cls.vectorizable:
        raise ConfigError(
            f"rank_executor=vectorized is not possible: algorithm {algo_cls.name} cannot be vectorized; "
            "use rank_executor=sequential or auto"
        )
    if cfg.rank_executor != "auto":
        return cfg.rank_executor
    return "vectorized" if device.type == "cuda" and algo_cls.vectorizable else "sequential"


def check_own_data(cfg: Config, spec: DatasetSpec, options: Any) -> None:
    """:class:`ConfigError` unless ``cfg`` (``node_data=own``) says what the nodes of a
    federation must agree on, and asks nothing of the server that needs their data."""
    from ..data.user import CommonOptions

    fix = "(docs/flower.md, \"Three sites, three folders\")"
    if not isinstance(options, CommonOptions):
        raise ConfigError(
            f"node_data=own: each SuperNode reads its own files, and dataset {spec.name} is not read from a user's files; "
            f"use dataset=folder, arrays, huggingface, pfllib or leaf {fix}"
        )
    if cfg.data_dir is not None:
        raise ConfigError(
            f"node_data=own: the server holds no training data, but data_dir={cfg.data_dir} is set; drop it "
            "(each SuperNode's node config says where its own data are: data=PATH)"
        )
    if options.classes is None or options.shape is None:
        missing = "dataset.classes" if options.classes is None else "dataset.shape"
        raise ConfigError(
            f"node_data=own: the nodes must agree on the class names in order and the input shape, and {missing} is not set; "
            f"set dataset.classes=[NAME,...] and dataset.shape=[C,H,W] (or [D]) {fix}"
        )
    if len(options.shape) == 3 and cfg.normalize == "dataset" and options.mean is None:
        raise ConfigError(
            "node_data=own: the normalisation cannot come from data the server does not hold; set dataset.mean=[...] and "
            f"dataset.std=[...] (the images' per-channel statistics), or normalize=half {fix}"
        )
    if cfg.pool or cfg.test_fraction > 0:
        raise ConfigError(
            "node_data=own: each node's test split comes with its data (a test folder or split, or dataset.test_fraction); "
            "leave pool=false and test_fraction=0"
        )
    if cfg.knn_every is not None and cfg.knn_every > 0:
        raise ConfigError(
            f"knn_every={cfg.knn_every}: the kNN evaluation needs every client's training data in one place, which "
            "node_data=own does not have; set knn_every=0"
        )


def resolve_dp(dp: Component, algo_cls: type[Algorithm], algo_params: Any) -> Component:
    """The ``dp`` component validated and in canonical form: ``none``, or ``central`` /
    ``local`` with every option of :class:`~contrafl.engine.privacy.DPParams`; a one-line
    error for a mode the algorithm cannot take."""
    mode = component_name(dp, "dp", MODES, "set it with dp=central or dp=local")
    if mode == "none":
        return without_options(dp, "dp", "none", "add dp=central (the server adds the noise) or dp=local (each client does)")
    options = P.build(DPParams, dp.options, "dp")
    why = algo_cls.individual_updates(algo_params)
    if not algo_cls.samples_clients:
        raise ConfigError(f"dp={mode} protects what clients send, and {algo_cls.name}'s clients send nothing; leave dp unset")
    if why is not None and mode == "central":
        raise ConfigError(
            f"dp=central needs a server that aggregates the sum of the updates, but {why}; "
            "use dp=local (each client adds its own noise) or another algorithm"
        )
    return Component(mode, P.to_dict(options))


def resolve_augment(name: str, spec: DatasetSpec, algo_cls: type[Algorithm]) -> str:
    """The augmentation of ``augment=name``: ``auto`` is the dataset's pipeline, and for
    self-supervised algorithms, whose views of a sample must differ, the dataset's
    two-view pipeline (:attr:`DatasetSpec.ssl_augment`)."""
    if P.fold(name) != "auto":
        return name
    if algo_cls.supervised:
        return spec.augment
    if spec.ssl_augment is None:
        raise ConfigError(
            f"algorithm {algo_cls.name} learns from differently augmented views of each sample, and dataset "
            f"{spec.name} has no default two-view augmentation; set augment=NAME (`contrafl list augmentations`), "
            "or augment=none to train on identical views"
        )
    return spec.ssl_augment


def default_workers(cfg: Config, executor: str) -> int:
    """The processes of ``executor`` when ``workers`` is not set: the CPU cores for the
    parallel and distributed executors, for the distributed one at most the clients a
    round trains (a rank beyond them would be started, joined and never given a client;
    the ranks share the cores), 1 for the others."""
    if executor == "parallel":
        return cpu_cores()
    if executor == "distributed":
        return min(cpu_cores(), clients_per_round(cfg.num_clients, cfg.sample_fraction))
    return 1


def choose_executor(cfg: Config, algo_cls: type[Algorithm], device: torch.device) -> str:
    """The executor for ``executor=auto`` (``distributed`` under ``torchrun``).

    On CUDA: the vectorized executor for algorithms that support it. On a multi-core
    CPU, when a round trains at least two clients (:func:`~contrafl.engine.sampling.
    clients_per_round`): the distributed executor, one process a core (one client's
    small operations do not use many cores well), each rank training its share one client
    at a time or stacked (:func:`choose_stacking`). Measured on 2 cores
    against the parallel executor, which forks its workers every round: as fast or
    faster on every shape tried, from MOON with ResNet-18 (59.0 against 58.7 s) and the
    silo shape (14.0 against 15.0 s) to pfl-research's device round of 50 clients of 5
    steps (24.2 against 33.4 s) and the digits default (5.6 against 6.8 s;
    docs/performance.md). Otherwise the sequential executor, or the vectorized one where
    the clients stack (:func:`choose_stacking`).
    """
    can_vectorize = algo_cls.vectorizable
    if cfg.executor == "vectorized" and not can_vectorize:
        raise ConfigError(
            f"executor=vectorized is not possible: algorithm {algo_cls.name} cannot be vectorized; "
            "use executor=sequential or executor=auto"
        )
    if cfg.executor == "parallel" and device.type != "cpu":
        raise ConfigError("executor=parallel trains on the CPU; use executor=vectorized or auto with device=cuda")
    if cfg.executor == "parallel" and not can_fork():
        raise ConfigError(
            f"executor=parallel forks its workers every round, which is safe on Linux only (this is {sys.platform}); "
            "use executor=distributed or auto (workers started once, for the whole run)"
        )
    if launched() is not None:  # one of several processes of torchrun
        if cfg.executor not in ("auto", "distributed"):
            raise ConfigError(
                f"executor={cfg.executor} under torchrun, which starts the ranks of executor=distributed; "
                "set executor=distributed (or auto), or run contrafl without torchrun"
            )
        return "distributed"
    if cfg.executor != "auto":
        return cfg.executor
    if device.type == "cuda":
        return "vectorized" if can_vectorize else "sequential"
    if cpu_cores() > 1 and clients_per_round(cfg.num_clients, cfg.sample_fraction) >= 2:
        return "distributed"
    return "sequential"


def check_vectorizable(requested: Config, cfg: Config, model: FedModel, shape: tuple[int, ...]) -> tuple[Config, list[str]]:
    """``cfg`` with the sequential executor, and a note saying why, when the vectorized
    executor that ``executor=auto`` chose (or ``rank_executor=auto``, for the ranks of the
    distributed one) cannot train a model of the user's code or of a plugin
    (:func:`~contrafl.models.custom.vectorizable`); a :class:`ConfigError` when the user
    asked for it. Built-in models are known to vectorise."""
    setting = "rank_executor" if cfg.executor == "distributed" else "executor"
    if getattr(cfg, setting) != "vectorized" or not from_user(cfg.model.name):
        return cfg, []
    why = vectorizable(model, shape)
    if why is None:
        return cfg, []
    if getattr(requested, setting) == "vectorized":
        raise ConfigError(f"{setting}=vectorized cannot train model {cfg.model.name}: torch.func fails on it ({why}); use {setting}=sequential")
    note = f"{setting}=auto: torch.func cannot vectorise model {cfg.model.name} ({why}); training clients one at a time ({setting}=sequential)"
    return dataclasses.replace(cfg, **{setting: "sequential"}), [note]


def choose_stacking(requested: Config, cfg: Config, model: FedModel, partition: Partition, algo_cls: type[Algorithm]) -> Config:
    """``cfg`` with the vectorized executor instead of the sequential one that
    ``executor=auto`` (or ``rank_executor=auto``) chose on a CPU, where stacking the
    clients pays: a vectorizable algorithm, a model with a stacked forward
    (:func:`~contrafl.models.stacked.stacked_forward`: grouped convolutions and batched
    products) and clients that take their steps together, at least
    :data:`~contrafl.execution.stacked.STACK_WIDTH` of them a stacked step on average
    (:func:`~contrafl.execution.stacked.stack_width` over the partition, as many at a
    time as a process trains a round)."""
    setting = "rank_executor" if cfg.executor == "distributed" else "executor"
    if (
        getattr(requested, setting) != "auto" or getattr(cfg, setting) != "sequential" or cfg.device != "cpu"
        or not algo_cls.vectorizable or stacked_forward(model) is None
    ):
        return cfg
    per_process = -(-clients_per_round(cfg.num_clients, cfg.sample_fraction) // (cfg.workers if setting == "rank_executor" else 1))
    sizes = [len(rows) for rows in partition.train]
    if stack_width(sizes, per_process, cfg.batch_size, cfg.local_epochs, cfg.drop_last) < STACK_WIDTH:
        return cfg
    return dataclasses.replace(cfg, **{setting: "vectorized"})


def prepare(cfg: Config, partition: Partition | None = None) -> Setup:
    """Resolve ``cfg`` (:func:`resolve`), load and partition the data (or take
    ``partition``, a run's recorded partition, checked against the data), build the
    algorithm. With ``node_data=own`` (the server of a federation whose nodes hold their
    own data) the data are :func:`federation_data`: no training samples, and the
    ``server_test`` set, if any."""
    requested, cfg = cfg, resolve(cfg)
    if cfg.node_data == "own":
        data = federation_data(cfg)
        if partition is None:
            empty = np.zeros(0, dtype=np.int64)
            partition = Partition("natural", {}, cfg.seed, train=[empty] * cfg.num_clients)
        check_fits(partition, cfg.num_clients, 0)
        return build(requested, cfg, data, partition)
    data, _ = load_data(cfg)
    if cfg.pool:
        data = data.pooled()
    data = normalised(cfg, data)
    if data.natural_partition is not None and cfg.partition.name != "natural":
        raise ConfigError(
            f"dataset {data.name} is federated by construction; use partition=natural "
            f"(got partition={cfg.partition.name})"
        )
    labels = data.train.y.numpy()
    if cfg.num_clients > len(labels):
        raise ConfigError(
            f"num_clients={cfg.num_clients} is larger than the {len(labels)} training samples of "
            f"{data.name}; choose num_clients <= {len(labels)}"
        )
    local_tests = None
    if data.local_test and cfg.partition.name == "natural":
        if cfg.test_fraction > 0:
            raise ConfigError(
                f"dataset {data.name} gives each client its own test data, and test_fraction={cfg.test_fraction:g} "
                "would split another test part off its training data; leave test_fraction=0"
            )
        data, local_tests = data.with_local_tests()
    if partition is not None:
        check_fits(partition, cfg.num_clients, len(data.train))
    else:
        partition = make_partition(
            labels,
            cfg.num_clients,
            cfg.partition.name,
            cfg.partition.options,
            seed=cfg.seed,
            test_fraction=cfg.test_fraction,
            natural=(data.natural_partition or {}).get("train"),
            num_classes=data.num_classes,
        )
        if local_tests is not None:
            partition = dataclasses.replace(partition, test=[np.asarray(rows, dtype=np.int64) for rows in local_tests])
    if cfg.global_eval == "federated" and partition.test is None:
        raise ConfigError(
            "global_eval=federated evaluates the global model on the clients' local test splits, and they have none; "
            "set test_fraction=0.25, or use a dataset whose clients have test data of their own (partition=natural)"
        )
    return build(requested, cfg, data, partition)


def normalised(cfg: Config, data: FederatedDataset) -> FederatedDataset:
    """``data`` with the normalisation of ``cfg.normalize``: the dataset's own, ``half``
    (0.5 / 0.5) or ``none``."""
    if cfg.normalize == "half" and data.mean is not None:
        return dataclasses.replace(data, mean=(0.5,) * len(data.mean), std=(0.5,) * len(data.std))
    if cfg.normalize == "none":
        return dataclasses.replace(data, mean=None, std=None)
    return data


def build(requested: Config, cfg: Config, data: FederatedDataset, partition: Partition) -> Setup:
    """The :class:`Setup` of the resolved ``cfg`` on ``data`` and ``partition`` (checked
    to suit the algorithm and the augmentation); ``requested``: ``cfg`` as given, for
    the warnings."""
    algo_cls = ALGORITHMS.get(cfg.algorithm.name)
    algo_params = P.build(algo_cls.Params, cfg.algorithm.options, "algorithm")
    device = torch.device(cfg.device)
    shape = data.input_shape
    why = algo_cls.input_problem(algo_params, shape)
    if why is not None:
        raise ConfigError(why)
    train_transform = augment.AUGMENTATIONS.get(cfg.augment)(data.mean, data.std)
    why = train_transform.input_problem(shape)
    if why is not None:
        fits = "augment=scarf or augment=none" if len(shape) == 1 else "augment=none or a pipeline for these images"
        raise ConfigError(
            f"augment={cfg.augment} cannot augment dataset {data.name}: {why}, and its samples have shape "
            f"{list(shape)}; use {fits} (`contrafl list augmentations`)"
        )
    model_factory = functools.partial(init_model, cfg, data, algo_cls, algo_params)
    model = model_factory(derive_seed(cfg.seed, "global-init"))
    smallest = smallest_batch(model)
    if cfg.batch_size < smallest:
        raise ConfigError(
            f"batch_size={cfg.batch_size} cannot train model {cfg.model.name}: its BatchNorm layers normalise each "
            f"feature over a batch, which needs at least {smallest} samples; use batch_size={smallest} or more"
        )
    cfg, notes = check_vectorizable(requested, cfg, model, shape)
    cfg = choose_stacking(requested, cfg, model, partition, algo_cls)
    federation = Federation(
        num_clients=cfg.num_clients,
        num_classes=data.num_classes,
        rounds=cfg.rounds,
        lr=cfg.lr,
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        param_names=tuple(name for name, _ in model.named_parameters()),
        seed=cfg.seed,
        rep_dim=model.out_dim,
        client_sizes=tuple(len(rows) for rows in partition.train),
    )
    algorithm = algo_cls(algo_params, federation)
    attack = Attack.of(cfg)
    if attack is not None:  # what an attack needs of the algorithm and the data; the attackers' data poisoned
        message = algorithm.broadcast(algorithm.init_server(dict(model.state_dict())), 0)
        resolve_attack(cfg.attack, cfg.num_clients, cfg.num_clients, has_tables(algorithm.reply_spec(message)),
                       algo_cls.supervised, data.num_classes)
        data = attack.poisoned(data, partition)
    return Setup(
        config=cfg,
        data=data,
        partition=partition,
        algorithm=algorithm,
        model=model,
        model_factory=model_factory,
        train_transform=train_transform,
        eval_transform=augment.eval_transform(data.mean, data.std),
        device=device,
        warnings=[*notes, *setup_warnings(requested, cfg, algo_cls, partition)],
    )


def has_tables(spec: Any) -> bool:
    """Whether a reply of :class:`~contrafl.algorithms.base.TensorSpec` tree ``spec``
    carries a per-label table (``reps`` with ``counts`` or ``mask``)."""
    if isinstance(spec, dict):
        return ("reps" in spec and ("counts" in spec or "mask" in spec)) or any(has_tables(v) for v in spec.values())
    if isinstance(spec, (list, tuple)):
        return any(has_tables(v) for v in spec)
    return False


def federation_data(cfg: Config) -> FederatedDataset:
    """What the server of a federation whose nodes hold their own data (``node_data=own``,
    resolved) knows of them: the classes, the input shape and the normalisation the
    config says, no training samples, and as the test set the ``server_test`` set (none
    without one: the global model is then evaluated by the clients)."""
    spec = DATASETS.get(cfg.dataset.name)
    options = P.build(spec.options, cfg.dataset.options, "dataset")
    shape = tuple(int(d) for d in options.shape)
    dtype = torch.uint8 if len(shape) == 3 and options.mean is None and cfg.normalize == "dataset" else torch.float32
    empty = ArrayDataset(torch.zeros((0, *shape), dtype=dtype), torch.zeros(0, dtype=torch.long))
    mean = tuple(options.mean) if len(shape) == 3 and options.mean is not None else None
    std = tuple(options.std) if len(shape) == 3 and options.std is not None else None
    data = FederatedDataset(spec.name, empty, empty, list(options.classes), mean, std, info={"node_data": "own"})
    if cfg.server_test is not None:
        held = spec.load(LoadRequest(data_dir=Path(cfg.server_test), options=options, num_clients=1, seed=cfg.seed))
        x, y = torch.cat([held.train.x, held.test.x]), torch.cat([held.train.y, held.test.y])
        data = dataclasses.replace(data, test=ArrayDataset(x, y), info={**data.info, "server_test": cfg.server_test})
    return normalised(cfg, data)


def prepare_node(cfg: Config, data_dir: Path, cid: int) -> Setup:
    """The setup of client ``cid`` of a federation whose nodes hold their own data
    (``node_data=own``), on this node's data in ``data_dir`` (in the config's dataset
    format), read with the classes, shape and normalisation the config says (samples of
    another class or shape are a :class:`~contrafl.errors.DataError`). As
    :func:`own_rows` gives a client of a shared dataset: the training split holds its
    training samples, then its test samples, and the partition gives it those rows and
    the other clients none."""
    requested, cfg = cfg, resolve(cfg)
    spec = DATASETS.get(cfg.dataset.name)
    options = P.build(spec.options, cfg.dataset.options, "dataset")
    loaded = spec.load(LoadRequest(data_dir=Path(data_dir), options=options, num_clients=1, seed=cfg.seed))
    clients = loaded.natural_partition["train"] if loaded.natural_partition is not None else [range(len(loaded.train))]
    if len(clients) != 1:
        names = ", ".join((loaded.client_names or [])[:5])
        raise DataError(
            f"data={data_dir} holds the data of {len(clients)} clients ({names}); give each SuperNode only its own data"
        )
    n_train, n_test = len(loaded.train), len(loaded.test)
    data = dataclasses.replace(
        normalised(cfg, loaded),
        train=ArrayDataset(torch.cat([loaded.train.x, loaded.test.x]), torch.cat([loaded.train.y, loaded.test.y])),
        test=ArrayDataset(loaded.test.x[:0], loaded.test.y[:0]),
        natural_partition=None, local_test=False,
    )
    partition = Partition.one_client("natural", {}, cfg.seed, cfg.num_clients, cid, n_train, n_test or None)
    return build(requested, cfg, data, partition)


def check_fits(partition: Partition, num_clients: int, num_samples: int) -> None:
    """Raise a :class:`DataError` unless ``partition`` has ``num_clients`` clients whose
    rows index ``num_samples`` training samples."""
    if partition.num_clients != num_clients:
        raise DataError(f"the partition has {partition.num_clients} clients but num_clients={num_clients}; use the run's own config.yaml")
    parts = partition.train + (partition.test or [])
    top = max((int(rows.max()) for rows in parts if len(rows)), default=-1)
    if top >= num_samples:
        raise DataError(
            f"the partition indexes training sample {top} but the data have {num_samples}; "
            "use the dataset files the run was partitioned on"
        )


def own_rows(setup: Setup, cid: int) -> Setup:
    """``setup`` as client ``cid`` sees it: the training data are its own rows alone
    (its training rows, then its local test rows) and the partition gives it those rows
    in that order and the other clients none. Its batches are the same samples as in the
    full setup (:func:`~contrafl.execution.plan.make_plan` draws positions in the client's
    row list, not row numbers); the algorithm keeps the federation it was built with."""
    part = setup.partition
    train = part.train[cid]
    test = part.test[cid] if part.test is not None else np.zeros(0, dtype=np.int64)
    rows = torch.as_tensor(np.concatenate([train, test]), dtype=torch.long)
    data = dataclasses.replace(setup.data, train=ArrayDataset(setup.data.train.x[rows], setup.data.train.y[rows]))
    mine = Partition.one_client(
        part.method, part.options, part.seed, part.num_clients, cid, len(train), None if part.test is None else len(test),
    )
    return dataclasses.replace(setup, data=data, partition=mine)


def setup_warnings(requested: Config, cfg: Config, algo_cls: type[Algorithm], partition: Partition) -> list[str]:
    """Settings that are valid but probably not what the user meant (``requested``: as
    given, ``cfg``: resolved)."""
    out = []
    params, defaults = P.build(algo_cls.Params, cfg.algorithm.options, "algorithm"), algo_cls.Params()
    for option, when in algo_cls.inapplicable(params).items():
        if getattr(params, option) != getattr(defaults, option):
            setting = when.partition("=")[0]
            where = f"with algorithm.{when}" if hasattr(defaults, setting) else f"with {when}, and {algo_cls.name} has no {setting} option"
            out.append(
                f"algorithm.{option}={getattr(params, option)} has no effect on {algo_cls.name}: it applies only {where} "
                "(`contrafl list algorithms` shows the options that apply)"
            )
    if not algo_cls.supervised and cfg.augment == "none":
        out.append(
            f"augment=none gives {algo_cls.name}'s views of a sample the same input, so its self-supervised "
            f"loss compares a sample with itself; the dataset's two-view augmentation is augment=auto"
        )
    if not algo_cls.samples_clients and requested.sample_fraction < 1:
        out.append(f"{algo_cls.name} trains every client every round; sample_fraction is ignored")
    out += execution_warnings(requested, cfg)
    if cfg.drop_last:
        small = [cid for cid, rows in enumerate(partition.train) if 0 < len(rows) < cfg.batch_size]
        if small:
            shown = ", ".join(map(str, small[:10])) + (", ..." if len(small) > 10 else "")
            out.append(
                f"{len(small)} of {cfg.num_clients} clients have fewer than batch_size={cfg.batch_size} "
                f"training samples and take no local step (drop_last=true; clients {shown}); "
                "lower batch_size, use fewer clients or set drop_last=false"
            )
    return out


VECTORIZED_SETTINGS = ("vectorize_memory_gb", "pad_finished_clients", "cuda_graphs")
"""Settings that only the vectorized executor reads."""


def execution_warnings(requested: Config, cfg: Config) -> list[str]:
    """How the run executes, as given (``requested``) and resolved (``cfg``): settings
    that the chosen executor does not read (``rank_executor`` outside the distributed
    executor; the vectorized executor's settings where clients are trained one at a time,
    ``cuda_graphs`` off the GPU), and ranks that a round has no client for."""
    out = []
    if requested.rank_executor != "auto" and cfg.executor != "distributed":
        out.append(
            f"rank_executor={requested.rank_executor} has no effect with executor={cfg.executor}: it says how each "
            "rank of executor=distributed trains its share of a round's clients"
        )
    default = Config()
    changed = {
        k: str(v).lower() if isinstance(v, bool) else str(v)  # as a config writes it
        for k in VECTORIZED_SETTINGS if (v := getattr(requested, k)) != getattr(default, k)
    }
    if (cfg.rank_executor if cfg.executor == "distributed" else cfg.executor) != "vectorized":
        how = f"executor={cfg.executor}" + (f" rank_executor={cfg.rank_executor}" if cfg.executor == "distributed" else "")
        out += [
            f"{k}={value} has no effect with {how}: only the vectorized executor reads it "
            "(executor=vectorized, or rank_executor=vectorized with executor=distributed)"
            for k, value in changed.items()
        ]
    elif "cuda_graphs" in changed and cfg.device != "cuda":
        out.append(f"cuda_graphs={changed['cuda_graphs']} has no effect on device={cfg.device}: CUDA graphs are for device=cuda")
    per_round = clients_per_round(cfg.num_clients, cfg.sample_fraction)
    if cfg.executor == "distributed" and cfg.workers > per_round:
        started = "torchrun started" if launched() is not None else f"workers={cfg.workers} starts"
        idle = cfg.workers - per_round
        out.append(
            f"{started} {cfg.workers} ranks, and a round trains {count(per_round, 'client')}: {count(idle, 'rank')} "
            f"{'is' if idle == 1 else 'are'} given no client and only {'waits' if idle == 1 else 'wait'}; "
            f"use at most {count(per_round, 'rank')} (workers unset: the cores, and no more than a round's clients)"
        )
    return out


def init_model(cfg: Config, data: FederatedDataset, algo_cls: type[Algorithm], algo_params, seed: int) -> FedModel:
    """The run's architecture, randomly initialised from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(
            cfg.model.name,
            data.input_shape,
            data.num_classes,
            cfg.model.options,
            heads=algo_cls.heads(algo_params),
        )

