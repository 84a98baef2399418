"""Triton kernels for CUDA: TRM-MLP's position mixing fused with the residual norm after it, and the SwiGLU gate.

TRM-MLP mixes the positions of every (batch row, feature) column with a SwiGLU, adds the column back and normalises
it over positions. Done as separate operations, the gate/up projection writes a [2 * inner, columns] tensor, 8 times
the size of the states, which the gate then reads back: on an H200 those bytes, not the products, bound the step.
One program here takes a block of columns through the whole map in registers and on-chip memory, so it reads the
states once and writes the result once.

It is the forward of the no-grad rounds (most of a TRM step), on CUDA in half precision when Triton is installed;
everything else takes the plain formulas (`raytrm.models.layers`). It matches them within rounding: each product
accumulates in fp32 and is rounded to the states' dtype where the plain formula rounds it.

The SwiGLU gate, silu(gate) * up, is an operator with a hand-written backward (`swiglu_gate`), on CUDA in half
precision, with or without a graph and compiled or not. It reads the projection once and writes the product once;
its backward reads the projection and the gradient once and writes both halves' gradients in place. On an H200 the
plain formulas' backward, fused by inductor into one kernel that writes a concatenation, ran at half the memory rate
(0.85 ms against 0.50 ms at TRM-MLP's [1024, 393,216] mixing projection).

RoPE on the attention's fused projection is an operator too (`rope_qkv`): it reads qkv once and writes q and k rotated
and v copied, and its backward writes qkv's gradient in one pass. Under torch.compile the textbook formula took two
kernels forward and one backward, 0.39 ms a call at TRM-attention's Sudoku shape on an H200, against 0.23 ms, to the
same bits. In a compiled graph's no-grad rounds inductor fuses the rotation into one pass that leaves v in place
(0.08 ms), so those keep the formula.

The feature SwiGLU's gate and down projection are one operator too (`swiglu_down`). Without a graph (the no-grad
rounds) its kernel computes the gate from the projection as it loads it into the down projection's product, so the
gate's output never goes to memory and back; in the back-propagated round the gate's backward runs in the epilogue of
the product that gives its gradient. On an H100 at TRM's shape the two took 0.345 and 0.510 ms a call against 0.393
and 0.577 for the gate operators and cuBLAS, to the same bits there. In the no-grad rounds a post-norm block's
residual add and norm after the SwiGLU join the same kernel's epilogue (`swiglu_down_norm`, a tile holding whole
rows): 0.389 ms against 0.426 for `swiglu_down` and inductor's add and norm. On GPUs with TMA copies that kernel
takes its weight, the residual and the injection and writes its output as TMA copies (swiglu_down_norm_kernel, the
same bits): on an H200, 0.35-0.36 ms against 0.40-0.42, the step 1.024x. On Hopper GPUs where raytrm.models.gated's
kernel is built, the gate comes out of the gate/up product instead (layers.SwiGLU): the rounds without a gradient then
take cuBLAS's down projection and inductor's add and norm, and the back-propagated round `swiglu_down_after_gate`,
whose backward is `swiglu_down`'s, gate_up's gradient from raytrm.models.gated's CUDA kernel (the same bits).

TRM-attention's whole attention is an operator too (`rope_attention`), for sequences of at most 128 positions
(Sudoku's 97): a program takes a head's whole sequence on chip, rotating q and k as it loads them from the fused
projection, and writes the output where the output projection reads it; its backward recomputes the probabilities
from the forward's log-sum-exp and writes qkv's gradient, q's and k's rotated back, in one pass. A program per
multiprocessor takes one head after another, the next heads' loads in flight while it computes one. It replaces
RoPE's two passes and cuDNN's attention in every round, compiled or not: on an H100 its forward took 0.17 ms a call
against 0.22 ms for inductor's rotation and cuDNN's forward, its backward 0.435 ms. Its loads and stores are TMA
copies through tensor descriptors, which took the backward to 0.350 ms and the forward to 0.164. GPUs before Hopper
have no TMA: there Triton rewrites the copies into pointer loads, which compiled for an A100 spill far more than the
pointer-load kernels did (_triton_kernels.py, beside ATTENTION_FORWARD), so those GPUs keep the plain formulas for
the attention and for the SwiGLU's back-propagated round (TMA_CAPABILITY).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os

import torch

from raytrm.models import cublaslt

logger = logging.getLogger(__name__)


#: Triton is installed and torch can make an operator of its kernels (torch.library.triton_op, torch 2.6 or later).
HAVE_TRITON = importlib.util.find_spec("triton") is not None and hasattr(torch.library, "triton_op")


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), as the tests do without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_INTERPRETED = interpreted()


#: The most positions the kernel takes: a block of columns holds all of them, in registers (Sudoku has 97; a 30x30
#: maze's 916 take the plain formulas).
MAX_POSITIONS = 128


def _runs_kernels(x: torch.Tensor) -> bool:
    """Whether the kernels take x at all: registered (`register`), in half precision on CUDA, or in bf16 under
    Triton's interpreter (whose rounding here is bf16's)."""
    return _registered and (
        (x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16))
        or (_INTERPRETED and x.dtype == torch.bfloat16)
    )


def fused_mix_available(x: torch.Tensor) -> bool:
    """Whether mix_positions_norm serves x [positions, columns]: no gradient is being recorded, at most
    MAX_POSITIONS positions, and the kernels take x (half precision on CUDA, or bf16 under Triton's interpreter,
    once registered)."""
    return _runs_kernels(x) and not torch.is_grad_enabled() and x.shape[0] <= MAX_POSITIONS


def _rope_layout(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether the RoPE and attention kernels take qkv [B, L, 3 * heads * head_dim]: contiguous, head_dim twice a
    power of two, in a dtype and on a device the kernels take (half precision on CUDA, or bf16 under Triton's
    interpreter, once registered)."""
    half = head_dim // 2
    return _runs_kernels(qkv) and qkv.dim() == 3 and qkv.is_contiguous() and half > 0 and half & (half - 1) == 0


def fused_rope_available(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether rope_qkv serves qkv [B, L, 3 * heads * head_dim]: where the kernels take it (_rope_layout), except in
    a compiled graph's no-grad rounds, where inductor's fused formula is faster (the module's docstring)."""
    return _rope_layout(qkv, head_dim) and (torch.is_grad_enabled() or not torch.compiler.is_compiling())


def fused_attention_available(qkv: torch.Tensor, head_dim: int, causal: bool) -> bool:
    """Whether rope_attention serves qkv [B, L, 3 * heads * head_dim]: where the kernels take it (_rope_layout), for
    self-attention over the whole sequence (not causal) of at most MAX_POSITIONS positions, with heads of at least
    32 (each half a product's depth of 16), where its kernels' TMA copies run (_tma_copies); with or without a
    graph, compiled or not."""
    return (
        _rope_layout(qkv, head_dim)
        and _tma_copies(qkv)
        and not causal
        and qkv.shape[1] <= MAX_POSITIONS
        and head_dim >= 32
    )


def fused_gate_available(gate_up: torch.Tensor, dim: int) -> bool:
    """Whether swiglu_gate serves gate_up split along dim: contiguous, split along its first or last dimension, and
    the kernels take it (half precision on CUDA, or bf16 under Triton's interpreter, once registered)."""
    return (
        _runs_kernels(gate_up)
        and gate_up.is_contiguous()
        and dim % gate_up.dim() in (0, gate_up.dim() - 1)
        and gate_up.shape[dim] % 2 == 0
    )


def fused_swiglu_down_available(gate_up: torch.Tensor, w_down_shape: tuple[int, ...]) -> bool:
    """Whether swiglu_down serves gate_up [..., 2 * inner] with a down projection of weight shape [out, inner]:
    contiguous, inner and out multiples of 64 (a tile's inner step), and the kernels take it (half precision on
    CUDA, or bf16 under Triton's interpreter, once registered); with or without a graph (whose backward kernel
    needs TMA copies, _tma_copies), compiled or not."""
    out, inner = w_down_shape
    return (
        _runs_kernels(gate_up)
        and (not torch.is_grad_enabled() or _tma_copies(gate_up))
        and gate_up.is_contiguous()
        and gate_up.shape[-1] == 2 * inner
        and inner % 64 == 0
        and out % 64 == 0
    )


def fused_swiglu_down_after_gate_available(x: torch.Tensor) -> bool:
    """Whether swiglu_down_after_gate serves the SwiGLU of x, with gate_up and h from raytrm.models.gated (fresh,
    contiguous, of widths its kernels take: multiples of 128 and the input's 512): the kernels take x (half precision
    on CUDA, once registered) and copy tiles with TMA, as the down projection's backward kernel does."""
    return _runs_kernels(x) and _tma_copies(x)


#: The widest rows swiglu_down_norm takes: a tile holds whole rows (TRM's hidden 512).
MAX_NORM_WIDTH = 512


def fused_swiglu_down_norm_available(
    x: torch.Tensor, gate_up: torch.Tensor, w_down_shape: tuple[int, ...], then: torch.Tensor | None = None
) -> bool:
    """Whether swiglu_down_norm serves x [..., out] and its SwiGLU's gate_up (and then): no gradient is being
    recorded, swiglu_down serves gate_up, out is a power of two of at most MAX_NORM_WIDTH, and x (and then) are
    contiguous in gate_up's dtype and rows."""
    out = w_down_shape[0]
    return (
        not torch.is_grad_enabled()
        and fused_swiglu_down_available(gate_up, w_down_shape)
        and out <= MAX_NORM_WIDTH
        and out & (out - 1) == 0
        and all(
            t.is_contiguous() and t.dtype == gate_up.dtype and t.shape == (*gate_up.shape[:-1], out)
            for t in (x, then)
            if t is not None
        )
    )


_registered = False
#: Triton has tensor descriptors (TMA copies on Hopper and later), which the attention kernels and the SwiGLU down
#: projection's backward kernel load and store through.
_descriptors = False


#: The first compute capability whose GPUs copy tiles with TMA (Hopper). On earlier GPUs Triton rewrites a tensor
#: descriptor's copies into pointer loads; compiled for an A100 (sm_80) at TRM-attention's shape, the attention kernels
#: then spilled 6 KB a thread forward and 13 KB backward, against 0.1 and 3 KB for the pointer-load kernels they
#: replaced, so those GPUs keep the plain formulas.
TMA_CAPABILITY = (9, 0)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, read once."""
    return torch.cuda.get_device_capability(device)


@torch.compiler.assume_constant_result
def _tma_device(device: torch.device) -> bool:
    """Whether a CUDA device copies tiles with TMA (TMA_CAPABILITY or later). A device's capability is fixed, so
    torch.compile, which meets this while tracing a round, calls it there and keeps the answer as a constant: no
    graph break."""
    return _capability(device) >= TMA_CAPABILITY


def _tma_copies(x: torch.Tensor) -> bool:
    """Whether the kernels that load and store through tensor descriptors serve x (a tensor the kernels take):
    Triton has descriptors (3.3 or later), and x is on a GPU that copies tiles with TMA, or under Triton's
    interpreter, which runs the descriptors' copies as Hopper does."""
    return _descriptors and (x.device.type != "cuda" or _tma_device(x.device))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where it does not start on 16 bytes, as a tensor descriptor's base must."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors, which the attention kernels' programs fill; under Triton's interpreter 2, so
    that a program takes several heads there too."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


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


def padded_weights(w_gate_up: torch.Tensor, w_down: torch.Tensor, block_l: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's weights: transposed and zero-padded to block_l positions, so it loads whole tiles (300 KB at
    Sudoku's shape): w_gate_up_t [block_l, 2 * inner] and w_down_t [inner, block_l]."""
    L, inner = w_down.shape
    w_gate_up_t = w_gate_up.new_zeros(block_l, 2 * inner)
    w_gate_up_t[:L] = w_gate_up.t()
    w_down_t = w_down.new_zeros(inner, block_l)
    w_down_t[:, :L] = w_down.t()
    return w_gate_up_t, w_down_t


def register() -> bool:
    """Make the kernel an operator, torch.ops.raytrm.mix_positions_norm, where Triton is installed; True if it is.

    Called when a model is built, so torch.compile later finds the operator and traces it into its graph.
    """
    global _registered, _descriptors
    if _registered or not HAVE_TRITON:
        return _registered
    import triton
    from torch.utils.flop_counter import register_flop_formula

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor

        _descriptors = True
    except ImportError:  # Triton before 3.3
        logger.info(
            "Triton %s has no tensor descriptors: the attention and the SwiGLU's back-propagated round run without "
            "their kernels",
            triton.__version__,
        )

    from raytrm.models._triton_kernels import (
        BLOCK_I,
        GATE_BLOCK_C,
        GATE_BLOCK_R,
        GATE_WARPS,
        ROPE_BLOCK_T,
        SWIGLU_DOWN,
        SWIGLU_DOWN_BACKWARD,
        SWIGLU_DOWN_GROUP,
        SWIGLU_DOWN_NORM,
        SWIGLU_DOWN_NORM_TMA,
        mix_positions_norm_kernel,
        rope_attention_backward_kernel,
        rope_attention_kernel,
        rope_qkv_backward_kernel,
        rope_qkv_kernel,
        swiglu_down_backward_kernel,
        swiglu_down_kernel,
        swiglu_down_norm_kernel,
        swiglu_gate_backward_kernel,
        swiglu_gate_kernel,
    )

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
            cols, w_gate_up_t, w_down_t, y, N, L, inner, eps, BLOCK_L=block_l, BLOCK_I=BLOCK_I, INTERPRETED=_INTERPRETED
        )
        return y

    @register_flop_formula(torch.ops.raytrm.mix_positions_norm)
    def mix_positions_norm_flops(cols_shape, w_gate_up_shape, w_down_shape, *args: object, **kwargs: object) -> int:
        """The two products' FLOPs, at the unpadded shape: what the plain formulas' matrix products count."""
        L, N = cols_shape
        return 2 * N * L * (w_gate_up_shape[0] + w_down_shape[1])

    def gate_launch(
        kernel: object, gate_up: torch.Tensor, dim: int, *tensors: torch.Tensor, traced: bool = True
    ) -> None:
        """Run a gate kernel over gate_up (split along dim) in tiles; tensors are its other tensor arguments.

        traced: launched from a triton_op, through wrap_triton, so that torch.compile sees the kernel. Inside an
        opaque custom_op it is launched directly: wrap_triton's dispatch there costs the host about 1 ms a call.
        """
        rows, columns, row_stride, up_offset, _ = _gate_layout(gate_up, dim)
        tiles = triton.cdiv(rows, GATE_BLOCK_R) * triton.cdiv(columns, GATE_BLOCK_C)
        (torch.library.wrap_triton(kernel) if traced else kernel)[(tiles,)](
            gate_up, *tensors, rows, columns, row_stride, up_offset, BLOCK_R=GATE_BLOCK_R, BLOCK_C=GATE_BLOCK_C,
            INTERPRETED=_INTERPRETED, num_warps=GATE_WARPS,
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

    def down_shape(gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[int, int, int]:
        """(rows, out, inner) of a down projection of gate_up [..., 2 * inner] by w_down [out, inner]."""
        out, inner = w_down.shape
        return gate_up.numel() // (2 * inner), out, inner

    def down_flops(gate_up_shape: torch.Size, w_down_shape: torch.Size, products: int) -> int:
        """FLOPs of `products` products the down projection's size, as torch counts a linear layer's."""
        out, inner = w_down_shape
        return products * 2 * (math.prod(gate_up_shape) // (2 * inner)) * inner * out

    def down_launch(
        gate_up: torch.Tensor,
        w_down: torch.Tensor,
        x: torch.Tensor | None,
        eps: float,
        then: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """swiglu_down_kernel over gate_up: the down projection, or with x the norm of x plus it (plus then), which
        swiglu_down_norm_kernel computes to the same bits where tiles are copied with TMA."""
        rows, out, inner = down_shape(gate_up, w_down)
        y = gate_up.new_empty(*gate_up.shape[:-1], out)
        if x is not None and _tma_copies(gate_up):
            block_m, block_k, warps, stages = SWIGLU_DOWN_NORM_TMA
            box = min(out, 256)  # a TMA copy's longest side
            w_view = _aligned(w_down).view(out // box, box, inner)
            row_views = [t.view(rows, out // box, box) for t in (_aligned(x), _aligned(x if then is None else then), y)]
            swiglu_down_norm_kernel[(triton.cdiv(rows, block_m),)](
                gate_up, TensorDescriptor.from_tensor(w_view, [out // box, box, block_k]),
                *(TensorDescriptor.from_tensor(t, [block_m, out // box, box]) for t in row_views), rows, inner, eps,
                N=out, BLOCK_M=block_m, BLOCK_K=block_k, THEN_ADD=then is not None, EVEN=rows % block_m == 0,
                INTERPRETED=_INTERPRETED, num_warps=warps, num_stages=stages,
            )  # fmt: skip
            return y
        if x is None:
            block_m, block_n, block_k, warps, stages = SWIGLU_DOWN
            block_n = min(block_n, triton.next_power_of_2(out))
        else:
            (block_m, block_k, warps, stages), block_n = SWIGLU_DOWN_NORM, triton.next_power_of_2(out)
        swiglu_down_kernel[(triton.cdiv(rows, block_m) * triton.cdiv(out, block_n),)](
            gate_up, w_down, y, y if x is None else x, y if then is None else then, rows, out, inner, eps,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM=x is not None, THEN_ADD=then is not None,
            INTERPRETED=_INTERPRETED, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return y

    # Opaque operators, as the attention's below: their launches are tuned here, not by inductor.
    @torch.library.custom_op("raytrm::swiglu_down", mutates_args=())
    def swiglu_down_op(gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        return down_launch(gate_up, w_down, None, 0.0, None)

    @swiglu_down_op.register_fake
    def _(gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty(*gate_up.shape[:-1], w_down.shape[0])

    @torch.library.custom_op("raytrm::swiglu_down_norm", mutates_args=())
    def swiglu_down_norm_op(
        gate_up: torch.Tensor, w_down: torch.Tensor, x: torch.Tensor, eps: float, then: torch.Tensor | None = None
    ) -> torch.Tensor:
        return down_launch(gate_up, w_down, x, eps, then)

    @swiglu_down_norm_op.register_fake
    def _(
        gate_up: torch.Tensor, w_down: torch.Tensor, x: torch.Tensor, eps: float, then: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.custom_op("raytrm::swiglu_down_keeping_gate", mutates_args=())
    def swiglu_down_keeping_gate_op(gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The gate operator and cuBLAS's product (raytrm.models.cublaslt): the gate inside the product, written out
        # too (by its first column block's programs), made TRM-attention's compiled step 4% slower on an H100.
        rows, out, inner = down_shape(gate_up, w_down)
        h = gate_up.new_empty(*gate_up.shape[:-1], inner)
        gate_launch(swiglu_gate_kernel, gate_up, -1, h, traced=False)
        return cublaslt.product(h.view(rows, inner), w_down.t()).view(*gate_up.shape[:-1], out), h

    @swiglu_down_keeping_gate_op.register_fake
    def _(gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, inner = w_down.shape
        return gate_up.new_empty(*gate_up.shape[:-1], out), gate_up.new_empty(*gate_up.shape[:-1], inner)

    @torch.library.custom_op("raytrm::swiglu_down_after_gate", mutates_args=())
    def swiglu_down_after_gate_op(gate_up: torch.Tensor, h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        # h, the gate of gate_up, computed beside it (raytrm.models.gated): cuBLAS's product, the backward as above.
        rows, out, inner = down_shape(gate_up, w_down)
        return cublaslt.product(h.view(rows, inner), w_down.t()).view(*gate_up.shape[:-1], out)

    @swiglu_down_after_gate_op.register_fake
    def _(gate_up: torch.Tensor, h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty(*gate_up.shape[:-1], w_down.shape[0])

    @torch.library.custom_op("raytrm::swiglu_down_backward", mutates_args=())
    def swiglu_down_backward_op(
        grad: torch.Tensor,
        gate_up: torch.Tensor,
        w_down: torch.Tensor,
        h: torch.Tensor,
        w_ordered: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # With w_ordered (gated.down_order's, from the caller's graph) gate_up's gradient is raytrm.models.gated's
        # CUDA kernel's, to the same bits.
        rows, out, inner = down_shape(gate_up, w_down)
        w_grad = cublaslt.product(grad.view(rows, out).t(), h.view(rows, inner))
        if w_ordered is not None:
            from raytrm.models import gated  # it imports this module

            return gated.down_backward(grad, gate_up, w_ordered), w_grad
        grad_gate_up = torch.empty_like(gate_up)
        block_m, block_n, block_k = SWIGLU_DOWN_BACKWARD[0][:3]  # the autotuner's hook sets its config's blocks
        # The inputs copied where they do not start on 16 bytes; the output is fresh, so it does.
        gate_up_halves = [t.view(rows, 2, inner) for t in (_aligned(gate_up), grad_gate_up)]
        descriptors = (
            TensorDescriptor.from_tensor(_aligned(grad).view(rows, out), [block_m, block_k]),
            TensorDescriptor.from_tensor(_aligned(w_down), [block_k, block_n]),
            *(TensorDescriptor.from_tensor(t, [block_m, 1, block_n]) for t in gate_up_halves),
        )
        grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(inner, meta["BLOCK_N"]),)  # noqa: E731
        swiglu_down_backward_kernel[grid](
            *descriptors, rows, out, inner, GROUP=SWIGLU_DOWN_GROUP, INTERPRETED=_INTERPRETED
        )  # fmt: skip
        return grad_gate_up, w_grad

    @swiglu_down_backward_op.register_fake
    def _(
        grad: torch.Tensor,
        gate_up: torch.Tensor,
        w_down: torch.Tensor,
        h: torch.Tensor,
        w_ordered: torch.Tensor | None = None,
    ) -> tuple:
        return torch.empty_like(gate_up), torch.empty_like(w_down)

    def swiglu_down_flops(gate_up_shape, w_down_shape, *args: object, **kwargs: object) -> int:
        return down_flops(gate_up_shape, w_down_shape, 1)

    # The forwards do one product the down projection's size each.
    for forward in (
        torch.ops.raytrm.swiglu_down,
        torch.ops.raytrm.swiglu_down_norm,
        torch.ops.raytrm.swiglu_down_keeping_gate,
    ):
        register_flop_formula(forward)(swiglu_down_flops)

    @register_flop_formula(torch.ops.raytrm.swiglu_down_after_gate)
    def swiglu_down_after_gate_flops(gate_up_shape, h_shape, w_down_shape, *args: object, **kwargs: object) -> int:
        return down_flops(gate_up_shape, w_down_shape, 1)

    @register_flop_formula(torch.ops.raytrm.swiglu_down_backward)
    def swiglu_down_backward_flops(grad_shape, gate_up_shape, w_down_shape, *args: object, **kwargs: object) -> int:
        return down_flops(gate_up_shape, w_down_shape, 2)

    def down_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
        gate_up, w_down = inputs
        ctx.save_for_backward(gate_up, w_down, output[1])
        ctx.mark_non_differentiable(output[1])

    def down_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor, _: object) -> tuple:
        gate_up, w_down, h = ctx.saved_tensors
        from raytrm.models import gated  # it imports this module

        # On Hopper the CUDA kernel, its weight ordered here: under torch.compile in a kernel of inductor's.
        w_ordered = gated.down_order(w_down) if gated.serves_down_backward(gate_up, w_down) else None
        return torch.ops.raytrm.swiglu_down_backward(grad.contiguous(), gate_up, w_down, h, w_ordered)

    torch.library.register_autograd("raytrm::swiglu_down_keeping_gate", down_backward, setup_context=down_setup)

    def after_gate_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
        gate_up, h, w_down = inputs
        ctx.save_for_backward(gate_up, w_down, h)

    def after_gate_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        grad_gate_up, grad_w_down = down_backward(ctx, grad, None)  # saved as down_setup saves them
        return grad_gate_up, None, grad_w_down

    torch.library.register_autograd(
        "raytrm::swiglu_down_after_gate", after_gate_backward, setup_context=after_gate_setup
    )

    def rope_launch(kernel: object, tokens: int, L: int, heads: int, head_dim: int, *args: object) -> None:
        """Run a RoPE kernel over tokens (batch x L) in blocks, a program per block and part (q, k, v)."""
        torch.library.wrap_triton(kernel)[(triton.cdiv(tokens, ROPE_BLOCK_T), 3)](
            *args, BLOCK_T=ROPE_BLOCK_T, BLOCK_H=triton.next_power_of_2(heads), HALF=head_dim // 2,
            INTERPRETED=_INTERPRETED, num_warps=4,
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

    def attention_launch(
        kernel: object, heads: int, tiles: list[tuple[torch.Tensor, str]], cos: torch.Tensor, sin: torch.Tensor,
        lse: torch.Tensor, rotated: bool,
    ) -> None:  # fmt: skip
        """Run an attention kernel over qkv [B, L, 3 * heads * head_dim] (tiles' first tensor; q and k in it rotated
        already where `rotated`), a head at a time in the launch its autotuner picked (programs per multiprocessor,
        warps, stages; _triton_kernels, beside ATTENTION_FORWARD), with SDPA's scale. tiles: the [B, L, width]
        tensors it reads and writes, in its arguments' order, each through a descriptor of a head's "half" or "head"
        of columns over one batch row's positions."""
        qkv = tiles[0][0]
        B, L, width = qkv.shape
        head_dim = width // (3 * heads)
        block_l = lse.shape[1]
        columns = {"half": head_dim // 2, "head": head_dim}
        descriptors = [TensorDescriptor.from_tensor(t, [1, block_l, columns[part]]) for t, part in tiles]
        multiprocessors = _multiprocessors(qkv.device)
        grid = lambda meta: (min(B * heads, meta["PROGRAMS_PER_SM"] * multiprocessors),)  # noqa: E731
        kernel[grid](
            *descriptors, cos, sin, lse, B * heads, L, heads, cos.stride(0), head_dim**-0.5, BLOCK_L=block_l,
            HALF=head_dim // 2, ROTATED=rotated, INTERPRETED=_INTERPRETED,
        )  # fmt: skip

    def attention_outputs(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output [B, L, width / 3] and its rows' log-sum-exp [B * heads, L padded], uninitialised."""
        B, L, width = qkv.shape
        lse = torch.empty(B * heads, max(16, triton.next_power_of_2(L)), dtype=torch.float32, device=qkv.device)
        return qkv.new_empty(B, L, width // 3), lse

    # Opaque operators (custom_op, not triton_op): inductor recompiles a triton_op's kernels its own way, and these
    # ran 5.5 times slower so (1.17 ms against 0.21 for the forward at TRM-attention's Sudoku shape on an H200).
    @torch.library.custom_op("raytrm::rope_attention", mutates_args=())
    def rope_attention_op(
        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, rotated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = attention_outputs(qkv, heads)
        qkv = _aligned(qkv)
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
        qkv, out, grad = _aligned(qkv), _aligned(out), _aligned(grad)
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
                "raytrm.models.rotary_qkv.attention, which differentiates the projection and it as one"
            )
        qkv, cos, sin, out, lse = ctx.saved_tensors
        grad_qkv = torch.ops.raytrm.rope_attention_backward(qkv, cos, sin, out, lse, grad.contiguous(), ctx.heads)
        return grad_qkv, None, None, None, None

    torch.library.register_autograd("raytrm::rope_attention", attention_backward, setup_context=attention_setup)

    _registered = True
    logger.debug("mix_positions_norm, swiglu_gate, rope_qkv, rope_attention: Triton kernels registered")
    return True


def _tables_fit(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernels read the RoPE tables for x [B, L, ...]: rows of unit stride, alike in strides, covering
    its L positions."""
    return cos.stride(-1) == 1 and sin.stride() == cos.stride() and cos.shape[0] >= x.shape[1]


def _check_tables(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    assert _tables_fit(qkv, cos, sin), "bad RoPE tables"


def swiglu_gate(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """silu(gate) * up for gate and up the halves of gate_up along dim, rounded where the plain formula rounds (the
    eager one; inductor rounds only the product); differentiable.

    Only where fused_gate_available(gate_up, dim).
    """
    return torch.ops.raytrm.swiglu_gate(gate_up, dim)


def swiglu_down(gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ w_down^T for gate and up the halves of gate_up's last dimension and w_down [out, inner] in
    gate_up's dtype: a SwiGLU's gate and down projection; differentiable. Without a graph the gate is computed on
    the way into the product, so its output never goes to memory. With one, its output is kept for w_down's
    gradient, and the gate's backward runs in the epilogue of the product that gives the gate's gradient, so that
    gradient never goes to memory.

    Only where fused_swiglu_down_available(gate_up, w_down.shape).
    """
    if torch.is_grad_enabled():
        return torch.ops.raytrm.swiglu_down_keeping_gate(gate_up, w_down)[0]
    return torch.ops.raytrm.swiglu_down(gate_up, w_down)


def swiglu_down_after_gate(gate_up: torch.Tensor, h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """h @ w_down^T for h = silu(gate) * up already computed beside gate_up (raytrm.models.gated), differentiable
    through gate_up and w_down as swiglu_down is (the gate's backward in the epilogue of the product that gives its
    gradient; h kept for w_down's). Only where fused_swiglu_down_after_gate_available(x) for the SwiGLU's input x."""
    return torch.ops.raytrm.swiglu_down_after_gate(gate_up, h, w_down)


def swiglu_down_norm(
    gate_up: torch.Tensor, w_down: torch.Tensor, x: torch.Tensor, eps: float, then: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x + swiglu_down(gate_up, w_down), eps) in one kernel, for the rounds that keep no graph: a
    residual add and norm in the epilogue of swiglu_down's product, a tile holding whole rows. x is added in its
    dtype and the norm is in fp32, as the eager formulas do. With `then` (x's shape, dtype and layout), the result
    plus then, added in its dtype as a separate add would: the next recursion's input, written in place of the
    norm's output (TRM's latent updates, raytrm.models.trm).

    Only where fused_swiglu_down_norm_available(x, gate_up, w_down.shape, then).
    """
    return torch.ops.raytrm.swiglu_down_norm(gate_up, w_down, x, eps, then)


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of qkv [B, L, 3 * heads * head_dim] rotated by position, and v: each [B, L, heads, head_dim],
    contiguous; differentiable. cos and sin are rotate-half tables [positions >= L, head_dim] (RotaryEmbedding's).
    Half-precision q and k rotate in fp32 and are rounded once, as _Rotary's.

    Only where fused_rope_available(qkv, head_dim).
    """
    _check_tables(qkv, cos, sin)
    return torch.ops.raytrm.rope_qkv(qkv, cos, sin, heads)


def rope_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, rotated: bool = False
) -> torch.Tensor:
    """Self-attention over qkv [B, L, 3 * heads * head_dim] (q, k and v side by side, as the fused projection
    writes them) with q and k rotated by position: [B, L, heads * head_dim], the heads side by side, as the output
    projection reads them; differentiable. cos and sin are rotate-half tables [positions >= L, head_dim]
    (RotaryEmbedding's); the rotation rounds as rope_qkv's, the attention as flash attention's kernels do.

    With `rotated`, q and k in qkv come rotated (raytrm.models.rotary_qkv's projection) and are taken as they are;
    not differentiable so (rotary_qkv.attention is).

    Only where fused_attention_available(qkv, head_dim, causal=False).
    """
    _check_tables(qkv, cos, sin)
    return torch.ops.raytrm.rope_attention(qkv, cos, sin, heads, rotated)[0]


def mix_positions_norm(cols: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(cols + w_down @ swiglu_gate(w_gate_up @ cols, dim=0), eps, dim=0) in one kernel.

    cols is [L, N] (positions, columns), w_gate_up [2 * inner, L] and w_down [L, inner] in cols' dtype; inner must
    be a multiple of 64 (swiglu_width's multiples of 256 are). Only where fused_mix_available(cols).
    """
    L = cols.shape[0]
    inner = w_down.shape[1]
    assert w_gate_up.shape == (2 * inner, L) and w_down.shape == (L, inner), "weights do not match the columns"
    assert inner % 64 == 0, "the SwiGLU's inner width must be a multiple of 64"
    return torch.ops.raytrm.mix_positions_norm(cols.contiguous(), w_gate_up.contiguous(), w_down.contiguous(), eps)
