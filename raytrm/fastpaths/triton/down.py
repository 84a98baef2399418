"""The SwiGLU's gate and down projection as Triton operators (torch.ops.raytrm.swiglu_down and its kin).

Without a graph, the kernel computes the gate from the projection as it loads it into the down projection's product,
so the gate's output never goes to memory and back; with one, the gate's backward runs in the epilogue of the product
that gives its gradient. In the rounds without a graph a post-norm block's residual add and norm (and the next
recursion's injection) join the same kernel's epilogue (swiglu_down_norm, a tile holding whole rows); on GPUs with TMA
copies that kernel takes its weight, the residual and the injection and writes its output as TMA copies, to the same
bits. Opaque operators (custom_op): their launches are tuned here, not by inductor.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.utils.flop_counter import register_flop_formula

from raytrm.fastpaths import cublaslt, registry
from raytrm.fastpaths.device import aligned
from raytrm.fastpaths.triton import tma_copies
from raytrm.fastpaths.triton.common import INTERPRETED, add_rms_norm, gate_gradients, gated, operand, rounded
from raytrm.fastpaths.triton.gate import gate_launch, swiglu_gate_kernel

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.3: the kernels that copy through descriptors are never asked for
    TensorDescriptor = None

#: How the down projection runs with the gate in it: (rows, columns, inner step) of a tile, warps, pipeline stages;
#: the fastest of the tilings measured at TRM's shape, each giving the same bits as the gate operator with cuBLAS's
#: product.
SWIGLU_DOWN = (128, 256, 64, 8, 3)
#: The backward's tiles, the autotuner's pick (they give the same bits: their inner steps alike).
SWIGLU_DOWN_BACKWARD = ((64, 128, 64, 4, 3), (128, 128, 64, 4, 3))
#: Row blocks of the backward's tiles that run side by side, sharing the weight's column blocks in L2.
SWIGLU_DOWN_GROUP = 8


#: The same with the residual add and RMSNorm in the epilogue (NORM): (rows, inner step) of a tile holding whole
#: rows, warps, stages.
SWIGLU_DOWN_NORM = (64, 64, 8, 3)


@triton.jit
def swiglu_down_kernel(
    gate_up_ptr, w_ptr, out_ptr, x_ptr, then_ptr, M, N, F, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM: tl.constexpr, THEN_ADD: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """out [M, N] = (silu(gate) * up) @ w^T for gate_up [M, 2 * F] (gate, then up, in each row) and w [N, F]: the
    down projection with the gate computed on the way in (gated, rounded as the gate operator's), so that the
    gate's [M, F] output never goes to memory. With NORM (then BLOCK_N >= N: a tile holds whole rows), out is
    rms_norm(x + that) instead, x [M, N], added in out's dtype and normalised in fp32 as the plain formulas do; with
    THEN_ADD too, out is that norm plus then [M, N], added in out's dtype (the next network's input, which would
    otherwise be a pass of its own). A program takes a tile; a row block's tiles are neighbours, so its gate_up comes
    from memory once. F must be a multiple of BLOCK_K."""
    dtype = out_ptr.dtype.element_ty
    column_blocks = tl.cdiv(N, BLOCK_N)
    rows = ((tl.program_id(0) // column_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    columns = (tl.program_id(0) % column_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    row_mask = (rows < M)[:, None]
    column_mask = (columns < N)[None, :]
    gate_ptr = gate_up_ptr + rows[:, None] * (2 * F) + inner[None, :]
    w_t_ptr = w_ptr + columns[None, :] * F + inner[:, None]  # [BLOCK_K, BLOCK_N] of w^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, F, BLOCK_K):
        gate = tl.load(gate_ptr + k, mask=row_mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + k + F, mask=row_mask, other=0.0).to(tl.float32)
        h = operand(gated(gate, up, dtype, INTERPRETED).to(dtype), INTERPRETED)
        acc = tl.dot(h, operand(tl.load(w_t_ptr + k, mask=column_mask, other=0.0), INTERPRETED), acc)
    mask = row_mask & column_mask
    out = rounded(acc, dtype, INTERPRETED)
    if NORM:
        x = tl.load(x_ptr + rows[:, None] * N + columns[None, :], mask=mask, other=0.0).to(tl.float32)
        out = add_rms_norm(x, out, N, eps, dtype, INTERPRETED)
        if THEN_ADD:
            then = tl.load(then_ptr + rows[:, None] * N + columns[None, :], mask=mask, other=0.0).to(tl.float32)
            out = rounded(out + then, dtype, INTERPRETED)
    tl.store(out_ptr + rows[:, None] * N + columns[None, :], out.to(dtype), mask=mask)


#: swiglu_down_kernel with NORM on GPUs that copy tiles with TMA: (rows, inner step) of a tile, warps, stages. Its
#: weight comes in as TMA copies and its epilogue reads x and then and writes out as TMA copies, where the pointer
#: loads' address arithmetic held the programs back.
SWIGLU_DOWN_NORM_TMA = (64, 64, 8, 3)


@triton.jit
def swiglu_down_norm_kernel(
    gate_up_ptr, w, x, then, out, M, F, eps, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    THEN_ADD: tl.constexpr, EVEN: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """swiglu_down_kernel's NORM (and THEN_ADD) output, the same bits, with w, x, then and out as descriptors: w [N,
    F] viewed as [N / BOX, BOX, F] (block [N / BOX, BOX, BLOCK_K]), the others [M, N] viewed as [M, N / BOX, BOX]
    (block [BLOCK_M, N / BOX, BOX]), BOX at most 256 (a TMA copy's limit). A program takes BLOCK_M whole rows; EVEN
    when M is a multiple of BLOCK_M (gate_up's loads unmasked)."""
    dtype: tl.constexpr = out.dtype
    row = tl.program_id(0) * BLOCK_M
    rows = (row + tl.arange(0, BLOCK_M)).to(tl.int64)
    gate_ptr = gate_up_ptr + rows[:, None] * (2 * F) + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((BLOCK_M, N), dtype=tl.float32)
    for k in range(0, F, BLOCK_K):
        if EVEN:
            gate = tl.load(gate_ptr + k).to(tl.float32)
            up = tl.load(gate_ptr + k + F).to(tl.float32)
        else:
            gate = tl.load(gate_ptr + k, mask=(rows < M)[:, None], other=0.0).to(tl.float32)
            up = tl.load(gate_ptr + k + F, mask=(rows < M)[:, None], other=0.0).to(tl.float32)
        h = operand(gated(gate, up, dtype, INTERPRETED).to(dtype), INTERPRETED)
        w_t = tl.trans(w.load([0, 0, k]).reshape(N, BLOCK_K))
        acc = tl.dot(h, operand(w_t, INTERPRETED), acc)
    # x is read after the loop and then after the norm, so that neither is held through the loop (with both read
    # together the program spilled).
    residual = x.load([row, 0, 0]).reshape(BLOCK_M, N).to(tl.float32)
    y = add_rms_norm(residual, rounded(acc, dtype, INTERPRETED), N, eps, dtype, INTERPRETED)
    if THEN_ADD:
        y = rounded(y + then.load([row, 0, 0]).reshape(BLOCK_M, N).to(tl.float32), dtype, INTERPRETED)
    out.store([row, 0, 0], y.to(dtype).reshape(out.block_shape))


def _down_blocks(nargs: dict) -> None:
    """The autotuner's hook before a launch of swiglu_down_backward_kernel: its descriptors' blocks set to the
    config's tiles."""
    m, n, k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["grad"].block_shape = [m, k]
    nargs["w"].block_shape = [k, n]
    nargs["gate_up"].block_shape = nargs["grad_gate_up"].block_shape = [m, 1, n]


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s, pre_hook=_down_blocks)
        for m, n, k, w, s in (SWIGLU_DOWN_BACKWARD[:1] if INTERPRETED else SWIGLU_DOWN_BACKWARD)
    ],
    key=["M", "N", "F"],
)
@triton.jit
def swiglu_down_backward_kernel(
    grad, w, gate_up, grad_gate_up, M, N, F, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """grad_gate_up [M, 2 * F] (laid out as gate_up) for grad [M, N], the gradient of swiglu_down_kernel's output:
    the gate's gradient grad @ w (w [N, F]), rounded to gate_up's dtype as a product's output is, goes through the
    gate's backward (gate_gradients) in the product's epilogue, so that it never goes to memory. A program takes a
    tile of [M, F]; GROUP row blocks' tiles run side by side, sharing w's column blocks. The tensors come as
    descriptors, of blocks [BLOCK_M, BLOCK_K] (grad), [BLOCK_K, BLOCK_N] (w) and [BLOCK_M, 1, BLOCK_N] (gate_up and
    grad_gate_up viewed as [M, 2, F]: gate, then up)."""
    dtype: tl.constexpr = grad_gate_up.dtype
    row_blocks, column_blocks = tl.cdiv(M, BLOCK_M), tl.cdiv(F, BLOCK_N)
    group, within = tl.program_id(0) // (GROUP * column_blocks), tl.program_id(0) % (GROUP * column_blocks)
    group_rows = tl.minimum(row_blocks - group * GROUP, GROUP)
    row = (group * GROUP + within % group_rows) * BLOCK_M
    column = (within // group_rows) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, N, BLOCK_K):
        acc = tl.dot(operand(grad.load([row, k]), INTERPRETED), operand(w.load([k, column]), INTERPRETED), acc)
    gate = gate_up.load([row, 0, column]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
    up = gate_up.load([row, 1, column]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
    grad_gate, grad_up = gate_gradients(gate, up, rounded(acc, dtype, INTERPRETED), dtype, INTERPRETED)
    grad_gate_up.store([row, 0, column], grad_gate.to(dtype).reshape(BLOCK_M, 1, BLOCK_N))
    grad_gate_up.store([row, 1, column], grad_up.to(dtype).reshape(BLOCK_M, 1, BLOCK_N))


def down_shape(gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[int, int, int]:
    """(rows, out, inner) of a down projection of gate_up [..., 2 * inner] by w_down [out, inner]."""
    out, inner = w_down.shape
    return gate_up.numel() // (2 * inner), out, inner


def down_flops(gate_up_shape: torch.Size, w_down_shape: torch.Size, products: int) -> int:
    """FLOPs of `products` products the down projection's size, as torch counts a linear layer's."""
    out, inner = w_down_shape
    return products * 2 * (math.prod(gate_up_shape) // (2 * inner)) * inner * out


def down_launch(
    gate_up: torch.Tensor, w_down: torch.Tensor, x: torch.Tensor | None, eps: float, then: torch.Tensor | None = None
) -> torch.Tensor:
    """swiglu_down_kernel over gate_up: the down projection, or with x the norm of x plus it (plus then), which
    swiglu_down_norm_kernel computes to the same bits where tiles are copied with TMA."""
    rows, out, inner = down_shape(gate_up, w_down)
    y = gate_up.new_empty(*gate_up.shape[:-1], out)
    if x is not None and tma_copies(gate_up):
        block_m, block_k, warps, stages = SWIGLU_DOWN_NORM_TMA
        box = min(out, 256)  # a TMA copy's longest side
        w_view = aligned(w_down).view(out // box, box, inner)
        row_views = [t.view(rows, out // box, box) for t in (aligned(x), aligned(x if then is None else then), y)]
        swiglu_down_norm_kernel[(triton.cdiv(rows, block_m),)](
            gate_up, TensorDescriptor.from_tensor(w_view, [out // box, box, block_k]),
            *(TensorDescriptor.from_tensor(t, [block_m, out // box, box]) for t in row_views), rows, inner, eps,
            N=out, BLOCK_M=block_m, BLOCK_K=block_k, THEN_ADD=then is not None, EVEN=rows % block_m == 0,
            INTERPRETED=INTERPRETED, num_warps=warps, num_stages=stages,
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
        INTERPRETED=INTERPRETED, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


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
    # The gate operator and cuBLAS's product: with the gate inside the product, written out too (by its first column
    # block's programs), TRM-attention's compiled step ran slower. Launched directly, not through wrap_triton, whose
    # dispatch inside an opaque operator costs the host more than the kernel takes.
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
    # h, the gate of gate_up, computed beside it (the Hopper backend's kernel): cuBLAS's product, the backward as above.
    rows, out, inner = down_shape(gate_up, w_down)
    return cublaslt.product(h.view(rows, inner), w_down.t()).view(*gate_up.shape[:-1], out)


@swiglu_down_after_gate_op.register_fake
def _(gate_up: torch.Tensor, h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], w_down.shape[0])


@torch.library.custom_op("raytrm::swiglu_down_backward", mutates_args=())
def swiglu_down_backward_op(
    grad: torch.Tensor, gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, out, inner = down_shape(gate_up, w_down)
    w_grad = cublaslt.product(grad.view(rows, out).t(), h.view(rows, inner))
    grad_gate_up = torch.empty_like(gate_up)
    block_m, block_n, block_k = SWIGLU_DOWN_BACKWARD[0][:3]  # the autotuner's hook sets its config's blocks
    # The inputs copied where they do not start on 16 bytes; the output is fresh, so it does.
    gate_up_halves = [t.view(rows, 2, inner) for t in (aligned(gate_up), grad_gate_up)]
    descriptors = (
        TensorDescriptor.from_tensor(aligned(grad).view(rows, out), [block_m, block_k]),
        TensorDescriptor.from_tensor(aligned(w_down), [block_k, block_n]),
        *(TensorDescriptor.from_tensor(t, [block_m, 1, block_n]) for t in gate_up_halves),
    )
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(inner, meta["BLOCK_N"]),)  # noqa: E731
    swiglu_down_backward_kernel[grid](*descriptors, rows, out, inner, GROUP=SWIGLU_DOWN_GROUP, INTERPRETED=INTERPRETED)
    return grad_gate_up, w_grad


@swiglu_down_backward_op.register_fake
def _(grad: torch.Tensor, gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor) -> tuple:
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


@registry.op("swiglu_down_backward")
def swiglu_down_backward(
    grad: torch.Tensor, gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of gate_up and w_down from the gradient grad of (silu(gate) * up) @ w_down^T, h the gate's
    output: Triton's kernel (the gate's backward in the epilogue of the product that gives its gradient), and
    cuBLAS's product. An operation of the registry, which the Hopper backend serves where its CUDA kernel runs."""
    return torch.ops.raytrm.swiglu_down_backward(grad, gate_up, w_down, h)


def down_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    gate_up, w_down = inputs
    ctx.save_for_backward(gate_up, w_down, output[1])
    ctx.mark_non_differentiable(output[1])


def down_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor, _: object) -> tuple:
    gate_up, w_down, h = ctx.saved_tensors
    return swiglu_down_backward(grad.contiguous(), gate_up, w_down, h)


torch.library.register_autograd("raytrm::swiglu_down_keeping_gate", down_backward, setup_context=down_setup)


def after_gate_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    gate_up, h, w_down = inputs
    ctx.save_for_backward(gate_up, w_down, h)


def after_gate_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    grad_gate_up, grad_w_down = down_backward(ctx, grad, None)  # saved as down_setup saves them
    return grad_gate_up, None, grad_w_down


torch.library.register_autograd("raytrm::swiglu_down_after_gate", after_gate_backward, setup_context=after_gate_setup)
