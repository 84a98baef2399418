"""TRM-MLP's position mixing on a CPU, a cache-sized block of columns at a time (plain PyTorch).

The operation mix_positions_norm mixes and normalises every column alone, so running its plain formula on blocks of
columns is the whole-matrix formula; only the BLAS may sum a narrow block's products in another order, and the
weights' gradients add up block by block (within fp32 rounding). What changes is that a block's [2 * inner, block]
gate/up product stays in the CPU's cache for the gate, the second product and the norm, forward and backward, where
the whole one (32 MB at Sudoku's 97 positions, batch 16, hidden 512) does not. Eager only: compiled, inductor fuses
the whole formula.
"""

from __future__ import annotations

import torch

from raytrm.fastpaths import registry
from raytrm.fastpaths.registry import Backend
from raytrm.hardware import device as devices

#: Columns a block: a block's activations stay in a core's cache at TRM's widths (the position-mixing row of
#: docs/performance.md chose it).
COLUMN_BLOCK = 1024


def mix_why_not(cols: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float) -> str | None:
    """The operation mix_positions_norm's: on a CPU, eager."""
    if cols.device.type != devices.CPU:
        return "not on a CPU"
    if torch.compiler.is_compiling():
        return "compiled (inductor fuses the whole formula)"
    return None


def mix_in_blocks(
    cols: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, block: int = COLUMN_BLOCK
) -> torch.Tensor:
    """The plain formula of mix_positions_norm on cols [positions, N], `block` columns at a time."""
    formula = registry.formula("mix_positions_norm")
    if cols.shape[1] <= block:
        return formula(cols, w_gate_up, w_down, eps)
    return torch.cat([formula(part, w_gate_up, w_down, eps) for part in cols.split(block, dim=1)], dim=1)


BACKENDS = (Backend("mix_positions_norm", "cpu-blocks", mix_why_not, mix_in_blocks),)
