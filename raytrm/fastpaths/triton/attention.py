"""Self-attention with RoPE over the fused qkv projection as a Triton operator (torch.ops.raytrm.rope_attention).

For sequences of at most 128 positions (Sudoku's 97): a program takes a head's whole sequence on chip, rotating q and
k as it loads them from the fused projection, and writes the output where the output projection reads it; its
backward recomputes the probabilities from the forward's log-sum-exp and writes qkv's gradient, q's and k's rotated
back, in one pass. A program per multiprocessor takes one head after another, the next heads' loads in flight while
it computes one. Loads and stores are TMA copies through tensor descriptors (Hopper and later). It replaces RoPE's
passes and cuDNN's attention in every round, compiled or not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.flop_counter import register_flop_formula

from raytrm.fastpaths.device import aligned, multiprocessors
from raytrm.fastpaths.triton.common import INTERPRETED, operand, rotated_back, rounded

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.3: these kernels are never asked for
    TensorDescriptor = None

#: How the attention kernels may run: (programs per multiprocessor, warps a program, pipeline stages), the autotuner
#: timing them at a shape's first call and keeping the fastest (they give the same bits). A program takes a head at a
#: time, its whole sequence on chip, and then the head num_programs further on, with the loads of its next heads in
#: flight while it computes one; the RoPE tables are loaded once a program. The backward works key-major (its scores
#: transposed, keys as rows): the transposed probabilities and score gradients, the first operands of v's and k's
#: gradients, are then computed where they are used, and only the score gradients go through shared memory
#: transposed (for q's).
ATTENTION_FORWARD = ((1, 8, 3), (2, 4, 2))
ATTENTION_BACKWARD = ((1, 8, 2),)


def _launches(launches: tuple[tuple[int, int, int], ...]) -> list:
    """The autotuner's configs for the attention kernels' launches (the first alone under the interpreter)."""
    return [
        triton.Config({"PROGRAMS_PER_SM": programs, "STAGES": stages}, num_warps=warps)
        for programs, warps, stages in (launches[:1] if INTERPRETED else launches)
    ]


@triton.jit
def _rotated(x1, x2, c, s, INTERPRETED: tl.constexpr):
    """The halves of x rotated by position, (x1 c - x2 s, x2 c + x1 s), in fp32, each rounded once to x's dtype
    (as rope_qkv_kernel's) and made a dot operand."""
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    r1 = rounded(a * c - b * s, dtype, INTERPRETED).to(dtype)
    r2 = rounded(b * c + a * s, dtype, INTERPRETED).to(dtype)
    return operand(r1, INTERPRETED), operand(r2, INTERPRETED)


@triton.jit
def _tables(cos_ptr, sin_ptr, L, table_stride, BLOCK_L: tl.constexpr, HALF: tl.constexpr):
    """The first halves of the rotate-half tables for positions [0, BLOCK_L) (zero from L), fp32: c and s."""
    positions = tl.arange(0, BLOCK_L)[:, None]
    table = positions * table_stride + tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + table, mask=positions < L, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + table, mask=positions < L, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _tile(desc, batch, column, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """A [ROWS, COLUMNS] tile of a [batch, L, width] tensor's descriptor (block [1, ROWS, COLUMNS]): one batch row's
    positions from 0 (zero from L) and the columns from column on."""
    return desc.load([batch, 0, column]).reshape(ROWS, COLUMNS)


@triton.jit
def _put(desc, batch, column, x):
    """Store the tile x at _tile's place (the positions from L are left out)."""
    desc.store([batch, 0, column], x.reshape(1, x.shape[0], x.shape[1]))


@triton.jit
def _put_rotated_back(desc, batch, column, g1, g2, c, s, INTERPRETED: tl.constexpr):
    """rotated_back's halves stored at column and HALF after it, through a descriptor of block [1, BLOCK_L, HALF]."""
    r1, r2 = rotated_back(g1, g2, c, s, desc.dtype, INTERPRETED)
    _put(desc, batch, column, r1)
    _put(desc, batch, column + g1.shape[1], r2)


@triton.jit
def _exponent(scores, offset, scale):
    """The raw scores in log2 units less offset (already in log2 units, broadcast over them: the rows' maxima or
    log-sum-exps): one fused multiply-add an element, faster than applying the scale first and the offset after."""
    return scores * (scale * 1.4426950408889634) - offset


@triton.jit
def _halves(qk, batch, column, c, s, BLOCK_L: tl.constexpr, HALF: tl.constexpr, ROTATED: tl.constexpr,
            INTERPRETED: tl.constexpr):  # fmt: skip
    """The halves of q's or k's head at column (dot operands): rotated by position with the tables' halves c and s,
    or as they are where they come ROTATED (the projection rotated them)."""
    x1, x2 = _tile(qk, batch, column, BLOCK_L, HALF), _tile(qk, batch, column + HALF, BLOCK_L, HALF)
    if ROTATED:
        return operand(x1, INTERPRETED), operand(x2, INTERPRETED)
    return _rotated(x1, x2, c, s, INTERPRETED)


@triton.jit
def _attention_head(
    head, qk, v_desc, c, s, H, BLOCK_L: tl.constexpr, HALF: tl.constexpr, ROTATED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """A head of qkv [batch, L, 3 * H * 2 * HALF] (its index batch * H + head), on chip, through descriptors of
    blocks [1, BLOCK_L, HALF] (qk) and [1, BLOCK_L, 2 * HALF] (v_desc): its batch row and first column, q's and k's
    halves rotated by position (_halves), and v."""
    batch = head // H
    column = (head % H) * (2 * HALF)
    width = H * 2 * HALF
    q1, q2 = _halves(qk, batch, column, c, s, BLOCK_L, HALF, ROTATED, INTERPRETED)
    k1, k2 = _halves(qk, batch, width + column, c, s, BLOCK_L, HALF, ROTATED, INTERPRETED)
    v = _tile(v_desc, batch, 2 * width + column, BLOCK_L, 2 * HALF)
    return batch, column, q1, q2, k1, k2, v


@triton.autotune(configs=_launches(ATTENTION_FORWARD), key=["heads", "L", "H", "ROTATED"])
@triton.jit
def rope_attention_kernel(
    qk, v_desc, out_desc, cos_ptr, sin_ptr, lse_ptr, heads, L, H, table_stride, scale, BLOCK_L: tl.constexpr,
    HALF: tl.constexpr, STAGES: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr, ROTATED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """out [batch, L, H * 2 * HALF] = softmax(q k^T * scale) v, a head at a time (heads = batch * H of them, the
    program's every num_programs-th, the loads of the next STAGES - 1 in flight), the whole sequence (L <= BLOCK_L)
    on chip, q and k rotated by position on the way in; lse [batch * H, BLOCK_L] the rows' log2-sum-exp2 of the
    scores in log2 units, for the backward. The probabilities are rounded to qkv's dtype for the second product (as
    flash attention's kernels do), and their sum divides its fp32 result. qk and v_desc are qkv's descriptors (see
    _attention_head), out_desc out's, of block [1, BLOCK_L, 2 * HALF]. ROTATED: q and k come rotated (the projection
    rotated them: raytrm.fastpaths.hopper.rotary_qkv). PROGRAMS_PER_SM sets the launch's grid (attention_launch), not
    the program."""
    c, s = _tables(cos_ptr, sin_ptr, L, table_stride, BLOCK_L, HALF)
    positions = tl.arange(0, BLOCK_L)
    for head in tl.range(tl.program_id(0), heads, tl.num_programs(0), num_stages=STAGES):
        batch, column, q1, q2, k1, k2, v = _attention_head(
            head, qk, v_desc, c, s, H, BLOCK_L, HALF, ROTATED, INTERPRETED
        )
        dtype = v.dtype
        scores = tl.dot(q2, tl.trans(k2), tl.dot(q1, tl.trans(k1)))
        scores = tl.where((positions < L)[None, :], scores, float("-inf"))  # padded keys
        top = tl.max(scores, 1) * (scale * 1.4426950408889634)  # the scale is positive: the same maximum
        p = tl.exp2(_exponent(scores, top[:, None], scale))
        total = tl.sum(p, 1)
        p = operand(rounded(p, dtype, INTERPRETED).to(dtype), INTERPRETED)
        out = tl.dot(p, operand(v, INTERPRETED)) / total[:, None]
        _put(out_desc, batch, column, rounded(out, dtype, INTERPRETED).to(dtype))
        tl.store(lse_ptr + head * BLOCK_L + positions, top + tl.log2(total))


@triton.autotune(configs=_launches(ATTENTION_BACKWARD), key=["heads", "L", "H", "ROTATED"])
@triton.jit
def rope_attention_backward_kernel(
    qk, v_desc, out_desc, grad_desc, grad_qk, grad_v_desc, cos_ptr, sin_ptr, lse_ptr, heads, L, H, table_stride,
    scale, BLOCK_L: tl.constexpr, HALF: tl.constexpr, STAGES: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr,
    ROTATED: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """grad_qkv [batch, L, 3 * H * 2 * HALF] from grad, the gradient of rope_attention_kernel's out, a head at a
    time as there: the probabilities recomputed from lse, the gradients of v, of the scores and of the rotated q and
    k in fp32 (products of operands rounded to qkv's dtype), q's and k's rotated back (by -angle) and rounded
    once. Descriptors as rope_attention_kernel's: grad_qk and grad_v_desc are grad_qkv's as qk and v_desc are qkv's,
    grad_desc grad's as out_desc is out's. ROTATED: q and k come rotated, as the forward took them; their gradients
    are still rotated back, so grad_qkv is the unrotated projection's gradient."""
    c, s = _tables(cos_ptr, sin_ptr, L, table_stride, BLOCK_L, HALF)
    positions = tl.arange(0, BLOCK_L)
    width = H * 2 * HALF
    for head in tl.range(tl.program_id(0), heads, tl.num_programs(0), num_stages=STAGES):
        batch, column, q1, q2, k1, k2, v = _attention_head(
            head, qk, v_desc, c, s, H, BLOCK_L, HALF, ROTATED, INTERPRETED
        )
        dtype = v.dtype
        # Key-major: the scores transposed, [keys, queries] (padded keys at -inf), so that the transposed
        # probabilities and score gradients, the first operands of v's and k's gradients, are computed in place
        # and only the score gradients go through a transposition, for q's.
        scores_t = tl.dot(k2, tl.trans(q2), tl.dot(k1, tl.trans(q1)))
        scores_t = tl.where((positions < L)[:, None], scores_t, float("-inf"))
        out = _tile(out_desc, batch, column, BLOCK_L, 2 * HALF)
        grad = _tile(grad_desc, batch, column, BLOCK_L, 2 * HALF)
        # d softmax: p * (dp - delta), delta the queries' grad . out.
        delta = tl.sum(grad.to(tl.float32) * out.to(tl.float32), 1)
        lse = tl.load(lse_ptr + head * BLOCK_L + positions)
        p_t = tl.exp2(_exponent(scores_t, lse[None, :], scale))
        grad = operand(grad, INTERPRETED)
        # Each gradient is stored as soon as it is computed (v's, q's, then k's), so fewer values are held at once.
        grad_v = tl.dot(operand(rounded(p_t, dtype, INTERPRETED).to(dtype), INTERPRETED), grad)
        _put(grad_v_desc, batch, 2 * width + column, rounded(grad_v, dtype, INTERPRETED).to(dtype))
        dp_t = tl.dot(operand(v, INTERPRETED), tl.trans(grad))
        ds_t = operand(rounded(p_t * (dp_t - delta[None, :]), dtype, INTERPRETED).to(dtype), INTERPRETED)
        ds = tl.trans(ds_t)
        _put_rotated_back(grad_qk, batch, column, tl.dot(ds, k1) * scale, tl.dot(ds, k2) * scale, c, s, INTERPRETED)
        _put_rotated_back(
            grad_qk, batch, width + column, tl.dot(ds_t, q1) * scale, tl.dot(ds_t, q2) * scale, c, s, INTERPRETED
        )


def attention_launch(
    kernel: object, heads: int, tiles: list[tuple[torch.Tensor, str]], cos: torch.Tensor, sin: torch.Tensor,
    lse: torch.Tensor, rotated: bool,
) -> None:  # fmt: skip
    """Run an attention kernel over qkv [B, L, 3 * heads * head_dim] (tiles' first tensor; q and k in it rotated
    already where `rotated`), a head at a time in the launch its autotuner picked (programs per multiprocessor,
    warps, stages; ATTENTION_FORWARD), with SDPA's scale. tiles: the [B, L, width] tensors it reads and writes, in
    its arguments' order, each through a descriptor of a head's "half" or "head" of columns over one batch row's
    positions."""
    qkv = tiles[0][0]
    B, L, width = qkv.shape
    head_dim = width // (3 * heads)
    block_l = lse.shape[1]
    columns = {"half": head_dim // 2, "head": head_dim}
    descriptors = [TensorDescriptor.from_tensor(t, [1, block_l, columns[part]]) for t, part in tiles]
    programs = multiprocessors(qkv.device)
    grid = lambda meta: (min(B * heads, meta["PROGRAMS_PER_SM"] * programs),)  # noqa: E731
    kernel[grid](
        *descriptors, cos, sin, lse, B * heads, L, heads, cos.stride(0), head_dim**-0.5, BLOCK_L=block_l,
        HALF=head_dim // 2, ROTATED=rotated, INTERPRETED=INTERPRETED,
    )  # fmt: skip


def attention_outputs(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's output [B, L, width / 3] and its rows' log-sum-exp [B * heads, L padded], uninitialised."""
    B, L, width = qkv.shape
    lse = torch.empty(B * heads, max(16, triton.next_power_of_2(L)), dtype=torch.float32, device=qkv.device)
    return qkv.new_empty(B, L, width // 3), lse


# Opaque operators (custom_op, not triton_op): inductor recompiles a triton_op's kernels its own way, and these ran
# several times slower so.
@torch.library.custom_op("raytrm::rope_attention", mutates_args=())
def rope_attention_op(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, rotated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = attention_outputs(qkv, heads)
    qkv = aligned(qkv)
    tiles = [(qkv, "half"), (qkv, "head"), (out, "head")]
    attention_launch(rope_attention_kernel, heads, tiles, cos, sin, lse, rotated)
    return out, lse


@rope_attention_op.register_fake
def _(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, rotated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_outputs(qkv, heads)


@torch.library.custom_op("raytrm::rope_attention_backward", mutates_args=())
def rope_attention_backward_op(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grad: torch.Tensor, heads: int, rotated: bool = False,
) -> torch.Tensor:  # fmt: skip
    grad_qkv = torch.empty_like(qkv)
    qkv, out, grad = aligned(qkv), aligned(out), aligned(grad)
    tiles = [(qkv, "half"), (qkv, "head"), (out, "head"), (grad, "head"), (grad_qkv, "half"), (grad_qkv, "head")]
    attention_launch(rope_attention_backward_kernel, heads, tiles, cos, sin, lse, rotated)
    return grad_qkv


@rope_attention_backward_op.register_fake
def _(qkv: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(qkv)


def attention_flops(qkv_shape: torch.Size, products: int) -> int:
    """FLOPs of `products` products of [L, head_dim] by [head_dim, L] (or the like) a head, as torch counts
    SDPA's: two forward, five backward."""
    B, L, width = qkv_shape
    return products * 2 * B * L * L * (width // 3)


@register_flop_formula(torch.ops.raytrm.rope_attention)
def rope_attention_flops(qkv_shape, cos_shape, sin_shape, heads, *args: object, **kwargs: object) -> int:
    return attention_flops(qkv_shape, 2)


@register_flop_formula(torch.ops.raytrm.rope_attention_backward)
def rope_attention_backward_flops(qkv_shape, *args: object, **kwargs: object) -> int:
    return attention_flops(qkv_shape, 5)


def attention_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    qkv, cos, sin, heads, rotated = inputs
    out, lse = output
    ctx.save_for_backward(qkv, cos, sin, out, lse)
    ctx.heads, ctx.rotated = heads, rotated
    ctx.mark_non_differentiable(lse)


def attention_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor, _: object) -> tuple:
    if ctx.rotated:
        # Its backward kernel gives the gradient of the projection before the rotation, not of its input.
        raise RuntimeError(
            "rope_attention over a rotated projection has no gradient of its own: use "
            "raytrm.fastpaths.hopper.rotary_qkv.attention, which differentiates the projection and it as one"
        )
    qkv, cos, sin, out, lse = ctx.saved_tensors
    grad_qkv = torch.ops.raytrm.rope_attention_backward(qkv, cos, sin, out, lse, grad.contiguous(), ctx.heads)
    return grad_qkv, None, None, None, None


torch.library.register_autograd("raytrm::rope_attention", attention_backward, setup_context=attention_setup)
