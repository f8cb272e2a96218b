"""On a CUDA device: the executors agree with each other and with the CPU.

Skipped without a GPU (CI has none); run on one with ``pytest tests/test_cuda.py``.
cuDNN's TF32 convolutions (PyTorch's default on Ampere and later) are switched off here,
so that a difference is the code's and not TF32's 10-bit mantissa; with them on, runs
stay within the bf16 test's 2% (``test_tf32_and_bf16_stay_close_to_fp32``).
"""

from __future__ import annotations

import pytest
import torch

from conftest import simulate
from test_datasets import write_cifar10

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# one per kind of local work: plain CE, frozen models, proximal terms and control variates,
# prototypes, personal models and phases, adaptive aggregation, self-supervised pairs
ALGORITHMS = [
    ["algorithm=fedavg"],
    ["algorithm=moon", "algorithm.mu=5", "algorithm.k=2"],
    ["algorithm=fedprox", "algorithm.mu=0.1"],
    ["algorithm=scaffold"],
    ["algorithm=fedcrl"],
    ["algorithm=fedproto"],
    ["algorithm=ditto"],
    ["algorithm=fedrep"],
    ["algorithm=fedala"],
    ["algorithm=fedssc"],
    ["algorithm=fedsiam_da"],
    ["algorithm=fedu2", "augment=simclr"],
]
# SimCLR's augmentation makes flat image regions (grayscale, saturated jitter), whose equal
# convolution outputs tie in max pooling; the executors' convolutions sum in different
# orders, a tie becomes a 1-ulp difference and the gradient goes to another pixel of the
# window. Two CPU executors already differ by 2e-3 after a round this way, and by 3e-5 with
# average pooling in place of max pooling; for it the first losses are compared
LOSSES_ONLY = {"algorithm=fedu2"}


@pytest.fixture
def cifar(tmp_path):
    write_cifar10(tmp_path / "cifar-10-batches-py", rows=64, test_rows=16)
    return [f"data_dir={tmp_path}", "dataset=cifar10", "allow_subset=true", "batch_size=8"]


@pytest.fixture(autouse=True)
def graphs_untried():
    """Each test starts as a new process would: a capture that failed in an earlier test
    (which switches CUDA graphs off for the rest of the process) fails only that test."""
    from contrafl.execution.cuda_graphs import StepGraphs

    StepGraphs.failed = None
    yield
    StepGraphs.failed = None


@pytest.fixture
def no_tf32():
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


def assert_models_close(a, b, atol):
    assert a.server.model.keys() == b.server.model.keys()
    for k, v in a.server.model.items():
        torch.testing.assert_close(b.server.model[k].cpu(), v.cpu(), rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a[0].split("=")[1])
def test_vectorized_equals_sequential_and_the_cpu(algorithm, cifar):
    seq = simulate(*algorithm, *cifar, "device=cuda", "executor=sequential")
    vec = simulate(*algorithm, *cifar, "device=cuda", "executor=vectorized")
    cpu = simulate(*algorithm, *cifar, "device=cpu", "executor=sequential")
    assert seq.device.type == vec.device.type == "cuda"
    if algorithm[0] in LOSSES_ONLY:
        for run in (vec, cpu):
            assert run.history[0]["train_loss"] == pytest.approx(seq.history[0]["train_loss"], rel=1e-3)
        return
    assert_models_close(seq, vec, atol=1e-4)
    assert_models_close(cpu, seq, atol=1e-4)
    for a, b in zip(cpu.history, seq.history):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)


GRAPHED = {
    "moon-fp32": ["algorithm=moon", "algorithm.mu=5"],  # three networks, SGD with momentum, flip-and-crop
    "moon-bf16": ["algorithm=moon", "algorithm.mu=5", "precision=bf16"],
    "scaffold": ["algorithm=scaffold"],  # a post-step correction
    "fedrep": ["algorithm=fedrep"],  # two phases, each with its own graphs
    # SimCLR's augmentation in the graph (ColorJitter's masked form on a GPU), noise drawn on
    # the CPU each step, the target's EMA as a post-step
    "fedu2": ["algorithm=fedu2", "augment=simclr", "algorithm.uniformity=tangent_sw"],
    # the paper's FUR (the default): an interior-point UOT solve in float64 each step, whose
    # linear solves must be capturable (torch.cholesky_solve, MAGMA's on a GPU, was not)
    "fedu2-uot": ["algorithm=fedu2", "augment=simclr"],
}


@pytest.fixture
def step_calls(monkeypatch):
    """Every ``StepGraphs.run`` call from here on: (its StepGraphs, the key, whether it
    replayed a graph)."""
    from contrafl.execution.cuda_graphs import StepGraphs

    calls = []
    run = StepGraphs.run

    def counted(self, key, remaining, step):
        before = self.replays
        run(self, key, remaining, step)
        calls.append((id(self), key, self.replays - before))

    monkeypatch.setattr(StepGraphs, "run", counted)
    return calls


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("case", list(GRAPHED))
def test_steps_replayed_as_cuda_graphs_equal_eager_steps(tmp_path, step_calls, case):
    """The vectorized executor's steps replayed from CUDA graphs compute what eager steps
    compute, and they are replayed: every step but the first of each arena (eager; the
    second is captured first), which keeps its graph for the later rounds of the same
    computation (MOON's first round, without its contrastive term, has its own).
    Emulated with stand-in graphs on the CPU: 158, 159, 318 and 159 replays for MOON,
    SCAFFOLD, FedRep (two phases) and FedU2 (80 steps a client and round)."""
    from contrafl.execution.cuda_graphs import StepGraphs

    write_cifar10(tmp_path / "cifar-10-batches-py", rows=512, test_rows=16)
    args = [f"data_dir={tmp_path}", "dataset=cifar10", "allow_subset=true", "batch_size=8", "partition=iid",
            "device=cuda", "executor=vectorized", *GRAPHED[case]]
    eager = simulate(*args, "cuda_graphs=false")
    assert sum(r for *_, r in step_calls) == 0
    step_calls.clear()
    graphed = simulate(*args, "cuda_graphs=true")
    replays = sum(r for *_, r in step_calls)
    assert StepGraphs.failed is None
    steps = [row["local_steps"] // 4 for row in graphed.history]  # 4 clients with equal shares
    arenas = len({graphs for graphs, _, _ in step_calls})
    assert replays == sum(steps) - arenas and min(steps) > 8
    assert arenas == (2 if case.startswith(("moon", "fedrep")) else 1)
    assert_models_close(eager, graphed, atol=1e-5)
    for a, b in zip(eager.history, graphed.history):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)


PADDED = {
    "moon": GRAPHED["moon-fp32"],
    "scaffold": GRAPHED["scaffold"],
    # one round: over two, FedRep's two phases amplify float differences (its vectorized
    # and sequential runs already differ by 1e-3 on the CPU; padded and unpadded by 9e-5
    # there after two rounds, 7e-9 after one)
    "fedrep": [*GRAPHED["fedrep"], "rounds=1"],
}


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("case", list(PADDED))
def test_padded_steps_replay_one_graph_per_phase(tmp_path, step_calls, case):
    """With ``pad_finished_clients`` clients with different numbers of steps train as they
    do in eager steps without it, and in every phase all steps but the first are
    replayed from one graph (the one of all the chunk's clients)."""
    from contrafl.execution.cuda_graphs import StepGraphs

    write_cifar10(tmp_path / "cifar-10-batches-py", rows=512, test_rows=16)
    args = [f"data_dir={tmp_path}", "dataset=cifar10", "allow_subset=true", "batch_size=8",
            "partition=dirichlet", "partition.beta=0.5", "device=cuda", "executor=vectorized", *PADDED[case]]
    eager = simulate(*args, "cuda_graphs=false")
    step_calls.clear()
    padded = simulate(*args, "cuda_graphs=true", "pad_finished_clients=true")
    assert StepGraphs.failed is None
    assert {key for _, key, _ in step_calls} == {(4, 8)}  # one shape: all 4 clients, batches of 8, in every step
    assert sum(r for *_, r in step_calls) == len(step_calls) - len({graphs for graphs, _, _ in step_calls}) > 0
    assert_models_close(eager, padded, atol=1e-5)
    for a, b in zip(eager.history, padded.history):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)


@pytest.mark.usefixtures("no_tf32")
def test_mixed_steps_replay_a_graph_for_each_group(tmp_path, step_calls, monkeypatch):
    """``drop_last=false`` with clients of unequal sizes: in the steps where some
    clients take their partial last batch, each group of one batch size is replayed as
    a graph masked to it (keys ``(clients, batch size, "masked")``), none is gathered
    and trained apart, and the run ends as with the same steps run eagerly. Against
    eager steps of the other grouping (``cuda_graphs=false``: every group apart), the
    convolutions of the global model, shared by the clients, run over other batches
    and round otherwise: on the CPU the two groupings differ by 1.0e-4 after these two
    rounds, the sequential and vectorized executors by 1.1e-3."""
    from contrafl.execution.cuda_graphs import StepGraphs
    from test_executors import _record_gathers

    write_cifar10(tmp_path / "cifar-10-batches-py", rows=512, test_rows=16)
    args = [f"data_dir={tmp_path}", "dataset=cifar10", "allow_subset=true", "batch_size=24", "drop_last=false",
            "local_epochs=4", "partition=dirichlet", "partition.beta=0.5", "device=cuda", "executor=vectorized",
            *GRAPHED["moon-fp32"]]
    apart = simulate(*args, "cuda_graphs=false")
    gathered = _record_gathers(monkeypatch)
    step_calls.clear()
    graphed = simulate(*args, "cuda_graphs=true")
    assert StepGraphs.failed is None and not gathered
    assert any(key[-1] == "masked" and replayed for _, key, replayed in step_calls)
    monkeypatch.setattr(StepGraphs, "run", lambda graphs, key, remaining, step: step())  # graphs on, every step eager
    eager = simulate(*args, "cuda_graphs=true")
    assert not gathered
    assert_models_close(eager, graphed, atol=1e-5)
    assert_models_close(apart, graphed, atol=1e-3)
    for a, b, c in zip(eager.history, graphed.history, apart.history):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert c["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)


def test_tf32_and_bf16_stay_close_to_fp32(cifar):
    """PyTorch's default TF32 convolutions and precision=bf16 change a MOON run's losses by
    little (within 2%, as on the CPU); bf16 also under the vectorized executor."""
    run = ["algorithm=moon", "algorithm.mu=5", *cifar, "device=cuda", "executor=sequential"]
    torch.backends.cudnn.allow_tf32 = False
    try:
        fp32 = simulate(*run).history
    finally:
        torch.backends.cudnn.allow_tf32 = True
    tf32 = simulate(*run).history
    bf16 = simulate(*run, "precision=bf16").history
    bf16_vec = simulate(*run, "precision=bf16", "executor=vectorized").history
    for other in (tf32, bf16, bf16_vec):
        for a, b in zip(fp32, other):
            assert b["train_loss"] == pytest.approx(a["train_loss"], rel=0.02)
