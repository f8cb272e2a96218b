"""The algorithm interface.

An algorithm says four things and nothing else (the round loop belongs to the engine):

1. what the server sends (:meth:`Algorithm.broadcast`, and
   :meth:`Algorithm.message_for` where clients get different messages),
2. the client's local objective (:meth:`Algorithm.client_begin` prepares a
   :class:`LocalTask`; :meth:`Algorithm.local_loss`, :meth:`Algorithm.stages` or
   :meth:`Algorithm.phases` give the loss of one batch and how it is optimised),
3. what the client returns (:meth:`Algorithm.client_end` builds a :class:`Reply`),
4. how the server aggregates (:meth:`Algorithm.aggregate`),

and, for evaluation, which model a client holds (:meth:`Algorithm.personal_model`).

Local objectives are *functions of parameters*: ``local_loss(task, batch, net)`` reads the
trainable parameters from ``task.params`` and runs the network through ``net`` (a
``torch.func.functional_call`` wrapper), so an executor can evaluate it for one client
with ordinary autograd or for many clients at once under ``torch.func.vmap``. For that the
loss must not branch on tensor values, must not mutate its inputs (the engine updates
BatchNorm buffers) and must give every client of a round the same task structure (same
keys and shapes in ``params``, ``buffers``, ``frozen`` and ``consts``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from ..models.base import Heads, ModelOutput

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Federation:
    """Facts about the simulated federation that algorithms may use.

    Attributes:
        num_clients: total number of clients ``N``.
        num_classes: number of labels.
        rounds: number of communication rounds ``T``.
        lr, local_epochs, batch_size: the clients' local training settings.
        param_names: names of the model's trainable parameters (the rest of a state dict
            are buffers such as BatchNorm statistics).
        seed: the run's seed (for algorithm-side randomness, e.g. FedSSC's sampling).
        rep_dim: width of the representation ``z`` the classifier reads.
        client_sizes: every client's number of training samples, by client id.
    """

    num_clients: int
    num_classes: int
    rounds: int
    lr: float
    local_epochs: int
    batch_size: int
    param_names: tuple[str, ...]
    seed: int = 0
    rep_dim: int = 0
    client_sizes: tuple[int, ...] = ()

    def split(self, state: Mapping[str, torch.Tensor]) -> tuple[StateDict, StateDict]:
        """Split a full state dict into ``(parameters, buffers)``."""
        names = set(self.param_names)
        params = {k: v for k, v in state.items() if k in names}
        buffers = {k: v for k, v in state.items() if k not in names}
        return params, buffers


class ClientContext(Protocol):
    """What the engine tells an algorithm about the client it is working for.

    ``net`` is the run's functional forward (:class:`Network`), for computations an
    algorithm makes outside the executor's local training (FedALA's adaptive
    aggregation, Per-FedAvg's adaptation step at evaluation), in the run's precision
    (with ``precision=bf16`` under bfloat16 autocast, its outputs in float32); ``generator(*key)`` gives
    a random stream derived from (seed, round, client, key). ``smallest_batch``: the
    fewest samples a train-mode forward of ``net`` takes (2 for a model with BatchNorm,
    :func:`~contrafl.models.base.smallest_batch`; else 1).
    """

    cid: int
    round: int
    num_samples: int
    label_counts: torch.Tensor  # int64 [num_classes], the client's training labels
    net: "Network"
    smallest_batch: int

    def initial_state(self) -> StateDict:
        """The client's own random initialisation of the model (built on demand)."""

    def predict(self, state: Mapping[str, torch.Tensor]) -> tuple[ModelOutput, torch.Tensor]:
        """Eval-mode forward of ``state`` over the client's training data, without
        augmentation or gradients; returns the outputs and the labels."""

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's training samples, normalised without augmentation, and their
        labels, in the partition's order."""

    def augmented_data(self, view: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's training samples through the run's training pipeline of view
        ``view`` (random parameters drawn from ``generator``), and their labels, in the
        partition's order."""

    def generator(self, *key: object) -> torch.Generator:
        """A random stream derived from (seed, round, client, ``key``)."""


@dataclass
class LocalTask:
    """The starting point of one client's local training.

    Attributes:
        params: trainable parameters by role (``{"model": {...}}``; FedSiam-DA also
            trains a ``"branch"``). Each role is a model of the run's architecture, or
            tensors that only :attr:`Stage.pre_step` / :attr:`Stage.post_step` change
            (Orchestra's memory bank).
        buffers: buffers (BatchNorm statistics) of each trained role, updated by
            train-mode forwards.
        frozen: eval-mode models (full state dicts) used by the loss, never updated, e.g.
            MOON's global and previous models.
        consts: other tensors used by the loss (control variates, class representations).
        snapshots: ``{frozen_name: role}``: at the end of every local epoch the engine
            copies the current ``role`` model (parameters and buffers) into
            ``frozen[frozen_name]`` (FedSiam-DA's history model).
        epochs: this client's epochs of each phase, overriding :attr:`Phase.epochs`
            (``None``: the phases' own); per-client epochs.

    An entry shared by all clients (the same tensor object, e.g. the broadcast global
    model) is not copied per client by the vectorized executor. A role's parameters
    and buffers together are a (possibly partial) state dict of the run's model: a
    forward merges the roles it needs, e.g. FedRep's ``{**body, **head}``.
    """

    params: dict[str, StateDict]
    buffers: dict[str, StateDict]
    frozen: dict[str, StateDict] = field(default_factory=dict)
    consts: dict[str, Any] = field(default_factory=dict)
    snapshots: dict[str, str] = field(default_factory=dict)
    epochs: tuple[int, ...] | None = None


class TaskView(NamedTuple):
    """The per-client tensors a loss sees (one client's slice under ``vmap``)."""

    params: dict[str, StateDict]
    buffers: dict[str, StateDict]
    frozen: dict[str, StateDict]
    consts: dict[str, Any]


class Batch(NamedTuple):
    """One local batch: normalised, augmented inputs and labels.

    ``x`` is ``[B, ...]``, or ``[V, B, ...]`` for algorithms that ask for ``V`` views.
    ``noise`` holds the standard-normal tensors the stage asked for (:attr:`Stage.noise`),
    fresh at every optimiser step (empty when it asked for none).
    """

    x: torch.Tensor
    y: torch.Tensor
    noise: Mapping[str, torch.Tensor] = {}


class Network(Protocol):
    """Functional forward of the run's architecture, provided by the engine."""

    def __call__(
        self, state: Mapping[str, torch.Tensor], x: torch.Tensor, *, train: bool
    ) -> ModelOutput: ...


LossFn = Callable[[TaskView, Batch, Network], tuple[torch.Tensor, dict[str, torch.Tensor]]]
StepUpdate = Callable[[TaskView, Batch, Network], dict[str, StateDict]]


@dataclass(frozen=True)
class Stage:
    """One optimisation step of a local update: minimise ``loss`` over ``trains``.

    Most algorithms have one stage training every role. FedSiam-DA's alternating update
    (its eqs. 8-9) is two stages: first the global branch, then the local model.
    ``repeat`` optimiser steps are taken on the same batch (pFedMe's K inner steps); the
    loss's statistics are summed over every step, repeats included.

    Updates that gradients do not make: ``pre_step(task, batch)`` before the loss of
    each optimiser step and ``post_step(task, batch)`` after it optionally return new
    values, ``w <- update[role][name]`` for every entry they return, of trained
    parameters (the NIID-Bench form of SCAFFOLD's correction, ``w - lr (c - c_i)``) or
    of roles that gradients do not train: BYOL's target network after each step, ``xi +
    (1 - tau)(theta - xi)``; Orchestra's target before it and its memory bank of target
    projections after it. Like the loss they must be functions of tensors only.

    ``noise`` names standard-normal tensors and their shapes (``(("samples", (128,
    512)),)``) that every optimiser step of the stage receives fresh in ``batch.noise``:
    the loss's randomness (FedU2's uniform samples on the sphere) drawn from the client's
    own stream, so that every executor sees the same numbers.
    """

    loss: LossFn
    trains: tuple[str, ...] | None = None
    post_step: StepUpdate | None = None
    repeat: int = 1
    noise: tuple[tuple[str, tuple[int, ...]], ...] = ()
    pre_step: StepUpdate | None = None


@dataclass(frozen=True)
class Phase:
    """A block of local training: its stages run on every batch of its own schedule.

    Most algorithms train in one phase of the run's ``local_epochs``. FedRep trains the
    head for some epochs and then the body; Ditto its personal model, then the global
    one. A phase has its own number of ``epochs`` (``None``: the run's
    ``local_epochs``; a client's :attr:`LocalTask.epochs` overrides it), ``batch_size``
    (``None``: the run's) and optimiser settings, given as overrides of the run's
    optimiser (``{"name": "sgd", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0}``,
    any subset). The parameters a stage does not train keep their values; each phase
    starts from where the previous one ended. ``parts``: how many parts the stages'
    loss splits each batch into (Per-FedAvg's two halves); with a model that trains no
    batch of one sample (BatchNorm), a last batch too short to give each part two is
    left out.
    """

    stages: tuple[Stage, ...]
    epochs: int | None = None
    batch_size: int | None = None
    optimizer: Mapping[str, Any] | None = None
    name: str = "local"
    parts: int = 1


@dataclass
class TrainResult:
    """What local training produced.

    ``stats`` are the per-batch statistics returned by the loss, summed over all local
    steps; ``steps`` is the number of optimiser steps taken; ``opt_state`` the optimiser
    state per stage (kept by the engine when optimiser state persists across rounds).
    """

    params: dict[str, StateDict]
    buffers: dict[str, StateDict]
    stats: dict[str, torch.Tensor]
    steps: int
    opt_state: list[Any] | None = None


@dataclass
class Reply:
    """A client's message to the server.

    ``payload`` maps a kind (``"model"``, ``"delta_c"``, ``"class_reps"``) to tensors or
    nested dicts of tensors; the engine counts its bytes by kind. ``metrics`` are scalars
    for logging (not counted as communication).
    """

    cid: int
    num_samples: int
    payload: dict[str, Any]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorSpec:
    """The expected shape (``None``: any size on that dimension) and dtype of a tensor."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        dims = ", ".join("*" if d is None else str(d) for d in self.shape)
        return f"{dtype_name(self.dtype)}[{dims}]"


def spec_of(tree: Any) -> Any:
    """The :class:`TensorSpec` tree of the tensors in ``tree`` (exact shapes)."""
    if isinstance(tree, torch.Tensor):
        return TensorSpec(tuple(tree.shape), tree.dtype)
    if isinstance(tree, Mapping):
        return {k: spec_of(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [spec_of(v) for v in tree]
    raise TypeError(f"cannot describe a {type(tree).__name__} as tensors")


def dtype_name(dtype: torch.dtype) -> str:
    """The name of ``dtype`` without its ``torch.`` prefix (``float32``)."""
    return str(dtype).removeprefix("torch.")


@dataclass
class PersonalModel:
    """The model a client is evaluated with.

    ``state`` is a full state dict of the run's architecture. ``scores`` maps the model's
    outputs to class scores ``[B, num_classes]`` whose argmax is the prediction (``None``:
    the logits, and the loss is their cross-entropy; FedProto scores by the distance to
    class prototypes).
    """

    state: StateDict
    scores: Callable[[ModelOutput], torch.Tensor] | None = None


@dataclass
class ServerState:
    """The server's state: the global model and whatever else the algorithm keeps."""

    model: StateDict
    extras: dict[str, Any] = field(default_factory=dict)


class Algorithm:
    """Base class of federated algorithms; subclasses override what differs from FedAvg.

    Attributes:
        name, summary, paper: registry name, one-line description and reference.
        Params: dataclass of hyperparameters (``algorithm.<name>=...``).
        vectorizable: the local objective can run under ``torch.func.vmap``.
        evaluates_global: the global model is meaningful (False for SOLO).
        supervised: the local objective uses labels and the model has a classifier;
            self-supervised algorithms are evaluated by their representations (kNN).
        personalized: clients keep personal models worth evaluating.
        default_server_momentum: server momentum when ``server_momentum=auto``.
        min_batch_size: the smallest batch ``batch_size=auto`` gives it (the larger of
            this and the dataset's recommendation); 0: the dataset's recommendation.
        views: number of augmented views of each sample the loss needs.
        samples_clients: the round trains the clients sampled by ``sample_fraction``;
            False trains every client every round (SOLO, which communicates nothing).
        partial_work: a reply from fewer local steps than the client planned is a valid
            update, so a straggler may send the work it finished by the round's
            deadline (``stragglers=partial``; FedProx's gamma-inexact local solutions).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    Params: ClassVar[type]
    vectorizable: ClassVar[bool] = True
    evaluates_global: ClassVar[bool] = True
    supervised: ClassVar[bool] = True
    personalized: ClassVar[bool] = False
    default_server_momentum: ClassVar[float] = 0.0
    min_batch_size: ClassVar[int] = 0
    views: ClassVar[int] = 1
    samples_clients: ClassVar[bool] = True
    partial_work: ClassVar[bool] = False

    def __init__(self, params: Any, federation: Federation) -> None:
        """An algorithm with its validated hyperparameters ``params`` (an instance of
        :attr:`Params`) for ``federation``."""
        self.params = params
        self.federation = federation

    @classmethod
    def individual_updates(cls, params: Any) -> str | None:
        """Why the server needs each client's update on its own, or None when
        :meth:`aggregate`, with every reply weighing one sample, is an affine function of
        the sum of the replies' payloads (a mean or a sum over them, as FedAvg's and
        SCAFFOLD's are): then clipped updates plus one Gaussian draw are the Gaussian
        mechanism on that sum (``dp=central``), and the sum alone suffices (secure
        aggregation). The reason names what the server computes from single updates."""
        return None

    @classmethod
    def beyond_weighted_mean(cls, params: Any) -> str | None:
        """Why :meth:`aggregate` needs more than the weighted means of the replies'
        payloads, which is all secure aggregation reveals: every tensor weighted by the
        reply's ``num_samples``, and the rows of a per-label table (``reps`` and
        ``counts``) by :meth:`label_weighting`; None when those means suffice (the
        aggregate of equal payloads is then the payload). Beyond
        :meth:`individual_updates`: an aggregate of sums weighted otherwise."""
        return cls.individual_updates(params)

    @classmethod
    def label_weighting(cls, params: Any) -> str:
        """How :meth:`aggregate` weighs a client's row of a per-label table:
        ``"counts"`` (the label's count, FedCRL's eq. 6) or ``"uniform"`` (one for each
        client that holds the label); see
        :func:`~contrafl.algorithms.prototypes.aggregate_prototypes`."""
        return "counts"

    @classmethod
    def needs_all_clients_data(cls, params: Any) -> str | None:
        """Why the client side needs facts of every client's data
        (:attr:`Federation.client_sizes`), which a federation whose nodes hold their own
        data (``node_data=own``) does not share, or None."""
        return None

    @classmethod
    def depends_on_total_rounds(cls, params: Any) -> str | None:
        """Why what round ``t`` computes with ``params`` depends on the run's total
        rounds (:attr:`Federation.rounds`: a learning-rate or loss-weight schedule over
        ``T``), or None. An algorithm that reads ``Federation.rounds`` must say so here:
        a run extended to more rounds (``contrafl run --resume RUN rounds=N``) then
        reports that it differs from a run started with ``N`` rounds, and this sentence
        why."""
        return None

    @classmethod
    def inapplicable(cls, params: Any) -> dict[str, str]:
        """The options that have no effect with ``params``, each with the setting under
        which it would (``{"ema": "method=byol"}``): ``contrafl list`` leaves them out or
        names that setting, and a run that sets one to a value other than its default is
        a configuration error."""
        return {}

    @classmethod
    def input_problem(cls, params: Any, input_shape: tuple[int, ...]) -> str | None:
        """Why the algorithm cannot train on samples of ``input_shape`` with ``params``
        (a sentence naming the setting and how to fix it), or None."""
        return None

    # -- model -------------------------------------------------------------------------
    @classmethod
    def heads(cls, params: Any) -> Heads:
        """The heads the model needs on its projection: by default the classifier only."""
        return Heads()

    # -- server ------------------------------------------------------------------------
    def init_server(self, model: StateDict) -> ServerState:
        """The server's state before round 0, from the initial global ``model``: by default
        the model alone (algorithms add what they keep in :attr:`ServerState.extras`)."""
        return ServerState(model)

    def broadcast(self, server: ServerState, round: int) -> dict[str, Any]:
        """The message of ``round`` (before :meth:`message_for` personalises it)."""
        return {"model": server.model}

    def message_for(self, message: dict[str, Any], server: ServerState, cid: int, round: int) -> dict[str, Any]:
        """What client ``cid`` receives in ``round``: by default the broadcast itself.
        Algorithms that send each client its own message (FedAMP's attentive model,
        FedPAC's combined head) return a different dict; its bytes are counted per
        client."""
        return message

    def aggregate(self, server: ServerState, replies: list[Reply], round: int) -> ServerState:
        """The server's state after ``round`` from the valid ``replies`` of its clients
        (FedAvg: ``w^{t+1} = sum_k n_k w_k / sum_k n_k``); every algorithm defines it."""
        raise NotImplementedError

    def reply_spec(self, message: dict[str, Any]) -> dict[str, Any]:
        """The structure of a valid reply payload to ``message``, as a tree of
        :class:`TensorSpec` (checked by :mod:`contrafl.execution.validate` before
        aggregation): by default the model, shaped like the broadcast one."""
        return {"model": spec_of(message["model"])}

    # -- client ------------------------------------------------------------------------
    def init_client(self, ctx: ClientContext) -> dict[str, Any]:
        """The client's persistent state before it first participates."""
        return {}

    def client_begin(
        self, message: dict[str, Any], state: dict[str, Any], ctx: ClientContext
    ) -> LocalTask:
        """The starting point of the client's local training from the received ``message``
        and its persistent ``state``: by default the received model, all of it trained."""
        params, buffers = self.federation.split(message["model"])
        return LocalTask(params={"model": params}, buffers={"model": buffers})

    def phases(self, round: int) -> list[Phase]:
        """The phases of local training in ``round``: by default one phase of the run's
        epochs running :meth:`stages`."""
        return [Phase(tuple(self.stages(round)))]

    def stages(self, round: int) -> list[Stage]:
        """The stages of every local step in ``round`` (:meth:`phases`' default phase): by
        default one stage minimising :meth:`local_loss` over every trained role."""
        return [Stage(self.local_loss)]

    def local_loss(
        self, task: TaskView, batch: Batch, net: Network
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one ``batch`` for the parameters in ``task``, and statistics to log
        (summed over the local steps), e.g. FedAvg's ``CE(F_w(x), y)``; a function of
        tensors only (see the module's notes on ``vmap``)."""
        raise NotImplementedError

    def client_end(
        self, task: LocalTask, result: TrainResult, state: dict[str, Any], ctx: ClientContext
    ) -> tuple[Reply, dict[str, Any]]:
        """The client's :class:`Reply` to the server after local training produced
        ``result`` from ``task``, and its persistent state for the next round it joins."""
        raise NotImplementedError

    def personal_model(self, state: dict[str, Any], message: dict[str, Any], ctx: ClientContext) -> PersonalModel | None:
        """The model client ``ctx.cid`` is evaluated with when it holds ``state`` and
        has just received ``message`` (the next round's), without changing ``state``:
        PFLlib evaluates what each client holds at the start of a round. By default the
        received global model; ``None`` when the client has nothing to evaluate."""
        return PersonalModel(message["model"]) if "model" in message else None


def model_state(result: TrainResult, role: str = "model") -> StateDict:
    """The trained ``role`` model as one state dict (parameters and buffers)."""
    return {**result.params[role], **result.buffers[role]}
