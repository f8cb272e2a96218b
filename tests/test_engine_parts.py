"""Plans, client sampling, the client store and seed derivation."""

import numpy as np
import torch

from contrafl.engine.client_store import ClientStore, state_bytes
from contrafl.execution.plan import make_plan
from contrafl.rng import derive_seed, generator
from contrafl.engine.sampling import sample_schedule


def _no_aug(n, g):
    return {"u": torch.rand(n, generator=g)}


def test_plan_drop_last_epochs_and_coverage():
    rows = np.arange(100, 170)  # 70 samples
    plan = make_plan(rows, epochs=3, batch_size=32, drop_last=True, sample_aug=_no_aug, views=1, generator=generator(0, "p"))
    assert plan.sizes == [32, 32] * 3 and plan.steps == 6
    assert plan.epoch_ends == frozenset({1, 3, 5})
    for e in range(3):
        used = plan.order[e * 64 : (e + 1) * 64]
        assert len(set(used.tolist())) == 64 and set(used.tolist()) <= set(rows.tolist())
    idx, aug = plan.batch(2)
    assert torch.equal(idx, plan.order[64:96]) and aug[0]["u"].shape == (32,)


def test_plan_keep_last_and_tiny_clients():
    rows = np.arange(70)
    plan = make_plan(rows, 2, 32, False, _no_aug, 2, generator(0, "p"))
    assert plan.sizes == [32, 32, 6] * 2 and plan.epoch_ends == frozenset({2, 5})
    assert len(plan.aug) == 2
    assert sorted(plan.order[:70].tolist()) == list(range(70))
    tiny = make_plan(np.arange(10), 5, 32, True, _no_aug, 1, generator(0, "p"))
    assert tiny.steps == 0 and tiny.epoch_ends == frozenset()


def test_a_last_batch_shorter_than_the_smallest_is_left_out():
    """A model with BatchNorm trains no batch of one sample (``smallest=2``): without
    ``drop_last`` an epoch's last batch of one is left out as ``drop_last`` would; a
    longer one is kept; a client of one sample takes no step."""
    plan = make_plan(np.arange(65), 2, 32, False, _no_aug, 1, generator(0, "p"), smallest=2)
    assert plan.sizes == [32, 32] * 2 and plan.epoch_ends == frozenset({1, 3})
    assert make_plan(np.arange(66), 1, 32, False, _no_aug, 1, generator(0, "p"), smallest=2).sizes == [32, 32, 2]
    assert make_plan(np.arange(65), 1, 32, False, _no_aug, 1, generator(0, "p")).sizes == [32, 32, 1]
    assert make_plan(np.arange(1), 3, 32, False, _no_aug, 1, generator(0, "p"), smallest=2).steps == 0


def test_plan_is_a_function_of_the_seed_keys():
    a = make_plan(np.arange(50), 2, 8, True, _no_aug, 1, generator(3, "plan", 1, 4))
    b = make_plan(np.arange(50), 2, 8, True, _no_aug, 1, generator(3, "plan", 1, 4))
    c = make_plan(np.arange(50), 2, 8, True, _no_aug, 1, generator(3, "plan", 1, 5))
    assert torch.equal(a.order, b.order) and torch.equal(a.aug[0]["u"], b.aug[0]["u"])
    assert not torch.equal(a.order, c.order)
    assert derive_seed(1, "x") == derive_seed(1, "x") != derive_seed(2, "x")


def test_sample_schedule():
    assert sample_schedule(5, 1.0, 3, 0) == [[0, 1, 2, 3, 4]] * 3
    sched = sample_schedule(100, 0.2, 50, seed=7)
    assert all(len(r) == 20 and len(set(r)) == 20 and r == sorted(r) for r in sched)
    assert sched == sample_schedule(100, 0.2, 50, seed=7)
    assert sched != sample_schedule(100, 0.2, 50, seed=8)
    counts = np.bincount(np.concatenate(sched), minlength=100)
    assert counts.sum() == 1000 and counts.max() < 25  # uniform: 10 expected per client
    assert all(len(r) == 1 for r in sample_schedule(3, 0.1, 4, 0))  # at least one client


def test_client_store_spills_to_disk_and_back(tmp_path):
    one = 4 * 1000  # bytes of a 1000-float tensor
    store = ClientStore(memory_bytes=2.5 * one, directory=tmp_path / "spill")
    for cid in range(5):
        store.put(cid, {"w": torch.full((1000,), float(cid))})
    assert store.spilled == 3 and len(list((tmp_path / "spill").iterdir())) == 3
    for cid in range(5):
        assert store.get(cid)["w"][0].item() == cid
    assert 7 not in store and store.get(7) is None
    store.close()
    assert not (tmp_path / "spill").exists()


def test_client_store_checkpoints_survive_later_writes_and_restore(tmp_path):
    """A committed manifest's files are never overwritten or removed by later spills, so
    a crash after the checkpoint can always go back to it."""
    one = 4 * 1000
    d = tmp_path / "clients"
    store = ClientStore(memory_bytes=2.5 * one, directory=d, keep=True)
    for cid in range(4):
        store.put(cid, {"w": torch.full((1000,), float(cid))})
    manifest = store.checkpoint()
    store.commit(manifest)
    assert sorted(manifest["files"]) == [0, 1, 2, 3]
    assert {p.name for p in d.iterdir()} == set(manifest["files"].values())
    # the next round changes every client and spills some: the committed files stay
    for cid in range(4):
        store.put(cid, {"w": torch.full((1000,), 10.0 + cid)})
    assert set(manifest["files"].values()) <= {p.name for p in d.iterdir()}
    # a crash here; a new store restores the checkpoint's states and removes the rest
    again = ClientStore(memory_bytes=2.5 * one, directory=d, keep=True)
    again.restore(manifest)
    assert [again.get(cid)["w"][0].item() for cid in range(4)] == [0.0, 1.0, 2.0, 3.0]
    assert {p.name for p in d.iterdir()} == set(manifest["files"].values())
    # the next checkpoint writes new files and its commit removes the old ones
    again.put(2, {"w": torch.full((1000,), 42.0)})
    second = again.checkpoint()
    again.commit(second)
    assert second["files"][2] != manifest["files"][2]
    assert {p.name for p in d.iterdir()} == set(second["files"].values())
    again.close()
    assert d.exists()  # kept for the run directory's checkpoint


def test_client_store_commits_remove_superseded_files_only(tmp_path):
    """Round after round with spills, the directory holds exactly the last checkpoint's
    files and the states written since (a commit does not list the directory)."""
    one = 4 * 1000
    d = tmp_path / "clients"
    store = ClientStore(memory_bytes=1.5 * one, directory=d, keep=True)
    for round in range(4):
        for cid in range(5):
            if (cid + round) % 2:
                store.put(cid, {"w": torch.full((1000,), 10.0 * round + cid)})
        manifest = store.checkpoint()
        store.commit(manifest)
        assert {p.name for p in d.iterdir()} == set(manifest["files"].values())
    expected = {cid: 10.0 * (3 if (cid + 3) % 2 else 2) + cid for cid in range(5)}
    assert {cid: store.get(cid)["w"][0].item() for cid in range(5)} == expected


def test_state_bytes_counts_shared_storage_once():
    t = torch.zeros(10)
    assert state_bytes({"a": t, "b": [t, t[:5]], "c": 3}) == 40


def test_progress_prints_rejected_and_lost_clients_with_their_reasons():
    import io

    from contrafl.engine.progress import Progress

    out = io.StringIO()
    row = {
        "round": 2, "train_loss": 0.5,
        "rejected": [{"client": 1, "reason": "'w' has non-finite values (1 NaN, 0 infinite)"}],
        "lost": [{"client": 3, "reason": "no reply within 30s"}, {"client": 4, "reason": "dropped out (client_dropout=0.5)"},
                 {"client": 6, "reason": "dropped out (client_dropout=0.5)"}],
    }
    Progress(4, out).round_done(row)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("round 2/4") and "loss 0.5000" in lines[0]
    assert lines[1:] == [
        "  client 1's update rejected: 'w' has non-finite values (1 NaN, 0 infinite)",
        "  client 3 lost: no reply within 30s",
        "  clients 4, 6 lost: dropped out (client_dropout=0.5)",
    ]
