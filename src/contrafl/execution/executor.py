"""Executors run the local training of a group of clients.

An executor receives :class:`Job` s (an algorithm's :class:`LocalTask`, the client's
:class:`ClientPlan` and, when persisted, its optimiser state) and returns one
:class:`TrainResult` per job. It knows nothing about the algorithm beyond its stages and
loss functions. :class:`SequentialExecutor` trains clients one after another with
ordinary autograd; the vectorized executor (``vectorized.py``) trains many at once.
Every executor's ``train`` and ``run`` take an optional :data:`StepsDone` callback, told
the local steps as they finish (the progress of a long round).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..algorithms.base import Batch, LocalTask, Stage, StateDict, TaskView, TrainResult
from ..data.augment import Views, view_transform
from ..models.base import FedModel, ModelOutput
from ..models.layers import channels_last
from .optim import Adam, OptState, SGD
from .plan import ClientPlan
from ..rng import generator, seed_global


class FunctionalNet:
    """The run's architecture as a function of its state: ``net(state, x, train=...)``.

    Two skeletons of the same model are kept, one in train mode (BatchNorm uses batch
    statistics and updates the running statistics held in ``state``; dropout is active)
    and one in eval mode. A call puts the tensors of ``state`` into the skeleton's
    parameter and buffer slots, runs the forward and restores the slots: what
    ``torch.func.functional_call`` does, without its per-call module traversal (which
    costs as much as a small layer on the CPU). Works under ``vmap``/``grad``.

    Image batches on the CPU go in channels-last (``channels_last``), where oneDNN's
    convolutions and PyTorch's pooling are fastest (on an AVX-512 Xeon, one thread:
    FedAvgCNN's FedAvg step 1.82x faster than NCHW in fp32 and 1.76x in bf16, its MOON
    step 1.54x and 2.04x, MOON's CNN's steps 1.14-1.18x in fp32; docs/performance.md).
    The values are the same; oneDNN may sum in another order, so the outputs may differ
    from an NCHW forward's in the last bits.
    """

    def __init__(self, model: FedModel) -> None:
        self.train_model = model.train()
        self.eval_model = copy.deepcopy(model).eval()
        self._slots = {id(m): _slots(m) for m in (self.train_model, self.eval_model)}
        self.channels_last = True

    def for_vmap(self) -> "FunctionalNet":
        """This forward (the same skeletons) with the batches as they come: under
        ``vmap`` a channels-last batch sends some layers (ResNet's adaptive average
        pooling) to functorch's slow per-sample fallback."""
        net = copy.copy(self)
        net.channels_last = False
        return net

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the model gets it: channels-last when it is a batch of images on the
        CPU (unless :meth:`for_vmap`), else as it is; no copy when it already is."""
        cpu_images = self.channels_last and x.dim() == 4 and x.device.type == "cpu"
        return channels_last(x) if cpu_images else x

    def __call__(self, state: Mapping[str, torch.Tensor], x: torch.Tensor, *, train: bool) -> ModelOutput:
        module = self.train_model if train else self.eval_model
        slots = self._slots[id(module)]
        saved = [table[attr] for _, table, attr in slots]
        try:
            for name, table, attr in slots:
                table[attr] = state[name]
            return module(self.layout(x))
        finally:
            for (_, table, attr), old in zip(slots, saved):
                table[attr] = old


class AutocastNet:
    """``net`` under autocast to ``dtype`` (``precision=bf16``), as local training runs:
    the run's forward for what an algorithm computes outside the executor (FedALA's
    adaptive aggregation, Per-FedAvg's adaptation step, Orchestra's clustering pass).
    The outputs come back in float32, so that losses and statistics computed from them
    stay in float32, as under autocast."""

    def __init__(self, net: FunctionalNet, dtype: torch.dtype) -> None:
        self.net, self.dtype = net, dtype

    def __call__(self, state: Mapping[str, torch.Tensor], x: torch.Tensor, *, train: bool) -> ModelOutput:
        with torch.autocast(x.device.type, dtype=self.dtype):
            out = self.net(state, x, train=train)

        def fp32(v: Any) -> Any:
            return v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

        extra = None if out.extra is None else {k: fp32(v) for k, v in out.extra.items()}
        return ModelOutput(fp32(out.h), fp32(out.z), fp32(out.logits), fp32(out.p), extra)


def _slots(model: torch.nn.Module) -> list[tuple[str, dict, str]]:
    """``(state-dict name, the owning module's _parameters/_buffers dict, attribute)``."""
    slots = []
    for name in model.state_dict():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        table = module._parameters if attr in module._parameters else module._buffers
        slots.append((name, table, attr))
    return slots


StepsDone = Callable[[int], None]
"""Told how many local steps an executor has just finished (of one or more clients)."""


@dataclass
class Job:
    """One client's local training: what to train, on which batches (one plan per phase
    of the workload), from which optimiser state (one per stage of every phase, in
    order)."""

    cid: int
    task: LocalTask
    plans: list[ClientPlan]
    seed: int
    opt_state: list[OptState] | None = None


@dataclass(frozen=True)
class PhaseRun:
    """A phase of local training as the executors run it: its stages and optimiser."""

    stages: tuple[Stage, ...]
    optimizer: SGD | Adam


@dataclass
class Workload:
    """What every job of a round shares.

    Attributes:
        x, y: the training split on the executor's device.
        transform: batched training transform ``(x_raw, params) -> x``, or one per view
            (:class:`~contrafl.data.augment.Views`).
        net: functional forward of the architecture.
        phases: the algorithm's phases for this round, each with its optimiser.
        autocast: dtype for mixed precision (``precision=bf16``), or None.
        keep_opt_state: whether the results carry the clients' optimiser states (a run
            that does not persist them leaves them out: a parallel worker then does not
            send them, e.g. Adam's two moments of FedU2's ResNet-18, 117 MB a client).
    """

    x: torch.Tensor
    y: torch.Tensor
    transform: Callable[..., torch.Tensor] | Views
    net: FunctionalNet
    phases: list[PhaseRun]
    autocast: torch.dtype | None = None
    keep_opt_state: bool = True

    @classmethod
    def single(cls, x, y, transform, net, stages: list[Stage], optimizer: SGD | Adam, **kw: Any) -> "Workload":
        """A workload of one phase."""
        return cls(x, y, transform, net, [PhaseRun(tuple(stages), optimizer)], **kw)

    def init_opt_states(self, task: LocalTask) -> list[OptState]:
        """Fresh optimiser states of every stage of every phase, in order."""
        return [
            phase.optimizer.init([task.params[r][k] for r, k in stage_keys(stage, task)])
            for phase in self.phases
            for stage in phase.stages
        ]

    def opt_slices(self) -> list[slice]:
        """Where each phase's stage states lie in a job's flat optimiser-state list."""
        out, start = [], 0
        for phase in self.phases:
            out.append(slice(start, start + len(phase.stages)))
            start += len(phase.stages)
        return out

    def autocast_context(self) -> Any:
        """Autocast to :attr:`autocast` on the data's device, or nothing without it."""
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(self.x.device.type, dtype=self.autocast)

    def inputs(self, rows: torch.Tensor, aug: list[dict[str, torch.Tensor]]) -> Batch:
        """The batch of ``rows`` with each view's augmentation applied, in the layout the
        model gets it (:meth:`FunctionalNet.layout`: once per batch, not once per forward
        pass of a loss that runs several models on it)."""
        raw = take_rows(self.x, rows)
        views = [view_transform(self.transform, v)(raw, params) for v, params in enumerate(aug)]
        x = self.net.layout(views[0]) if len(views) == 1 else torch.stack(views)
        return Batch(x, self.y.index_select(0, rows))


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]``, the same values in the same layout, copied in ``x``'s storage order:
    a channels-last image tensor is gathered as its contiguous ``[N, H, W, C]`` rows
    (``index_select``, one block copy a row), where indexing copies it element by element
    through its strides (10 rows of 3x32x32 on one CPU core: 5.7 against 28 us, against
    about 1.9 ms for the step of MOON's CNN that takes them)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return x.permute(0, 2, 3, 1).index_select(0, rows).permute(0, 3, 1, 2)
    return x.index_select(0, rows)


def draw_noise(stage: Stage, g: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """The standard-normal tensors of one optimiser step of ``stage`` (:attr:`Stage.noise`),
    drawn on the CPU from ``g`` (the same numbers on every device)."""
    return {name: torch.randn(shape, generator=g).to(device) for name, shape in stage.noise}


def noise_generator(job: "Job", phase: int) -> torch.Generator:
    """The stream of the stages' noise of ``job`` in ``phase``."""
    return generator(job.seed, "noise", phase)


def set_values(params: dict[str, StateDict], updates: dict[str, StateDict], a: int | None = None) -> None:
    """``params[role][name] <- updates[role][name]`` in place (on the first ``a`` clients
    of stacked parameters when ``a`` is given)."""
    targets = [params[r][k] if a is None else params[r][k][:a] for r, sd in updates.items() for k in sd]
    torch._foreach_copy_(targets, [v for sd in updates.values() for v in sd.values()])


def stage_keys(stage: Stage, task: LocalTask) -> list[tuple[str, str]]:
    """``(role, name)`` of the parameters a stage updates, in a fixed order."""
    roles = stage.trains if stage.trains is not None else tuple(task.params)
    return [(role, name) for role in roles for name in task.params[role]]


def snapshot(params: dict[str, StateDict], buffers: dict[str, StateDict], role: str) -> StateDict:
    """A detached copy of the ``role`` model (parameters and buffers)."""
    return {k: v.detach().clone() for k, v in {**params[role], **buffers[role]}.items()}


class SequentialExecutor:
    """Trains clients one after another with ordinary autograd.

    Works with every algorithm and every batch layout (including ``drop_last=false``);
    dropout randomness is seeded per client from the job's seed.
    """

    name = "sequential"

    def __init__(self, workload: Workload) -> None:
        self.workload = workload

    def train(self, jobs: list[Job], on_steps: StepsDone | None = None) -> list[TrainResult]:
        """Train ``jobs`` one after another: their results, in the jobs' order."""
        return [self._train_one(job, on_steps) for job in jobs]

    def run(
        self, make_job: Callable[[int], Job], cids: Iterable[int], on_steps: StepsDone | None = None
    ) -> Iterator[tuple[Job, TrainResult]]:
        """Build and train one client at a time (one client's task in memory)."""
        for cid in cids:
            job = make_job(cid)
            yield job, self._train_one(job, on_steps)

    def _train_one(self, job: Job, on_steps: StepsDone | None = None) -> TrainResult:
        w, task = self.workload, job.task
        params = {
            role: {k: v.detach().clone().requires_grad_(True) for k, v in sd.items()}
            for role, sd in task.params.items()
        }
        buffers = {role: {k: v.clone() for k, v in sd.items()} for role, sd in task.buffers.items()}
        frozen = dict(task.frozen)
        states = job.opt_state or w.init_opt_states(task)
        stats: dict[str, torch.Tensor] = {}
        view = TaskView(params, buffers, frozen, task.consts)  # frozen: updated in place at epoch ends
        seed_global(job.seed, w.x.device)
        for p, (phase, plan, where) in enumerate(zip(w.phases, job.plans, w.opt_slices())):
            keys = [stage_keys(stage, task) for stage in phase.stages]
            tensors = [[params[r][k] for r, k in ks] for ks in keys]
            g = noise_generator(job, p)
            for step in range(plan.steps):
                rows, aug = plan.batch(step)
                batch = w.inputs(rows, aug)
                for stage, ts, state in zip(phase.stages, tensors, states[where]):
                    for _ in range(stage.repeat):
                        if stage.noise or batch.noise:
                            batch = batch._replace(noise=draw_noise(stage, g, w.x.device))
                        if stage.pre_step is not None:
                            with torch.no_grad():
                                set_values(params, stage.pre_step(view, batch, w.net))
                        with w.autocast_context():
                            loss, step_stats = stage.loss(view, batch, w.net)
                        grads = torch.autograd.grad(loss, ts, allow_unused=True)
                        phase.optimizer.step(ts, list(grads), state)
                        if stage.post_step is not None:
                            with torch.no_grad():
                                set_values(params, stage.post_step(view, batch, w.net))
                        accumulate(stats, step_stats)
                if step in plan.epoch_ends:
                    for name, role in task.snapshots.items():
                        frozen[name] = snapshot(params, buffers, role)
                if on_steps is not None:
                    on_steps(1)
        return TrainResult(
            params={r: {k: v.detach() for k, v in sd.items()} for r, sd in params.items()},
            buffers=buffers,
            stats=stats,
            steps=sum(plan.steps for plan in job.plans),
            opt_state=states if w.keep_opt_state else None,
        )


def used_parameters(workload: Workload, job: Job, phase: int = 0) -> list[list[bool]]:
    """For each stage of ``phase``, whether each trained parameter gets a gradient from
    the loss (probed with autograd on the job's first batch of the phase; a loss whose
    structure does not depend on tensor values, as vectorized losses must be, uses the
    same ones at every step). The global random streams are left as they were, so that
    training draws the same numbers whether or not the probe ran (a kept answer,
    :class:`~contrafl.execution.vectorized.StepArenas`)."""
    w, task, plan = workload, job.task, job.plans[phase]
    stages = w.phases[phase].stages
    if not plan.steps:
        return [[True] * len(stage_keys(stage, task)) for stage in stages]
    with torch.random.fork_rng(devices=[w.x.device] if w.x.device.type == "cuda" else []):
        return _probe_used(w, job, phase)


def _probe_used(w: Workload, job: Job, phase: int) -> list[list[bool]]:
    task, plan, stages = job.task, job.plans[phase], w.phases[phase].stages
    params = {
        role: {k: v.detach().clone().requires_grad_(True) for k, v in sd.items()} for role, sd in task.params.items()
    }
    buffers = {role: {k: v.clone() for k, v in sd.items()} for role, sd in task.buffers.items()}
    rows, aug = plan.batch(0)
    batch = w.inputs(rows, aug)
    seed_global(job.seed, w.x.device)
    g = noise_generator(job, phase)
    used = []
    for stage in stages:
        ts = [params[r][k] for r, k in stage_keys(stage, task)]
        batch = batch._replace(noise=draw_noise(stage, g, w.x.device))
        with w.autocast_context():
            loss, _ = stage.loss(TaskView(params, buffers, dict(task.frozen), task.consts), batch, w.net)
        used.append([g is not None for g in torch.autograd.grad(loss, ts, allow_unused=True)])
    return used


def state_bytes(obj: Any, _seen: set[int] | None = None) -> int:
    """Bytes held by the tensors in a nested structure (shared storages counted once)."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(state_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v, seen) for v in obj)
    return 0


def accumulate(total: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    """``total += stats`` key by key (detached)."""
    for k, v in stats.items():
        v = v.detach().float()
        if k in total:
            total[k].add_(v)
        else:
            total[k] = v.clone()
