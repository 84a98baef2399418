"""`python -m benchmarks mix`: TRM-MLP's position mixing, one call, each way raytrm can run it, timed in alternation.

The mixing (a SwiGLU across positions, the residual add and the norm over positions) is TRM-MLP's heaviest
memory traffic. Rows: the plain formulas eager and compiled by inductor (where this device compiles), and the fused
Triton kernel eager and inside a compiled graph (where it runs: half precision on CUDA with Triton). No gradient is
recorded, as in TRM's no-grad rounds. On a CPU, a row for the plain formulas a cache-sized block of columns at a
time, as raytrm runs them there. Rates count the two products' FLOPs at the unpadded shape.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from benchmarks.timing import median_seconds
from raytrm import fastpaths
from raytrm.fastpaths import cpu, triton
from raytrm.hardware import device as devices
from raytrm.models.layers import SwiGLU
from raytrm.models.ops import cast
from raytrm.train.compile import plan_compile

#: Sudoku's positions: 81 cells and the 16 puzzle-embedding slots.
SUDOKU_POSITIONS = 97
EPS = 1e-5


@dataclass
class MixRow:
    impl: str
    positions: int
    columns: int
    device: str
    dtype: str
    ms: float  # median milliseconds per call
    tflops: float  # the products' FLOPs per second, 1e12
    ratio: float  # the plain eager row's time over this row's


def implementations(mlp: SwiGLU, cols: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The ways this device runs the mixing of cols, by row name."""
    w_gate_up, w_down = cast(mlp.gate_up_proj.weight, cols.dtype), cast(mlp.down_proj.weight, cols.dtype)
    formula = fastpaths.formula("mix_positions_norm")

    def plain(x: torch.Tensor) -> torch.Tensor:
        return formula(x, cast(mlp.gate_up_proj.weight, x.dtype), cast(mlp.down_proj.weight, x.dtype), EPS)

    def fused(x: torch.Tensor) -> torch.Tensor:
        return triton.mix_positions_norm(x, w_gate_up, w_down, EPS)

    ways: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"plain": plain}
    if cols.device.type == devices.CPU:
        ways["column blocks"] = lambda x: cpu.mix_in_blocks(x, w_gate_up, w_down, EPS)
    compiles = plan_compile("on", cols.device.type).enabled
    if compiles:
        ways["plain compiled"] = torch.compile(plain)
    triton.load()
    with torch.no_grad():
        if triton.mix_why_not(cols, w_gate_up, w_down, EPS) is None:
            ways["kernel"] = fused
            if compiles:
                ways["kernel compiled"] = torch.compile(fused)
    return {name: (lambda f=f: f(cols)) for name, f in ways.items()}


def bench_mix(
    batch: int, hidden: int, device: str, dtype: str, repeats: int, positions: int = SUDOKU_POSITIONS
) -> list[MixRow]:
    """One row per implementation, at the states of `batch` examples of width `hidden` (batch * hidden columns)."""
    dev = devices.pick_device(device)
    torch_dtype = devices.pick_dtype(dev, dtype)
    torch.manual_seed(0)
    mlp = SwiGLU(positions, 4.0).to(dev)
    cols = torch.randn(positions, batch * hidden, device=dev).to(torch_dtype)
    inner = mlp.down_proj.weight.shape[1]
    flops = 2 * cols.shape[1] * (positions * 2 * inner + inner * positions)
    with torch.no_grad():
        ways = implementations(mlp, cols)
        for run in ways.values():  # compile, autotune and warm up
            for _ in range(3):
                run()
        samples: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(repeats):
            for name, run in ways.items():
                samples[name].append(median_seconds(run, dev, warmup=0, repeats=1))
    seconds = {name: statistics.median(times) for name, times in samples.items()}
    return [
        MixRow(
            name,
            positions,
            cols.shape[1],
            dev.type,
            str(torch_dtype).removeprefix("torch."),
            s * 1e3,
            flops / s / 1e12,
            seconds["plain"] / s,
        )
        for name, s in seconds.items()
    ]


def format_rows(rows: list[MixRow]) -> str:
    lines = [
        f"{'impl':<16} {'positions':>9} {'columns':>9} {'device':>6} {'dtype':>8} {'ms':>8} {'TFLOP/s':>8} {'ratio':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r.impl:<16} {r.positions:>9} {r.columns:>9} {r.device:>6} {r.dtype:>8} {r.ms:>8.3f} {r.tflops:>8.2f} "
            f"{r.ratio:>6.2f}"
        )
    return "\n".join(lines)


def as_json(rows: list[MixRow]) -> list[dict]:
    return [asdict(r) for r in rows]
