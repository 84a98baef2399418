"""Triton kernels on NVIDIA GPUs in half precision (and in Triton's CPU interpreter in bf16, as the tests run them).

The operations they serve, and when (the kernels are in this package's modules, imported by `load`):
- swiglu_gate (gate.py): the SwiGLU gate split along a first or last dimension, with a graph or without.
- swiglu_down (down.py): the gate inside the down projection's product; with a graph only where tiles are copied
  with TMA, which its backward kernel does.
- swiglu_add_norm (down.py): that with a post-norm block's residual add and norm in the epilogue, in the rounds
  without a graph, unless another backend serves the SwiGLU itself (the Hopper kernel, faster there).
- rope_qkv (rope.py): RoPE on the fused projection, but in a compiled graph's no-grad rounds, where inductor's own
  fused rotation leaves v in place and is faster.
- rope_attention (attention.py): the whole attention with RoPE for whole sequences of at most 128 positions, where
  tiles are copied with TMA; with a graph or without, compiled or not.
- mix_positions_norm (mix.py): TRM-MLP's position mixing with its norm, in the rounds without a graph.
Each matches the plain formula within rounding: products accumulate in fp32 and round where the formula rounds.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from raytrm.fastpaths import device, registry
from raytrm.fastpaths.registry import Backend
from raytrm.hardware import device as devices

logger = logging.getLogger(__name__)

#: Triton is installed and torch can make an operator of its kernels (torch.library.triton_op, torch 2.6 or later).
HAVE_TRITON = importlib.util.find_spec("triton") is not None and hasattr(torch.library, "triton_op")
#: Whether bf16 CPU tensors take the kernels: under Triton's interpreter.
INTERPRETED = device.interpreted()
#: The most positions the mixing and attention kernels take: a program holds all of them on chip (Sudoku has 97; a
#: 30x30 maze's 916 take the plain formulas).
MAX_POSITIONS = 128
#: The widest rows swiglu_add_norm takes: a tile holds whole rows (TRM's hidden 512).
MAX_NORM_WIDTH = 512

_loaded = False
#: Triton has tensor descriptors (3.3 or later), through which the attention kernels and the down projection's
#: backward kernel copy their tiles.
_descriptors = False


def load() -> bool:
    """Make the kernels torch operators (torch.ops.raytrm.*), once a process, where Triton is installed; True where
    they are."""
    global _loaded, _descriptors
    if _loaded or not HAVE_TRITON:
        return _loaded
    import triton

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

        _descriptors = True
    except ImportError:
        logger.info(
            "Triton %s has no tensor descriptors: the attention and the SwiGLU's back-propagated round run without "
            "their kernels",
            triton.__version__,
        )
    from raytrm.fastpaths.triton import attention, down, gate, mix, rope  # noqa: F401  (each defines its operators)

    _loaded = True
    logger.debug("Triton kernels loaded: %s", ", ".join(b.op for b in BACKENDS))
    return True


def tma_copies(x: torch.Tensor) -> bool:
    """Whether the kernels that copy tiles through tensor descriptors serve x (a tensor the kernels take): Triton has
    descriptors, and x is on a GPU that copies tiles with TMA, or under the interpreter, which runs them as Hopper."""
    return _descriptors and (x.device.type != devices.CUDA or device.tma_device(x.device))


# -- when each kernel serves: None, or why not -------------------------------------------------------------------


def kernels_why_not(x: torch.Tensor) -> str | None:
    """Whether the kernels take x at all: loaded, in half precision on CUDA, or in bf16 under the interpreter."""
    if not _loaded:
        return "not loaded (fastpaths.prepare() loads it)" if HAVE_TRITON else "no Triton installed"
    if x.device.type == devices.CUDA:
        return None if x.dtype in device.HALF else "not half precision"
    if INTERPRETED and x.dtype == torch.bfloat16:
        return None
    return "not on a CUDA GPU"


def gate_why_not(gate_up: torch.Tensor, dim: int = -1) -> str | None:
    """swiglu_gate's: contiguous, split along its first or last dimension into halves."""
    if why := kernels_why_not(gate_up):
        return why
    if not gate_up.is_contiguous():
        return "a strided view"
    if dim % gate_up.dim() not in (0, gate_up.dim() - 1):
        return "split along a middle dimension"
    if gate_up.shape[dim] % 2:
        return "no halves"
    return None


def down_why_not(gate_up: torch.Tensor, w_down: torch.Tensor) -> str | None:
    """swiglu_down's, for gate_up [..., 2 * inner] and w_down [out, inner]: contiguous, inner and out multiples of 64
    (a tile's inner step); with a gradient recorded, where the backward kernel's TMA copies run."""
    out, inner = w_down.shape
    if why := kernels_why_not(gate_up):
        return why
    if torch.is_grad_enabled() and not tma_copies(gate_up):
        return "a gradient is recorded, whose kernel copies tiles with TMA (Hopper and Triton 3.3 or later)"
    if not gate_up.is_contiguous():
        return "a strided view"
    if gate_up.shape[-1] != 2 * inner:
        return "gate_up is not [gate | up] of the down projection's width"
    if inner % 64 or out % 64:
        return "widths no multiples of 64"
    return None


def after_gate_why_not(x: torch.Tensor) -> str | None:
    """swiglu_down_after_gate's, for the SwiGLU's input x: the kernels take x and copy tiles with TMA, as the down
    projection's backward kernel does."""
    if why := kernels_why_not(x):
        return why
    return None if tma_copies(x) else "no TMA copies (Hopper and Triton 3.3 or later)"


def add_norm_why_not(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, then: torch.Tensor | None = None
) -> str | None:
    """swiglu_add_norm's: no gradient recorded, swiglu_down's conditions on the product x @ w_gate_up^T (a fresh
    tensor in x's dtype), rows of a power of two of at most MAX_NORM_WIDTH, x (and then) contiguous in x's dtype and
    shape; and no other backend serving the SwiGLU itself."""
    if torch.is_grad_enabled():
        return "a gradient is recorded"
    if why := kernels_why_not(x):
        return why
    out, inner = w_down.shape
    if w_gate_up.shape[0] != 2 * inner:
        return "gate_up is not [gate | up] of the down projection's width"
    if inner % 64 or out % 64:
        return "widths no multiples of 64"
    if out > MAX_NORM_WIDTH or out & (out - 1):
        return "rows wider than 512 or no power of two"
    for t in (x, then):
        if t is not None and not (
            t.is_contiguous() and t.dtype == x.dtype and t.shape[-1] == out and t.shape == x.shape
        ):
            return "the residual or the injection is not contiguous rows of the output's dtype and width"
    if registry.served("swiglu", x, w_gate_up, w_down):
        return "another backend serves the SwiGLU itself"
    return None


def rope_layout_why_not(qkv: torch.Tensor, head_dim: int) -> str | None:
    """Whether the RoPE and attention kernels take qkv [B, L, 3 * heads * head_dim]: contiguous, head_dim twice a
    power of two."""
    if why := kernels_why_not(qkv):
        return why
    half = head_dim // 2
    if qkv.dim() != 3 or not qkv.is_contiguous():
        return "not a contiguous [B, L, width] projection"
    if half <= 0 or half & (half - 1):
        return "half a head is no power of two"
    return None


def rope_why_not(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> str | None:
    """rope_qkv's: rope_layout_why_not's, except in a compiled graph's no-grad rounds."""
    if why := rope_layout_why_not(qkv, qkv.shape[-1] // (3 * heads)):
        return why
    if not torch.is_grad_enabled() and torch.compiler.is_compiling():
        return "compiled without a gradient, where inductor's fused rotation is faster"
    return None


def attention_kernels_why_not(t: torch.Tensor, head_dim: int, causal: bool) -> str | None:
    """Whether the attention kernels take t [B, L, 3 * heads * head_dim] (or a tensor alike in what is checked): the
    RoPE kernels' layout, TMA copies, self-attention over the whole sequence (not causal) of at most MAX_POSITIONS
    positions, heads of at least 32 (each half a product's depth of 16); with a graph or without, compiled or not."""
    if why := rope_layout_why_not(t, head_dim):
        return why
    if not tma_copies(t):
        return "no TMA copies (Hopper and Triton 3.3 or later)"
    if causal:
        return "causal"
    if t.shape[1] > MAX_POSITIONS:
        return "more than 128 positions"
    if head_dim < 32:
        return "heads narrower than 32"
    return None


def attention_why_not(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, causal: bool = False
) -> str | None:
    """rope_attention's: attention_kernels_why_not's for qkv's heads."""
    return attention_kernels_why_not(qkv, qkv.shape[-1] // (3 * heads), causal)


def mix_why_not(cols: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float) -> str | None:
    """mix_positions_norm's, for cols [positions, columns]: no gradient recorded, at most MAX_POSITIONS positions."""
    if why := kernels_why_not(cols):
        return why
    if torch.is_grad_enabled():
        return "a gradient is recorded"
    if cols.shape[0] > MAX_POSITIONS:
        return "more than 128 positions"
    return None


# -- the operators, each only where its conditions hold -----------------------------------------------------------


def swiglu_gate(gate_up: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """silu(gate) * up for gate and up the halves of gate_up along dim, rounded where the plain formula rounds (the
    eager one; inductor rounds only the product); differentiable."""
    return torch.ops.raytrm.swiglu_gate(gate_up, dim)


def swiglu_down(gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ w_down^T for gate and up the halves of gate_up's last dimension and w_down [out, inner] in
    gate_up's dtype; differentiable. Without a graph the gate is computed on the way into the product. With one, its
    output is kept for w_down's gradient, and the gate's backward runs in the epilogue of the product that gives the
    gate's gradient."""
    if torch.is_grad_enabled():
        return torch.ops.raytrm.swiglu_down_keeping_gate(gate_up, w_down)[0]
    return torch.ops.raytrm.swiglu_down(gate_up, w_down)


def swiglu_down_after_gate(gate_up: torch.Tensor, h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """h @ w_down^T for h = silu(gate) * up already computed beside gate_up (the Hopper backend's gated product),
    differentiable through gate_up and w_down as swiglu_down is. Where after_gate_why_not(x) is None for the SwiGLU's
    input x."""
    return torch.ops.raytrm.swiglu_down_after_gate(gate_up, h, w_down)


def swiglu_down_norm(
    gate_up: torch.Tensor, w_down: torch.Tensor, x: torch.Tensor, eps: float, then: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x + swiglu_down(gate_up, w_down), eps) in one kernel, without a graph: x is added in its dtype and
    the norm is in fp32, as the eager formulas do. With `then` (x's shape, dtype and layout), the result plus then,
    added in its dtype as a separate add would: TRM's next latent input, written in place of the norm's output."""
    return torch.ops.raytrm.swiglu_down_norm(gate_up, w_down, x, eps, then)


def swiglu_add_norm(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, then: torch.Tensor | None = None
) -> torch.Tensor:
    """The operation swiglu_add_norm: the gate/up product (the linear operation, as the plain formula runs it), then
    swiglu_down_norm."""
    return swiglu_down_norm(registry.call("linear", x, w_gate_up), w_down, x, eps, then)


def _check_tables(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    assert device.rope_tables_fit(qkv, cos, sin), "bad RoPE tables"


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of qkv [B, L, 3 * heads * head_dim] rotated by position, and v: each [B, L, heads, head_dim],
    contiguous; differentiable. cos and sin are rotate-half tables [positions >= L, head_dim]. Half-precision q and
    k rotate in fp32 and are rounded once, as the plain formula's."""
    _check_tables(qkv, cos, sin)
    return torch.ops.raytrm.rope_qkv(qkv, cos, sin, heads)


def rope_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, rotated: bool = False
) -> torch.Tensor:
    """Self-attention over qkv [B, L, 3 * heads * head_dim] with q and k rotated by position: [B, L, heads *
    head_dim], the heads side by side, as the output projection reads them; differentiable. cos and sin are
    rotate-half tables [positions >= L, head_dim]; the rotation rounds as rope_qkv's, the attention as flash
    attention's kernels do. With `rotated`, q and k in qkv come rotated (the Hopper backend's projection) and are
    taken as they are; not differentiable so."""
    _check_tables(qkv, cos, sin)
    return torch.ops.raytrm.rope_attention(qkv, cos, sin, heads, rotated)[0]


def _attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, causal: bool = False
) -> torch.Tensor:
    """The operation rope_attention (never causal where it runs)."""
    return rope_attention(qkv, cos, sin, heads)


def mix_positions_norm(cols: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(cols + w_down @ swiglu_gate(w_gate_up @ cols, dim=0), eps, dim=0) in one kernel.

    cols is [L, N] (positions, columns), w_gate_up [2 * inner, L] and w_down [L, inner] in cols' dtype; inner must
    be a multiple of 64 (swiglu_width's multiples of 256 are).
    """
    L = cols.shape[0]
    inner = w_down.shape[1]
    assert w_gate_up.shape == (2 * inner, L) and w_down.shape == (L, inner), "weights do not match the columns"
    assert inner % 64 == 0, "the SwiGLU's inner width must be a multiple of 64"
    return torch.ops.raytrm.mix_positions_norm(cols.contiguous(), w_gate_up.contiguous(), w_down.contiguous(), eps)


BACKENDS = (
    Backend("swiglu_gate", "triton", gate_why_not, swiglu_gate),
    Backend("swiglu_down", "triton", down_why_not, swiglu_down),
    Backend("swiglu_add_norm", "triton", add_norm_why_not, swiglu_add_norm),
    Backend("rope_qkv", "triton", rope_why_not, rope_qkv),
    Backend("rope_attention", "triton", attention_why_not, _attention),
    Backend("mix_positions_norm", "triton", mix_why_not, mix_positions_norm),
)
