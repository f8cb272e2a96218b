"""The vectorized executor: many clients trained in one batched computation.

The sampled clients' parameters, buffers, optimiser states and per-client frozen models
are stacked along a leading client dimension, and every local step evaluates the
algorithm's loss for all of them at once with
``vmap(grad_and_value(loss))`` over ``torch.func.functional_call``. One optimiser update
(the same plain-tensor code as the sequential executor) then moves all clients.

Clients whose local datasets differ in size take different numbers of steps. Clients are
sorted by their number of steps, longest first, so the clients still training at step
``s`` are a prefix ``[:a]`` of the stack; every update works on views ``[:a]``, and a
client that has finished its epochs is neither updated nor has its optimiser state or
BatchNorm statistics touched. Tensors shared by all clients (the broadcast global model,
SCAFFOLD's server control variate) are passed unbatched (``in_dims=None``) instead of
being copied per client.

Batches of unequal sizes (``drop_last=false``: each client's epochs end with a batch
of what is left) are stacked padded to the largest. A step whose active clients all
have batches of one size runs as any other (its shape, clients x batch size, is its
CUDA graph's key). In a step where they differ (the last of an epoch for some clients)
each group of one size is gathered from the stack, stepped eagerly and written back;
where steps are replayed as CUDA graphs, each group is instead one step over the
stack's prefix masked to the group, as padding masks finished clients, with a graph key
of its own (:func:`_step_groups`), so that no step runs eagerly once its shapes have
been seen.

With ``pad_finished`` every step computes all the clients of the phase instead: the
ones that have finished run on stale batches, and their parameters, buffers, optimiser
states and statistics are put back after the step (``torch.where`` on a mask, so that
nothing they compute, NaN included, reaches them). Every step of a phase then has one
shape, so one CUDA graph and one eager warm-up step serve the whole phase instead of
one of each per number of clients still training. On a GPU, where launching a step
costs more than computing it, the finished clients' wasted arithmetic may cost less
than the eager steps it saves, the more so the more the clients' step counts differ.
Random draws inside a step (dropout) are then made for every client, so a model with
dropout gives other, equally valid numbers than without padding; explicit per-client
noise (:attr:`Stage.noise`) is drawn for the active clients only, as without it.

On a CPU, for a model with a stacked forward (:mod:`contrafl.models.stacked`: grouped
convolutions in channels-last and batched products, where ``vmap``'s batching rules
move the clients' dimension through copies and strided kernels), the forward passes
leave ``vmap`` (:class:`~contrafl.execution.stacked.StackedNet`) and the gradient is
taken by ordinary autograd outside it (:func:`~contrafl.execution.stacked.stacked_grad_and_value`).

Clients are trained in chunks that fit ``memory_bytes``; the per-client memory is
measured on the first client by counting the tensors autograd saves for one step.

Steps replayed as CUDA graphs run on the tensors they were captured on. With
:class:`StepArenas` (a run's), a phase keeps its stacks and graphs for the next round
of the same computation, which copies its values into them: a shape seen in one round
is captured in the next and replayed from then on, however few steps it has a round.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch
from torch.func import grad_and_value, vmap
from torch.utils import _pytree as pytree

from ..algorithms.base import Batch, Stage, TaskView, TrainResult
from ..data.augment import view_transform
from .cuda_graphs import StepGraphs
from .executor import (
    Job,
    PhaseRun,
    SequentialExecutor,
    StepsDone,
    Workload,
    draw_noise,
    set_values,
    noise_generator,
    stage_keys,
    state_bytes,
    used_parameters,
)
from .plan import ClientPlan
from .stacked import StackedNet, stacked_grad_and_value
from ..models.stacked import stacked_forward
from ..rng import seed_global


def stack_trees(trees: list[Any], force: bool = False) -> tuple[Any, Any]:
    """Stack the leaves of structurally identical trees along a new dim 0.

    A leaf that is the same object in every tree is kept unstacked (its in_dim is None)
    unless ``force``. Returns ``(stacked_tree, in_dims_tree)``.
    """
    flat, spec = pytree.tree_flatten(trees[0])
    others = [pytree.tree_flatten(t) for t in trees[1:]]
    for leaves, other_spec in others:
        if other_spec != spec:
            raise ValueError("clients of a round must have tasks of the same structure to be vectorized")
    out, dims = [], []
    for i, leaf in enumerate(flat):
        column = [leaf] + [leaves[i] for leaves, _ in others]
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            dims.append(None)
        elif not force and all(c is leaf for c in column):
            out.append(leaf)
            dims.append(None)
        else:
            with torch.no_grad():  # one operation per leaf, not one detach per client
                out.append(torch.stack(column))
            dims.append(0)
    return pytree.tree_unflatten(out, spec), pytree.tree_unflatten(dims, spec)


def slice_tree(tree: Any, dims: Any, a: int) -> Any:
    """Views ``[:a]`` of the batched leaves of ``tree`` (unbatched leaves unchanged)."""
    return pytree.tree_map(lambda x, d: x[:a] if d == 0 else x, tree, dims)


def unstack(tree: Any, n: int) -> list[Any]:
    """The ``n`` clients' slices of a tree whose tensors are all stacked, each copied so
    it owns its storage (a view would keep the whole stack alive, and be saved whole):
    one ``unbind`` per tensor, and every copy written by one fused ``_foreach_copy_``
    into fresh tensors (on a GPU a few kernels, not one per client and tensor)."""
    leaves, spec = pytree.tree_flatten(tree)
    columns = [leaf.unbind(0) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    sources = [c[i] for i in range(n) for c in columns if c is not None]
    copies = [torch.empty_like(s) for s in sources]
    if copies:
        with torch.no_grad():
            torch._foreach_copy_(copies, sources)
    made = iter(copies)
    return [pytree.tree_unflatten([leaf if c is None else next(made) for leaf, c in zip(leaves, columns)], spec)
            for _ in range(n)]


def saved_bytes_of_step(workload: Workload, job: Job) -> int:
    """Bytes autograd saves for one local step of ``job`` (activation memory)."""
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    probe = Job(job.cid, job.task, [_first_step(plan) for plan in job.plans], job.seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        SequentialExecutor(workload).train([probe])
    return total


def _first_step(plan: ClientPlan) -> ClientPlan:
    n = plan.sizes[0] if plan.sizes else 0
    aug = [{k: v[:n] for k, v in view.items()} for view in plan.aug]
    return ClientPlan(plan.order[:n], plan.sizes[:1], aug, frozenset())


class VectorizedExecutor:
    """Trains a group of clients together with ``torch.func.vmap``."""

    name = "vectorized"

    def __init__(
        self,
        workload: Workload,
        memory_bytes: float,
        cuda_graphs: bool = True,
        pad_finished: bool = False,
        arenas: "StepArenas | None" = None,
    ) -> None:
        self.workload = workload
        self.memory_bytes = memory_bytes
        self.cuda_graphs = cuda_graphs  # on a CUDA device: replay steps as CUDA graphs (cuda_graphs.py)
        self.pad_finished = pad_finished  # every step computes all clients, finished ones masked (module doc)
        self.arenas = arenas  # the stacks and graphs kept from round to round (StepArenas), or None
        self._grad_fns: dict[tuple, Callable] = {}

    def client_bytes(self, job: Job) -> int:
        """Estimated memory of one client in a stacked chunk."""
        task = job.task
        params = state_bytes(task.params)
        per_client = 4 * params + state_bytes(task.buffers)  # params, grads, optimiser state, update temporaries
        frozen = sum(state_bytes(v) for v in task.frozen.values())
        if self.pad_finished:  # the step's copies of the parameters, optimiser state and buffers
            per_client += 2 * params + state_bytes(task.buffers)
        elif any(len(set(plan.sizes)) > 1 for plan in job.plans):  # a mixed step's masked copies or gathered group
            per_client += 2 * params + state_bytes(task.buffers) + frozen
        if self._keeps_arenas:  # a round's stack beside the arena's
            per_client += 2 * params + state_bytes(task.buffers)
        per_client += frozen
        per_client += sum(plan.order.numel() for plan in job.plans) * 8
        return per_client + 2 * self._saved_bytes(job)

    def _saved_bytes(self, job: Job) -> int:
        """:func:`saved_bytes_of_step` of ``job``; with a run's arenas on a GPU, measured
        once for each computation and kept with them (the probe is an eager step of one
        client, a few hundred kernel launches a round on a GPU)."""
        w = self.workload
        if not self._keeps_arenas:
            return saved_bytes_of_step(w, job)
        first = [(plan.sizes[:1], [{k: tuple(v.shape[1:]) for k, v in view.items()} for view in plan.aug]) for plan in job.plans]
        task = (job.task.params, job.task.buffers, job.task.frozen, job.task.consts)
        signature = ("saved bytes", tuple(map(_phase_signature, w.phases)), self._inputs_signature(), repr(first), _layout(task))
        return self.arenas.measured(signature, lambda: saved_bytes_of_step(w, job))

    def _inputs_signature(self) -> tuple:
        """What every step of this workload reads besides its tensors' values: the model,
        the transform, the data and the autocast dtype."""
        w = self.workload
        return id(w.net), id(w.transform), w.x.data_ptr(), w.y.data_ptr(), w.autocast

    @property
    def _keeps_arenas(self) -> bool:
        """Whether this executor keeps its stacks from round to round (a run's arenas,
        with CUDA graphs on a GPU)."""
        return self.arenas is not None and self.cuda_graphs and self.workload.x.is_cuda

    def chunk_size(self, job: Job) -> int:
        return max(1, int(self.memory_bytes // max(self.client_bytes(job), 1)))

    def run(
        self, make_job: Callable[[int], Job], cids: Iterable[int], on_steps: StepsDone | None = None
    ) -> Iterator[tuple[Job, TrainResult]]:
        """Build jobs lazily and train them in chunks that fit the memory budget."""
        cids = list(cids)
        if not cids:
            return
        first = make_job(cids[0])
        size = self.chunk_size(first)
        chunk = [first]
        for cid in cids[1:]:
            if len(chunk) == size:
                yield from zip(chunk, self.train(chunk, on_steps))
                chunk = []
            chunk.append(make_job(cid))
        yield from zip(chunk, self.train(chunk, on_steps))

    # -- training -----------------------------------------------------------------
    def train(self, jobs: list[Job], on_steps: StepsDone | None = None) -> list[TrainResult]:
        """Train ``jobs`` phase by phase; in each phase the clients are stacked longest
        first (by that phase's steps). ``on_steps`` is told the clients of every stacked
        step (on a GPU, when the step is queued)."""
        w = self.workload
        current = [
            _Progress(job.task.params, job.task.buffers, dict(job.task.frozen), job.opt_state or w.init_opt_states(job.task))
            for job in jobs
        ]
        for p, where in enumerate(w.opt_slices()):
            order = sorted(range(len(jobs)), key=lambda i: -jobs[i].plans[p].steps)
            self._train_phase(p, where, [jobs[i] for i in order], [current[i] for i in order], on_steps)
        return [
            TrainResult(
                c.params, c.buffers, c.stats, sum(plan.steps for plan in job.plans), c.opt_states if w.keep_opt_state else None
            )
            for job, c in zip(jobs, current)
        ]

    def _train_phase(
        self, p: int, where: slice, jobs: list[Job], current: list["_Progress"], on_steps: StepsDone | None
    ) -> None:
        """Phase ``p`` for ``jobs`` (sorted by their steps, longest first), updating
        each job's progress in place."""
        w = self.workload
        phase = w.phases[p]
        tasks = [j.task for j in jobs]
        K = len(jobs)
        steps = [j.plans[p].steps for j in jobs]
        sizes = [j.plans[p].sizes for j in jobs]
        B = max((b for s in sizes for b in s), default=0)

        params, _ = stack_trees([c.params for c in current], force=True)
        buffers, _ = stack_trees([c.buffers for c in current], force=True)
        snap_names = set(tasks[0].snapshots)
        frozen_shared, frozen_dims = stack_trees([{k: v for k, v in c.frozen.items() if k not in snap_names} for c in current])
        frozen_snap, _ = stack_trees([{k: c.frozen[k] for k in snap_names if k in c.frozen} for c in current], force=True)
        frozen = {**frozen_shared, **frozen_snap}
        frozen_dims = {**frozen_dims, **pytree.tree_map(lambda _: 0, frozen_snap)}
        consts, consts_dims = stack_trees([t.consts for t in tasks])

        keys = [stage_keys(stage, tasks[0]) for stage in phase.stages]
        opt_states = [stack_trees([c.opt_states[where][i] for c in current], force=True)[0] for i in range(len(phase.stages))]

        S = max(steps) if steps else 0
        # every step's rows and augmentation parameters, filled where the plans are (on
        # the CPU) and moved to the device in one copy each, not one per client
        plans = [j.plans[p] for j in jobs]
        at, taken = _batch_positions(plans, S, B)
        rows = _gathered([plan.order for plan in plans], at, taken).to(w.x.device)
        augs = [
            {k: _gathered([plan.aug[v][k] for plan in plans], at, taken).to(w.x.device) for k in view}
            for v, view in enumerate(plans[0].aug)
        ]

        # the batch and noise of the current step, at fixed addresses: a step reads only
        # these and the stacked state, so that it can be replayed as a CUDA graph
        batch_rows = torch.zeros(K, B, dtype=torch.long, device=w.x.device)
        batch_augs = [{k: v.new_zeros((K,) + v.shape[2:]) for k, v in view.items()} for view in augs]
        batch_noise = [  # per stage, per repeat
            [{name: torch.zeros((K, *shape), device=w.x.device) for name, shape in stage.noise} for _ in range(stage.repeat)]
            for stage in phase.stages
        ]
        totals: dict[str, torch.Tensor] = {}

        def add_stats(k: str, v: torch.Tensor, into: slice | torch.Tensor) -> None:
            if k not in totals:
                totals[k] = torch.zeros((K,) + v.shape[1:], device=v.device)
            if isinstance(into, slice):
                totals[k][into] += v
            else:
                totals[k].index_add_(0, into, v)

        whole = _Stack(params, buffers, frozen, frozen_dims, consts, consts_dims, opt_states, batch_rows, batch_augs, batch_noise)
        noise_gens = [noise_generator(job, p) for job in jobs]
        graphs = StepGraphs.for_device(w.x.device, self.cuda_graphs)
        live = torch.ones(K, dtype=torch.bool, device=w.x.device)  # a masked step's clients (fixed address)
        if graphs.enabled and self.arenas is not None:  # an earlier round's stacks and graphs, this round's values
            arena = self._arena(p, repr(keys), whole, lambda: _Arena(whole, totals, live, graphs, used_parameters(w, jobs[0], p)))
            whole, totals, live, graphs, used = arena.whole, arena.totals, arena.live, arena.graphs, arena.used
            params, buffers, frozen, opt_states = whole.params, whole.buffers, whole.frozen, whole.opt_states
            batch_rows, batch_augs, batch_noise = whole.rows, whole.augs, whole.noise
        else:
            used = used_parameters(w, jobs[0], p)
        if p == 0:
            seed_global(jobs[0].seed, w.x.device)
        pad = self.pad_finished
        plan_of_steps = _step_groups(steps, sizes, K, pad, mask_groups=graphs.enabled)
        masks = [mask for _, runs, _ in plan_of_steps for _, mask in runs if mask is not None]
        next_mask = iter(torch.stack(masks).to(w.x.device).unbind(0) if masks else ())  # in the runs' order, one copy
        kept = pytree.tree_leaves((params, buffers, opt_states)) if masks else []  # what a masked-out client keeps

        def step(st: _Stack, a: int, b: int, into: slice | torch.Tensor, masked: bool) -> None:
            """One local step of the first ``a`` clients of ``st`` on batches of ``b``;
            their statistics go to ``totals[into]``; ``masked``: the clients not
            ``live`` keep their state (finished or taking a batch of another size)."""
            before = [t.clone() for t in kept] if masked else []
            r = st.rows[:a, :b]
            raw = w.x[r]
            views = [
                view_transform(w.transform, i)(raw, {k: v[:a, :b] for k, v in view.items()})
                for i, view in enumerate(st.augs)
            ]
            x = views[0] if len(views) == 1 else torch.stack(views, dim=1)
            y = w.y[r]
            for stage, ks, state, uses, stage_noise in zip(phase.stages, keys, st.opt_states, used, st.noise):
                trained = {role for role, _ in ks}
                ts = [st.params[role][k] for role, k in ks]
                for rep in range(stage.repeat):
                    bufs = {role: {k: v[:a] for k, v in sd.items()} for role, sd in st.buffers.items()}
                    fz = slice_tree(st.frozen, st.frozen_dims, a)
                    cs = slice_tree(st.consts, st.consts_dims, a)
                    noise = {name: t[:a] for name, t in stage_noise[rep].items()}
                    if stage.pre_step is not None:
                        update = self._update_fn(stage.pre_step, frozen_dims, consts_dims)
                        set_values(st.params, update(_sliced(st.params, a), bufs, fz, cs, x, y, noise), a)
                    tp = {role: {k: v[:a] for k, v in st.params[role].items()} for role in st.params if role in trained}
                    op = {role: {k: v[:a] for k, v in st.params[role].items()} for role in st.params if role not in trained}
                    fn = self._grad_fn(stage, frozen_dims, consts_dims, sorted(op))
                    with w.autocast_context():
                        grads, (_, stats) = fn(tp, op, bufs, fz, cs, x, y, noise)
                    flat_grads = [grads[role][k] if u else None for (role, k), u in zip(ks, uses)]
                    phase.optimizer.step([t[:a] for t in ts], flat_grads, _slice_state(state, a))
                    if stage.post_step is not None:
                        update = self._update_fn(stage.post_step, frozen_dims, consts_dims)
                        set_values(st.params, update(_sliced(st.params, a), bufs, fz, cs, x, y, noise), a)
                    for k, v in stats.items():
                        v = v.detach().float()
                        if masked:
                            v = torch.where(_per_client(live[:a], v), v, 0.0)
                        add_stats(k, v, into)
            for t, old in zip(kept if masked else [], before):
                t.copy_(torch.where(_per_client(live, t), t, old))

        left: dict[Any, int] = {}  # runs of each graph key from step s on (a graph's replays)
        remaining: list[list[int]] = [[] for _ in range(S)]
        for s in reversed(range(S)):
            for key, _ in plan_of_steps[s][1]:
                left[key] = left.get(key, 0) + 1
                remaining[s].append(left[key])
        for s, (a, runs, apart) in enumerate(plan_of_steps):
            batch_rows[:a].copy_(rows[:a, s])
            for view, dst in zip(augs, batch_augs):
                for k, v in view.items():
                    dst[k][:a].copy_(v[:a, s])
            for stage, reps in zip(phase.stages, batch_noise):  # the clients' streams, in the eager order
                for dst in reps:
                    for name, t in _stack_noise([draw_noise(stage, g, w.x.device) for g in noise_gens[:a]]).items():
                        dst[name][:a].copy_(t)
            for (key, mask), runs_left in zip(runs, remaining[s]):
                if mask is not None:
                    live.copy_(next(next_mask))
                n, b = key[0], key[1]
                graphs.run(key, runs_left, lambda n=n, b=b, masked=mask is not None: step(whole, n, b, slice(0, n), masked))
            for b, members in apart:
                idx = torch.tensor(members, device=w.x.device)
                group = whole.take(idx)
                step(group, len(idx), b, idx, False)
                whole.put(idx, group)
            if on_steps is not None:
                on_steps(a)
            for i in range(a):
                if s in jobs[i].plans[p].epoch_ends:
                    for name, role in tasks[0].snapshots.items():
                        for k, v in {**params[role], **buffers[role]}.items():
                            frozen[name][k][i].copy_(v[i])

        kept_states = opt_states if w.keep_opt_state else []  # a run that does not persist them drops them
        out = unstack((params, buffers, {name: frozen[name] for name in frozen_snap}, kept_states, totals), K)
        for c, n, (p_i, b_i, snaps_i, opt_i, totals_i) in zip(current, steps, out):
            c.params, c.buffers, c.frozen = p_i, b_i, {**c.frozen, **snaps_i}
            if w.keep_opt_state:
                c.opt_states[where] = opt_i
            if n:
                for k, v in totals_i.items():
                    c.stats[k] = c.stats[k] + v if k in c.stats else v

    def _arena(self, p: int, step_keys: str, whole: "_Stack", make: Callable[[], "_Arena"]) -> "_Arena":
        """The kept arena of phase ``p``'s computation with the values of this round's
        stack ``whole`` copied in, or the new one that ``make()`` builds around
        ``whole``, kept, with its shared tensors made its own (:class:`StepArenas`)."""
        phase, K = self.workload.phases[p], len(whole.rows)
        signature = (p, K, self.pad_finished, _phase_signature(phase), self._inputs_signature(), step_keys, whole.layout())
        arena = self.arenas.get(signature)
        if arena is None:
            new = make()
            new.whole = new.whole.owning()
            return self.arenas.add(signature, new)
        arena.refresh(whole)
        return arena

    def _grad_fn(self, stage: Stage, frozen_dims: Any, consts_dims: Any, other_roles: list[str]) -> Callable:
        key = (id(stage.loss), repr(frozen_dims), repr(consts_dims), tuple(other_roles))
        if key not in self._grad_fns:
            net = self.workload.net.for_vmap()
            in_dims = (0, 0, 0, frozen_dims, consts_dims, 0, 0, 0)

            def loss(train_p, other_p, buffers, frozen, consts, x, y, noise, net=net):
                view = TaskView({**other_p, **train_p}, buffers, frozen, consts)
                return stage.loss(view, Batch(x, y, noise), net)

            stacked = self._stacked_net()
            if stacked is not None:
                self._grad_fns[key] = stacked_grad_and_value(loss, in_dims, stacked)
            else:
                self._grad_fns[key] = vmap(
                    grad_and_value(loss, argnums=0, has_aux=True), in_dims=in_dims, randomness="different"
                )
        return self._grad_fns[key]

    def _stacked_net(self) -> Callable[[], StackedNet] | None:
        """On a CPU, for a model with a stacked forward (:mod:`contrafl.models.stacked`):
        what makes the :class:`StackedNet` of a loss, under ``vmap``; else ``None`` (the
        forward goes through ``vmap``'s batching rules)."""
        w = self.workload
        forward = stacked_forward(w.net.train_model) if w.x.device.type == "cpu" else None
        if forward is None:
            return None
        batched = w.net.for_vmap()
        return lambda: StackedNet(forward, batched, w.net, w.x.dim() - 1)

    def _update_fn(self, fn: Callable, frozen_dims: Any, consts_dims: Any) -> Callable:
        """``fn`` (a stage's ``pre_step`` or ``post_step``) vectorised over clients."""
        key = ("update", id(fn), repr(frozen_dims), repr(consts_dims))
        if key not in self._grad_fns:
            net = self.workload.net.for_vmap()
            stacked = self._stacked_net()

            def update(params, buffers, frozen, consts, x, y, noise):
                return fn(TaskView(params, buffers, frozen, consts), Batch(x, y, noise), net if stacked is None else stacked())

            self._grad_fns[key] = vmap(
                update, in_dims=(0, 0, frozen_dims, consts_dims, 0, 0, 0), randomness="different"
            )
        return self._grad_fns[key]


class _Stack:
    """The stacked state a step reads and updates (clients first): parameters, buffers,
    frozen models and constants (with their trees of batched dims: a frozen model
    shared by all clients is not stacked), optimiser states, and the step's batch rows,
    augmentation parameters and noise. :meth:`take` copies out a group of clients,
    :meth:`put` writes back the state a step of that group changed."""

    def __init__(self, params, buffers, frozen, frozen_dims, consts, consts_dims, opt_states, rows, augs, noise) -> None:
        self.params, self.buffers, self.opt_states = params, buffers, opt_states
        self.frozen, self.frozen_dims, self.consts, self.consts_dims = frozen, frozen_dims, consts, consts_dims
        self.rows, self.augs, self.noise = rows, augs, noise

    def take(self, idx: torch.Tensor) -> "_Stack":
        """Clients ``idx`` (positions in the stack), their batched tensors gathered."""
        def rows(tree: Any, dims: Any = None) -> Any:
            if dims is None:
                return pytree.tree_map(lambda t: t.index_select(0, idx) if isinstance(t, torch.Tensor) else t, tree)
            return pytree.tree_map(lambda t, d: t.index_select(0, idx) if d == 0 else t, tree, dims)

        return _Stack(rows(self.params), rows(self.buffers), rows(self.frozen, self.frozen_dims), self.frozen_dims,
                      rows(self.consts, self.consts_dims), self.consts_dims, rows(self.opt_states),
                      rows(self.rows), rows(self.augs), rows(self.noise))

    def layout(self) -> str:
        """The structure, shapes and dtypes of every tree (what a step's graph is built
        for, apart from the values)."""
        return _layout((self.params, self.buffers, self.frozen, self.frozen_dims, self.consts,
                        self.consts_dims, self.opt_states, self.rows, self.augs, self.noise))

    def owning(self) -> "_Stack":
        """This stack with its unstacked tensors (frozen models and constants shared by
        all clients, such as the broadcast global model) copied, so that an arena can
        overwrite them in later rounds without touching the tensors they came from."""
        def own(tree: Any, dims: Any) -> Any:
            return pytree.tree_map(lambda t, d: t.clone() if isinstance(t, torch.Tensor) and d is None else t, tree, dims)

        return _Stack(self.params, self.buffers, own(self.frozen, self.frozen_dims), self.frozen_dims,
                      own(self.consts, self.consts_dims), self.consts_dims, self.opt_states, self.rows, self.augs, self.noise)

    def put(self, idx: torch.Tensor, group: "_Stack") -> None:
        """The parameters, buffers and optimiser states of ``group``, taken as clients
        ``idx``, written back."""
        for mine, theirs in ((self.params, group.params), (self.buffers, group.buffers), (self.opt_states, group.opt_states)):
            for t, g in zip(pytree.tree_leaves(mine), pytree.tree_leaves(theirs)):
                if isinstance(t, torch.Tensor):
                    t.index_copy_(0, idx, g)


class _Arena:
    """One phase's stacked state, statistics and mask at fixed addresses, the CUDA graphs
    of its steps, and which parameters get gradients (:func:`used_parameters`: what the
    graphs were captured for), kept for the next round of the same shapes."""

    def __init__(
        self, whole: _Stack, totals: dict[str, torch.Tensor], live: torch.Tensor, graphs: StepGraphs, used: list[list[bool]]
    ) -> None:
        self.whole, self.totals, self.live, self.graphs, self.used = whole, totals, live, graphs, used

    def refresh(self, new: _Stack) -> None:
        """This round's values (``new``, of the same layout) copied in; the statistics
        zeroed; the graphs told that their shapes recur."""
        mine = (self.whole.params, self.whole.buffers, self.whole.frozen, self.whole.consts, self.whole.opt_states)
        theirs = (new.params, new.buffers, new.frozen, new.consts, new.opt_states)
        for t, v in zip(pytree.tree_leaves(mine), pytree.tree_leaves(theirs)):
            if isinstance(t, torch.Tensor):
                t.copy_(v)
        for t in self.totals.values():
            t.zero_()
        self.graphs.recurring = True


class StepArenas:
    """The vectorized executor's arenas (:class:`_Arena`) from round to round, for steps
    replayed as CUDA graphs. A graph replays the kernels it captured on the tensors it
    captured them on, so that a round can replay an earlier round's graphs only on the
    same tensors: this round's values are copied into them. An arena serves a later
    phase whose steps are the same computation: the same stages (the loss and step
    functions, which must read what varies between rounds from the task's tensors, as
    the other executors also require), optimiser settings, model, data, transform,
    clients, batch width and the same structure, shapes and dtypes of every tensor;
    which parameters get gradients is probed once, when an arena is made. The
    ``capacity`` most recently used are kept (each holds a chunk's state and its
    graphs' memory). The chunks' memory probes (:func:`saved_bytes_of_step`) are kept
    too, one for each computation."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self.arenas: OrderedDict[Hashable, _Arena] = OrderedDict()
        self.sizes: dict[Hashable, int] = {}

    def get(self, signature: Hashable) -> _Arena | None:
        arena = self.arenas.get(signature)
        if arena is not None:
            self.arenas.move_to_end(signature)
        return arena

    def add(self, signature: Hashable, arena: _Arena) -> _Arena:
        self.arenas[signature] = arena
        while len(self.arenas) > self.capacity:
            self.arenas.popitem(last=False)
        return arena

    def measured(self, signature: Hashable, measure: Callable[[], int]) -> int:
        """``measure()``, taken once for each ``signature`` (a chunk's memory probe)."""
        if signature not in self.sizes:
            self.sizes[signature] = measure()
        return self.sizes[signature]


def _step_groups(
    steps: list[int], sizes: list[list[int]], K: int, pad: bool, mask_groups: bool
) -> list[tuple[int, list[tuple[tuple, torch.Tensor | None]], list[tuple[int, list[int]]]]]:
    """How each step of a phase trains its clients (sorted by their steps, longest
    first, so that the ``a`` still training are a prefix): ``(a, runs, apart)``.

    ``runs`` are the steps over the stack's prefix, ``[:a]`` (``[:K]`` with padding),
    each ``(key, mask)``: its graph key and the clients it trains (None: all ``a``).
    A step whose clients all take batches of one size ``b`` is one run, key ``(a, b)``.
    Where their sizes differ (some take the partial last batch of an epoch:
    ``drop_last=false``), with padding or ``mask_groups`` (steps replayed as CUDA
    graphs) each group of one size ``b`` is a run masked to the group, key ``(a, b,
    "masked")`` (with padding ``(K, b)``, as every step of the phase is masked),
    largest group first: replayed, a masked-out client's wasted arithmetic costs less
    than an eager step. Without (on the CPU, where nothing is replayed and that
    arithmetic would be wasted) each group is trained on its own: ``apart``, a list of
    ``(b, clients)``."""
    out = []
    for s in range(max(steps, default=0)):
        a = sum(1 for n in steps if n > s)
        by_size: dict[int, list[int]] = {}
        for i in range(a):
            by_size.setdefault(sizes[i][s], []).append(i)
        n, mixed = K if pad else a, len(by_size) > 1
        if mixed and not (pad or mask_groups):
            out.append((a, [], sorted(by_size.items(), reverse=True)))
            continue
        runs = []
        for b, members in sorted(by_size.items(), key=lambda g: (len(g[1]), g[0]), reverse=True):
            mask = None
            if pad or mixed:
                mask = torch.zeros(K, dtype=torch.bool)
                mask[members] = True
            runs.append(((n, b, "masked") if mixed and not pad else (n, b), mask))
        out.append((a, runs, []))
    return out


def _batch_positions(plans: list[ClientPlan], steps: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[clients, steps, width]`` positions of each step's batch in the concatenation of
    the ``plans``' orders, the batch in its first ``size`` columns (the rest repeat its
    last sample; never read), and ``[clients, steps]``: which of the steps the client
    takes (the others' positions are 0)."""
    offsets, sizes, base = [], [], 0
    for plan in plans:
        pad = steps - plan.steps
        offsets.append([base + o for o in plan.offsets[:-1]] + [0] * pad)
        sizes.append(plan.sizes + [1] * pad)
        base += plan.offsets[-1]
    col = torch.arange(width)
    sizes_t = torch.tensor(sizes, dtype=torch.long).reshape(len(plans), steps)
    at = torch.tensor(offsets, dtype=torch.long).reshape(len(plans), steps)[..., None] + torch.minimum(col, (sizes_t[..., None] - 1).clamp(min=0))
    taken = torch.arange(steps) < torch.tensor([plan.steps for plan in plans])[:, None]
    return at, taken


def _gathered(parts: list[torch.Tensor], at: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """The rows ``at`` of the concatenated ``parts`` (``[clients, steps, width, ...]``),
    zero in the steps not ``taken``: one gather for all clients."""
    out = torch.cat(parts)[at]
    out[~taken] = 0
    return out


def _phase_signature(phase: PhaseRun) -> tuple:
    """A phase's computation apart from its tensors: its stages and optimiser settings."""
    return phase.stages, type(phase.optimizer).__name__, tuple(sorted(vars(phase.optimizer).items()))


def _layout(tree: Any) -> str:
    """The structure of ``tree``, and the shape, dtype and device of each tensor in it
    (its other leaves as they are)."""
    leaves, spec = pytree.tree_flatten(tree)
    return f"{spec}" + ";".join(f"{tuple(t.shape)}{t.dtype}{t.device}" if isinstance(t, torch.Tensor) else repr(t) for t in leaves)


class _Progress:
    """One client's parameters, buffers, frozen models, optimiser states and summed
    statistics between phases."""

    def __init__(self, params, buffers, frozen, opt_states) -> None:
        self.params, self.buffers, self.frozen = params, buffers, frozen
        self.opt_states = list(opt_states)
        self.stats: dict[str, torch.Tensor] = {}


def _stack_noise(per_client: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The clients' noise tensors stacked along a leading client dimension."""
    return {name: torch.stack([n[name] for n in per_client]) for name in per_client[0]}


def _per_client(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``mask`` (one entry per client) shaped to broadcast over ``t`` (clients first)."""
    return mask.view((-1,) + (1,) * (t.dim() - 1))


def _sliced(params: dict[str, dict[str, torch.Tensor]], a: int) -> dict[str, dict[str, torch.Tensor]]:
    """The first ``a`` clients of stacked parameters (views)."""
    return {role: {k: v[:a] for k, v in sd.items()} for role, sd in params.items()}


def _slice_state(state: dict, a: int) -> dict:
    return {k: ([t[:a] for t in v] if isinstance(v, list) else v[:a]) for k, v in state.items()}
