"""Triton helpers the kernels share: rounding as the plain formulas round, the gate and its gradients, the residual
norm, dot operands and RoPE's inverse rotation.

Under Triton's CPU interpreter (INTERPRETED), products take fp32 operands (its bf16 products are wrong) and the
rounding to bf16 is done on the bits (it truncates); on a GPU both are the hardware's.
"""

import triton
import triton.language as tl

from raytrm.fastpaths.device import interpreted

#: Whether the kernels run in Triton's CPU interpreter, which Triton reads when a kernel is defined.
INTERPRETED = interpreted()


@triton.jit
def rounded(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """v (fp32) rounded to dtype, to nearest even, and back to fp32."""
    if INTERPRETED:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def sigmoid(v, INTERPRETED: tl.constexpr):
    """sigmoid(v) in fp32 from the hardware's approximate 2^x and 1/x (each within 2 ulp of fp32, far inside the
    bf16 rounding that follows), where tl.sigmoid's 1 / (1 + exp(-v)) is a full division."""
    if INTERPRETED:
        return 1.0 / (1.0 + tl.exp(-v))
    else:
        e = tl.exp2(-1.4426950408889634 * v)
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def gated(gate, up, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """silu(gate) * up (fp32), rounded to dtype where the plain formula rounds: silu(gate), then the product."""
    silu = rounded(gate * sigmoid(gate, INTERPRETED), dtype, INTERPRETED)
    return rounded(silu * up, dtype, INTERPRETED)


@triton.jit
def gate_gradients(gate, up, g, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """The gradients of silu(gate) * up (fp32 operands) for its gradient g: d gate = (g * up) * s * (1 + gate *
    (1 - s)) and d up = silu(gate) * g, with s = sigmoid(gate), rounded where the plain formulas' backward rounds
    (g * up, silu(gate) and each result)."""
    s = sigmoid(gate, INTERPRETED)
    g_up = rounded(g * up, dtype, INTERPRETED)
    grad_gate = rounded(g_up * s * (1 + gate * (1 - s)), dtype, INTERPRETED)
    grad_up = rounded(rounded(gate * s, dtype, INTERPRETED) * g, dtype, INTERPRETED)
    return grad_gate, grad_up


@triton.jit
def add_rms_norm(x, f, length, eps, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """rms_norm(x + f) along the rows of fp32 tiles as the eager formulas compute it: the sum rounded to dtype, the
    norm over `length` entries in fp32 (a row's entries past it are zeros), the result rounded to dtype."""
    s = rounded(x + f, dtype, INTERPRETED)
    r = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / length + eps)
    return rounded(s * r[:, None], dtype, INTERPRETED)


@triton.jit
def operand(v, INTERPRETED: tl.constexpr):
    """v as an operand of tl.dot."""
    if INTERPRETED:
        return v.to(tl.float32)
    else:
        return v


@triton.jit
def rotated_back(g1, g2, c, s, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """The halves g1, g2 (fp32) of a gradient of rotated q or k rotated back (by -angle), each rounded once to
    dtype."""
    r1 = rounded(g1 * c + g2 * s, dtype, INTERPRETED).to(dtype)
    r2 = rounded(g2 * c - g1 * s, dtype, INTERPRETED).to(dtype)
    return r1, r2
