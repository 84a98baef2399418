"""The memory model's arithmetic: the fit, the largest micro-batch under a budget, and even cuts."""

from __future__ import annotations

import pytest

from raytrm.train.memory.fit import MemoryFit, cut, fit

MiB = 2**20


def test_fit_recovers_a_line():
    points = [(4, 500 * MiB + 4 * 10 * MiB), (8, 500 * MiB + 8 * 10 * MiB), (16, 500 * MiB + 16 * 10 * MiB)]
    f = fit(points)
    assert f.fixed_bytes == pytest.approx(500 * MiB)
    assert f.per_sample_bytes == pytest.approx(10 * MiB)
    assert max(abs(e) for e in f.relative_errors()) < 1e-9


def test_largest_micro_batch_under_budget():
    f = MemoryFit(500 * MiB, 10 * MiB)
    # 1000 MiB budget, 10% margin: 900 - 500 = 400 MiB of activations, 40 samples.
    assert f.largest_micro_batch(1000 * MiB, margin=0.1) == 40
    assert f.largest_micro_batch(1000 * MiB, margin=0.1, limit=32) == 32
    assert f.largest_micro_batch(400 * MiB) == 1  # even the fixed part does not fit: the smallest step


def test_noise_never_gives_a_negative_slope():
    assert fit([(4, 600 * MiB), (8, 590 * MiB)]).per_sample_bytes == 0.0
    assert fit([(8, 700 * MiB)]).predict(64) == 700 * MiB


@pytest.mark.parametrize(
    "global_batch, micro, expected",
    [(256, 64, [64, 64, 64, 64]), (256, 100, [86, 85, 85]), (10, 3, [3, 3, 2, 2]), (8, 32, [8]), (7, 1, [1] * 7)],
)
def test_cut_adds_up_and_is_even(global_batch, micro, expected):
    pieces = cut(global_batch, micro)
    assert pieces == expected
    assert sum(pieces) == global_batch and max(pieces) <= micro and max(pieces) - min(pieces) <= 1
