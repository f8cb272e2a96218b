"""Executors run the local training of a group of clients.

An executor receives :class:`Job` s (an algorithm's :class:`LocalTask`, the client's
:class:`ClientPlan` and, when persisted, its optimiser state) and returns one
:class:`TrainResult` per job. It knows nothing about the algorithm beyond its stages and
loss functions. :class:`SequentialExecutor` trains clients one after another with
ordinary autograd; the vectorized executor (``vectorized.py``) trains many at once.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..algorithms.base import Batch, LocalTask, Stage, StateDict, TaskView, TrainResult
from ..models.base import FedModel, ModelOutput
from .optim import Adam, OptState, SGD
from .plan import ClientPlan
from .rng import seed_global


class FunctionalNet:
    """The run's architecture as a function of its state: ``net(state, x, train=...)``.

    Two skeletons of the same model are kept, one in train mode (BatchNorm uses batch
    statistics and updates the running statistics held in ``state``; dropout is active)
    and one in eval mode. A call puts the tensors of ``state`` into the skeleton's
    parameter and buffer slots, runs the forward and restores the slots: what
    ``torch.func.functional_call`` does, without its per-call module traversal (which
    costs as much as a small layer on the CPU). Works under ``vmap``/``grad``.
    """

    def __init__(self, model: FedModel) -> None:
        self.train_model = model.train()
        self.eval_model = copy.deepcopy(model).eval()
        self._slots = {id(m): _slots(m) for m in (self.train_model, self.eval_model)}

    def __call__(self, state: Mapping[str, torch.Tensor], x: torch.Tensor, *, train: bool) -> ModelOutput:
        module = self.train_model if train else self.eval_model
        slots = self._slots[id(module)]
        saved = [table[attr] for _, table, attr in slots]
        try:
            for name, table, attr in slots:
                table[attr] = state[name]
            return module(x)
        finally:
            for (_, table, attr), old in zip(slots, saved):
                table[attr] = old


def _slots(model: torch.nn.Module) -> list[tuple[str, dict, str]]:
    """``(state-dict name, the owning module's _parameters/_buffers dict, attribute)``."""
    slots = []
    for name in model.state_dict():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        table = module._parameters if attr in module._parameters else module._buffers
        slots.append((name, table, attr))
    return slots


@dataclass
class Job:
    """One client's local training: what to train, on which batches, from which state."""

    cid: int
    task: LocalTask
    plan: ClientPlan
    seed: int
    opt_state: list[OptState] | None = None


@dataclass
class Workload:
    """What every job of a round shares.

    Attributes:
        x, y: the training split on the executor's device.
        transform: batched training transform ``(x_raw, params) -> x``.
        net: functional forward of the architecture.
        stages: the algorithm's stages for this round.
        optimizer: the client optimiser.
        autocast: dtype for mixed precision on CUDA, or None.
    """

    x: torch.Tensor
    y: torch.Tensor
    transform: Callable[..., torch.Tensor]
    net: FunctionalNet
    stages: list[Stage]
    optimizer: SGD | Adam
    autocast: torch.dtype | None = None

    def autocast_context(self) -> Any:
        if self.autocast is None or self.x.device.type != "cuda":
            return nullcontext()
        return torch.autocast("cuda", dtype=self.autocast)

    def inputs(self, rows: torch.Tensor, aug: list[dict[str, torch.Tensor]]) -> Batch:
        """The batch of ``rows`` with each view's augmentation applied."""
        raw = self.x[rows]
        views = [self.transform(raw, params) for params in aug]
        x = views[0] if len(views) == 1 else torch.stack(views)
        return Batch(x, self.y[rows])


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

    def train(self, jobs: list[Job]) -> list[TrainResult]:
        return [self._train_one(job) for job in jobs]

    def run(self, make_job: Callable[[int], Job], cids: Iterable[int]) -> Iterator[tuple[Job, TrainResult]]:
        """Build and train one client at a time (one client's task in memory)."""
        for cid in cids:
            job = make_job(cid)
            yield job, self._train_one(job)

    def _train_one(self, job: Job) -> TrainResult:
        w, task = self.workload, job.task
        params = {
            role: {k: v.detach().clone().requires_grad_(True) for k, v in sd.items()}
            for role, sd in task.params.items()
        }
        buffers = {role: {k: v.clone() for k, v in sd.items()} for role, sd in task.buffers.items()}
        frozen = dict(task.frozen)
        keys = [stage_keys(stage, task) for stage in w.stages]
        tensors = [[params[r][k] for r, k in ks] for ks in keys]
        states = job.opt_state or [w.optimizer.init(ts) for ts in tensors]
        stats: dict[str, torch.Tensor] = {}
        seed_global(job.seed, w.x.device)
        for step in range(job.plan.steps):
            rows, aug = job.plan.batch(step)
            batch = w.inputs(rows, aug)
            for stage, ks, ts, state in zip(w.stages, keys, tensors, states):
                with w.autocast_context():
                    loss, step_stats = stage.loss(TaskView(params, buffers, frozen, task.consts), batch, w.net)
                grads = torch.autograd.grad(loss, ts, allow_unused=True)
                w.optimizer.step(ts, list(grads), state)
                if stage.post_step is not None:
                    with torch.no_grad():
                        delta = stage.post_step(TaskView(params, buffers, frozen, task.consts))
                        torch._foreach_add_(ts, [delta[r][k] for r, k in ks])
                accumulate(stats, step_stats)
            if step in job.plan.epoch_ends:
                for name, role in task.snapshots.items():
                    frozen[name] = snapshot(params, buffers, role)
        result = TrainResult(
            params={r: {k: v.detach() for k, v in sd.items()} for r, sd in params.items()},
            buffers=buffers,
            stats=stats,
            steps=job.plan.steps,
            opt_state=states,
        )
        return result


def used_parameters(workload: Workload, job: Job) -> list[list[bool]]:
    """For each stage, whether each trained parameter gets a gradient from the loss
    (probed with autograd on the job's first batch; a loss whose structure does not
    depend on tensor values, as vectorized losses must be, uses the same ones at every
    step)."""
    w, task = workload, job.task
    if not job.plan.steps:
        return [[True] * len(stage_keys(stage, task)) for stage in w.stages]
    params = {
        role: {k: v.detach().clone().requires_grad_(True) for k, v in sd.items()} for role, sd in task.params.items()
    }
    buffers = {role: {k: v.clone() for k, v in sd.items()} for role, sd in task.buffers.items()}
    rows, aug = job.plan.batch(0)
    batch = w.inputs(rows, aug)
    seed_global(job.seed, w.x.device)
    used = []
    for stage in w.stages:
        ts = [params[r][k] for r, k in stage_keys(stage, task)]
        with w.autocast_context():
            loss, _ = stage.loss(TaskView(params, buffers, dict(task.frozen), task.consts), batch, w.net)
        used.append([g is not None for g in torch.autograd.grad(loss, ts, allow_unused=True)])
    return used


def accumulate(total: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    """``total += stats`` key by key (detached)."""
    for k, v in stats.items():
        v = v.detach().float()
        total[k] = total[k] + v if k in total else v.clone()
