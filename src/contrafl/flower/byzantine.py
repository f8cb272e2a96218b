"""Byzantine SuperNodes: attackers that are SuperNodes of their own, not simulated by the
server.

A SuperNode whose node config names an attack (``attack='sign_flipping'``, options as
``attack-OPTION`` keys, :mod:`contrafl.flower.node`) is an attacker of the run with the
same :class:`~contrafl.engine.attacking.Attack` code as the simulator's, as its client
alone (``attack.clients=[partition-id]``) and non-omniscient (``attack.omniscient=false``):
a real attacker sees only its own update. It poisons its own training data before the
run (data attacks) and crafts its reply from its own update after each round's training
(:meth:`contrafl.flower.client.FlowerClient.train`), before the reply is checked, and,
with secure aggregation, masked. The server's config says ``attack=none``: it knows
nothing of the attackers, and its aggregator (``aggregator=NAME``) meets their replies as
any others.

Such a deployment is the simulation of its config with ``attack.clients=[the attacking
clients] attack.omniscient=false`` wherever each attacker's reply depends on its own
update alone: every attack a SuperNode may make with one attacker, and with several the
attacks that each attacker makes for itself (``gaussian``, ``scaling``, the data attacks,
``prototype_poisoning``); the simulator's non-omniscient attackers of ``sign_flipping`` and
``inner_product_manipulation`` pool the updates of all the round's attackers (they collude).
``alie``, ``min_max`` and ``min_sum`` are refused: from one update they send it unchanged.
``scaling``, ``model_replacement`` (and every attack whose scale defaults to ``n /
server_lr``) need ``attack.scale``: that default needs the number of replies the server
aggregates.

``contrafl deploy --byzantine-nodes`` makes the attackers of the config's attack
(``attack.clients`` or ``attack.fraction``, drawn from the seed as the simulator draws
them) such SuperNodes (:func:`split`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from .. import params as P
from ..config import Component, Config
from ..engine.attacking import READS, SCALE_ONE, SPREAD_ATTACKS, Attack, AttackParams, resolve_attack
from ..engine.sampling import clients_per_round
from ..errors import ConfigError

CHOSEN_BY_SERVER = ("clients", "fraction", "choice", "omniscient")
"""Options that a Byzantine SuperNode does not take: who attacks, and what it sees."""
DOC = "docs/flower.md, \"Byzantine SuperNodes\""


def problem(name: str, scale: float | None) -> str | None:
    """Why a SuperNode cannot make attack ``name`` (with ``attack.scale`` ``scale``), or None."""
    if name in SPREAD_ATTACKS:
        return (f"attack={name} needs the spread of several updates, and a SuperNode sees only its own, from which it would send "
                "its update unchanged; use sign_flipping, inner_product_manipulation, gaussian, scaling or a data attack")
    if "scale" in READS.get(name, ()) and name not in SCALE_ONE and scale is None:
        return (f"attack={name} scales the update by n / server_lr unless attack.scale is set, and a SuperNode does not know n, "
                "the replies the server aggregates; set attack.scale=S")
    return None


def node_attack(cfg: Config, cid: int, name: str, options: Mapping[str, Any]) -> Config:
    """``cfg`` (the run's config, ``attack=none``) with client ``cid`` as the one attacker of
    the node config's attack ``name`` with ``options`` (by option name), non-omniscient, the
    attack checked and in canonical form; one-line :class:`ConfigError` in the node
    config's spelling (``attack-scale``) otherwise."""
    folded = P.fold(name)
    given = " ".join([f"attack='{name}'", *(f"attack-{k.replace('_', '-')}={v!r}" for k, v in options.items())])
    chosen = {"clients": [cid], **({"omniscient": False} if "omniscient" in READS.get(folded, ()) else {})}
    try:
        component = resolve_attack(Component(name, {**options, **chosen}), cfg.num_clients, clients_per_round(cfg.num_clients, cfg.sample_fraction))
        why = problem(component.name, P.build(AttackParams, component.options, "attack").scale)
        if why is not None:
            raise ConfigError(why)
    except ConfigError as exc:
        raise ConfigError(f"node config {given}: {node_spelling(str(exc))}; restart the SuperNode with other attack keys ({DOC})") from None
    return dataclasses.replace(cfg, attack=component)


def node_spelling(text: str) -> str:
    """``text`` with the run config's ``attack.OPTION`` written as node config keys, ``attack-OPTION``."""
    return re.sub(r"\battack\.(\w+)", lambda m: "attack-" + m.group(1).replace("_", "-"), text)


def split(cfg: Config) -> tuple[Config, dict[str, str | int | float | bool], tuple[int, ...]]:
    """``contrafl deploy --byzantine-nodes``: the server's config (``cfg`` with
    ``attack=none``), the node config keys of ``cfg``'s attack and its attackers, the
    clients whose SuperNodes make it (``attack.clients``, or ``attack.fraction`` drawn from
    the seed as the simulator draws them). :class:`ConfigError` in one line for no attack,
    attackers drawn per round, an omniscient attack (``attack.omniscient=false`` must be
    given: the simulation of the deployment has it) and what :func:`problem` refuses.
    ``cfg``'s ``num_clients`` must be resolved."""
    name = cfg.attack.name
    if P.fold(name) == "none":
        raise ConfigError(f"--byzantine-nodes makes the config's attackers SuperNodes, and the config has attack=none; add attack=NAME attack.clients=[K] ({DOC})")
    component = resolve_attack(cfg.attack, cfg.num_clients, clients_per_round(cfg.num_clients, cfg.sample_fraction))
    params = P.build(AttackParams, component.options, "attack")
    if params.choice == "per_round":
        raise ConfigError("--byzantine-nodes: attack.choice=per_round draws the attackers each round, and a SuperNode attacks in every round or none; "
                          "set attack.clients=[K] or leave attack.choice fixed")
    if "omniscient" in READS[component.name] and params.omniscient:
        raise ConfigError(f"--byzantine-nodes: attack={component.name} sees the round's honest updates unless attack.omniscient=false, "
                          "and a SuperNode sees only its own; add attack.omniscient=false (`contrafl run` of the same config simulates the deployment)")
    why = problem(component.name, params.scale)
    if why is not None:
        raise ConfigError(f"--byzantine-nodes: {why}")
    attackers = tuple(Attack(component, cfg.num_clients, cfg.seed, cfg.server_lr).fixed or ())
    keys: dict[str, str | int | float | bool] = {"attack": component.name}
    for option, value in component.options.items():
        if option not in CHOSEN_BY_SERVER and value is not None:
            keys[f"attack-{option}"] = json.dumps(value, separators=(",", ":")) if isinstance(value, list) else value
    return dataclasses.replace(cfg, attack=Component("none")), keys, attackers


def node_config_text(keys: Mapping[str, str | int | float | bool]) -> str:
    """Node config ``keys`` as ``flower-supernode --node-config`` takes them (``attack='scaling' attack-scale=5.0``)."""
    def text(value: str | int | float | bool) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else f"'{value}'" if isinstance(value, str) else str(value)

    return " ".join(f"{key}={text(value)}" for key, value in keys.items())
