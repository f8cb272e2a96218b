"""From a configuration to the components of a simulation.

:func:`prepare` validates every component's options, fills the ``auto`` settings
(dataset recommendations, the algorithm's server momentum, the device), loads the data,
partitions it and builds the algorithm. The returned :class:`Setup` carries the *resolved*
configuration, which is what a run directory records.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import params as P
from ..algorithms import ALGORITHMS, Algorithm
from ..algorithms.base import Federation
from ..config import Component, Config
from ..cores import cpu_cores
from ..data import augment
from ..data.base import ArrayDataset, FederatedDataset
from ..data.partition import PARTITIONS, Partition, make_partition
from ..data.registry import DATASETS, DatasetSpec, LoadRequest
from ..errors import ConfigError, DataError
from ..models import MODELS, build_model
from ..models.registry import split_options
from ..models.base import FedModel
from ..rng import derive_seed
from .privacy import MODES, DPParams


@dataclass
class Setup:
    """Everything a :class:`~contrafl.engine.simulation.Simulation` is made of."""

    config: Config
    data: FederatedDataset
    partition: Partition
    algorithm: Algorithm
    model: FedModel
    model_factory: Callable[[int], FedModel]
    train_transform: augment.Transform
    eval_transform: augment.Transform
    device: torch.device
    warnings: list[str] = dataclasses.field(default_factory=list)


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
    """The configured data directory, checked to exist when the dataset needs one."""
    spec = DATASETS.get(cfg.dataset.name)
    data_dir = Path(cfg.data_dir).expanduser() if cfg.data_dir else None
    if spec.needs_data_dir and data_dir is None:
        raise ConfigError(
            f"dataset {spec.name} needs data_dir=DIR; get the files with "
            f"`contrafl data download {spec.name} --data-dir DIR`"
        )
    if data_dir is not None and spec.needs_data_dir and not data_dir.exists() and not cfg.download:
        raise ConfigError(
            f"data_dir={cfg.data_dir} does not exist; point it to the {spec.name} files or get them "
            f"with `contrafl data download {spec.name} --data-dir {cfg.data_dir}`"
        )
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
    model_spec = MODELS.get(spec.default_model if P.fold(cfg.model.name) == "auto" else cfg.model.name)
    head, backbone = split_options(model_spec, cfg.model.options)
    augment_name = augment.AUGMENTATIONS.canonical(resolve_augment(cfg.augment, spec, algo_cls))
    partition = PARTITIONS.get(cfg.partition.name)
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
    device = resolve_device(cfg.device)
    rec = spec.recommended
    cfg = dataclasses.replace(
        cfg,
        dataset=Component(spec.name, P.to_dict(dataset_options)),
        partition=Component(partition.name, P.to_dict(partition_options)),
        model=Component(model_spec.name, {**P.to_dict(head), **P.to_dict(backbone)}),
        algorithm=Component(algo_cls.name, P.to_dict(algo_params)),
        dp=dp,
        data_dir=str(Path(cfg.data_dir).expanduser().resolve()) if cfg.data_dir else None,
        rounds=cfg.rounds if cfg.rounds is not None else rec["rounds"],
        local_epochs=cfg.local_epochs if cfg.local_epochs is not None else rec["local_epochs"],
        batch_size=cfg.batch_size if cfg.batch_size is not None else rec["batch_size"],
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
        knn_every=cfg.knn_every if cfg.knn_every is not None else (0 if algo_cls.supervised else cfg.eval_every),
    )
    executor = choose_executor(cfg, algo_cls, device)
    workers = (cfg.workers or cpu_cores()) if executor == "parallel" else 1
    return dataclasses.replace(cfg, executor=executor, workers=workers)


def resolve_dp(dp: Component, algo_cls: type[Algorithm], algo_params: Any) -> Component:
    """The ``dp`` component validated and in canonical form: ``none``, or ``central`` /
    ``local`` with every option of :class:`~contrafl.engine.privacy.DPParams`; a one-line
    error for a mode the algorithm cannot take."""
    mode = P.fold(dp.name)
    if mode not in MODES:
        raise ConfigError(f"dp={dp.name!r} is invalid: expected one of {', '.join(MODES)}{P.suggest(dp.name, list(MODES))}; set it with dp=central or dp=local")
    if mode == "none":
        if dp.options:
            raise ConfigError(f"dp.{next(iter(dp.options))} is set but dp=none; add dp=central (the server adds the noise) or dp=local (each client does)")
        return Component("none")
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


def choose_executor(cfg: Config, algo_cls: type[Algorithm], device: torch.device) -> str:
    """The executor for ``executor=auto``.

    On CUDA: the vectorized executor for algorithms that support it with equal batch
    sizes (``drop_last``). On a multi-core CPU, when a round trains at least two clients:
    the parallel executor (batched per-client convolutions are slower than one client at
    a time on a CPU, and one client's small operations do not use many cores well; it
    is faster from 3 local steps per client on, docs/performance.md). Otherwise the
    sequential executor.
    """
    can_vectorize = algo_cls.vectorizable and cfg.drop_last
    if cfg.executor == "vectorized" and not can_vectorize:
        why = f"algorithm {algo_cls.name} cannot be vectorized" if not algo_cls.vectorizable else "drop_last=false gives unequal batch sizes"
        raise ConfigError(f"executor=vectorized is not possible: {why}; use executor=sequential or executor=auto")
    if cfg.executor == "parallel" and device.type != "cpu":
        raise ConfigError("executor=parallel trains on the CPU; use executor=vectorized or auto with device=cuda")
    if cfg.executor != "auto":
        return cfg.executor
    if device.type == "cuda":
        return "vectorized" if can_vectorize else "sequential"
    if cpu_cores() > 1 and cfg.num_clients * cfg.sample_fraction >= 2:
        return "parallel"
    return "sequential"


def prepare(cfg: Config, partition: Partition | None = None) -> Setup:
    """Resolve ``cfg`` (:func:`resolve`), load and partition the data (or take
    ``partition``, a run's recorded partition, checked against the data), build the
    algorithm."""
    requested, cfg = cfg, resolve(cfg)
    algo_cls = ALGORITHMS.get(cfg.algorithm.name)
    algo_params = P.build(algo_cls.Params, cfg.algorithm.options, "algorithm")
    device = torch.device(cfg.device)
    data, _ = load_data(cfg)
    if cfg.pool:
        data = data.pooled()
    if cfg.normalize == "half" and data.mean is not None:
        data = dataclasses.replace(data, mean=(0.5,) * len(data.mean), std=(0.5,) * len(data.std))
    elif cfg.normalize == "none":
        data = dataclasses.replace(data, mean=None, std=None)
    if data.natural_partition is not None and cfg.partition.name != "natural":
        raise ConfigError(
            f"dataset {data.name} is federated by construction; use partition=natural "
            f"(got partition={cfg.partition.name})"
        )
    shape = tuple(data.train.x.shape[1:])
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
    labels = data.train.y.numpy()
    if cfg.num_clients > len(labels):
        raise ConfigError(
            f"num_clients={cfg.num_clients} is larger than the {len(labels)} training samples of "
            f"{data.name}; choose num_clients <= {len(labels)}"
        )
    if partition is not None:
        check_fits(partition, cfg.num_clients, len(labels))
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
    model_factory = functools.partial(init_model, cfg, data, algo_cls, algo_params)
    model = model_factory(derive_seed(cfg.seed, "global-init"))
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
    return Setup(
        config=cfg,
        data=data,
        partition=partition,
        algorithm=algo_cls(algo_params, federation),
        model=model,
        model_factory=model_factory,
        train_transform=train_transform,
        eval_transform=augment.eval_transform(data.mean, data.std),
        device=device,
        warnings=setup_warnings(requested, cfg, algo_cls, partition),
    )


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
    full setup (:func:`~contrafl.engine.plan.make_plan` draws positions in the client's
    row list, not row numbers); the algorithm keeps the federation it was built with."""
    part = setup.partition
    empty = np.zeros(0, dtype=np.int64)
    train = part.train[cid]
    test = part.test[cid] if part.test is not None else empty
    rows = torch.as_tensor(np.concatenate([train, test]), dtype=torch.long)
    data = dataclasses.replace(setup.data, train=ArrayDataset(setup.data.train.x[rows], setup.data.train.y[rows]))

    def only(own: np.ndarray) -> list[np.ndarray]:
        return [own if c == cid else empty for c in range(part.num_clients)]

    mine = Partition(
        part.method, part.options, part.seed,
        train=only(np.arange(len(train))),
        test=None if part.test is None else only(np.arange(len(train), len(rows))),
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
    if cfg.drop_last:
        small = [cid for cid, rows in enumerate(partition.train) if len(rows) < cfg.batch_size]
        if small:
            shown = ", ".join(map(str, small[:10])) + (", ..." if len(small) > 10 else "")
            out.append(
                f"{len(small)} of {cfg.num_clients} clients have fewer than batch_size={cfg.batch_size} "
                f"training samples and take no local step (drop_last=true; clients {shown}); "
                "lower batch_size, use fewer clients or set drop_last=false"
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

