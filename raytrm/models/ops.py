"""The operations raytrm's models are made of, as plain PyTorch formulas.

An operation marked `@fastpaths.op(name)` may run on a device fast path instead (raytrm.fastpaths): a call asks the
registry for a backend that serves its inputs and runs the formula here where none does, or where RAYTRM_FASTPATHS=off.
Either way the result is this formula's, within rounding. Several formulas call other named operations, each of which
may be served on its own (the SwiGLU's product, gate and down projection).

Norms, the gate and RoPE have hand-written backwards (autograd functions) where autograd's version keeps more or
passes over the activation more often; under torch.compile the textbook formula is traced instead: inductor fuses it
and derives its backward itself, and an autograd.Function would only cut the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raytrm import fastpaths
from raytrm.hardware import device as devices


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, without a call or a copy when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision tensors, the tensor's own dtype for fp32 and fp64."""
    return torch.promote_types(dtype, torch.float32)


# -- RMSNorm -----------------------------------------------------------------------------------------------------


def _rms_scale(h: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
    """1 / sqrt(mean(h^2) + eps) along dim, accumulated in fp32 (or fp64), in one pass over h where it can be.

    On a CPU, vector_norm across the outer dimension of a matrix (TRM-MLP's norm over positions) runs several times
    slower than squaring and summing, so that reduction squares first; along the last dimension vector_norm's one pass
    is the faster.
    """
    acc = _accumulation_dtype(h.dtype)
    if h.device.type == devices.CPU and dim % h.dim() != h.dim() - 1:
        squares = cast(h, acc).square().sum(dim, keepdim=True)
    else:
        squares = torch.linalg.vector_norm(h, dim=dim, keepdim=True, dtype=acc).square_()
    return squares.div_(h.shape[dim]).add_(eps).rsqrt_()


def _rms_norm_backward(g: torch.Tensor, y: torch.Tensor, r: torch.Tensor, dim: int) -> torch.Tensor:
    """The gradient of y = h * r(h) with respect to h: r * (g - y * mean(g * y)), three passes over y."""
    m = (g * y).mean(dim, keepdim=True)
    return torch.addcmul(g, y, m, value=-1).mul_(r)


class _RMSNorm(torch.autograd.Function):
    """rms_norm(x) with a hand-written backward: the norm, then one multiply, forward.

    fp32 and fp64 keep the output y and the scale r (the projection that reads y keeps it anyway). Half precision
    rounds once, from the fp32 product to x's dtype, as the plain formula does, and keeps x, from which backward
    recomputes the fp32 y: the gradient is the plain formula's, and no fp32 copy of the activation is kept.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
        r = _rms_scale(x, eps, dim)
        y = torch.mul(x, r, out=torch.empty_like(x))
        ctx.half = r.dtype != x.dtype
        ctx.save_for_backward(x if ctx.half else y, r)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, r = ctx.saved_tensors
        y = saved * r if ctx.half else saved
        return cast(_rms_norm_backward(g, y, r, ctx.dim), g.dtype), None, None


def rms_norm(x: torch.Tensor, eps: float, dim: int = -1) -> torch.Tensor:
    """RMSNorm without a learned scale, computed in fp32 and returned in x's dtype."""
    if not torch.compiler.is_compiling():
        return _RMSNorm.apply(x, eps, dim)
    h = cast(x, torch.float32)
    h = h * torch.rsqrt(h.square().mean(dim, keepdim=True) + eps)
    return cast(h, x.dtype)


class _AddRMSNorm(torch.autograd.Function):
    """rms_norm(x + f) in fp32 with a hand-written backward.

    Autograd's version of the same formula keeps the sum, its square and the scale, and runs about six passes over
    the activation in backward; this one keeps only the output y and the scale r, and runs three, using
    d/dh = r * (g - y * mean(g * y)). On a CPU, where these passes are bound by memory bandwidth, that shows in the
    step.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, f: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
        h = x + f
        # The norm needs no squared copy of h; then h is ours to scale in place.
        r = _rms_scale(h, eps, dim)
        y = h.mul_(r)
        ctx.save_for_backward(y, r)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, r = ctx.saved_tensors
        grad = _rms_norm_backward(g, y, r, ctx.dim)
        return grad, grad, None, None


def add_rms_norm(x: torch.Tensor, f: torch.Tensor, eps: float, dim: int = -1) -> torch.Tensor:
    """rms_norm(x + f, eps, dim): a residual add and the norm after it, fused where the states are fp32 (or fp64)."""
    if x.dtype == f.dtype and x.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling():
        return _AddRMSNorm.apply(x, f, eps, dim)
    # Half-precision states add in their dtype, as the reference does, then normalise in fp32.
    return rms_norm(x + f, eps, dim)


# -- the SwiGLU ----------------------------------------------------------------------------------------------------


class _SwiGLUGate(torch.autograd.Function):
    """silu(gate) * up for gate and up the two halves of one projection, split along dim.

    Autograd's version saves silu(gate) beside the projection and ends its backward by concatenating the two halves'
    gradients into a new tensor; this one saves only the projection, recomputes silu(gate) in backward, and writes
    both halves' gradients straight into one buffer.
    """

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, dim: int) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim)
        ctx.save_for_backward(gate_up)
        ctx.dim = dim
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, ctx.dim)
        grad = torch.empty_like(gate_up)
        grad_gate, grad_up = grad.chunk(2, ctx.dim)
        torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=grad_gate)
        torch.ops.aten.silu.out(gate, out=grad_up)
        grad_up.mul_(g)
        return grad, None


@fastpaths.op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), weight and bias in x's dtype."""
    return F.linear(x, weight, bias)


@fastpaths.op("swiglu_gate")
def swiglu_gate(gate_up: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """silu(gate) * up, where gate and up are the two halves of gate_up along dim."""
    if torch.compiler.is_compiling():
        gate, up = gate_up.chunk(2, dim)
        return F.silu(gate) * up
    return _SwiGLUGate.apply(gate_up, dim)


@fastpaths.op("swiglu")
def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up) with [gate; up] = x @ w_gate_up^T, weights in x's dtype."""
    return swiglu_down(linear(x, w_gate_up), w_down)


@fastpaths.op("swiglu_down")
def swiglu_down(gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The SwiGLU's gate and down projection: (silu(gate) * up) @ w_down^T for gate_up [..., 2 * inner]."""
    return linear(swiglu_gate(gate_up), w_down)


@fastpaths.op("swiglu_add_norm")
def swiglu_add_norm(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, then: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x + swiglu(x), eps), a post-norm block's SwiGLU with its residual add and norm; plus `then`, where
    given, added as a separate add would."""
    y = add_rms_norm(x, swiglu(x, w_gate_up, w_down), eps)
    return y if then is None else y + then


def swiglu_columns(cols: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The SwiGLU applied to every column of cols [in, N]: swiglu(cols.T).T without transposes, weights in cols'
    dtype. Mixing along a leading dimension this way is a plain matrix product on a contiguous tensor."""
    return torch.mm(w_down, swiglu_gate(torch.mm(w_gate_up, cols), dim=0))


@fastpaths.op("mix_positions_norm")
def mix_positions_norm(cols: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float) -> torch.Tensor:
    """TRM-MLP's mixing of positions with the residual norm after it, over cols [positions, N]: every column mixed
    by the SwiGLU, added back and normalised over positions."""
    return add_rms_norm(cols, swiglu_columns(cols, w_gate_up, w_down), eps, dim=0)


# -- RoPE and attention --------------------------------------------------------------------------------------------


class _Rotary(torch.autograd.Function):
    """x rotated by position, from the first halves of rotate-half tables; backward is the inverse rotation.

    With c and s the tables' halves, the rotation is (x1 c - x2 s, x2 c + x1 s): two fused multiply-adds per half,
    written into one output, where the textbook x cos + rotate_half(x) sin negates, concatenates and multiplies
    whole copies (and autograd undoes each of those in backward). Half-precision x rotates in fp32 and is rounded
    once, as the textbook formula computed in fp32 is.
    """

    @staticmethod
    def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if c.dtype != x.dtype:
            # One cast each way: kernels mixing a half-precision x with fp32 tables run slower on a GPU.
            return _Rotary._rotate(x.to(c.dtype), c, s).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out1, out2 = out.chunk(2, dim=-1)
        torch.mul(x1, c, out=out1).addcmul_(x2, s, value=-1)
        torch.mul(x2, c, out=out2).addcmul_(x1, s)
        return out

    @staticmethod
    def forward(ctx, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(c, s)
        return _Rotary._rotate(x, c, s)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        c, s = ctx.saved_tensors
        return _Rotary._rotate(g, c, -s), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., head_dim] by position; cos and sin broadcast against x. In fp32, returned in x's dtype.

    The tables are in the rotate-half layout of RotaryEmbedding (both halves of the last dimension equal).
    Half-precision inputs rotate in fp32, as the reference does.
    """
    half = x.shape[-1] // 2
    if not torch.compiler.is_compiling():
        acc = _accumulation_dtype(x.dtype)
        return _Rotary.apply(x, cast(cos[..., :half], acc), cast(sin[..., :half], acc))
    # Under torch.compile the textbook formula, which inductor fuses into one kernel.
    h = cast(x, torch.float32)
    h1, h2 = h.chunk(2, dim=-1)
    return cast(h * cos + torch.cat((-h2, h1), dim=-1) * sin, x.dtype)


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qk [B, L, 2 * heads, head_dim] and v [B, L, heads, head_dim], views of qkv [B, L, 3 * heads * head_dim]."""
    qkv = qkv.unflatten(-1, (3 * heads, qkv.shape[-1] // (3 * heads)))
    return qkv[..., : 2 * heads, :], qkv[..., 2 * heads :, :]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA over q, k, v [B, L, heads, head_dim]: [B, L, heads * head_dim]. The transposes to SDPA's [B, heads, L,
    head_dim] are views, in the strides its kernels read natively."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2).flatten(-2)


@fastpaths.op("rope_qkv")
def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of qkv [B, L, 3 * heads * head_dim] rotated by position, and v: each [B, L, heads, head_dim]. cos and
    sin are rotate-half tables [positions >= L, head_dim] (RotaryEmbedding's)."""
    L = qkv.shape[1]
    qk, v = split_heads(qkv, heads)
    # q and k share the rotation, so they are rotated in one pass.
    q, k = apply_rotary(qk, cos[:L, None], sin[:L, None]).split(heads, dim=-2)
    return q, k, v


@fastpaths.op("rope_attention")
def rope_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, causal: bool = False
) -> torch.Tensor:
    """Self-attention over qkv [B, L, 3 * heads * head_dim] with q and k rotated by position: [B, L, heads *
    head_dim], the heads side by side."""
    return attend(*rope_qkv(qkv, cos, sin, heads), causal)


@fastpaths.op("attention")
def attention(
    x: torch.Tensor, w_qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, causal: bool = False
) -> torch.Tensor:
    """Self-attention with RoPE over qkv = x @ w_qkv^T (w_qkv in x's dtype): [B, L, heads * head_dim], before the
    output projection."""
    return rope_attention(linear(x, w_qkv), cos, sin, heads, causal)
