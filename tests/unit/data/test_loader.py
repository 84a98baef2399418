"""Global batches are a pure function of (seed, step): nothing lost or doubled across epochs or restarts."""

from __future__ import annotations

import numpy as np

from raytrm.data.loader import batch_indices, global_batches


def test_each_epoch_sees_every_sample_once():
    n, b = 10, 4
    stream = np.concatenate([batch_indices(n, b, seed=3, step=s) for s in range(5)])  # 20 samples = 2 epochs
    assert sorted(stream[:10]) == list(range(10))
    assert sorted(stream[10:]) == list(range(10))


def test_restart_at_a_step_continues_the_same_stream():
    def gather(idx):
        return {"inputs": np.stack([idx, idx]).T}

    full = global_batches(gather, 13, 5, seed=1, first_step=0)
    first = [next(full)["inputs"][:, 0].tolist() for _ in range(6)]
    resumed = global_batches(gather, 13, 5, seed=1, first_step=3)
    assert [next(resumed)["inputs"][:, 0].tolist() for _ in range(3)] == first[3:]


def test_seed_changes_the_order():
    assert not np.array_equal(batch_indices(100, 10, seed=0, step=0), batch_indices(100, 10, seed=1, step=0))
