"""The ``contrafl`` command line.

``contrafl run`` runs a simulation from the embedded defaults, a YAML file and
``key=value`` overrides; ``contrafl list`` shows what can be chosen; ``contrafl data
download`` fetches official dataset files; ``contrafl partition`` shows how a dataset is
split; ``contrafl report`` summarises finished runs. User errors print one line and exit
with status 2.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import io
import json
import os
import sys
import textwrap
import threading
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from .allocator import keep_freed_memory
from . import params as P
from .config import COMPONENTS, SETTINGS, Config, load_config, parse_overrides
from .files import check_output
from .words import count
from .errors import ClientUpdateError, ConfigError, ContraflError

# Exit statuses (README, "Exit status"): 128 + N for a run stopped by signal N.
EXIT_FAILED = 1  # an unexpected error (a bug, out of memory, a full disk): traceback shown
EXIT_USAGE = 2  # invalid input: configuration, data files, command line
EXIT_DIVERGED = 3  # a client update was rejected and on_bad_update=stop


def _settings_help() -> str:
    lines = ["settings (KEY=VALUE):"]
    for f in dataclasses.fields(Config):
        if f.name in COMPONENTS:
            continue
        doc, check = f.metadata.get("doc", ""), f.metadata.get("check")
        default = "auto" if f.default == "auto" or (f.default is None and "auto" in doc) else "none" if f.default is None else f.default
        choices = f" [choices: {', '.join(map(str, check.choices))}]" if type(check) is P.OneOf else ""
        lines.append(f"  {f.name:<24} {doc}{choices} [default: {default}]")
    lines.append("")
    lines.append("components (NAME or component.OPTION=VALUE; see `contrafl list`):")
    for name in COMPONENTS:
        default = getattr(Config(), name).name
        lines.append(f"  {name:<24} [default: {default}]")
    return "\n".join(lines)


def _split_run_args(args: list[str]) -> tuple[str | None, list[str]]:
    config, overrides = None, []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif config is None:
            config = a
        else:
            raise ContraflError(f"unexpected argument '{a}': give at most one CONFIG file, then KEY=VALUE overrides")
    return config, overrides


def cmd_run(ns: argparse.Namespace) -> int:
    with _ranks_met(), _start_without_gc():
        if ns.autoresume:
            ns = autoresumed(ns)
        return resume_run(ns) if ns.resume else start_run(ns)


def autoresumed(ns: argparse.Namespace) -> argparse.Namespace:
    """``contrafl run [CONFIG] [KEY=VALUE...] --out DIR --autoresume``: ``--resume DIR``
    where DIR holds a run of the command's settings (with the command's settings of
    where it runs, and its rounds, which may extend the run), else the command as it
    is (a new run in DIR), so that one command serves a job that a scheduler may
    requeue. A run of other settings in DIR is an error that names them."""
    from .config import EXECUTION_SETTINGS, differences, fingerprint
    from .engine.setup import resolve

    if ns.resume or not ns.out:
        raise ContraflError("--autoresume continues the run in --out DIR, or starts it there: give --out DIR (and no --resume)")
    out = Path(ns.out)
    if not (out / "config.yaml").is_file():
        return ns
    config_path, overrides = _split_run_args(ns.args)
    ours, theirs = resolve(load_config(config_path, overrides)), load_config(out / "config.yaml")

    def results(cfg: Config) -> dict:
        return {k: v for k, v in cfg.to_dict().items() if k not in EXECUTION_SETTINGS and k != "rounds"}

    mine, found = results(ours), results(theirs)
    if fingerprint(mine) != fingerprint(found):
        changed = ", ".join(differences(found, mine)) or "the file of the user's model"
        raise ContraflError(
            f"--out {out} holds a run of other settings than this command's ({out}'s -> this command's: {changed}); "
            f"choose another --out, or continue that run with `contrafl run --resume {out}`"
        )
    kept = [o for o, (key, _) in zip(overrides, parse_overrides(overrides)) if key.split(".")[0] in EXECUTION_SETTINGS]
    rounds = [f"rounds={ours.rounds}"] if ours.rounds != theirs.rounds else []
    return argparse.Namespace(**{**vars(ns), "resume": str(out), "out": None, "args": kept + rounds})


@contextlib.contextmanager
def _start_without_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off while a run starts, on again (if it was) when
    the command ends. Importing torch and building the setup make some 180,000 long-lived
    objects, over which the collector ran three full passes (about 0.2 s of a run's
    start); :func:`_collect_from_here` turns it on before the rounds."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()  # a process that runs several commands (tests) collects their objects
        if enabled:
            gc.enable()


def _collect_from_here() -> None:
    """The garbage collector on (:func:`_start_without_gc`), the objects made so far frozen
    (``gc.freeze``: later passes, and a forked worker's copy-on-write pages, leave them
    alone)."""
    gc.freeze()
    gc.enable()


def _ranks_met() -> contextlib.AbstractContextManager[None]:
    """Under torchrun (``RANK`` and ``WORLD_SIZE`` set), the process group joined first,
    so that a rank that cannot start the run tells the others
    (:func:`~contrafl.execution.distributed.launched_run`); otherwise nothing (and no
    torch import before a configuration's quick errors)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return contextlib.nullcontext()
    from .execution import distributed

    return distributed.launched_run()


def start_run(ns: argparse.Namespace) -> int:
    """``contrafl run [CONFIG] [KEY=VALUE...]``: a new run."""
    from .engine.tracking import require  # imports no torch

    config_path, overrides = _split_run_args(ns.args)
    cfg = load_config(config_path, overrides)  # before the slow imports: quick errors
    require(cfg.tracking)
    if ns.out:
        check_output(Path(ns.out), "--out")

    from .engine import estimate
    from .execution import distributed
    from .engine.progress import Progress
    from .engine.run_dir import RunDir, default_run_dir
    from .engine.privacy import require_accounting
    from .engine.setup import check_data_dir, prepare
    from .engine.simulation import Simulation

    check_data_dir(cfg)
    distributed.bind_device()
    setup = prepare(cfg)
    if (served := serve_rank(setup)) is not None:
        return served
    cfg = setup.config
    if cfg.dp.name != "none":
        require_accounting()
    path = Path(ns.out) if ns.out else default_run_dir(cfg.algorithm.name, cfg.dataset.name)
    run_dir = RunDir(path)
    if not ns.quiet:
        sizes = [len(r) for r in setup.partition.train]
        data = (
            f"{len(setup.data.train)} samples pooled"
            if cfg.pool
            else f"{setup.data.info.get('train_rows', len(setup.data.train))} train / {len(setup.data.test)} test"
        )
        local = " train" if setup.partition.test is not None else ""
        print(
            f"contrafl {__version__}: {cfg.algorithm.name} on {cfg.dataset.name} "
            f"({data}), model {cfg.model.name}, "
            f"{cfg.num_clients} clients ({cfg.partition.name}; {min(sizes)}-{max(sizes)}{local} samples each), "
            f"{count(cfg.rounds, 'round')} x {count(cfg.local_epochs, 'local epoch')}, {cfg.executor} executor on {setup.device.type}"
        )
        print(f"run directory: {run_dir.path}")
    _warn(setup.warnings)
    sim = Simulation(setup, run_dir, None if ns.quiet else Progress(cfg.rounds, sys.stdout))
    if not ns.quiet:
        planned = estimate.estimate(sim, shortest=estimate.SHORT_RUN_S, say=lambda line: print(line, flush=True))
        if planned is not None:
            print(planned.line(), flush=True)
            sim.estimated_time_s = round(planned.seconds, 1)
    return run_simulation(sim, ns.quiet)


def resume_run(ns: argparse.Namespace) -> int:
    """``contrafl run --resume RUN_DIR [KEY=VALUE...]``: continue from the last checkpoint;
    with ``rounds=N`` above the run's rounds, extend the run (completed or stopped) to N."""
    from .config import EXECUTION_SETTINGS
    from .execution import distributed
    from .engine.progress import Progress
    from .engine.run_dir import RunDir, read_summary
    from .engine.setup import prepare
    from .engine.resume import resume
    from .engine.tracking import require

    config_path, overrides = _split_run_args(ns.args)
    if config_path is not None or ns.out:
        raise ContraflError(
            "--resume continues a run with the config.yaml of its run directory; give no CONFIG or --out, "
            f"only overrides of where it runs ({', '.join(EXECUTION_SETTINGS)})"
        )
    given = dict(parse_overrides(overrides))
    for key, value in given.items():
        if key not in EXECUTION_SETTINGS and key != "rounds":
            raise ContraflError(
                f"{key}={value} would change what the resumed run computes; a resumed run takes only "
                f"{', '.join(EXECUTION_SETTINGS)}, and rounds=N to extend it (start a new run to change {key})"
            )
    if "executor" in given:  # the run's workers and rank_executor were chosen for the executor it had
        overrides = [*(f"{key}=auto" for key in ("workers", "rank_executor") if key not in given), *overrides]
    launched = distributed.launched()
    run_dir = RunDir(Path(ns.resume), resume=True, lock=launched is None or launched[0] == 0)  # the others only read it
    cfg = load_config(run_dir.path / "config.yaml", overrides)
    before = load_config(run_dir.path / "config.yaml").rounds or cfg.rounds  # the run's own
    require(cfg.tracking)
    summary = read_summary(run_dir.path)
    if before is not None and (cfg.rounds is None or cfg.rounds < before):
        raise ContraflError(
            f"rounds={cfg.rounds or 'auto'} is fewer than the {before} rounds of {run_dir.path} "
            f"({summary.get('checkpointed_rounds', 0)} done): --resume takes rounds=N to extend a run, N above {before}"
        )
    extending = before is not None and cfg.rounds > before
    if (summary.get("status") == "completed" and summary.get("rounds", cfg.rounds) >= cfg.rounds) or summary.get("checkpointed_rounds", 0) >= cfg.rounds:
        if launched is None or launched[0] == 0:  # under torchrun, rank 0 speaks for the run
            print(f"{run_dir.path} has completed all {count(cfg.rounds, 'round')}; nothing to resume")
        return 0
    if not run_dir.checkpoint_path.is_file() and "fingerprint" not in summary and (run_dir.path / "metrics.jsonl").is_file():
        raise ContraflError(
            f"{run_dir.path} was written by an older contrafl without resumable checkpoints; "
            "start a new run with its config.yaml"
        )
    distributed.bind_device()
    setup = prepare(cfg)
    if (served := serve_rank(setup)) is not None:
        return served
    if run_dir.taken_over:
        _warn([run_dir.taken_over])
    sim = resume(setup, run_dir, None if ns.quiet else Progress(setup.config.rounds, sys.stdout))
    sim.estimated_time_s = None if extending else summary.get("estimated_time_s")  # made before round 1
    if not ns.quiet:
        extended = f"extending {run_dir.path} from {before} to {cfg.rounds} rounds," if extending else f"resuming {run_dir.path}"
        print(f"{extended} after round {sim.rounds_done} of {setup.config.rounds}")
    _warn(setup.warnings)
    extension = sim.extension()
    if extension is not None and not extension["equal_to_fresh_run"]:
        _warn([f"the run extended from {extension['from']} to {extension['to']} rounds differs from a run started with rounds={extension['to']}: {extension['why']}"])
    return run_simulation(sim, ns.quiet)


def serve_rank(setup) -> int | None:
    """Under torchrun, a rank other than 0 serves the run of rank 0 (which writes the run
    directory and prints): its exit status once it has served it; None for rank 0 and
    outside torchrun. Losing rank 0 is one line, as rank 0's run resumes."""
    import functools

    from .engine.simulation import worker_clients
    from .execution import distributed

    env = distributed.launched()
    if env is None or env[0] == 0:
        return None
    _collect_from_here()
    try:
        distributed.serve_launched(functools.partial(worker_clients, setup), *env)
    except distributed.RankLost as exc:
        print(f"contrafl: error: {exc}; rank {env[0]} ends with it (`contrafl run --resume RUN` on every machine continues the run)", file=sys.stderr)
        return EXIT_FAILED
    return 0


def run_simulation(sim, quiet: bool) -> int:
    """Run ``sim`` and turn how it ended into a message and an exit status."""
    from .execution.distributed import RankLost
    from .execution.signals import exit_code, signal_name

    where = sim.run_dir.path
    _collect_from_here()
    try:
        summary = sim.run()
    except KeyboardInterrupt as exc:
        print(f"\ninterrupted by {signal_name(exc)} after round {sim.rounds_done}; {_resume_hint(sim)}", file=sys.stderr)
        return exit_code(exc)
    except ClientUpdateError as exc:
        print(f"contrafl: error: {exc} (results up to round {sim.rounds_done} are in {where})", file=sys.stderr)
        return EXIT_DIVERGED
    except ContraflError as exc:
        raise ContraflError(f"{exc} (results up to round {sim.rounds_done} are in {where})") from None
    except RankLost as exc:  # not a bug of contrafl's: no traceback
        print(f"contrafl: error: {exc} in round {sim.rounds_done + 1}; {_resume_hint(sim)}", file=sys.stderr)
        return EXIT_FAILED
    except Exception:
        traceback.print_exc()
        print(f"contrafl: the run failed in round {sim.rounds_done + 1} (error above); {_resume_hint(sim)}", file=sys.stderr)
        return EXIT_FAILED
    if not quiet:
        print(format_summary(summary, sim.history))
    return 0


def _resume_hint(sim) -> str:
    return f"`contrafl run --resume {sim.run_dir.path}` continues from round {sim.checkpointed + 1}"


def _warn(warnings: list[str]) -> None:
    for w in warnings:
        print(f"contrafl: warning: {w}", file=sys.stderr)


def format_summary(summary: dict, history: list[dict] | None = None) -> str:
    """The run's last line: rounds and time, accuracies, privacy spent, replies lost or
    rejected, stragglers, simulated time and communication (``history``: the rounds'
    rows, for the replies lost)."""
    from .experiments.report import ATTACK_METRICS

    final = summary.get("final", {})
    parts = [f"done: {count(summary['rounds_completed'], 'round')} in {summary['wall_time_s']:.1f}s"]
    if "test_acc" in final:
        parts.append(f"final test accuracy {final['test_acc']:.4f}")
    if "best_test_acc" in summary:
        parts.append(f"best {summary['best_test_acc']:.4f} (round {summary['best_round']})")
    if "personal_acc" in final:  # PFLlib and FedCRL report the best round
        parts.append(
            f"client accuracy {final['personal_acc']:.4f} ± {final['personal_acc_std']:.4f}, best "
            f"{summary['best_personal_acc']:.4f} ± {summary['best_personal_acc_std']:.4f} (round {summary['best_personal_round']})"
        )
    if "knn_acc" in final:
        parts.append(f"kNN accuracy {final['knn_acc']:.4f}, best {summary['best_knn_acc']:.4f} (round {summary['best_knn_round']})")
    if summary.get("rounds_to_target") is not None or "target_accuracy" in summary:
        parts.append(f"rounds to {summary['target_accuracy']:.2%}: {summary.get('rounds_to_target') or 'not reached'}")
    if "dp" in summary:
        epsilon = summary["dp"]["epsilon"]
        noise = "; reproducible noise: protects nothing" if summary["dp"].get("noise") == "reproducible" else ""
        parts.append(f"({'inf' if epsilon is None else f'{epsilon:.3g}'}, {summary['dp']['delta']:g})-DP ({summary['dp']['mode']}{noise})")
    if "robustness" in summary:
        rb = summary["robustness"]
        found = "; ".join(f"{k} {rb[k]:.2f}" for k in ("precision", "recall") if rb.get(k) is not None)
        parts.append(f"aggregator={rb['aggregator']}, attack={rb['attack']}" + (f" (attackers found: {found})" if found else ""))
    for metric in ATTACK_METRICS:
        if final.get(metric.key) is not None:
            parts.append(f"{metric.words} {final[metric.key]:.4f}")
    lost = sum(len(row.get("lost", [])) for row in history or [])
    if lost:
        parts.append(f"{count(lost, 'reply', 'replies')} lost")
    if summary.get("rejected_updates"):
        parts.append(f"{count(summary['rejected_updates'], 'update')} rejected")
    if "straggler_replies" in summary:
        stragglers = summary["straggler_replies"]
        parts.append(f"stragglers: {stragglers['dropped']} dropped, {stragglers['partial']} partial")
    if "simulated_time" in summary:
        parts.append(f"simulated time {summary['simulated_time']:.4g}")
    mb = sum(summary["bytes_total"]["down"].values()) + sum(summary["bytes_total"]["up"].values())
    parts.append(f"communication {mb / 2**20:.1f} MiB")
    return "; ".join(parts)


def cmd_deploy(ns: argparse.Namespace) -> int:
    """``contrafl deploy [CONFIG] KEY=VALUE...``: the run on a local Flower deployment.
    Every input is checked (and the run directory written) before anything is printed."""
    try:
        from .flower.deploy import LOCAL_WAIT_NODES_S, Settings, check_hosts, check_node_data, check_settings, commands, deploy, prepare_run
    except ImportError as exc:
        raise ContraflError(str(exc)) from None
    from .engine.run_dir import default_run_dir, read_summary
    from .engine.setup import resolved_clients

    if ns.server_host and not ns.prepare_only:
        raise ConfigError("--server-host is for --prepare-only (a deployment of your own); contrafl deploy's own SuperLink is 127.0.0.1")
    if ns.wait_nodes is not None and not ns.wait_nodes >= 0:
        raise ConfigError(f"--wait-nodes {ns.wait_nodes:g} must be a number of seconds, 0 or more")
    if ns.supernode_poll is not None and not ns.supernode_poll > 0:
        raise ConfigError(f"--supernode-poll {ns.supernode_poll:g} must be a positive number of seconds (3 waits as long as Flower's own SuperNode)")
    given = {"round_timeout": ns.round_timeout, "min_replies": ns.min_replies, "wait_nodes": ns.wait_nodes, "supernode_poll": ns.supernode_poll,
             "max_weight": ns.max_weight}
    if ns.resume:
        if ns.args or ns.out or ns.prepare_only:
            raise ConfigError("contrafl deploy --resume RUN_DIR takes no config, KEY=VALUE, --out or --prepare-only: the run keeps its own config.yaml")
        if ns.node_data:
            raise ConfigError("--resume takes no --node-data: the run keeps the --node-data paths it was started with")
        if ns.byzantine_nodes:
            raise ConfigError("--resume takes no --byzantine-nodes: the run keeps the Byzantine SuperNodes it was started with")
        path = Path(ns.resume)
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"--resume {path}: no config.yaml there; give the directory of a run started with contrafl deploy")
        cfg = load_config(path / "config.yaml")
        security = {"tls": ns.tls, "auth": ns.auth, "secure_aggregation": ns.secure_aggregation}
        settings = Settings.read(path).overridden(path, {**security, **given}, ns.allow_weaker_security)
        if settings.auth and not settings.tls:
            if ns.tls is False:
                raise ConfigError("--auth needs TLS (flwr 1.41 refuses SuperNode authentication with --insecure); drop --insecure")
            settings = dataclasses.replace(settings, tls=True)
    else:
        config_path, overrides = _split_run_args(ns.args)
        if ns.node_data and not any(o.startswith("node_data=") for o in overrides):
            overrides = [*overrides, "node_data=own"]
        cfg = attacking = load_config(config_path, overrides)
        path = check_output(Path(ns.out) if ns.out else default_run_dir(cfg.algorithm.name, cfg.dataset.name), "--out")
        tls, auth = deploy_security(ns)
        secure = bool(ns.secure_aggregation)
        attackers: tuple[int, ...] = ()
        node_attack: dict[str, Any] = {}
        if ns.byzantine_nodes:  # the attack goes to the attackers' SuperNodes, not to the server's config
            from .flower.byzantine import split

            cfg, node_attack, attackers = split(dataclasses.replace(cfg, num_clients=resolved_clients(cfg)))
        settings = Settings(
            tls=tls, auth=auth, secure_aggregation=secure, min_replies=min(3, resolved_clients(cfg)) if secure else 1,
            wait_nodes=Settings.wait_nodes if ns.prepare_only else LOCAL_WAIT_NODES_S, node_data=tuple(ns.node_data or ()),
            attackers=attackers, node_attack=node_attack,
        ).overridden(path, given, weaker_allowed=False)
    check_settings(cfg, settings.round_timeout, settings.min_replies, settings.secure_aggregation, settings.max_weight)
    if ns.prepare_only:
        check_hosts(ns.server_host or (), settings.tls)
        check_node_data(cfg, settings.node_data, required=False)
        cfg = prepare_run(attacking, path, byzantine_nodes=bool(settings.attackers))
        print(commands(path, cfg, settings.round_timeout, settings.min_replies, settings.wait_nodes, server_hosts=ns.server_host or (), tls=settings.tls,
                       auth=settings.auth, secure_aggregation=settings.secure_aggregation, node_data=settings.node_data,
                       max_weight=settings.max_weight, attackers=settings.attackers, node_attack=settings.node_attack))
        return 0
    check_node_data(cfg, settings.node_data, required=True)
    if not ns.resume:
        cfg = prepare_run(attacking, path, byzantine_nodes=bool(settings.attackers))
    security = " (TLS, SuperNode authentication)" if settings.auth else " (TLS)" if settings.tls else ""
    print(f"contrafl {__version__}: {cfg.algorithm.name} on a local Flower deployment of {cfg.num_clients} SuperNodes"
          f"{security}{', secure aggregation' if settings.secure_aggregation else ''}"
          f"{byzantine_text(settings.attackers, settings.node_attack)}; "
          f"run directory: {path}, Flower logs: {path / 'flower' / 'logs'}")
    deploy(cfg, path, settings, prepared=True, echo=sys.stdout)
    summary = read_summary(path)
    if summary.get("status") == "completed":  # the same last line as contrafl run's
        history = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
        print(format_summary(summary, history))
    return 0


def byzantine_text(attackers: Sequence[int], node_attack: Mapping[str, Any]) -> str:
    """What ``contrafl deploy``'s first line says of its Byzantine SuperNodes (nothing without)."""
    if not attackers:
        return ""
    return f", Byzantine SuperNode{'s' if len(attackers) > 1 else ''} of client{'s' if len(attackers) > 1 else ''} {', '.join(map(str, attackers))} ({node_attack['attack']})"


def _switch(parser: argparse.ArgumentParser, on: str, off: str, dest: str, on_help: str, off_help: str) -> None:
    """Options ``on`` and ``off`` that set ``dest`` to True or False (None: neither given)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(on, dest=dest, action="store_true", default=None, help=on_help)
    group.add_argument(off, dest=dest, action="store_false", help=off_help)


def deploy_security(ns: argparse.Namespace) -> tuple[bool, bool]:
    """``(tls, auth)`` of ``contrafl deploy``: TLS and SuperNode authentication are on by
    default for several machines (``--prepare-only``) and off on this one; ``--auth``
    takes TLS with it."""
    tls = ns.tls if ns.tls is not None else (ns.prepare_only or bool(ns.auth))
    if ns.auth and not tls:
        raise ConfigError("--auth needs TLS (flwr 1.41 refuses SuperNode authentication with --insecure); drop --insecure")
    auth = ns.auth if ns.auth is not None else (ns.prepare_only and tls)
    return tls, auth


def cmd_list(ns: argparse.Namespace) -> int:
    from . import params as P
    from .algorithms import ALGORITHMS
    from .data import augment
    from .data.partition import PARTITIONS
    from .data.registry import DATASETS
    from .models import MODELS
    from .models.registry import HeadOptions
    from .engine.attacking import ATTACKS, AttackParams
    from .engine.privacy import DP_MODES, DPParams
    from .engine.robustness import AGGREGATORS, AggregatorParams

    what = ns.what
    def options(cls: type, prefix: str, inapplicable: dict[str, str] | None = None) -> None:
        fields = {name for name, _, _ in P.describe(cls)}
        for name, default, doc in P.describe(cls):
            when = (inapplicable or {}).get(name)
            if when is None:
                print(f"      {prefix}.{name}={default}  {doc}")
            elif when.partition("=")[0] in fields:  # applies once that option is changed
                print(f"      {prefix}.{name}={default}  {doc} (with {prefix}.{when})")

    def plugin(registry, name: str) -> str:
        package = registry.package(name)
        return f" (plugin: {package})" if package else ""

    if what in ("all", "algorithms"):
        print("algorithms (algorithm=NAME, options algorithm.OPTION=VALUE):")
        for name, cls in ALGORITHMS.items():
            print(f"  {name:<12} {cls.summary}{plugin(ALGORITHMS, name)}")
            options(cls.Params, "algorithm", cls.inapplicable(cls.Params()))
    if what in ("all", "datasets"):
        print("datasets (dataset=NAME):")
        for name, spec in DATASETS.items():
            rec = ", ".join(f"{k} {v}" for k, v in spec.recommended.items())
            print(f"  {name:<12} {spec.summary} [model {spec.default_model}; {rec}]{plugin(DATASETS, name)}")
            options(spec.options, "dataset")
    if what in ("all", "partitions"):
        print("partitions (partition=NAME):")
        for name, spec in PARTITIONS.items():
            print(f"  {name:<12} {spec.summary}{plugin(PARTITIONS, name)}")
            options(spec.options, "partition")
    if what in ("all", "models"):
        print("models (model=NAME; every model takes the head options below):")
        for name, spec in MODELS.items():
            print(f"  {name:<12} {spec.summary}{plugin(MODELS, name)}")
            options(spec.options, "model")
        print("  MODULE:FACTORY  your encoder: model=mypkg.nets:make_encoder or model=./nets.py:make_encoder, options model.ARG=VALUE (docs/extending.md)")
        print("  head options:")
        options(HeadOptions, "model")
    if what in ("all", "augmentations"):
        print("augmentations (augment=NAME):")
        for name in augment.AUGMENTATIONS.names():
            print(f"  {name:<12} {augment.summary(name)}{plugin(augment.AUGMENTATIONS, name)}")
    if what in ("all", "dp"):
        print("differential privacy (dp=NAME, options dp.OPTION=VALUE; docs/privacy.md):")
        for name, summary in DP_MODES.items():
            print(f"  {name:<12} {summary}")
        options(DPParams, "dp")
    if what in ("all", "aggregators"):
        print("robust aggregators (aggregator=NAME, options aggregator.OPTION=VALUE; docs/robustness.md):")
        for name, summary in AGGREGATORS.items():
            print(f"  {name:<20} {summary}")
        options(AggregatorParams, "aggregator")
    if what in ("all", "attacks"):
        print("Byzantine attacks (attack=NAME, options attack.OPTION=VALUE; docs/robustness.md):")
        for name, summary in ATTACKS.items():
            print(f"  {name:<28} {summary}")
        options(AttackParams, "attack")
    return 0


def cmd_download(ns: argparse.Namespace) -> int:
    from .data.registry import DATASETS

    spec = DATASETS.get(ns.name)
    if spec.download is None:
        raise ContraflError(f"dataset {spec.name} is bundled or generated and needs no download")
    path = spec.download(Path(ns.data_dir).expanduser())
    print(f"{spec.name}: files verified in {path}")
    return 0


def cmd_partition(ns: argparse.Namespace) -> int:
    from .data.partition import format_partition
    from .engine.setup import prepare
    from .experiments.plots import plot_partition_heatmap
    from .experiments.report import partition_label

    config_path, overrides = _split_run_args(ns.args)
    if ns.out:
        check_output(Path(ns.out), "--out", folder=False)
    setup = prepare(load_config(config_path, overrides))
    data, partition = setup.data, setup.partition
    labels = data.train.y.numpy()
    print(format_partition(partition, labels, data.classes))
    out = Path(ns.out or f"partition-{setup.config.dataset.name}-{partition.method}.png")
    plot_partition_heatmap(
        partition.counts(labels, data.num_classes),
        out,
        classes=data.classes,
        title=f"{data.name}, {partition_label({'name': partition.method, **partition.options})}, seed {setup.config.seed}",
    )
    if ns.json:
        partition.save(Path(ns.json))
    print(f"heatmap written to {out}")
    return 0


def cmd_report(ns: argparse.Namespace) -> int:
    from .experiments.report import report
    from .experiments.suite import SUITE_RECORD, suite_report
    from .experiments.sweep import SWEEP_RECORD, sweep_report, sweep_statistics

    if ns.update:
        from .experiments.markdown import update

        done, left = update(Path(ns.update))
        print(f"{ns.update}: {len(done)} tables and figures regenerated from their run directories ({', '.join(done) or 'none'})"
              + (f"; left as they were, no run directory here: {', '.join(left)}" if left else ""))
        return 0
    if not ns.runs:
        raise ContraflError("give run directories or a suite directory, e.g. `contrafl report runs/reduced`, or --update FILE")
    paths = [Path(p) for p in ns.runs]
    if ns.html:
        from .experiments.html import write_html

        argv = ["report", *ns.runs, "--html", ns.html]
        out = write_html(paths, check_output(Path(ns.html), "--html", folder=False), argv)
        print(f"report written to {out} ({out.stat().st_size / 2**10:.0f} KiB, self-contained)")
        return 0
    if ns.markdown and len(paths) == 1 and (paths[0] / SUITE_RECORD).is_file():
        print(suite_report(paths[0]))
        return 0
    if ns.markdown and len(paths) == 1 and (paths[0] / SWEEP_RECORD).is_file():
        print(sweep_report(paths[0]) + "\n\n" + sweep_statistics(paths[0]))
        return 0
    print(report(paths, target=ns.target, target_from=ns.target_from, markdown=ns.markdown, clients=ns.clients))
    return 0


def cmd_eval_repr(ns: argparse.Namespace) -> int:
    from .experiments.probe import evaluate_run

    result = evaluate_run(
        Path(ns.run_dir), ns.protocol, label_fraction=ns.label_fraction, epochs=ns.epochs, seed=ns.seed,
        device=ns.device, clients=ns.clients, local=not ns.no_local,
    )
    where = f"{ns.run_dir}: round {result['round']}"
    untrained = "" if result["global_trained"] else "; the global encoder is still its initialisation and was not evaluated"
    local = result.get("local", {})
    if ns.protocol == "spectrum":
        ranks = [r["effective_rank"] for r in local.values()]
        parts = [f"global model's effective rank {result['effective_rank']:.1f}"] if result["global_trained"] else []
        if ranks:
            parts.append(f"local models of {len(ranks)} clients {min(ranks):.1f} to {max(ranks):.1f}")
        print(f"{where}: spectrum, {', '.join(parts)}{untrained}; saved in representation/spectrum.json and spectrum.png")
    else:
        what = {"knn": "kNN", "linear": "linear-probe", "finetune": f"fine-tuning ({result.get('label_fraction', 0):.0%} labels)"}
        parts = [f"global model {result['acc']:.4f}"] if "acc" in result else []
        if local:
            accs = [r["acc"] for r in local.values()]
            parts.append(f"local models of {len(accs)} clients {min(accs):.4f} to {max(accs):.4f} (mean {sum(accs) / len(accs):.4f})")
        print(f"{where}: {what[ns.protocol]} accuracy of the {', '.join(parts)}{untrained}; saved in representation/")
    return 0


def cmd_plot_repr(ns: argparse.Namespace) -> int:
    from .experiments.tsne import FIGURE, plot_run

    out = check_output(Path(ns.out) if ns.out else Path(ns.run_dir) / FIGURE, "--out", folder=False)
    result = plot_run(
        Path(ns.run_dir), clients=ns.clients, local=not ns.no_local, samples=ns.samples, perplexity=ns.perplexity,
        seed=ns.seed, device=ns.device, out=out,
    )
    scores = "; ".join(
        f"{p['title']} silhouette {p['silhouette']:.3f}, leave-one-out {result['knn_k']}-NN accuracy {p['knn_acc']:.3f}" for p in result["panels"]
    )
    skipped = f"; no global panel: {result['note']}" if "note" in result else ""
    print(f"{ns.run_dir}: round {result['round']}, t-SNE of {result['samples']} test samples: {scores}{skipped}; "
          f"written to {out} and {out.with_suffix('.json')}")
    return 0


def cmd_experiment(ns: argparse.Namespace) -> int:
    from .experiments.suite import load_suite

    suite = load_suite(Path(ns.file))
    if ns.seeds:
        suite.seeds = _seeds(ns.seeds)
    out = check_output(Path(ns.out) if ns.out else Path("runs") / "experiments" / Path(ns.file).stem, "--out")
    methods = ns.methods.split(",") if ns.methods else None
    return _run_suite(suite, out, ns.overrides, methods, f"results: {out / 'results.md'}")


def cmd_compare(ns: argparse.Namespace) -> int:
    from .experiments.report import algorithm_label
    from .experiments.suite import Suite

    algorithms = [a for a in ns.args if "=" not in a]
    if len(algorithms) < 2:
        raise ContraflError("compare needs at least two algorithms, e.g. `contrafl compare fedavg moon`")
    methods: dict[str, dict] = {a: {"algorithm": {"name": a}} for a in algorithms}
    overrides = []
    for key, value in parse_overrides([a for a in ns.args if "=" in a]):
        head, _, option = key.partition(".")
        if head in methods and option:  # moon.mu=5 sets an option of one algorithm only
            methods[head]["algorithm"][option] = value
        else:
            overrides.append(f"{key}={value}")
    # each method named as `contrafl report` labels it: the algorithm and its options that differ from their defaults
    labels = {a: algorithm_label(m["algorithm"]) for a, m in methods.items()}
    suite = Suite(
        name="compare " + " vs ".join(labels.values()),
        base={},
        methods={labels[a]: m for a, m in methods.items()},
        seeds=_seeds(ns.seeds),
        target={"from": labels[algorithms[0]]},
        families_only=True,
    )
    out = check_output(Path(ns.out) if ns.out else Path("runs") / ("compare-" + "-".join(algorithms)), "--out")
    done = f"baseline: {labels[algorithms[0]]} (the first algorithm); tables: {out / 'results.md'}; runs in {out}"
    return _run_suite(suite, out, overrides, None, done)


def cmd_sweep(ns: argparse.Namespace) -> int:
    from .experiments.sweep import format_table, interrupted_line, load_sweep, parse_shard, run_sweep

    sweep = load_sweep(Path(ns.file))
    if ns.seeds:
        sweep.seeds = _seeds(ns.seeds)
    if ns.workers is not None and ns.workers < 1:
        raise ContraflError(f"--workers {ns.workers} is invalid: expected a number of processes >= 1")
    shard = parse_shard(ns.shard) if ns.shard is not None else None
    out = check_output(Path(ns.out) if ns.out else Path("runs") / "sweeps" / Path(ns.file).stem, "--out")
    try:
        results = run_sweep(sweep, out, ns.overrides, ns.workers, sys.stdout, dry_run=ns.dry_run, shard=shard)
    except KeyboardInterrupt as exc:
        line, code = interrupted_line(exc)
        print("\n" + line, file=sys.stderr)
        return code
    if ns.dry_run:
        return 0
    print(format_table(sweep, results))
    if shard:
        print(f"share {ns.shard.strip()} done; the table has the runs of every share in {out} so far")
    print(f"table: {out / 'results.md'}; report: contrafl report {out} --html {out / 'report.html'}")
    if results["failed"]:
        print(f"contrafl: {len(results['failed'])} runs failed: {', '.join(results['failed'])} (see above)", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _run_suite(suite, out: Path, overrides: list[str], methods: list[str] | None, done: str) -> int:
    """Run a suite with progress; its tables (the suite's own layout, unless it is
    tabulated by family only, then one per metric family) and figures, or one line when
    it is interrupted."""
    from .execution.signals import exit_code, signal_name
    from .experiments.suite import run_suite

    try:
        results = run_suite(suite, out, overrides, methods, progress=sys.stdout)
    except KeyboardInterrupt as exc:
        where = getattr(exc, "where", None)
        print(
            f"\ncontrafl: interrupted by {signal_name(exc)}{' during ' + where if where else ''}; "
            "run the same command again to continue (finished runs are reused, stopped ones resume)",
            file=sys.stderr,
        )
        return exit_code(exc)
    print((out / "results.md").read_text().rstrip())  # the suite's tables, as run_suite wrote them
    print(f"figures, one metric each: {', '.join(results['figures']) or 'none (no evaluated run)'}")
    print(done)
    if results["failed"]:
        print(f"contrafl: {len(results['failed'])} runs failed: {', '.join(results['failed'])} (see above)", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _seeds(text: str) -> list[int]:
    """``"3"`` -> [0, 1, 2]; ``"0,5,7"`` -> [0, 5, 7]; ``"4,"`` -> [4]."""
    usage = "expected a count (3) or a list of distinct seeds >= 0 (0,1,2; one seed: 4,)"
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()] if "," in text else list(range(int(text)))
    except ValueError:
        raise ContraflError(f"--seeds {text!r} is invalid: {usage}") from None
    if not seeds:
        raise ContraflError(f"--seeds {text!r} runs no seed: {usage}")
    if min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ContraflError(f"--seeds {text!r} is invalid: {usage}")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="contrafl",
        description="Federated learning on non-IID data, centred on contrastive methods.",
        formatter_class=fmt,
    )
    from importlib.metadata import PackageNotFoundError, version

    try:  # the installed distribution's version (pyproject.toml's, as pip installed it)
        installed = version("contrafl")
    except PackageNotFoundError:  # run from a source tree that pip has not installed
        installed = __version__
    parser.add_argument("--version", action="version", version=f"contrafl {installed}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser(
        "run",
        help="run a federated simulation",
        description=textwrap.dedent(
            """\
            Run a federated simulation. With no arguments: scikit-learn's digits, 10 clients,
            Dirichlet(0.5) label skew, FedAvg. CONFIG is a YAML file of the settings below;
            KEY=VALUE overrides it, e.g.
              contrafl run algorithm=moon algorithm.mu=5 rounds=20
              contrafl run dataset=cifar10 data_dir=DIR allow_subset=true rounds=5
            The run directory holds config.yaml (resolved), partition.json, metrics.jsonl,
            summary.json (with the run's status) and the checkpoint of the last round
            (checkpoint.pt, client-state/); a stopped run continues with
              contrafl run --resume RUN_DIR
            and a stopped or finished one goes on to N rounds with
              contrafl run --resume RUN_DIR rounds=N
            Exit status: 0 completed, 1 failed (unexpected error), 2 invalid input,
            3 a client update was rejected (on_bad_update=stop), 128+N stopped by
            signal N (130 Ctrl-C, 143 SIGTERM)."""
        ),
        epilog=_settings_help(),
        formatter_class=fmt,
    )
    run.add_argument("args", nargs="*", metavar="[CONFIG] KEY=VALUE", help="config file and overrides")
    run.add_argument("--out", metavar="DIR", help="run directory (default: runs/<time>-<algorithm>-<dataset>)")
    run.add_argument("--quiet", action="store_true", help="print nothing; results go to the run directory")
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a stopped run from its last checkpoint (KEY=VALUE: only where it runs, e.g. executor, device; rounds=N extends a run to N rounds)")
    run.add_argument("--autoresume", action="store_true",
                     help="with --out DIR: continue the run in DIR where it holds one of these settings, else start it there "
                          "(one command for a job that a scheduler may requeue)")
    run.set_defaults(func=cmd_run, settings_dest="args")

    dep = sub.add_parser(
        "deploy",
        help="run a config on a local Flower deployment (SuperLink + one SuperNode per client)",
        description=textwrap.dedent(
            """\
            Run a config on the Flower runtime on this machine: a SuperLink and one SuperNode
            per client (127.0.0.1; insecure, or TLS with certificates made for the run),
            contrafl's ServerApp running the simulator's round loop and its ClientApps the
            same local training, e.g.
              contrafl deploy algorithm=moon num_clients=3 rounds=5 --out runs/moon-flower
            The run directory is the one `contrafl run` writes (config.yaml, partition.json,
            metrics.jsonl, summary.json, checkpoints); the SuperNodes keep the client states
            in flower-clients/, the Flower processes' logs are in flower/logs/. Needs the
            flower extra: pip install "contrafl[flower]"."""
        ),
        epilog=_settings_help(),
        formatter_class=fmt,
    )
    dep.add_argument("args", nargs="*", metavar="[CONFIG] KEY=VALUE", help="config file and overrides")
    dep.add_argument("--out", metavar="DIR", help="run directory (default: runs/<time>-<algorithm>-<dataset>)")
    _switch(dep, "--tls", "--insecure", "tls",
            "serve the SuperLink over TLS, with certificates made in the run directory's flower/certs "
            "(for 127.0.0.1; with --prepare-only, for the --server-host names); the default with --prepare-only",
            "no TLS (the default on this machine; with --prepare-only, only on a network you trust)")
    _switch(dep, "--auth", "--no-auth", "auth",
            "SuperNode authentication: only SuperNodes whose key pair the run made (flower/keys) may join; "
            "needs TLS; the default with --prepare-only",
            "any SuperNode that reaches the SuperLink may join (the default on this machine)")
    _switch(dep, "--secure-aggregation", "--no-secure-aggregation", "secure_aggregation",
            "train through Flower's SecAgg+: the server sees only sums over the round's clients (the weighted mean of "
            "their updates, up to the protocol's quantisation; total samples, steps, loss and label counts); "
            "algorithms whose server needs single updates refuse it",
            "no secure aggregation (the default; with --resume of a run that had it, only with --allow-weaker-security)")
    dep.add_argument("--max-weight", type=int, default=None, metavar="N",
                     help="with --secure-aggregation and --node-data: a public bound on every site's training samples (each "
                          "update is weighted by its count over N inside the masks; a site with more refuses); not needed "
                          "under dp=local, nor where the server holds the data (the largest client's count)")
    dep.add_argument("--round-timeout", type=float, default=None, metavar="S",
                     help="seconds a round waits for replies before the missing clients count as lost (default 600; "
                          "--resume: the run's own)")
    dep.add_argument("--min-replies", type=int, default=None, metavar="N",
                     help="the fewest replies a round needs after the timeout; fewer stop the run, resumable "
                          "(default 1; 3 with --secure-aggregation, the fewest a secure sum takes; --resume: the run's own)")
    dep.add_argument("--wait-nodes", type=float, default=None, metavar="S",
                     help="seconds a round waits for the SuperNode of a client whose node the server has not seen yet (default 30 "
                          "on this machine, whose SuperNodes are up before the run starts; 120 with --prepare-only; --resume: the run's own)")
    dep.add_argument("--supernode-poll", type=float, default=None, metavar="S",
                     help="the SuperNodes' longest wait between their pulls of messages, in seconds (default 0.2; "
                          "Flower's own SuperNode waits 3 s, a second and a half per message on average)")
    dep.add_argument("--node-data", action="append", metavar="PATH",
                     help="a client's own data (repeat once per client, in client order; sets node_data=own): each SuperNode "
                          "holds only its own, the server none (docs/flower.md, \"Three sites, three folders\")")
    dep.add_argument("--byzantine-nodes", action="store_true",
                     help="the config's attackers (attack=NAME with attack.clients=[K,...] or attack.fraction) are SuperNodes that "
                          "attack on their own, non-omniscient (attack.omniscient=false where the attack reads it): their node configs get "
                          "attack='NAME' and attack-OPTION keys, the server's config.yaml attack=none, and its aggregator meets their "
                          "replies as any others; `contrafl run` of the same config simulates it (docs/flower.md, \"Byzantine SuperNodes\")")
    dep.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a deployed run from its last checkpoint (after its server or the machine stopped), with the "
                          "settings it was deployed with (flower/deployment.json): TLS, authentication, secure aggregation, "
                          "the SuperNodes' data and timeouts; options given override them, but none may drop a security setting")
    dep.add_argument("--allow-weaker-security", action="store_true",
                     help="with --resume: let --insecure, --no-auth or --no-secure-aggregation drop what the run was deployed with")
    dep.add_argument("--prepare-only", action="store_true",
                     help="write the run directory and print the commands to run it on your own SuperLink and SuperNodes (several machines)")
    dep.add_argument("--server-host", action="append", metavar="HOST",
                     help="with --prepare-only: a host name or address of the SuperLink that the SuperNodes dial (repeatable; "
                          "with --tls, the certificates name these and 127.0.0.1, where the SuperLink's own SuperExec dials it)")
    dep.set_defaults(func=cmd_deploy, settings_dest="args")

    lst = sub.add_parser("list", help="list algorithms, datasets, partitions, models, augmentations",
                         description="List what can be chosen, with options and defaults.")
    lst.add_argument("what", nargs="?", default="all",
                     choices=["all", "algorithms", "datasets", "partitions", "models", "augmentations", "dp", "aggregators", "attacks"])
    lst.set_defaults(func=cmd_list)

    data = sub.add_parser("data", help="dataset files", description="Manage dataset files.")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION")
    data_sub.required = True
    dl = data_sub.add_parser("download", help="download official files and verify their checksums",
                             description="Download a dataset's official archive, verify its checksum and extract it.")
    dl.add_argument("name", help="dataset name (see `contrafl list datasets`)")
    dl.add_argument("--data-dir", required=True, metavar="DIR", help="where to put the files")
    dl.set_defaults(func=cmd_download)

    part = sub.add_parser(
        "partition",
        help="show how a dataset is split among clients",
        description=textwrap.dedent(
            """\
            Print per-client statistics of a partition and write a heatmap of samples per
            client and class (like MOON's Figure 5). Takes the same CONFIG and KEY=VALUE as
            `contrafl run`, e.g.
              contrafl partition dataset=cifar10 data_dir=DIR allow_subset=true partition.beta=0.1"""
        ),
        formatter_class=fmt,
    )
    part.add_argument("args", nargs="*", metavar="[CONFIG] KEY=VALUE")
    part.add_argument("--out", metavar="PNG", help="heatmap path (default: partition-<dataset>-<method>.png)")
    part.add_argument("--json", metavar="FILE", help="also save the partition as JSON")
    part.set_defaults(func=cmd_partition, settings_dest="args")

    exp = sub.add_parser(
        "experiment",
        help="run a paper-reproduction suite (methods x seeds) and print its table",
        description=textwrap.dedent(
            """\
            Run every method x seed of an experiment file (see experiments/), resuming finished
            runs, and print mean ± std over seeds next to the paper's numbers, e.g.
              contrafl experiment experiments/moon/table1_cifar10.yaml data_dir=DIR
              contrafl experiment experiments/reduced/cifar10_subset.yaml --seeds 1"""
        ),
        formatter_class=fmt,
    )
    exp.add_argument("file", help="experiment YAML file")
    exp.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings applied to every run")
    exp.add_argument("--out", metavar="DIR", help="output directory (default: runs/experiments/<file name>)")
    exp.add_argument("--seeds", help="number of seeds (3) or list (0,1,2; one seed: 4,); default: the file's")
    exp.add_argument("--methods", help="comma-separated subset of the file's methods")
    exp.set_defaults(func=cmd_experiment, settings_dest="overrides")

    cmp_ = sub.add_parser(
        "compare",
        help="run several algorithms on the same federation and compare them",
        description=textwrap.dedent(
            """\
            Run each ALGORITHM with the same settings and seeds and print final accuracy and the
            rounds each needs to reach the first algorithm's final accuracy, e.g.
              contrafl compare fedavg moon
              contrafl compare fedavg fedprox moon moon.mu=5 fedprox.mu=0.01 rounds=30 --seeds 3
            ALGORITHM.OPTION=VALUE sets an option of one algorithm; other KEY=VALUE apply to all."""
        ),
        formatter_class=fmt,
    )
    cmp_.add_argument("args", nargs="+", metavar="ALGORITHM|KEY=VALUE")
    cmp_.add_argument("--seeds", default="1", help="number of seeds (default 1) or list (0,1,2; one seed: 4,)")
    cmp_.add_argument("--out", metavar="DIR", help="output directory (default: runs/compare-<algorithms>)")
    cmp_.set_defaults(func=cmd_compare, settings_dest="args")

    swp = sub.add_parser(
        "sweep",
        help="run the cartesian product of settings (a grid) x seeds, in parallel processes",
        description=textwrap.dedent(
            """\
            Run every combination of the settings in a sweep file's grid, each with every seed,
            in --workers processes (on GPUs: one per GPU, each with its own); finished runs are
            reused and stopped ones resume, so the same command continues an interrupted sweep
            (Ctrl-C stops it with one line). E.g.
              contrafl sweep sweep.yaml --workers 2
              contrafl sweep sweep.yaml rounds=10 --seeds 3 --out runs/beta-sweep
              contrafl sweep sweep.yaml --out runs/beta-sweep --shard ${SLURM_ARRAY_TASK_ID}/4
            with sweep.yaml:
              base: {dataset: digits, rounds: 3}
              grid: {algorithm: [fedavg, moon], partition.beta: [0.1, 0.5], moon.mu: [1, 5]}
              seeds: [0, 1]
            (moon.mu applies to the MOON cells only). Each run goes to OUT/<cell>/seed<k>/, its
            output to OUT/logs/; the table (mean ± std over seeds of each run's metric) to
            OUT/results.md. See docs/sweeps.md."""
        ),
        formatter_class=fmt,
    )
    swp.add_argument("file", metavar="SWEEP.yaml", help="sweep file: base, grid, seeds")
    swp.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings applied to every run (after the grid's)")
    swp.add_argument("--workers", type=int, metavar="N",
                     help="runs at a time, each a process on its share of the cores (default: one per CPU core; for runs "
                          "on CUDA, one per visible GPU, each process given its own GPU by CUDA_VISIBLE_DEVICES)")
    swp.add_argument("--out", metavar="DIR", help="output directory (default: runs/sweeps/<file name>)")
    swp.add_argument("--seeds", help="number of seeds (3) or list (0,1,2; one seed: 4,); default: the file's")
    swp.add_argument("--dry-run", action="store_true", help="list the runs and what is done already; run nothing")
    swp.add_argument("--shard", metavar="I/N",
                     help="run only the I-th of N disjoint shares of the runs (every N-th run from the I-th), e.g. "
                          "--shard ${SLURM_ARRAY_TASK_ID}/4 in a job array; the shares may write one --out, whose table "
                          "has the runs of all of them")
    swp.set_defaults(func=cmd_sweep, settings_dest="overrides")

    ev = sub.add_parser(
        "eval-repr",
        help="evaluate a run's learned representations (kNN, linear probe, fine-tuning, spectrum)",
        description=textwrap.dedent(
            """\
            Evaluate the encoder of a run's global model (its last checkpoint) on the run's own
            data: the clients' training samples and the test set, un-augmented.
              knn       weighted kNN on the encoder's features (the run's knn_k, knn_temperature)
              linear    linear classifier on frozen features: Adam 3e-3, batch 512, 200 epochs
              finetune  encoder + linear head on --label-fraction of the labels (class-stratified):
                        SGD momentum 0.9, lr 1e-3 encoder / 0.3 head, batch 128, 200 epochs
              spectrum  singular values of the representation covariance (FedU2's Figure 3), plotted,
                        of the global model and of the local models of --clients after one
                        more round of local training (the checkpoint and metrics stay as they are)
            The result goes to RUN_DIR/representation/<protocol>.json, e.g.
              contrafl eval-repr runs/fedu2 --protocol linear
              contrafl eval-repr runs/fedu2 --protocol finetune --label-fraction 0.1"""
        ),
        formatter_class=fmt,
    )
    ev.add_argument("run_dir", metavar="RUN_DIR")
    ev.add_argument("--protocol", required=True, choices=["knn", "linear", "finetune", "spectrum"])
    ev.add_argument("--label-fraction", type=float, default=0.01, help="finetune: fraction of labelled training samples (0.01, 0.1)")
    ev.add_argument("--epochs", type=int, help="linear / finetune epochs (default 200)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the probe's initialisation, order and labelled subset")
    ev.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ev.add_argument("--clients", metavar="IDS",
                    help="knn, spectrum: clients whose local models are added, e.g. 0,3,5 or all "
                         "(spectrum, and runs without a trained global encoder: the first 10 by default)")
    ev.add_argument("--no-local", action="store_true", help="spectrum: the global model only")
    ev.set_defaults(func=cmd_eval_repr)

    pr = sub.add_parser(
        "plot-repr",
        help="plot a t-SNE of a run's test representations, coloured by class",
        description=textwrap.dedent(
            """\
            Embed the test representations (encoder features of un-augmented inputs) of a run's
            global model (its last checkpoint) and of the local models of --clients with t-SNE,
            one panel each, coloured by class (MOON's Figure 2). The panels share one
            class-stratified random subset of the test set. Local models are those of
            `eval-repr --protocol spectrum`: trained in one more round of local training, with
            the parts a client keeps to itself (Ditto, pFedMe: the model a client sends, not
            its personal model); the run directory stays as it is.
            A global encoder that is still its initialisation (FedProto, SOLO, FedGH,
            LG-FedAvg) gets no panel. Each panel reports the silhouette of the embedding by
            class and the leave-one-out 10-NN accuracy in feature space. Written to
            RUN_DIR/representation/tsne.png and tsne.json (coordinates, scores), e.g.
              contrafl plot-repr runs/moon --clients 0,3,5
              contrafl plot-repr runs/fedu2 --samples 1000 --perplexity 50 --no-local"""
        ),
        formatter_class=fmt,
    )
    pr.add_argument("run_dir", metavar="RUN_DIR")
    pr.add_argument("--clients", metavar="IDS", help="clients whose local models get a panel, e.g. 0,3,5 or all (default: the first 2)")
    pr.add_argument("--no-local", action="store_true", help="the global model only")
    pr.add_argument("--samples", type=int, default=2000, metavar="N",
                    help="test samples, class-stratified (default 2000; all when the test set is smaller)")
    pr.add_argument("--perplexity", type=float, default=30.0, help="t-SNE perplexity (default 30; at most samples - 1)")
    pr.add_argument("--seed", type=int, default=0, help="seed of the subset and of t-SNE")
    pr.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    pr.add_argument("--out", metavar="PNG",
                    help="figure path (default RUN_DIR/representation/tsne.png); the JSON is written beside it")
    pr.set_defaults(func=cmd_plot_repr)

    rep = sub.add_parser(
        "report",
        help="summarise runs and suites",
        description=textwrap.dedent(
            """\
            Status, final and best accuracy of runs, and rounds to reach a target accuracy
            (MOON Table 2). RUN_DIR is a run directory or a directory of runs (a suite's or
            sweep's --out), e.g.
              contrafl report runs/reduced
              contrafl report runs/reduced --html report.html  # one page with tables and figures
              contrafl report runs/reduced --markdown     # the suite's table as in docs/results.md
              contrafl report --update docs/results.md    # regenerate every table of that file"""
        ),
        formatter_class=fmt,
    )
    rep.add_argument("runs", nargs="*", metavar="RUN_DIR")
    rep.add_argument("--html", metavar="OUT.html",
                     help="write one self-contained HTML page (tables, curves with seed bands, per-client accuracy and "
                          "fairness, partition heatmaps, t-SNE figures, every run's state) instead of printing")
    rep.add_argument("--markdown", action="store_true",
                     help="markdown output; for one suite directory, its table with per-seed values")
    rep.add_argument("--update", metavar="FILE",
                     help="regenerate every block '<!-- report SUITE_DIR -->' ... '<!-- end report -->' (a table) and "
                          "'<!-- figure SUITE_DIR KIND PNG -->' ... '<!-- end figure -->' (KIND: curves, clients, partition) "
                          "of a markdown file (docs/results.md) from its suite or sweep directory (blocks whose "
                          "directory is not here are left as they are)")
    rep.add_argument("--target", type=float, help="accuracy to reach, e.g. 0.68")
    rep.add_argument("--target-from", metavar="RUN_DIR", help="use this run's final accuracy as the target (e.g. FedAvg's)")
    rep.add_argument("--clients", action="store_true",
                     help="add each run's per-client accuracy, loss and test samples (final and best round) "
                          "and their spread (std, worst 10%% of clients)")
    rep.set_defaults(func=cmd_report)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` with KEY=VALUE settings accepted before or after options
    (``contrafl run --out DIR rounds=3``): argparse leaves those after an option unparsed,
    and they join the command's own list of settings."""
    ns, extra = parser.parse_known_args(argv)
    dest = getattr(ns, "settings_dest", None)
    stray = [a for a in extra if dest is None or a.startswith("-") or "=" not in a]
    if stray:
        command = command_parser(parser, ns)
        setting = stray[0].lstrip("-").partition("=")[0].replace("-", "_")
        if stray[0].startswith("--") and dest is not None and setting in SETTINGS_NAMES:
            given = list(sys.argv[1:] if argv is None else argv)
            at = given.index(stray[0])
            value = stray[0].partition("=")[2] or (given[at + 1] if at + 1 < len(given) else "VALUE")
            written = stray[0] if "=" in stray[0] else " ".join(given[at: at + 2])
            command.error(f"settings are KEY=VALUE, not options: {setting}={value} instead of {written}")
        command.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        setattr(ns, dest, [*getattr(ns, dest), *extra])
    return ns


SETTINGS_NAMES = frozenset([*SETTINGS, *COMPONENTS])
"""What ``KEY=VALUE`` may name (a setting or a component)."""


def command_parser(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``ns`` ran, whose usage an error shows."""
    for name in ("command", "data_command"):
        choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if choices is None or getattr(ns, name, None) not in choices:
            break
        parser = choices[getattr(ns, name)]
    return parser


def whole_lines(stream: object) -> None:
    """Make ``stream`` write each line in one piece. With ``PYTHONUNBUFFERED=1`` (``-u``)
    Python's text streams write through, and ``print`` writes a line's text and its newline
    in two writes, so the lines of processes that share a terminal or a log (the ranks of
    a torchrun job, each printing the same error) run into each other. Line buffering
    writes a line, newline included, at once, and still as soon as it ends."""
    if isinstance(stream, io.TextIOWrapper) and stream.write_through and isinstance(stream.buffer, io.RawIOBase):
        stream.reconfigure(write_through=False, line_buffering=True)


def main(argv: list[str] | None = None) -> int:
    whole_lines(sys.stderr)
    keep_freed_memory()
    parser = build_parser()
    ns = parse_args(parser, argv)
    try:
        return ns.func(ns)
    except ContraflError as exc:
        print(f"contrafl: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        from .execution.signals import exit_code, signal_name

        print(f"\ncontrafl: interrupted by {signal_name(exc)}", file=sys.stderr)
        return exit_code(exc)
    except BrokenPipeError:  # the reader left (`contrafl list | head -1`): stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return EXIT_BROKEN_PIPE


def run() -> NoReturn:
    """The ``contrafl`` command (and ``python -m contrafl``): :func:`main`, then
    :func:`end_process`."""
    end_process(main())


def end_process(code: int) -> NoReturn:
    """End the process with exit status ``code`` as the interpreter would, less its
    teardown: the exit handlers run (``atexit``: logging, trackers, multiprocessing's
    children), the standard streams are flushed, and ``os._exit`` skips destroying every
    module and object, which takes torch alone about 0.3 s (``python -c "import torch"``
    1.25 s, 0.97 s ending so; a run of pfl-research's silo shape 0.42 s). Where a thread
    that is not a daemon still runs, the ordinary exit, which waits for it."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, a stream closed
            stream.flush()
    os._exit(code)


EXIT_BROKEN_PIPE = 128 + 13
"""The exit status of a command whose output was closed by its reader (SIGPIPE's)."""


if __name__ == "__main__":
    run()
