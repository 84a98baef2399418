"""Timing primitives for `python -m benchmarks`: medians of synchronised wall-clock samples, and measured ceilings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from raytrm.fastpaths import onednn
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


def onednn_flops_per_sec(n: int = 2048, repeats: int = 5) -> float:
    """Measured rate of oneDNN's n x n x n fp32 linear on a CPU, where raytrm's linear layers run (fastpaths.onednn)."""
    x, weight = torch.randn(n, n), torch.randn(n, n)
    seconds = median_seconds(lambda: onednn.linear(x, weight), torch.device(devices.CPU), warmup=2, repeats=repeats)
    return 2 * n**3 / seconds


def measure_steps(
    steps: list[Callable[[], object]], device: torch.device, dtype: torch.dtype, repeats: int
) -> tuple[list[int], list[list[float]], float, float | None]:
    """FLOPs of one call of each step, each step's seconds round by round, and the median matmul rate beside them;
    on a CPU whose linear layers run on oneDNN, oneDNN's median rate too (else None).

    Each step runs once (allocations, state set-up), once under the FLOP counter and once more to warm up; then
    one sample of each step and of the ceilings is taken per round, so a change in the machine's load reaches every
    row and the ceilings alike. 2048^3 saturates a CPU; a GPU needs a larger product to reach its rate.
    """
    size = 2048 if device.type == devices.CPU else 8192
    with_onednn = device.type == devices.CPU and dtype == torch.float32 and onednn.on()
    flops = []
    for step in steps:
        step()
        flops.append(count_flops(step))
        step()
    samples: list[list[float]] = [[] for _ in steps]
    rates, onednn_rates = [], []
    for _ in range(repeats):
        for step, times in zip(steps, samples, strict=True):
            times.append(median_seconds(step, device, warmup=0, repeats=1))
        rates.append(matmul_flops_per_sec(device, n=size, dtype=dtype, repeats=3))
        if with_onednn:
            onednn_rates.append(onednn_flops_per_sec(n=size, repeats=3))
    return flops, samples, statistics.median(rates), statistics.median(onednn_rates) if onednn_rates else None


def measure_side_by_side(
    steps: list[Callable[[], object]], device: torch.device, dtype: torch.dtype, repeats: int, batch: int
) -> list[dict[str, Any]]:
    """The rate fields of each step (step_rates), timed in alternation with the matmul ceiling (measure_steps).

    With two steps, the first is measured beside the second (a reference): its `ratio` is its samples/s over the
    second's (also the ratio of tokens/s at one sequence length), the median of the rounds' ratios, each of two
    steps timed back to back; None on every other row. A shared machine's slow spells last tens of seconds (README,
    Performance): a spell over a few rounds moves each row's median, which may then catch it in one row and not the
    other, while a round's two steps share it.
    """
    flops, samples, ceiling, onednn_ceiling = measure_steps(steps, device, dtype, repeats)
    rates: list[dict[str, Any]] = [
        {**step_rates(batch, f, statistics.median(times), ceiling, onednn_ceiling), "ratio": None}
        for f, times in zip(flops, samples, strict=True)
    ]
    if len(rates) == 2:
        rates[0]["ratio"] = statistics.median(ref / own for own, ref in zip(*samples, strict=True))
    return rates


def compiled_as_run(trainer: Any, mode: str) -> str:
    """How a Trainer's step ran: the training.compile mode asked for, or "off" where its plan stayed eager or a
    region's compilation failed (and it fell back to eager)."""
    failed = any(getattr(getattr(trainer.model, name), "failed", None) for name in trainer.compiled)
    return mode if trainer.compiled and not failed else "off"


def step_rates(
    batch: int, flops: float, seconds: float, ceiling: float, onednn_ceiling: float | None = None
) -> dict[str, float | None]:
    """The rate fields every bench row shares, from one step's FLOPs and median seconds and the matmul ceiling.

    On a CPU the ceiling is torch.mm's rate (MKL's, what the reference's products run on); oneDNN's, which raytrm's
    linear layers run on and which is faster on some CPUs, is beside it where measured.
    """
    return {
        "step_seconds": seconds,
        "samples_per_sec": batch / seconds,
        "gflop_per_step": flops / 1e9,
        "gflops": flops / seconds / 1e9,
        "matmul_gflops": ceiling / 1e9,
        "fraction_of_matmul": flops / seconds / ceiling,
        "onednn_gflops": onednn_ceiling / 1e9 if onednn_ceiling else None,
        "fraction_of_onednn": flops / seconds / onednn_ceiling if onednn_ceiling else None,
    }


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of the matrix products, convolutions and attention one call of fn performs, counted by torch.

    The call runs eagerly: compiled code would not be seen by the counter, and compiling under it would trace a
    second graph for the counter alone.
    """
    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def onednn_columns(row: Any) -> str:
    """A row's oneDNN ceiling and its fraction of it, as two table columns (blank where not measured)."""
    if row.onednn_gflops is None:
        return f"{'':>8} {'':>8}"
    return f"{row.onednn_gflops:>8.1f} {row.fraction_of_onednn:>8.2f}"
