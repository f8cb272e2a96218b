"""Byzantine clients as a setting of every algorithm (``attack=NAME``).

Threat model: a fraction of the clients (``attack.fraction``, or ``attack.clients`` by
id), chosen from the seed once for the run (``attack.choice=fixed``) or among each round's
sample (``per_round``), send crafted replies. They collude and, for the omniscient attacks
of the papers, see the round's honest updates (``attack.omniscient=false``: only their
own). They control their whole reply: its update and its per-label tables, within the
checks the server makes (shapes, finite values, possible label counts). The server does
not know who they are; ``metrics.jsonl`` records them, for measuring the aggregator.

Update attacks work on each reply's update as one vector, as
:mod:`contrafl.engine.robustness` reads it (``u = p - m``, every floating-point tensor of
the payload, per-label tables' rows included): the attackers' updates are replaced by
:mod:`contrafl.algorithms.attacks`' vector made from the honest ones, ``p <- m + u_attack``.
``prototype_poisoning`` sends each held label's prototype and count under the flipped
label ``C - 1 - c`` (algorithms whose replies carry per-label tables).
``encoder_collapse`` pulls the global model towards a collapsed one, ``X``: the message's
model with every weight matrix and kernel (each tensor of two or more dimensions) zero,
a constant map that gives every input the same representation (the failure
self-supervised methods guard against): ``p = m + s (X - m)`` with ``s = n / server_lr``,
model replacement's boost. Under the mean the round's model is then ``X`` plus the mean
of the honest updates.

Data attacks poison the attackers' training samples before the run (:meth:`Attack.poisoned`;
fixed attackers): ``label_flipping`` trains on labels ``C - 1 - y``, ``backdoor`` on a
fraction ``attack.poison`` of its samples carrying a trigger (a white square of
``attack.trigger`` pixels in the bottom-right corner of images, the last ``attack.trigger``
features at the dataset's maximum for vectors) labelled ``attack.target``;
``model_replacement`` is the backdoor with the update scaled by ``n / server_lr``
(Bagdasaryan et al. 2020), so that it replaces the global model under the mean. The
backdoor's success rate is the global model's accuracy on the test samples of other
labels with the trigger, against the target (``backdoor_success``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import params as P
from ..algorithms import attacks
from ..algorithms.base import Reply
from ..config import Component, component_name, without_options
from ..data.base import ArrayDataset, FederatedDataset
from ..data.partition import Partition
from ..errors import ConfigError
from ..execution.outcomes import Probe
from ..execution.validate import float_leaves, is_label_table, map_update, update_vector, updates, with_update
from ..rng import generator

ATTACKS = {
    "none": "no Byzantine clients (the default)",
    "sign_flipping": "the opposite of the honest mean (Allen-Zhu et al. 2021)",
    "gaussian": "N(mu, sigma^2) noise in every coordinate (Blanchard et al. 2017)",
    "scaling": "the attacker's own update times attack.scale (Bagdasaryan et al. 2020's boosting)",
    "alie": "A Little Is Enough: mean - z std of the honest updates (Baruch et al. 2019)",
    "inner_product_manipulation": "-epsilon times the honest mean (Xie et al. 2019)",
    "min_max": "mean + gamma perturbation, no farther from any update than the farthest two (Shejwalkar and Houmansadr 2021)",
    "min_sum": "mean + gamma perturbation, summed squared distances within the honest ones' largest (Shejwalkar and Houmansadr 2021)",
    "prototype_poisoning": "each held label's prototype and count sent under label C - 1 - c (per-label tables: FedCRL, FedProto)",
    "encoder_collapse": "pull the global model to a collapsed one (weight matrices 0: one representation for every input), boosted by n / server_lr",
    "label_flipping": "train on labels C - 1 - y (Fang et al. 2020's label flipping)",
    "backdoor": "train on samples with a pixel-pattern trigger labelled attack.target (Gu et al. 2017; success rate measured)",
    "model_replacement": "the backdoor with the update scaled by n / server_lr to replace the global model (Bagdasaryan et al. 2020)",
}
NAMES = tuple(ATTACKS)
DATA_ATTACKS = ("label_flipping", "backdoor", "model_replacement")
"""Attacks on the attackers' training data, which need labels and fixed attackers."""
SPREAD_ATTACKS = ("alie", "min_max", "min_sum")
"""Attacks that hide in the spread of several updates: from one update alone they send its value."""
SCALE_ONE = ("backdoor",)
"""Attacks that read ``attack.scale`` and default it to 1; the others default it to
``n / server_lr`` (``n``: the replies the server aggregates), which replaces the global
model under the mean."""


@dataclass(frozen=True)
class AttackParams:
    """Options of the ``attack`` setting."""

    fraction: float = P.param(0.2, P.Interval(0, 0.5, "left"), "fraction of the clients that are Byzantine (ignored with attack.clients)")
    clients: list[int] | None = P.param(None, None, "the Byzantine clients by id, e.g. [0,3] (instead of attack.fraction)")
    choice: str = P.param("fixed", P.OneOf(("fixed", "per_round")), "fixed: the same clients every round, drawn once from the seed; per_round: drawn among each round's sample")
    rounds: list[int] | None = P.param(None, None, "the rounds (from 1) in which the attackers craft their replies, e.g. [10] (none: every round); data attacks train on poisoned data in every round, model_replacement scales only in these")
    omniscient: bool = P.param(True, None, "the attackers see the round's honest updates, as in the papers; false: only their own")
    mu: float = P.param(0.0, None, "gaussian: the noise's mean")
    sigma: float = P.param(1.0, P.Interval(0, None), "gaussian: the noise's standard deviation")
    scale: float | None = P.param(None, P.Interval(0, None, "neither"), "scaling, backdoor, model_replacement, encoder_collapse: the factor on the attacker's own update (none: 1 for backdoor, else n / server_lr, which replaces the global model under the mean)")
    epsilon: float = P.param(0.1, P.Interval(0, None, "neither"), "inner_product_manipulation: x = -epsilon mean")
    z: float | None = P.param(None, None, "alie: x = mean - z std (none: the paper's z_max for the round's clients)")
    perturbation: str = P.param("unit_vec", P.OneOf(("unit_vec", "std", "sign")), "min_max, min_sum: the perturbation direction")
    target: int = P.param(0, P.Interval(0, None), "backdoor, model_replacement: the label the trigger leads to")
    poison: float = P.param(0.5, P.Interval(0, 1, "right"), "backdoor, model_replacement: fraction of the attacker's samples that carry the trigger")
    trigger: int = P.param(3, P.Interval(1, None), "backdoor, model_replacement: side of the trigger square in pixels (images) or number of features (vectors)")


READS = {
    "sign_flipping": ("omniscient",),
    "gaussian": ("mu", "sigma"),
    "scaling": ("scale",),
    "alie": ("omniscient", "z"),
    "inner_product_manipulation": ("omniscient", "epsilon"),
    "min_max": ("omniscient", "perturbation"),
    "min_sum": ("omniscient", "perturbation"),
    "prototype_poisoning": (),
    "encoder_collapse": ("scale",),
    "label_flipping": (),
    "backdoor": ("target", "poison", "trigger", "scale"),
    "model_replacement": ("target", "poison", "trigger", "scale"),
}
CHOOSING = ("fraction", "clients", "choice", "rounds")


def resolve_attack(component: Component, num_clients: int, clients_per_round: int, has_tables: bool | None = None,
                   supervised: bool = True, num_classes: int | None = None) -> Component:
    """The ``attack`` component validated and in canonical form; one-line errors for an
    unknown attack, an option it does not read, a fraction outside [0, 0.5) or one that
    makes no attacker, unknown client ids, ``prototype_poisoning`` on replies without
    per-label tables (``has_tables`` False; None: not known yet), a data attack on a
    self-supervised algorithm, with attackers drawn per round, or with a target label
    beyond ``num_classes``."""
    name = component_name(component, "attack", NAMES, "set it with attack=NAME (docs/robustness.md)")
    if name == "none":
        return without_options(component, "attack", "none", "choose an attack, e.g. attack=sign_flipping")
    options = P.build(AttackParams, component.options, "attack")
    ignored = [k for k in component.options if k not in READS[name] + CHOOSING]
    if ignored:
        readers = [a for a, keys in READS.items() if ignored[0] in keys]
        raise ConfigError(f"attack.{ignored[0]} has no effect with attack={name} (it is read by {', '.join(readers)}); remove it")
    if options.clients is not None:
        if "fraction" in component.options:
            raise ConfigError("attack.clients and attack.fraction both choose the attackers; give one")
        if options.choice == "per_round":
            raise ConfigError("attack.clients names fixed attackers, but attack.choice=per_round draws them each round; remove one")
        bad = [c for c in options.clients if not 0 <= c < num_clients]
        if bad:
            raise ConfigError(f"attack.clients names client {bad[0]}, but the clients are 0..{num_clients - 1}; give ids in that range")
        if not options.clients:
            raise ConfigError("attack.clients=[] names no attacker; give ids, e.g. attack.clients=[0,3], or set attack=none")
    else:
        pool = num_clients if options.choice == "fixed" else clients_per_round
        if round(options.fraction * pool) == 0:
            raise ConfigError(f"attack.fraction={options.fraction:g} of {pool} clients makes no attacker; raise attack.fraction or set attack=none")
    if name in DATA_ATTACKS:
        if not supervised:
            raise ConfigError(f"attack={name} poisons labels, and this algorithm learns without them; use an update attack, e.g. attack=alie")
        if options.choice == "per_round":
            raise ConfigError(f"attack={name} poisons the attackers' data before the run, so they cannot change from round to round; set attack.choice=fixed")
        if num_classes is not None and options.target >= num_classes:
            raise ConfigError(f"attack.target={options.target} is not a label of the dataset's {num_classes}; give a label in 0..{num_classes - 1}")
    if options.rounds is not None and (not options.rounds or min(options.rounds) < 1):
        raise ConfigError(f"attack.rounds={options.rounds} must list rounds from 1, e.g. attack.rounds=[10]; leave it unset to attack every round")
    if name == "prototype_poisoning" and has_tables is False:
        raise ConfigError("attack=prototype_poisoning poisons per-label tables (prototypes), and this algorithm's replies have none; use an update attack, e.g. attack=alie")
    kept = {k: v for k, v in P.to_dict(options).items() if k in READS[name] + ("choice",) or (k in ("clients", "rounds") and v is not None)
            or (k == "fraction" and options.clients is None)}
    return Component(name, kept)


class Attack:
    """A run's Byzantine clients and the replies they craft (the module doc)."""

    def __init__(self, component: Component, num_clients: int, seed: int, server_lr: float) -> None:
        self.name = component.name
        self.params: AttackParams = P.build(AttackParams, component.options, "attack")
        self.seed, self.server_lr = seed, server_lr
        p = self.params
        if p.clients is not None:
            self.fixed: list[int] | None = sorted(set(p.clients))
        elif p.choice == "fixed":
            order = torch.randperm(num_clients, generator=generator(seed, "attackers")).tolist()
            self.fixed = sorted(order[: round(p.fraction * num_clients)])
        else:
            self.fixed = None

    @classmethod
    def of(cls, cfg: Any) -> Attack | None:
        """The run's attack, or None for ``attack=none``."""
        return None if cfg.attack.name == "none" else cls(cfg.attack, cfg.num_clients, cfg.seed, cfg.server_lr)

    def attackers(self, t: int, sampled: Sequence[int]) -> list[int]:
        """Round ``t``'s Byzantine clients among its ``sampled`` ones."""
        if self.fixed is not None:
            fixed = set(self.fixed)
            return [c for c in sampled if c in fixed]
        order = torch.randperm(len(sampled), generator=generator(self.seed, "attackers", t)).tolist()
        return sorted(sampled[i] for i in order[: round(self.params.fraction * len(sampled))])

    def craft(self, t: int, replies: Mapping[int, Reply], byzantine: Sequence[int], message_of: Mapping[int, Any]) -> dict[int, Reply]:
        """The crafted replies of the round's ``byzantine`` clients that replied, from
        every reply that reached the server (``replies``, by client) and each client's
        message."""
        mine = [c for c in byzantine if c in replies]
        if not mine or (self.params.rounds is not None and t + 1 not in self.params.rounds):
            return {}
        if self.name == "prototype_poisoning":
            return {c: dataclasses.replace(replies[c], payload=_flip_tables(replies[c].payload)) for c in mine}
        if self.name == "encoder_collapse":  # p = m + scale (X - m): model replacement towards X, m's matrices zeroed
            scale = self.params.scale if self.params.scale is not None else len(replies) / self.server_lr
            out = {}
            for c in mine:
                payload, message = replies[c].payload, message_of[c]
                bases = [p - u for p, u in zip(float_leaves(payload), updates(payload, message))]
                crafted = map_update(payload, message, lambda k, u: -scale * bases[k] if bases[k].dim() >= 2 else torch.zeros_like(u))
                out[c] = dataclasses.replace(replies[c], payload=crafted)
            return out
        if self.name in DATA_ATTACKS:  # trained on poisoned data; scaled where asked
            scale = self.params.scale if self.params.scale is not None else 1.0 if self.name in SCALE_ONE else len(replies) / self.server_lr
            if self.name == "label_flipping" or scale == 1.0:
                return {}
            return {c: dataclasses.replace(replies[c], payload=map_update(replies[c].payload, message_of[c], lambda k, u: u * scale)) for c in mine}
        honest = [c for c in sorted(replies) if c not in set(mine)]
        seen = honest if self.params.omniscient and honest else mine
        vectors = {c: update_vector(replies[c].payload, message_of[c], torch.float64) for c in set(seen) | set(mine)}
        stacked = torch.stack([vectors[c] for c in seen])
        out = {}
        shared = None if self.name == "gaussian" else self.vector(stacked, len(mine), len(replies))
        for c in mine:
            if self.name == "gaussian":
                x = attacks.gaussian(stacked, self.params.mu, self.params.sigma, generator(self.seed, "attack", t, c))
            elif self.name == "scaling":
                scale = self.params.scale if self.params.scale is not None else len(replies) / self.server_lr
                x = scale * vectors[c]
            else:
                x = shared
            out[c] = dataclasses.replace(replies[c], payload=with_update(replies[c].payload, message_of[c], x))
        return out

    def vector(self, honest: torch.Tensor, f: int, n: int) -> torch.Tensor | None:
        """The omniscient attacks' one vector from the ``honest`` updates ``[h, d]``, for
        ``f`` attackers among ``n`` replies."""
        p = self.params
        if self.name in SPREAD_ATTACKS and len(honest) < 2:
            return honest.mean(dim=0)  # no spread to hide in
        if self.name == "sign_flipping":
            return attacks.sign_flipping(honest)
        if self.name == "inner_product_manipulation":
            return attacks.inner_product_manipulation(honest, p.epsilon)
        if self.name == "alie":
            z = p.z if p.z is not None else attacks.alie_z_max(n, f) if 0 < (n // 2 + 1) - f < n else 0.0
            return attacks.alie(honest, f, z)
        if self.name == "min_max":
            return attacks.min_max(honest, p.perturbation)
        if self.name == "min_sum":
            return attacks.min_sum(honest, p.perturbation)
        return None


    def poisoned(self, data: FederatedDataset, partition: Partition) -> FederatedDataset:
        """``data`` with the attackers' training samples poisoned (data attacks; the
        module doc), the rest as they are. The samples chosen to carry the trigger come
        from the stream ``(seed, "poison", client)``."""
        if self.name not in DATA_ATTACKS:
            return data
        x, y = data.train.x.clone(), data.train.y.clone()
        for c in self.fixed or []:
            rows = torch.as_tensor(partition.train[c], dtype=torch.long)
            if self.name == "label_flipping":
                y[rows] = data.num_classes - 1 - y[rows]
                continue
            chosen = rows[torch.randperm(len(rows), generator=generator(self.seed, "poison", c))[: round(self.params.poison * len(rows))]]
            x[chosen] = self.triggered(x[chosen])
            y[chosen] = self.params.target
        return dataclasses.replace(data, train=ArrayDataset(x, y))

    def triggered(self, x: torch.Tensor) -> torch.Tensor:
        """Samples ``x`` with the trigger: the bottom-right ``trigger x trigger`` square of
        images (``[N, C, H, W]``) or the last ``trigger`` features of vectors at the
        dtype's (uint8 images) or the samples' maximum."""
        x, k = x.clone(), self.params.trigger
        top = torch.iinfo(x.dtype).max if not x.is_floating_point() else (float(x.max()) if x.numel() else 1.0)
        if x.dim() == 4:
            x[:, :, -k:, -k:] = top
        else:
            x[..., -k:] = top
        return x

    def probes(self) -> dict[str, Probe]:
        """What a model is evaluated on besides its test data, by metric name, made from
        that data: ``backdoor_success``, the samples of labels other than the target with
        the trigger, labelled with the target (the accuracy on them is the attack's
        success rate); nothing for an attack without a backdoor."""
        if self.name not in ("backdoor", "model_replacement"):
            return {}
        return {"backdoor_success": self.backdoor_probe}

    def backdoor_probe(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples of ``(x, y)`` whose label is not the target, with the trigger, and
        the target as their label."""
        others = y != self.params.target
        return self.triggered(x[others].cpu()).to(x.device), torch.full_like(y[others], self.params.target)

    def test_sets(self, test: ArrayDataset) -> dict[str, ArrayDataset]:
        """What the global model is evaluated on besides the test set, by metric name
        (:meth:`probes` of the test set)."""
        return {name: ArrayDataset(*probe(test.x, test.y)) for name, probe in self.probes().items()}


def _flip_tables(payload: Any) -> Any:
    """``payload`` with every per-label table's rows and counts reversed (label ``c``'s
    sent as ``C - 1 - c``)."""
    if is_label_table(payload):
        flipped = dict(payload)
        for key in ("reps", "counts", "mask"):  # a compact table's rows (FedSSC's, marked labels only) reverse with its mask
            if isinstance(payload.get(key), torch.Tensor):
                flipped[key] = payload[key].flip(0)
        return flipped
    if isinstance(payload, Mapping):
        return {k: _flip_tables(v) for k, v in payload.items()}
    if isinstance(payload, (list, tuple)):
        return type(payload)(_flip_tables(v) for v in payload)
    return payload
