"""CUDA graphs of the vectorized executor's training step.

On a GPU a step of a small model over a chunk of clients is a thousand or more tiny
kernels, and their launches from Python (through ``torch.func``'s vmap) cost several
times the kernels' own run time. A step captured once as a CUDA graph is replayed with
one launch. A step reads its inputs from tensors that stay at the same addresses (the
stacked parameters, buffers and optimiser states it updates in place, and the batch
buffers the executor fills before each step), so its graph can be replayed for every
later step of the same shape, in later rounds too where the executor keeps those tensors
(``recurring``: the vectorized executor's arenas).

:class:`StepGraphs` decides per step: run it eagerly (the first step of a shape, which
also warms up cuDNN and allocates what the step creates once), capture it, or replay the
captured graph. A capture runs the step's Python as an eager step does and then builds
the graph, so a shape is only captured when at least :data:`MIN_REPLAYS` steps will use
it (a margin: the capture's own cost has not been measured apart from whole rounds),
or when its steps recur in later rounds. A step that cannot be
captured (an operation that waits for the GPU, a shape decided by the data) is run
eagerly, and so is every later step of the process, with one warning: nothing of it was
executed during the failed capture, so the eager step does the work exactly once.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable

import torch

MIN_REPLAYS = 8  # steps a captured graph must serve to pay for its capture


class CudaStepGraph:
    """One step as a CUDA graph: capturing records the step's kernels without running them;
    a replay runs them. Graphs of one :class:`StepGraphs` share a memory pool (they are
    captured one after another and each replayed only before the next is captured)."""

    def __init__(self, pool: Any = None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, step: Callable[[], None]) -> None:
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            step()
        self.pool = self.graph.pool()

    def replay(self) -> None:
        self.graph.replay()


class StepGraphs:
    """Eager, capture or replay for each step; one graph per key (the active clients)."""

    failed: str | None = None  # why a capture on the GPU failed in this process (then: no more tries)

    def __init__(self, enabled: bool, new_graph: Callable[[Any], Any] = CudaStepGraph) -> None:
        self.enabled = enabled
        self.new_graph = new_graph  # pool -> an object with capture(step), replay() and pool
        self.graphs: dict[Hashable, Any] = {}
        self.warm: set[Hashable] = set()
        self.pool: Any = None
        self.replays = 0
        self.recurring = False  # the steps recur in later rounds (an arena's graphs): capture on a shape's second step

    @classmethod
    def for_device(cls, device: torch.device, wanted: bool) -> "StepGraphs":
        return cls(wanted and device.type == "cuda" and StepGraphs.failed is None)

    def run(self, key: Hashable, remaining: int, step: Callable[[], None]) -> None:
        """Do ``step`` (which reads only fixed-address tensors) for ``key``, of which
        ``remaining`` steps (this one included) are left."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        if not self.enabled or key not in self.warm or (remaining < MIN_REPLAYS and not self.recurring):
            self.warm.add(key)
            step()
            return
        graph = self.new_graph(self.pool)
        try:
            graph.capture(step)
        except Exception as exc:  # noqa: BLE001 - any failure to capture means: run eagerly
            self.enabled = False
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if self.new_graph is CudaStepGraph:
                StepGraphs.failed = why
            warnings.warn(f"a training step could not be captured as a CUDA graph ({why}); "
                          "steps run eagerly from now on (set cuda_graphs=false to skip the attempt)",
                          RuntimeWarning, stacklevel=2)
            step()
            return
        self.pool = graph.pool
        self.graphs[key] = graph
        graph.replay()
        self.replays += 1
