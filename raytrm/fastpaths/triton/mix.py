"""TRM-MLP's position mixing and the residual norm after it in one Triton kernel (torch.ops.raytrm.mix_positions_norm).

TRM-MLP mixes the positions of every (batch row, feature) column with a SwiGLU, adds the column back and normalises
it over positions. Done as separate operations, the gate/up projection writes a [2 * inner, columns] tensor, 8 times
the size of the states, which the gate reads back: those bytes, not the products, bound the step on a GPU. A program
here takes a block of columns through the whole map in registers and on-chip memory, so it reads the states once and
writes the result once. Each product accumulates in fp32 and is rounded to the states' dtype where the plain formula
rounds it.
"""

import torch
import triton
import triton.language as tl
from torch.utils.flop_counter import register_flop_formula

from raytrm.fastpaths.triton.common import INTERPRETED, add_rms_norm, gated, operand, rounded

# The four fastest tilings measured at Sudoku's shape. They differ only in columns per program, warps and pipeline
# stages, which leave the order of every sum alone, so a run's numbers do not depend on the autotuner's pick.
_CONFIGS = [
    triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
    for n, w, s in ((128, 8, 4), (64, 4, 2), (128, 8, 2), (128, 8, 3))
]
#: Inner rows per step of the kernel's loop: fixed, since it sets the order of the second product's sum.
BLOCK_I = 64


@triton.autotune(configs=_CONFIGS[1:2] if INTERPRETED else _CONFIGS, key=["N", "L", "I"])
@triton.jit
def mix_positions_norm_kernel(
    x_ptr,
    w_gate_up_t_ptr,
    w_down_t_ptr,
    y_ptr,
    N,
    L,
    I,  # noqa: E741 (the SwiGLU's inner width)
    eps,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """y = rms_norm(x + w_down @ (silu(gate) * up), over rows), [gate; up] = w_gate_up @ x, for a block of columns.

    x and y are [L, N]; the weights come transposed and zero-padded to BLOCK_L positions: w_gate_up_t [BLOCK_L, 2I]
    and w_down_t [I, BLOCK_L]. A block of columns is the rows of the products ([BLOCK_N, BLOCK_L] @
    [BLOCK_L, BLOCK_I], then [BLOCK_N, BLOCK_I] @ [BLOCK_I, BLOCK_L]), the long side the tensor cores want.
    """
    dtype = y_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_L)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (cols < N)[:, None] & (rows < L)[None, :]
    x = tl.load(x_ptr + rows[None, :] * N + cols[:, None], mask=mask, other=0.0)  # [BLOCK_N, BLOCK_L]
    x_operand = operand(x, INTERPRETED)
    acc = tl.zeros((BLOCK_N, BLOCK_L), dtype=tl.float32)
    inner = tl.arange(0, BLOCK_I)
    for start in range(0, I, BLOCK_I):
        k = start + inner
        w_gate = tl.load(w_gate_up_t_ptr + rows[:, None] * (2 * I) + k[None, :])  # [BLOCK_L, BLOCK_I]
        w_up = tl.load(w_gate_up_t_ptr + rows[:, None] * (2 * I) + (k + I)[None, :])
        w_down = tl.load(w_down_t_ptr + k[:, None] * BLOCK_L + rows[None, :])  # [BLOCK_I, BLOCK_L]
        # Rounded where the plain formula rounds: the projection, then the gate (_gated).
        gate = rounded(tl.dot(x_operand, operand(w_gate, INTERPRETED)), dtype, INTERPRETED)
        up = rounded(tl.dot(x_operand, operand(w_up, INTERPRETED)), dtype, INTERPRETED)
        h = gated(gate, up, dtype, INTERPRETED).to(dtype)
        acc = tl.dot(operand(h, INTERPRETED), operand(w_down, INTERPRETED), acc)
    # The residual adds in the states' dtype; the norm over positions accumulates in fp32.
    y = add_rms_norm(x.to(tl.float32), rounded(acc, dtype, INTERPRETED), L, eps, dtype, INTERPRETED).to(dtype)
    tl.store(y_ptr + rows[None, :] * N + cols[:, None], y, mask=mask)


def padded_weights(w_gate_up: torch.Tensor, w_down: torch.Tensor, block_l: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's weights: transposed and zero-padded to block_l positions, so it loads whole tiles (300 KB at
    Sudoku's shape): w_gate_up_t [block_l, 2 * inner] and w_down_t [inner, block_l]."""
    L, inner = w_down.shape
    w_gate_up_t = w_gate_up.new_zeros(block_l, 2 * inner)
    w_gate_up_t[:L] = w_gate_up.t()
    w_down_t = w_down.new_zeros(inner, block_l)
    w_down_t[:, :L] = w_down.t()
    return w_gate_up_t, w_down_t


@torch.library.triton_op("raytrm::mix_positions_norm", mutates_args=())
def mix_positions_norm_op(
    cols: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float
) -> torch.Tensor:
    L, N = cols.shape
    inner = w_down.shape[1]
    block_l = max(16, triton.next_power_of_2(L))
    w_gate_up_t, w_down_t = padded_weights(w_gate_up, w_down, block_l)
    y = torch.empty_like(cols)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    torch.library.wrap_triton(mix_positions_norm_kernel)[grid](
        cols, w_gate_up_t, w_down_t, y, N, L, inner, eps, BLOCK_L=block_l, BLOCK_I=BLOCK_I, INTERPRETED=INTERPRETED
    )
    return y


@register_flop_formula(torch.ops.raytrm.mix_positions_norm)
def mix_positions_norm_flops(cols_shape, w_gate_up_shape, w_down_shape, *args: object, **kwargs: object) -> int:
    """The two products' FLOPs, at the unpadded shape: what the plain formulas' matrix products count."""
    L, N = cols_shape
    return 2 * N * L * (w_gate_up_shape[0] + w_down_shape[1])
