"""Invariant 1 across workers: any split of the global batch over 2-3 processes, with any micro-batch cuts per
worker, gives one process's update (fp32), for TRM (carry, halting exploration, the puzzle embedding's SignSGD, the
EMA) and both transformer tasks. Plain torch.distributed processes over gloo, no Ray."""

from __future__ import annotations

import pytest

from raytrm.distributed.launch import spawn
from tests.support.equivalence import compare, train_alone, train_steps

STEPS = 4
# Largest gradient difference relative to the tensor's largest entry: fp32 summation order (workers add partial sums
# in another order than one process does; re-cutting one process's micro-batches differs by as much).
GRAD_RTOL = 1e-5


pytestmark = pytest.mark.slow  # worker processes: tens of seconds per file


def check(config, schedule, micro_batches, alone_micro=None):
    alone = train_alone(config, STEPS, alone_micro)
    spread = spawn(train_steps, len(schedule[0]), config, schedule, micro_batches, STEPS)[0]
    result = compare(alone, spread)
    assert result["grad"] < GRAD_RTOL, result
    assert result["loss"] < GRAD_RTOL, result
    # Adam turns gradients that differ by rounding into steps that differ by rounding times lr at most.
    assert result["weights"] < 1e-4, result
    assert result["ema"] < 1e-4, result
    return result


@pytest.mark.parametrize(
    ("schedule", "micro_batches"),
    [
        ([[16, 16]] * STEPS, [16, 5]),  # equal shares, one worker cuts its share in four
        ([[7, 25]] * 2 + [[20, 12]] * 2, [3, 8]),  # uneven, then moved: carry slots change hands mid-run
        ([[5, 11, 16]] * 2 + [[14, 9, 9]] * 2, [2, 11, 4]),  # three workers
    ],
)
def test_trm_any_split_equals_one_process(tiny, schedule, micro_batches):
    result = check(tiny(), schedule, micro_batches, alone_micro=32)
    # Which example each slot holds, its step count and its halting: exactly the one process's.
    assert result["carry_slots_equal"] == 1.0
    assert result["carry"] < 1e-4


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_transformer_any_split_equals_one_process(text_config, task):
    check(text_config(task), [[3, 9]] * 2 + [[8, 4]] * 2, [2, 5])
