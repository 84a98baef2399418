"""Timing primitives for `raytrm bench`: medians of synchronised wall-clock samples, and measured ceilings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from raytrm.hardware import device as devices


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of fn() after warm-up, synchronising the device around each call."""
    for _ in range(warmup):
        fn()
    devices.synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        devices.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def matmul_flops_per_sec(
    device: torch.device, n: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 5
) -> float:
    """Measured rate of an n x n x n matrix multiply: the ceiling a model's FLOP rate is compared to."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = median_seconds(lambda: a @ b, device, warmup=2, repeats=repeats)
    return 2 * n**3 / seconds


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of the matrix products, convolutions and attention one call of fn performs, counted by torch."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
