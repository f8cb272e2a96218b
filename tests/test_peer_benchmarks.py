"""The peer benchmarks of issue #36 (benchmarks/peers/README.md): the documented quick
check (`--rounds R --seeds 1`) of pfl_research.py runs contrafl and pfl-research as whole
processes on the same work, checked on both sides, and the check names a peer that does
other work. flower_simulation.py shares this harness and these checks (its quick check
takes 16 s, most of it Ray's start, and is left to the benchmark's users to keep the
suite's time). Times are printed, never asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers"
CIFAR = ROOT.parent / "shared" / "data" / "cifar-10-batches-py"


def _common():
    """benchmarks/peers/_common.py, under a name of its own (benchmarks/ has a _common too)."""
    spec = importlib.util.spec_from_file_location("peers_common", PEERS / "_common.py")
    module = sys.modules["peers_common"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_equal_work_check_names_each_difference():
    check = _common().work_problems
    spec = {"rounds": 2, "schedule": [[0, 2], [1, 3]], "local_steps": [10, 11], "eval_rounds": [2], "clients": [[0], [1]],
            "fingerprint": "abc", "init_sha256": "83a1"}
    same = {"clients": [[0, 2], [1, 3]], "local_steps": [10, 11], "test_acc": {2: 0.3}, "init_sha256": {"83a1"}, "probe_max_abs_diff": 1e-8}
    assert check(spec, same) == []
    other = {**same, "clients": [[0, 2], [1, 4]], "local_steps": [9, 11], "test_acc": {1: 0.2, 2: 0.3},
             "init_sha256": {"83a1", "ffff"}, "probe_max_abs_diff": 0.1}
    assert check(spec, other) == [
        "round 2 trained clients [1, 4] instead of [1, 3]",
        "round 1 took 9 local steps instead of 10",
        "evaluated after rounds [1, 2] instead of [2]",
        "the peer started from weights ['83a1', 'ffff'], not contrafl's 83a1",
        "the peer's model gives other logits than contrafl's (max |diff| 1.00e-01)",
    ]
    assert check(spec, {**same, "clients": [[0, 2]], "local_steps": [10]}) == ["1 rounds instead of 2"]
    contrafl = {**same, "partition": [[0], [2]], "fingerprint": "abd"}
    del contrafl["init_sha256"], contrafl["probe_max_abs_diff"]
    assert check(spec, contrafl) == [
        "contrafl's run partitioned the data otherwise than the spec",
        "contrafl's run has config fingerprint abd, the spec abc",
    ]


def quick_check(script: str, tmp_path: Path, *options: str) -> dict:
    """benchmarks/peers/README.md's quick check of ``script`` on the device shape, with
    this Python; the JSON it writes."""
    done = subprocess.run(
        [sys.executable, str(PEERS / script), "--shape", "device", "--rounds", "1", "--seeds", "1", "--pairs", "1",
         "--data-dir", str(CIFAR), "--work", str(tmp_path / "work"), "--json", str(tmp_path / "out.json"), *options],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "same clients, steps and evaluations as the spec" in done.stdout
    [result] = json.loads((tmp_path / "out.json").read_text())
    return result


def assert_equal_work(result: dict, peers: list[str]) -> None:
    programs = result["programs"]
    assert list(programs) == ["contrafl", *peers]
    steps = {name: p["local_steps"] for name, p in programs.items()}
    assert all(s == steps["contrafl"] and s[0] > 250 for s in steps.values()), steps  # 50 clients of 5-6 steps each
    for p in programs.values():
        assert 0.0 <= p["accuracy_by_seed"]["0"] <= 1.0 and p["median_s"] > 0


needs_cifar = pytest.mark.skipif(not (CIFAR / "data_batch_1").exists(), reason="no ../shared CIFAR-10 subset")


@pytest.mark.slow
@needs_cifar
@pytest.mark.skipif(importlib.util.find_spec("pfl") is None, reason="pfl (pfl-research) is not installed")
def test_pfl_research_quick_check_runs_both_programs_on_equal_work(tmp_path):
    result = quick_check("pfl_research.py", tmp_path, "--configs", "single", "--floor")
    floor = result["programs"].pop("floor")  # the plain loop of the same steps, alternated with the programs
    assert_equal_work(result, ["pfl"])
    assert floor["local_steps"] == result["programs"]["contrafl"]["local_steps"] and floor["accuracy_by_seed"] == {"0": None}
    assert 0 < floor["rounds_median_s"] < floor["median_s"]  # its steps inside its process
    [ratio] = result["programs"]["contrafl"]["floor_ratios"]
    assert ratio == pytest.approx(result["programs"]["contrafl"]["median_s"] / floor["rounds_median_s"])
    [whole] = result["programs"]["contrafl"]["floor_process_ratios"]
    assert whole == pytest.approx(result["programs"]["contrafl"]["median_s"] / floor["median_s"]) and whole < ratio


def test_the_round_profiles_unfold_probe_computes_the_convolution(monkeypatch):
    """benchmarks/round_profile.py --unfold-conv (what the GPU session compares with cuDNN's
    grouped convolution) gives the convolution's values and, under vmap over clients with
    their own weights, its gradients; padding and strides included."""
    import torch
    from torch.func import functional_call, grad, vmap

    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ first
    for name in ("_common", "peers", "peers._common"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location("round_profile", ROOT / "benchmarks" / "round_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, (5, 3), stride=(2, 1), padding=(1, 2))
    weights, biases, x = torch.randn(3, 4, 3, 5, 3), torch.randn(3, 4), torch.randn(3, 6, 3, 17, 16)

    def loss(w):
        out = vmap(lambda w, b, x: functional_call(conv, {"weight": w, "bias": b}, (x,)))(w, biases, x)
        return out.square().sum(), out

    (native_grad, native) = grad(loss, has_aux=True)(weights)
    monkeypatch.setattr(torch.nn.Conv2d, "_conv_forward", profile.unfold_conv)
    (unfold_grad, unfolded) = grad(loss, has_aux=True)(weights)
    torch.testing.assert_close(unfolded, native, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unfold_grad, native_grad, rtol=1e-5, atol=1e-4)
