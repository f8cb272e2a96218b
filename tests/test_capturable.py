"""Every algorithm's vectorized training step can be captured as a CUDA graph: checked on
the CPU, by the operations it dispatches.

On a GPU the vectorized executor records each step once as a CUDA graph and replays it
(``engine/cuda_graphs.py``). A step that waits for the GPU (``.item()``, a tensor in an
``if``, an error check of a solver), takes a shape from the data (``nonzero``, boolean
indexing) or calls a solver that allocates while capturing (MAGMA's batched
``cholesky_solve``) cannot be captured; the executor then warns and runs every later step
eagerly, 7x slower for MOON's CNN on an H200. ``tests/test_cuda.py`` captures real graphs
where a GPU is lent; this test runs without one, so that such an operation shows in CI:
the steps are replayed from stand-in graphs (``test_executors._RecordedGraph``) with
every operation they dispatch recorded.
"""

from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import simulate
from test_datasets import write_cifar10
from test_executors import _RecordedGraph, _record_graphs

UNCAPTURABLE = {
    "_local_scalar_dense": "a host sync (.item(), bool() or int() of a tensor)",
    "is_nonzero": "a host sync (a tensor in an if)",
    "equal": "a host sync (torch.equal)",
    "allclose": "a host sync",
    "nonzero": "a shape taken from the data",
    "masked_select": "a shape taken from the data",
    "_unique2": "a shape taken from the data",
    "unique_dim": "a shape taken from the data",
    "unique_consecutive": "a shape taken from the data",
    "_linalg_check_errors": "a host sync (a solver's error check)",
    "cholesky_solve": "MAGMA's batched solver on a GPU, which allocates while capturing",
    "cholesky_inverse": "MAGMA on a GPU, which allocates while capturing",
}
"""ATen operations that cannot run inside a CUDA graph's capture, and why."""

# every algorithm whose local training the vectorized executor runs, with what its step
# may switch on (the SSL ones need two views)
ALGORITHMS = {
    "fedavg": [], "fedprox": ["algorithm.mu=0.1"], "moon": ["algorithm.mu=5", "algorithm.k=2"],
    "scaffold": [], "ditto": [], "fedrep": [], "fedper": [], "lg_fedavg": [], "fedala": [],
    "fedamp": [], "fedcrl": [], "fedproto": [], "fedpac": [], "fedgh": [], "fedssc": [],
    "fedsiam_da": [], "feddecorr": [], "perfedavg": [], "pfedme": [],
    "fedu2": ["augment=simclr"], "fedu2-tangent_sw": ["augment=simclr", "algorithm.uniformity=tangent_sw"],
    "fedsimclr": ["augment=simclr"], "fedbyol": ["augment=simclr"], "fedsimsiam": ["augment=simclr"],
    "fedx": ["augment=simclr"], "fedu": ["augment=simclr"], "fedema": ["augment=simclr"],
    "orchestra": ["augment=simclr", "rounds=2"],  # no local training in its first round (it fills the memory)
    "ldawa": ["augment=simclr"],
}


class _Operations(TorchDispatchMode):
    """Records the name of every ATen operation dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    folder = tmp_path_factory.mktemp("capturable")
    write_cifar10(folder / "cifar-10-batches-py", rows=64, test_rows=8)
    return [f"data_dir={folder}", "dataset=cifar10", "allow_subset=true", "batch_size=8", "rounds=1",
            "local_epochs=1", "executor=vectorized", "knn_every=0"]  # 2 steps a client: the first runs eagerly, the second is captured


@pytest.mark.slow  # 16 s in all
@pytest.mark.parametrize("case", list(ALGORITHMS))
def test_every_step_can_be_captured_as_a_cuda_graph(case, cifar, monkeypatch):
    from contrafl.data import augment
    from contrafl.execution import cuda_graphs

    seen = _Operations()

    class Audited(_RecordedGraph):
        def replay(self):
            with seen:
                self.step()

    made = _record_graphs(monkeypatch, Audited)
    monkeypatch.setattr(cuda_graphs, "MIN_REPLAYS", 1)  # capture every shape at its second step
    # the GPU's colour jitter (masked); the CPU's jitters only the images drawn for it (nonzero)
    monkeypatch.setattr(augment, "_jitter_selected", augment._jitter_masked)
    simulate(f"algorithm={case.split('-')[0]}", *cifar, *ALGORITHMS[case])
    assert sum(graphs.replays for graphs in made) > 0, "no step was replayed: the test checked nothing"
    found = {name: why for name, why in UNCAPTURABLE.items() if name in seen.names}
    assert not found, f"{case}'s step uses operations a CUDA graph cannot capture: {found}"
