"""The attention's fused qkv projection with RoPE in its epilogue, on Hopper GPUs (CUDA C++, csrc/rotary_qkv.cu).

qkv = x @ w^T with q and k rotated by position as Triton's RoPE operator rotates them, to the bits of cuBLAS's product
followed by that operator, so that Triton's attention kernels take q and k as they are (rope_attention's `rotated`)
where they would otherwise rotate them on the way in, a head at a time. It serves the operation attention.

`attention` is the projection and the attention as one operator, differentiable through x and w: its backward runs
the attention's backward kernel (q and k as the forward took them, their gradients rotated back, so the gradient of
the projection before its rotation) and then a Linear's products for x's and w's gradients.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from raytrm.fastpaths import triton
from raytrm.fastpaths.device import aligned, rope_tables_fit
from raytrm.fastpaths.hopper import library
from raytrm.fastpaths.hopper.gated import kernel_order
from raytrm.fastpaths.hopper.library import INNER

#: The kernel's heads (q's and k's column d turns with d + HEAD / 2) and the most positions its tables hold.
HEAD = 64
MAX_POSITIONS = 112
#: Tests and A/B runs turn this off: the attention then rotates q and k itself, after a plain projection.
ENABLED = True


def attention_why_not(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, causal: bool = False
) -> str | None:
    """The operation attention's, for x [B, L, 512], the projection's weight w [3 * 512, 512] in x's dtype and the
    fp32 rotate-half tables cos and sin: heads of 64, at most 112 positions, self-attention over the whole sequence
    where Triton's attention kernels run (x and qkv alike in what they check) and the library takes x; and ENABLED."""
    if not ENABLED:
        return "turned off (hopper.rotary_qkv.ENABLED)"
    if x.dim() != 3 or x.shape[-1] != INNER or tuple(w.shape) != (3 * INNER, INNER) or heads * HEAD != INNER:
        return "not a projection of 512 to 8 heads of 64"
    if x.shape[1] > MAX_POSITIONS:
        return "more than 112 positions"
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape[-1] != HEAD:
        return "the RoPE tables are not fp32 for heads of 64"
    if not rope_tables_fit(x, cos, sin):
        return "the RoPE tables do not fit"
    if why := triton.attention_kernels_why_not(x, HEAD, causal):
        return "Triton's attention: " + why
    return library.takes_why_not(x)


def _launch(x: torch.Tensor, w_ordered: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The kernel over x [B, L, 512] and w [N, 512] in the kernel's order (kernel_order): qkv [B, L, N], fresh, q and k
    rotated."""
    B, L = x.shape[:2]
    x, w_ordered = aligned(x.contiguous()), aligned(w_ordered.contiguous())  # TMA copies start on 16 bytes
    qkv = x.new_empty(B, L, w_ordered.shape[0])
    library.run("raytrm_rotary_qkv", "rotary qkv projection", (x, w_ordered, qkv, cos, sin), B * L, qkv.shape[-1],
                L, cos.stride(0))  # fmt: skip
    return qkv


# Opaque operators: the projection alone (the rounds without a gradient), and the projection with the attention,
# differentiable through x and w (w_ordered, w in the kernel's order, comes from the caller's graph).
@torch.library.custom_op("raytrm::rotary_qkv", mutates_args=())
def _rotary_qkv_op(x: torch.Tensor, w_ordered: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(x, w_ordered, cos, sin)


@_rotary_qkv_op.register_fake
def _(x: torch.Tensor, w_ordered: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w_ordered.shape[0])


@torch.library.custom_op("raytrm::rotary_qkv_attention", mutates_args=())
def _attention_op(
    x: torch.Tensor, w: torch.Tensor, w_ordered: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = _launch(x, w_ordered, cos, sin)
    out, lse = torch.ops.raytrm.rope_attention(qkv, cos, sin, heads, True)
    return out, lse, qkv


@_attention_op.register_fake
def _(
    x: torch.Tensor, w: torch.Tensor, w_ordered: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.raytrm.rope_attention(x.new_empty(*x.shape[:-1], w.shape[0]), cos, sin, heads, True)
    return out, lse, x.new_empty(*x.shape[:-1], w.shape[0])


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    x, w, _, cos, sin, heads = inputs
    out, lse, qkv = output
    ctx.save_for_backward(x, w, cos, sin, out, lse, qkv)
    ctx.heads = heads
    ctx.mark_non_differentiable(lse, qkv)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor, *_: object) -> tuple:
    """x's and w's gradients: the attention's backward kernel gives the projection's (before its rotation), then the
    products a Linear's backward runs (cuBLASLt's operator), so that they have its bits: w's as the transpose of
    x^T @ grad."""
    x, w, cos, sin, out, lse, qkv = ctx.saved_tensors
    grad_qkv = torch.ops.raytrm.rope_attention_backward(qkv, cos, sin, out, lse, grad.contiguous(), ctx.heads, True)
    grad_qkv, rows = grad_qkv.view(-1, qkv.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_x = torch.ops.raytrm.mm(grad_qkv, w).view(x.shape)
    return grad_x, torch.ops.raytrm.mm(rows.t(), grad_qkv).t(), None, None, None, None


torch.library.register_autograd("raytrm::rotary_qkv_attention", _backward, setup_context=_setup)


def _projection_flops(x_shape: torch.Size, w_shape: torch.Size) -> int:
    return 2 * x_shape[0] * x_shape[1] * x_shape[2] * w_shape[0]


@register_flop_formula(torch.ops.raytrm.rotary_qkv)
def _(x_shape: torch.Size, w_shape: torch.Size, *args: object, **kwargs: object) -> int:
    return _projection_flops(x_shape, w_shape)


@register_flop_formula(torch.ops.raytrm.rotary_qkv_attention)
def _(x_shape: torch.Size, w_shape: torch.Size, *args: object, **kwargs: object) -> int:
    # The projection's and the attention's two products a head, as torch counts SDPA's.
    B, L, _ = x_shape
    return _projection_flops(x_shape, w_shape) + 2 * 2 * B * L * L * (w_shape[0] // 3)


def attention(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, causal: bool = False
) -> torch.Tensor:
    """Self-attention over qkv = x @ w^T with q and k rotated by position ([B, L, 512], the heads side by side, as
    Triton's rope_attention gives it), the rotation in the projection's epilogue; differentiable through x and w
    where grad is enabled. The operation attention, where attention_why_not(...) is None (never causal)."""
    # In the caller's graph: under torch.compile inductor moves the rows in the kernel that casts w.
    w_ordered = kernel_order(w)
    if torch.is_grad_enabled():
        return torch.ops.raytrm.rotary_qkv_attention(x, w, w_ordered, cos, sin, heads)[0]
    qkv = torch.ops.raytrm.rotary_qkv(x, w_ordered, cos, sin)
    return triton.rope_attention(qkv, cos, sin, heads, rotated=True)
