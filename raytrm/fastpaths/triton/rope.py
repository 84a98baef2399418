"""RoPE on the attention's fused projection as a Triton operator (torch.ops.raytrm.rope_qkv).

It reads qkv once and writes q and k rotated and v copied; its backward writes qkv's gradient in one pass, where the
textbook formula under torch.compile takes two kernels forward and one backward, to the same bits. A triton_op:
torch.compile traces its kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raytrm.fastpaths.triton.common import INTERPRETED, rotated_back, rounded


@triton.jit
def _store_rotated_back(ptr, g1, g2, c, s, mask, HALF: tl.constexpr, INTERPRETED: tl.constexpr):
    """rotated_back's halves stored at ptr (the first half's columns) and HALF after it."""
    r1, r2 = rotated_back(g1, g2, c, s, ptr.dtype.element_ty, INTERPRETED)
    tl.store(ptr, r1, mask=mask)
    tl.store(ptr + HALF, r2, mask=mask)


#: Tokens per program of the RoPE kernels (each takes every head of one of q, k and v).
ROPE_BLOCK_T = 16


@triton.jit
def rope_qkv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    T,
    L,
    H,
    table_stride,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """q and k rotated by position, v copied, from qkv [T, 3 * H * 2 * HALF] (T = batch x L tokens) into q, k, v
    [T, H, 2 * HALF]. Program (i, part) takes BLOCK_T tokens of part 0 (q), 1 (k) or 2 (v).

    The rotation, (x1 c - x2 s, x2 c + x1 s) from the first halves of the rotate-half tables (rows table_stride
    apart), is in fp32 and rounded once, as the plain formula's.
    """
    part = tl.program_id(1)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, HALF)[None, None, :]
    mask = (t < T) & (h < H)
    src = qkv_ptr + t * (6 * H * HALF) + (part * H + h) * (2 * HALF) + d
    dst = t * (2 * H * HALF) + h * (2 * HALF) + d
    x1 = tl.load(src, mask=mask)
    x2 = tl.load(src + HALF, mask=mask)
    if part == 2:
        tl.store(v_ptr + dst, x1, mask=mask)
        tl.store(v_ptr + dst + HALF, x2, mask=mask)
    else:
        dtype = x1.dtype
        row = (t % L) * table_stride + d
        c = tl.load(cos_ptr + row, mask=mask).to(tl.float32)
        s = tl.load(sin_ptr + row, mask=mask).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        if part == 0:  # noqa: SIM108 (an if statement, as in the backward kernel)
            out = q_ptr + dst
        else:
            out = k_ptr + dst
        tl.store(out, rounded(a * c - b * s, dtype, INTERPRETED).to(dtype), mask=mask)
        tl.store(out + HALF, rounded(b * c + a * s, dtype, INTERPRETED).to(dtype), mask=mask)


@triton.jit
def rope_qkv_backward_kernel(
    grad_q_ptr,
    grad_k_ptr,
    grad_v_ptr,
    cos_ptr,
    sin_ptr,
    grad_qkv_ptr,
    T,
    L,
    H,
    table_stride,
    q_stride_b,
    q_stride_l,
    q_stride_h,
    k_stride_b,
    k_stride_l,
    k_stride_h,
    v_stride_b,
    v_stride_l,
    v_stride_h,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """grad_qkv [T, 3 * H * 2 * HALF] from the gradients of rope_qkv_kernel's q, k, v ([batch, L, H, 2 * HALF] in any
    strides with the last one 1): q's and k's rotated back (the rotation by -angle), v's copied."""
    part = tl.program_id(1)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, HALF)[None, None, :]
    mask = (t < T) & (h < H)
    batch, position = t // L, t % L
    dst = grad_qkv_ptr + t * (6 * H * HALF) + (part * H + h) * (2 * HALF) + d
    if part == 0:
        src = grad_q_ptr + batch * q_stride_b + position * q_stride_l + h * q_stride_h + d
    elif part == 1:
        src = grad_k_ptr + batch * k_stride_b + position * k_stride_l + h * k_stride_h + d
    else:
        src = grad_v_ptr + batch * v_stride_b + position * v_stride_l + h * v_stride_h + d
    g1 = tl.load(src, mask=mask)
    g2 = tl.load(src + HALF, mask=mask)
    if part == 2:
        tl.store(dst, g1, mask=mask)
        tl.store(dst + HALF, g2, mask=mask)
    else:
        row = position * table_stride + d
        c = tl.load(cos_ptr + row, mask=mask).to(tl.float32)
        s = tl.load(sin_ptr + row, mask=mask).to(tl.float32)
        _store_rotated_back(dst, g1.to(tl.float32), g2.to(tl.float32), c, s, mask, HALF, INTERPRETED)


def rope_launch(kernel: object, tokens: int, L: int, heads: int, head_dim: int, *args: object) -> None:
    """Run a RoPE kernel over tokens (batch x L) in blocks, a program per block and part (q, k, v)."""
    torch.library.wrap_triton(kernel)[(triton.cdiv(tokens, ROPE_BLOCK_T), 3)](
        *args, BLOCK_T=ROPE_BLOCK_T, BLOCK_H=triton.next_power_of_2(heads), HALF=head_dim // 2,
        INTERPRETED=INTERPRETED, num_warps=4,
    )  # fmt: skip


@torch.library.triton_op("raytrm::rope_qkv", mutates_args=())
def rope_qkv_op(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, L, width = qkv.shape
    head_dim = width // (3 * heads)
    q, k, v = (qkv.new_empty(B, L, heads, head_dim) for _ in range(3))
    rope_launch(rope_qkv_kernel, B * L, L, heads, head_dim, qkv, cos, sin, q, k, v, B * L, L, heads, cos.stride(0))
    return q, k, v


@torch.library.triton_op("raytrm::rope_qkv_backward", mutates_args=())
def rope_qkv_backward_op(
    grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    B, L, heads, head_dim = grad_q.shape
    grad_qkv = grad_q.new_empty(B, L, 3 * heads * head_dim)
    strides = [stride for g in (grad_q, grad_k, grad_v) for stride in g.stride()[:3]]
    rope_launch(
        rope_qkv_backward_kernel, B * L, L, heads, head_dim,
        grad_q, grad_k, grad_v, cos, sin, grad_qkv, B * L, L, heads, cos.stride(0), *strides,
    )  # fmt: skip
    return grad_qkv


def rope_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    _, cos, sin, _ = inputs
    ctx.save_for_backward(cos, sin)


def rope_backward(ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor) -> tuple:
    cos, sin = ctx.saved_tensors
    grads = tuple(g if g.stride(-1) == 1 else g.contiguous() for g in grads)
    return torch.ops.raytrm.rope_qkv_backward(*grads, cos, sin), None, None, None


torch.library.register_autograd("raytrm::rope_qkv", rope_backward, setup_context=rope_setup)
