"""The SwiGLU's gate/up product and its gate in one kernel on Hopper GPUs (CUDA C++, csrc/gated_swiglu.cu).

h = silu(x @ w_gate^T) * (x @ w_up^T), and gate_up = x @ w^T beside it where asked for, with the bits of cuBLAS's
product followed by raytrm's Triton gate kernel. The kernel keeps each tile's results in registers and gates and
stores them while the tensor cores run the next tile's products. It serves the operation swiglu: in the rounds without
a gradient h alone, then the down projection; in the back-propagated round h and gate_up, whose gradient the down
projection's backward computes (Triton's swiglu_down_after_gate), there with a second kernel of the library
(`down_backward`): the same CTAs and tiles with the gate's backward in the epilogue, to the bits of Triton's kernel.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from raytrm.fastpaths import cublaslt, registry, triton
from raytrm.fastpaths.device import aligned
from raytrm.fastpaths.hopper import library
from raytrm.fastpaths.hopper.library import COLUMN_TILE, INNER

#: Tests and A/B runs turn this off: the down projection's backward then takes Triton's kernel.
DOWN_BACKWARD = True


def gated_why_not(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Whether gated_swiglu takes x [..., 512] and the weight w [2 N, 512] (the gate's rows first) cast to x's dtype:
    x bf16 and contiguous on a Hopper GPU, N a multiple of 128, the library built."""
    if x.shape[-1] != INNER or w.dim() != 2 or w.shape[1] != INNER:
        return "the input is not 512 wide"
    if w.shape[0] % (2 * COLUMN_TILE):
        return "the inner width is no multiple of 128"
    return library.takes_why_not(x)


def swiglu_why_not(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> str | None:
    """The operation swiglu's: gated_why_not's; with a gradient recorded, where Triton's down projection after the
    gate runs too (its backward gives gate_up's gradient)."""
    if why := gated_why_not(x, w_gate_up):
        return why
    if torch.is_grad_enabled() and triton.after_gate_why_not(x):
        return "a gradient is recorded, and Triton's down projection after the gate does not serve"
    return None


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The operation swiglu with the gated product: h to the down projection (the linear operation) without a
    gradient; with one, h and gate_up to Triton's down projection after the gate."""
    if not torch.is_grad_enabled():
        return registry.call("linear", gated_swiglu(x, w_gate_up)[0], w_down)
    h, gate_up = gated_swiglu(x, w_gate_up, keep_gate_up=True)
    return triton.swiglu_down_after_gate(gate_up, h, w_down)


def kernel_order(w: torch.Tensor) -> torch.Tensor:
    """w [2 N, 512] with its rows in the kernel's order: within each 32 rows, the row of output column 8 q + 2 i + e
    (q, i < 4, e < 2) at 8 i + 2 q + e, so that the 8 columns that wgmma's accumulator layout gives a thread are 8
    consecutive output columns (csrc/gated_swiglu.cu). The order is its own inverse. Under torch.compile the rows move
    in the kernel that casts the weight to bf16 (`gated_swiglu`), not in a copy of their own."""
    return w.reshape(-1, 4, 4, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def _launch(x: torch.Tensor, w: torch.Tensor, keep_gate_up: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel over x [rows, 512] and w [2 N, 512] in the kernel's order (kernel_order): (h, gate_up or None),
    fresh."""
    rows, inner = x.shape[0], w.shape[0] // 2
    x, w = aligned(x.contiguous()), aligned(w.contiguous())  # TMA copies start on 16 bytes
    h = x.new_empty(rows, inner)
    gate_up = x.new_empty(rows, 2 * inner) if keep_gate_up else None
    library.run("raytrm_gated_swiglu", "gated SwiGLU", (x, w, h, gate_up), rows, inner)
    return h, gate_up


def down_backward_why_not(
    grad: torch.Tensor, gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor
) -> str | None:
    """The operation swiglu_down_backward's, for gate_up [..., 2 F] and w_down [512, F]: both bf16 on a Hopper GPU,
    gate_up contiguous, F a multiple of 256, the library built, DOWN_BACKWARD."""
    if not DOWN_BACKWARD:
        return "turned off (hopper.gated.DOWN_BACKWARD)"
    if w_down.dtype != torch.bfloat16 or w_down.dim() != 2 or w_down.shape[0] != INNER:
        return "not a bf16 down projection to 512"
    if w_down.shape[1] % (2 * COLUMN_TILE) or gate_up.shape[-1] != 2 * w_down.shape[1]:
        return "the inner width is no multiple of 256"
    return library.takes_why_not(gate_up)


def down_order(w_down: torch.Tensor) -> torch.Tensor:
    """w_down [512, F] as down_backward takes it: transposed, [F, 512], its rows in the kernel's order. A copy: in the
    caller's graph, so that under torch.compile it is an inductor kernel of its own."""
    return kernel_order(w_down.t())


def down_backward(grad: torch.Tensor, gate_up: torch.Tensor, w_ordered: torch.Tensor) -> torch.Tensor:
    """gate_up's gradient (fresh, laid out as gate_up) for the gradient grad [..., 512] of
    (silu(gate) * up) @ w_down^T: the gate's gradient grad @ w_down, rounded to bf16, goes through the gate's
    backward in the product's epilogue (csrc/gated_swiglu.cu), with the bits of Triton's kernel. w_ordered is
    down_order(w_down)."""
    inner = w_ordered.shape[0]
    rows = gate_up.numel() // (2 * inner)
    # TMA and cp.async copies start on 16 bytes
    grad, gate_up, w_ordered = (aligned(t.contiguous()) for t in (grad, gate_up, w_ordered))
    grad_gate_up = torch.empty_like(gate_up)
    library.run(
        "raytrm_swiglu_down_backward",
        "SwiGLU's down-projection backward",
        (grad, w_ordered, gate_up, grad_gate_up),
        rows,
        inner,
    )
    return grad_gate_up


# Opaque operators: h alone (the rounds without a gradient; w in the kernel's order, which the caller's graph gives),
# and h with gate_up, differentiable through gate_up (h's use, the down projection, computes gate_up's gradient; w as
# the layer has it, which its backward takes).
@torch.library.custom_op("raytrm::gated_swiglu", mutates_args=())
def _gated_swiglu_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _launch(x, w, keep_gate_up=False)[0]


@_gated_swiglu_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0] // 2)


@torch.library.custom_op("raytrm::gated_swiglu_keeping_gate_up", mutates_args=())
def _gated_swiglu_keeping_op(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h, gate_up = _launch(x, kernel_order(w), keep_gate_up=True)
    assert gate_up is not None
    return h, gate_up


@_gated_swiglu_keeping_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], w.shape[0] // 2), x.new_empty(x.shape[0], w.shape[0])


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs)
    ctx.mark_non_differentiable(output[0])


def _backward(ctx: torch.autograd.function.FunctionCtx, _: object, grad: torch.Tensor) -> tuple:
    """x's and w's gradients from gate_up's, with the products a Linear's backward runs (cuBLASLt's operator), so
    that they have its bits: w's as the transpose of x^T @ grad."""
    x, w = ctx.saved_tensors
    grad = grad.contiguous()
    return torch.ops.raytrm.mm(grad, w), torch.ops.raytrm.mm(x.t(), grad).t()


torch.library.register_autograd("raytrm::gated_swiglu_keeping_gate_up", _backward, setup_context=_setup)


@torch.library.custom_op("raytrm::swiglu_down_backward_hopper", mutates_args=())
def _down_backward_op(
    grad: torch.Tensor, gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, w_ordered: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton's swiglu_down_backward with gate_up's gradient from this library's kernel (the same bits)."""
    out, inner = w_down.shape
    rows = gate_up.numel() // (2 * inner)
    w_grad = cublaslt.product(grad.view(rows, out).t(), h.view(rows, inner))
    return down_backward(grad, gate_up, w_ordered), w_grad


@_down_backward_op.register_fake
def _(grad: torch.Tensor, gate_up: torch.Tensor, w_down: torch.Tensor, *args: object) -> tuple:
    return torch.empty_like(gate_up), torch.empty_like(w_down)


def swiglu_down_backward(
    grad: torch.Tensor, gate_up: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The operation swiglu_down_backward on this library's kernel, w_down ordered here: in the caller's graph, so
    that under torch.compile the copy is a kernel of inductor's."""
    return torch.ops.raytrm.swiglu_down_backward_hopper(grad, gate_up, w_down, h, down_order(w_down))


def _flops(x_shape: torch.Size, w_shape: torch.Size, *args: object, **kwargs: object) -> int:
    """The gate/up product's FLOPs, as torch counts a linear layer's."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[0]


def _down_backward_flops(grad_shape, gate_up_shape, w_down_shape, *args: object, **kwargs: object) -> int:
    """Two products the down projection's size, as Triton's operator counts them."""
    out, inner = w_down_shape
    return 2 * 2 * (math.prod(gate_up_shape) // (2 * inner)) * inner * out


for _op in (torch.ops.raytrm.gated_swiglu, torch.ops.raytrm.gated_swiglu_keeping_gate_up):
    register_flop_formula(_op)(_flops)
register_flop_formula(torch.ops.raytrm.swiglu_down_backward_hopper)(_down_backward_flops)


def gated_swiglu(
    x: torch.Tensor, w: torch.Tensor, keep_gate_up: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h [..., N], gate_up [..., 2 N] or None) for x [..., 512] and w [2 N, 512] (the gate's rows first), both
    bf16. With keep_gate_up it is differentiable through gate_up (h is not)."""
    why = gated_why_not(x, w) or (None if w.dtype == x.dtype else "w is not in x's dtype")
    if why:
        raise ValueError(
            f"gated_swiglu takes bf16 x [..., {INNER}] and w [2 N, {INNER}] (N a multiple of {COLUMN_TILE}), "
            f"contiguous, on a Hopper GPU with the kernel built; got x {tuple(x.shape)} {x.dtype} on {x.device}, "
            f"w {tuple(w.shape)} {w.dtype} ({why})"
        )
    rows, inner = x.numel() // INNER, w.shape[0] // 2
    if keep_gate_up:
        h, gate_up = torch.ops.raytrm.gated_swiglu_keeping_gate_up(x.view(rows, INNER), w)
        return h.view(*x.shape[:-1], inner), gate_up.view(*x.shape[:-1], 2 * inner)
    h = torch.ops.raytrm.gated_swiglu(x.view(rows, INNER), kernel_order(w))
    return h.view(*x.shape[:-1], inner), None
