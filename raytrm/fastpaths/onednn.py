"""Linear layers on oneDNN's matrix products, for fp32 on AMD's x86-64 CPUs.

On a CPU, torch.mm (and so F.linear and autograd's products) runs MKL's sgemm. PyTorch's x86-64 wheels carry oneDNN
too (torch.backends.mkldnn), whose just-in-time kernels suit AMD's CPUs, where MKL, Intel's own library, does not
pick its best kernels; on Intel's CPUs MKL is at home. So on AMD's CPUs the operation linear (a Linear's forward, and
the gradient of its input) runs on oneDNN's `_linear_pointwise` (the op inductor uses for CPU linears) with the
weight packed into oneDNN's layout once for each value it takes; the weight's gradient stays on MKL, since both of
its operands are strided activations that oneDNN would have to pack at every call. Intel's CPUs, and CPUs whose maker
is unknown, keep MKL. docs/performance.md's CPU rows give the ceiling of each on the build machine.

The products sum in another order than MKL's, so results agree with F.linear within fp32 rounding, not to the bit.
Elsewhere (other dtypes, GPUs, Apple Silicon's CPUs, under torch.compile, which packs its own weights) a Linear is
F.linear.
"""

from __future__ import annotations

import math
import platform

import torch
import torch.nn.functional as F

from raytrm.fastpaths.registry import Backend
from raytrm.hardware import device as devices
from raytrm.hardware import linux

#: The CPU maker whose CPUs run their products on oneDNN rather than MKL (the module's docstring).
FASTER_ON = "AuthenticAMD"


def why_not(machine: str, has_linear: bool, vendor: str) -> str | None:
    """Why oneDNN's linear does not serve a CPU, or None where it does: an x86-64 CPU made by FASTER_ON's maker,
    with a torch that has the op (has_linear)."""
    if machine.lower() not in ("x86_64", "amd64"):
        return f"oneDNN's linear needs an x86-64 CPU; this is {machine}"
    if not has_linear:
        return "this torch has no oneDNN linear"
    if vendor != FASTER_ON:
        return f"oneDNN's linear beat MKL on AMD's CPUs only; this one is {vendor or 'of an unknown maker'}"
    return None


#: Why oneDNN's linear does not serve this machine (None where it does), and whether it does. Tests turn ENABLED off
#: to compare with MKL.
WHY_NOT = why_not(
    platform.machine(),
    torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"),
    linux.cpu_vendor(),
)
ENABLED = WHY_NOT is None


def on() -> bool:
    """Whether this process's fp32 CPU linear layers run on oneDNN: it serves this CPU (ENABLED), and torch's oneDNN
    is not turned off (torch.backends.mkldnn.flags(enabled=False))."""
    return ENABLED and torch.backends.mkldnn.enabled


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T runs on oneDNN: where it is on, fp32 on a CPU, eager, with a 2-D weight and an x of 2 or
    more dims (linear_why_not)."""
    return linear_why_not(x, weight) is None


def reason() -> str:
    """One line on where a CPU's fp32 products run, for the log."""
    if not ENABLED:
        return f"torch.mm's BLAS for all ({WHY_NOT or 'oneDNN linear layers are turned off'})"
    if not torch.backends.mkldnn.enabled:
        return "torch.mm's BLAS for all (torch's oneDNN is turned off)"
    return "linear layers on oneDNN, the rest on torch.mm's BLAS (an AMD x86-64 CPU; raytrm.fastpaths.onednn says why)"


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) on oneDNN, weight in its packed layout (see _packed)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed(weight: torch.Tensor, transposed: bool, rows: int) -> torch.Tensor:
    """weight (or its transpose) reordered into oneDNN's blocked layout, kept on the weight until it changes.

    A packed weight runs its products faster than the dense one, and a weight serves dozens of products
    between two optimizer steps (TRM's 21 rounds reuse one network), so it is packed once for each value it holds.
    Its version counter moves with every in-place write through torch (the optimizer's step, load_state_dict, an
    EMA swap), and with it the packed copy; a write through `.data` would not be seen, and raytrm makes none. Costs
    a copy of the weight each way, on the weight (a replica's weights have their own).
    """
    key = (weight._version, weight.data_ptr())
    packs = weight.__dict__.setdefault("_onednn_packed", {})
    hit = packs.get(transposed)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            dense = weight.t().contiguous() if transposed else weight.contiguous()
            hit = packs[transposed] = (key, torch.ops.mkldnn._reorder_linear_weight(dense, rows))
    return hit[1]


def _rows(t: torch.Tensor) -> int:
    return t.numel() // t.shape[-1]


class _Linear(torch.autograd.Function):
    """F.linear with oneDNN's products forward and for the input's gradient, MKL's for the weight's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, _packed(weight, False, _rows(x)), bias)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(g, _packed(weight, True, _rows(g)), None)
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_w = torch.mm(g2.t(), x.reshape(-1, x.shape[-1]))
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), on oneDNN where `available` says so."""
    if available(x, weight):
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_why_not(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """The operation linear's: where oneDNN's linear is on (`on`), fp32 on a CPU, eager, a 2-D weight and an x of 2
    or more dims."""
    if not ENABLED:
        return WHY_NOT or "turned off (onednn.ENABLED)"
    if not torch.backends.mkldnn.enabled:
        return "torch's oneDNN is turned off"
    if x.device.type != devices.CPU:
        return "not on a CPU"
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return "not fp32"
    if x.dim() < 2 or weight.dim() != 2:
        return "a vector"
    if torch.compiler.is_compiling():
        return "compiled (inductor packs its own weights)"
    return None


def _serve(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _Linear.apply(x, weight, bias)


_registered = False


def load() -> bool:
    """Count oneDNN's linear in torch's FLOP counter as F.linear is counted (2 m k n), once per process; True where
    oneDNN's linear serves this CPU."""
    global _registered
    if _registered or not ENABLED:
        return ENABLED
    from torch.utils.flop_counter import register_flop_formula

    op = torch.ops.mkldnn._linear_pointwise  # both overloads: (x, w, ...) and binary's (x, other, w, ...)
    if op not in torch.utils.flop_counter.flop_registry:

        @register_flop_formula(op)
        def linear_pointwise_flops(x_shape, second, third=None, *args: object, **kwargs: object) -> int:
            w_shape = third if isinstance(third, torch.Size) and len(third) == 2 else second
            return 2 * math.prod(x_shape[:-1]) * w_shape[0] * w_shape[1]

    _registered = True
    return True


BACKENDS = (Backend("linear", "onednn", linear_why_not, _serve),)
