"""The SwiGLU gate, silu(gate) * up, as a Triton operator with a hand-written backward (torch.ops.raytrm.swiglu_gate).

It reads the projection once and writes the product once; its backward reads the projection and the gradient once
and writes both halves' gradients in place, where the plain formulas' backward, fused by inductor into one kernel
that writes a concatenation, runs at half the memory rate. A triton_op: torch.compile traces its kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raytrm.fastpaths.triton.common import INTERPRETED, gate_gradients, gated


@triton.jit
def _gate_tile(pid, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program pid's tile of a [R, C] gate: its rows (int64), its columns, and the mask of those inside."""
    column_blocks = tl.cdiv(C, BLOCK_C)
    r = (pid // column_blocks).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (pid % column_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    return r, c, (r < R)[:, None] & (c < C)[None, :]


# Tiles of 16 rows x 256 columns: the fastest of seven shapes measured at both of TRM's gates.
GATE_BLOCK_R, GATE_BLOCK_C, GATE_WARPS = 16, 256, 4


@triton.jit
def swiglu_gate_kernel(
    gate_up_ptr,
    out_ptr,
    R,
    C,
    row_stride,
    up_offset,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """out[r, c] = silu(gate) * up, gate at gate_up[r * row_stride + c] and up up_offset after it; out is [R, C].

    One program per tile of BLOCK_R rows and BLOCK_C columns. In fp32, rounded where the plain formula rounds:
    silu(gate), then the product.
    """
    dtype = out_ptr.dtype.element_ty
    r, c, mask = _gate_tile(tl.program_id(0), R, C, BLOCK_R, BLOCK_C)
    offset = r[:, None] * row_stride + c[None, :]
    gate = tl.load(gate_up_ptr + offset, mask=mask).to(tl.float32)
    up = tl.load(gate_up_ptr + offset + up_offset, mask=mask).to(tl.float32)
    tl.store(out_ptr + r[:, None] * C + c[None, :], gated(gate, up, dtype, INTERPRETED).to(dtype), mask=mask)


@triton.jit
def swiglu_gate_backward_kernel(
    gate_up_ptr,
    grad_ptr,
    grad_gate_up_ptr,
    R,
    C,
    row_stride,
    up_offset,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The gradient of swiglu_gate_kernel's output with respect to gate_up, laid out as gate_up (same tiles; the
    formulas are gate_gradients')."""
    dtype = grad_gate_up_ptr.dtype.element_ty
    r, c, mask = _gate_tile(tl.program_id(0), R, C, BLOCK_R, BLOCK_C)
    offset = r[:, None] * row_stride + c[None, :]
    gate = tl.load(gate_up_ptr + offset, mask=mask).to(tl.float32)
    up = tl.load(gate_up_ptr + offset + up_offset, mask=mask).to(tl.float32)
    g = tl.load(grad_ptr + r[:, None] * C + c[None, :], mask=mask).to(tl.float32)
    grad_gate, grad_up = gate_gradients(gate, up, g, dtype, INTERPRETED)
    tl.store(grad_gate_up_ptr + offset, grad_gate.to(dtype), mask=mask)
    tl.store(grad_gate_up_ptr + offset + up_offset, grad_up.to(dtype), mask=mask)


def _gate_layout(gate_up: torch.Tensor, dim: int) -> tuple[int, int, int, int, tuple[int, ...]]:
    """(rows, columns, row stride, offset of up from gate, output shape) of a gate split along dim (first or last).

    Split along the last dimension, a row is one vector: gate its first half, up its second. Split along the first,
    a row is one of the inner units: its gate over every column, and its up `inner` rows further.
    """
    inner = gate_up.shape[dim] // 2
    if dim % gate_up.dim() == gate_up.dim() - 1:
        return gate_up.numel() // (2 * inner), inner, 2 * inner, inner, (*gate_up.shape[:-1], inner)
    columns = gate_up.numel() // (2 * inner)
    return inner, columns, columns, inner * columns, (inner, *gate_up.shape[1:])


def gate_launch(kernel: object, gate_up: torch.Tensor, dim: int, *tensors: torch.Tensor, traced: bool = True) -> None:
    """Run a gate kernel over gate_up (split along dim) in tiles; tensors are its other tensor arguments.

    traced: launched from a triton_op, through wrap_triton, so that torch.compile sees the kernel. Inside an opaque
    custom_op it is launched directly: wrap_triton's dispatch there costs the host more than the kernel takes.
    """
    rows, columns, row_stride, up_offset, _ = _gate_layout(gate_up, dim)
    tiles = triton.cdiv(rows, GATE_BLOCK_R) * triton.cdiv(columns, GATE_BLOCK_C)
    (torch.library.wrap_triton(kernel) if traced else kernel)[(tiles,)](
        gate_up, *tensors, rows, columns, row_stride, up_offset, BLOCK_R=GATE_BLOCK_R, BLOCK_C=GATE_BLOCK_C,
        INTERPRETED=INTERPRETED, num_warps=GATE_WARPS,
    )  # fmt: skip


@torch.library.triton_op("raytrm::swiglu_gate", mutates_args=())
def swiglu_gate_op(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    out = gate_up.new_empty(_gate_layout(gate_up, dim)[4])
    gate_launch(swiglu_gate_kernel, gate_up, dim, out)
    return out


@torch.library.triton_op("raytrm::swiglu_gate_backward", mutates_args=())
def swiglu_gate_backward_op(gate_up: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
    grad_gate_up = torch.empty_like(gate_up)
    gate_launch(swiglu_gate_backward_kernel, gate_up, dim, grad, grad_gate_up)
    return grad_gate_up


def gate_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    gate_up, dim = inputs
    ctx.save_for_backward(gate_up)
    ctx.dim = dim


def gate_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    (gate_up,) = ctx.saved_tensors
    return torch.ops.raytrm.swiglu_gate_backward(gate_up, grad.contiguous(), ctx.dim), None


torch.library.register_autograd("raytrm::swiglu_gate", gate_backward, setup_context=gate_setup)
