"""precision=fp32|bf16|auto: bfloat16 autocast for local training where the device has
native bfloat16 (a CPU with AMX or AVX512-BF16, checked at run time), fp32 elsewhere.

The CPU's flags are stood in for (``setup.cpu_flags``), so every test runs the same on
every machine: autocast on a CPU without native bf16 computes the same numbers, slowly.
"""

from __future__ import annotations

import pytest
import torch

from contrafl.config import load_config
from contrafl.engine import setup
from contrafl.execution.executor import AutocastNet, FunctionalNet, Workload
from contrafl.models.build import build_model
from contrafl.engine.setup import prepare, resolve, resolve_precision
from contrafl.engine.simulation import Simulation
from contrafl.errors import ConfigError
from test_orchestra import tiny_cifar

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


@pytest.mark.parametrize("flags, auto", [({"amx_bf16", "avx512f"}, "bf16"), ({"avx512_bf16"}, "bf16"), ({"avx2", "avx512f"}, "fp32"), (set(), "fp32")])
def test_auto_takes_bf16_where_the_cpu_has_it_and_bf16_elsewhere_is_a_one_line_error(monkeypatch, flags, auto):
    monkeypatch.setattr(setup, "cpu_flags", lambda: flags)
    assert resolve_precision("auto", CPU) == auto
    assert resolve_precision("fp32", CPU) == "fp32"
    assert resolve(load_config(None, ["precision=auto"])).precision == auto
    if auto == "bf16":
        assert resolve_precision("bf16", CPU) == "bf16"
    else:
        with pytest.raises(ConfigError, match=r"^precision=bf16 but this CPU has neither AMX nor AVX512-BF16; use precision=fp32, or precision=auto"):
            resolve_precision("bf16", CPU)


def test_the_cpu_flags_are_read_from_proc_cpuinfo():
    flags = setup.cpu_flags()
    assert isinstance(flags, set)
    if flags:  # Linux
        assert "fpu" in flags or "sse2" in flags or "fp" in flags or "asimd" in flags


def test_bf16_local_training_runs_under_autocast_reproducibly(tmp_path, monkeypatch):
    """The same run in bf16 twice gives the same metrics; they differ from fp32's (the
    local steps ran in bfloat16), by little (the loss of the first round within 2%)."""
    monkeypatch.setattr(setup, "cpu_flags", lambda: {"amx_bf16"})
    base = ["algorithm=moon", "num_clients=2", "rounds=2", "local_epochs=1", "batch_size=8", "executor=sequential",
            "eval_personal=false", *tiny_cifar(tmp_path, rows=32, test_rows=8)]

    def history(precision):
        sim = Simulation(prepare(load_config(None, [*base, f"precision={precision}"])), None, None)
        sim.run()
        return sim.history

    fp32, bf16, again = history("fp32"), history("bf16"), history("auto")
    assert [r["train_loss"] for r in bf16] == [r["train_loss"] for r in again]
    assert [r["train_loss"] for r in bf16] != [r["train_loss"] for r in fp32]
    assert bf16[0]["train_loss"] == pytest.approx(fp32[0]["train_loss"], rel=0.02)

    base[base.index("executor=sequential")] = "executor=vectorized"  # the batched executor under bf16 too
    vectorized = history("bf16")
    assert vectorized[0]["train_loss"] == pytest.approx(bf16[0]["train_loss"], rel=0.02)


def test_the_algorithms_own_forward_runs_in_the_runs_precision(tmp_path, monkeypatch):
    """Context.net (FedALA's adaptive aggregation, Per-FedAvg's adaptation) is the plain
    forward in fp32 runs and the autocast one in bf16 runs, whose outputs are float32
    and close to fp32's; a bf16 FedALA run (ALA in its first rounds) completes."""
    net = FunctionalNet(build_model("moon_cnn", (3, 32, 32), 10))
    state = dict(net.eval_model.state_dict())
    x = torch.randn(5, 3, 32, 32)
    plain, cast = net(state, x, train=False), AutocastNet(net, torch.bfloat16)(state, x, train=False)
    for a, b in zip(plain[:3], cast[:3]):
        assert b.dtype == torch.float32 and not torch.equal(a, b)
        torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)

    monkeypatch.setattr(setup, "cpu_flags", lambda: {"amx_bf16"})
    base = ["algorithm=fedala", "num_clients=2", "rounds=3", "local_epochs=1", "batch_size=8", "executor=sequential",
            "pool=true", "test_fraction=0.25", *tiny_cifar(tmp_path, rows=32, test_rows=8)]
    for precision, kind in (("fp32", FunctionalNet), ("bf16", AutocastNet)):
        sim = Simulation(prepare(load_config(None, [*base, f"precision={precision}"])), None, None)
        assert isinstance(sim.client_net, kind)
        sim.run()
        assert len(sim.history) == 3 and all(torch.isfinite(torch.tensor(r["train_loss"])) for r in sim.history)
