"""The modes part's seeds, rows and gaps (the two-worker runs are faked: each takes minutes)."""

from __future__ import annotations

import pytest

from benchmarks import modes


def test_seeds_from_the_first_one_and_gaps_paired_by_seed(tmp_path, monkeypatch):
    seen = []

    def spawn(fn, world_size, config, run_dir, shares, device):
        training = config.training
        seen.append((training.seed, training.sync_mode, training.steps))
        assert (world_size, shares) == (2, None)
        accuracy = 0.9 + training.seed / 100 - (0.02 if training.sync_mode == "local" else 0.0)
        summary = {"eval_cell_acc": accuracy, "samples_seen": training.steps * 32, "steps": training.steps}
        return [{**summary, "samples_per_sec": 100.0, "shares": [16, 16]}, None]

    monkeypatch.setattr(modes, "spawn", spawn)
    monkeypatch.setattr("raytrm.data.cache.dataset_dir_for", lambda data: tmp_path)
    rows = modes.bench_modes(tmp_path, modes.variants([5]), seeds=2, samples=3200, first_seed=4)

    assert [seed for seed, _, _ in seen] == [4] * 5 + [5] * 5  # seed-major, from the first seed
    assert {steps for _, _, steps in seen} == {100}
    assert [r.name for r in rows] == [
        "exact",
        "compressed",
        "local H=5 plain",
        "local H=5 Nesterov 0.7/0.9",
        "local H=5 plain, 1 step behind",
    ]
    assert all(r.seeds == [4, 5] for r in rows)
    assert rows[0].accuracy == pytest.approx([0.94, 0.95]) and rows[0].gap == 0.0
    assert (rows[2].gap, rows[2].worst_gap) == pytest.approx((-0.02, -0.02))
    assert rows[2].note.endswith("at 3200 samples, seeds 4-5")


def test_unequal_shares_one_worker_per_weight_and_the_kinds_asked(tmp_path, monkeypatch):
    seen = []

    def spawn(fn, world_size, config, run_dir, shares, device):
        training = config.training
        seen.append((world_size, shares, training.sync_mode, training.sync_every))
        summary = {"eval_cell_acc": 0.9, "samples_seen": training.steps * 32, "steps": training.steps}
        return [{**summary, "samples_per_sec": 100.0, "shares": shares}, None, None]

    monkeypatch.setattr(modes, "spawn", spawn)
    monkeypatch.setattr("raytrm.data.cache.dataset_dir_for", lambda data: tmp_path)
    names = modes.variants([5, 10], ["plain"])
    rows = modes.bench_modes(tmp_path, names, seeds=1, samples=3200, weights=[2.0, 1.0, 1.0])

    assert seen == [(3, [16, 8, 8], "exact", None), (3, [16, 8, 8], "local", 5), (3, [16, 8, 8], "local", 10)]
    assert [(r.name, r.workers, r.shares) for r in rows] == [
        ("exact", 3, [16, 8, 8]),
        ("local H=5 plain", 3, [16, 8, 8]),
        ("local H=10 plain", 3, [16, 8, 8]),
    ]
