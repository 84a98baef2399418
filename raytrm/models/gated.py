"""The SwiGLU's gate/up product and its gate in one kernel on Hopper GPUs (CUDA C++, csrc/gated_swiglu.cu).

h = silu(x @ w_gate^T) * (x @ w_up^T), and gate_up = x @ w^T beside it where asked for, with the bits of cuBLAS's
product followed by raytrm's Triton gate kernel (kernels.swiglu_gate). The kernel keeps each tile's results in
registers and gates and stores them while the tensor cores run the next tile's products: at TRM's Sudoku shape on an
H200, h in 359 us a call and h with gate_up in 397, against 317 for cuBLASLt's product alone and 461 with the gate
operator after it (README, Performance). raytrm's SwiGLU takes it where it serves (layers.SwiGLU): in the rounds
without a gradient h alone, then cuBLAS's down projection; in the back-propagated round h and gate_up, whose gradient
the down projection's backward computes (kernels.swiglu_down_after_gate): on these GPUs with a second kernel
(`down_backward`), the same CTAs and tiles with the gate's backward in the epilogue, to the bits of raytrm's Triton
kernel, 348-350 us a call at TRM's shape on an H200 against the Triton kernel's 474-494 (README, Performance).

The library holds a third kernel, the attention's qkv projection with RoPE in its epilogue (raytrm.models.rotary_qkv).
It is built with nvcc when a model is built on a machine with a Hopper GPU, and cached under constants.cache_dir();
without nvcc, such a GPU or a build that succeeds, `serves` is False (the reason is logged) and the SwiGLU computes
the product and the gate apart, as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from raytrm.constants import cache_dir
from raytrm.models import cublaslt  # noqa: F401  (torch.ops.raytrm.mm, which the backward runs)
from raytrm.models.kernels import _aligned, _capability, _multiprocessors

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gated_swiglu.cu"
#: The library's sources, this module's kernels and the attention's projection with RoPE (raytrm.models.rotary_qkv),
#: and what they include (the Hopper kernels' shared parts).
SOURCES = (SOURCE, SOURCE.with_name("rotary_qkv.cu"))
HEADERS = (SOURCE.with_name("hopper.cuh"),)
#: The kernel's fixed shapes: the inner dimension (TRM's hidden size 512) and its tiles' columns.
INNER = 512
COLUMN_TILE = 128
#: The compute capability the kernel is built for (sm_90a: wgmma and setmaxnreg).
HOPPER = (9, 0)
#: Tests and A/B runs turn this off: the SwiGLU then computes the product and the gate apart.
ENABLED = True
#: And this: the down projection's backward then takes raytrm's Triton kernel (kernels.swiglu_down_backward).
DOWN_BACKWARD = True
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC")

_lib: ctypes.CDLL | None = None
_why_not: str | None = None
_loaded = False


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _build() -> tuple[ctypes.CDLL | None, str | None]:
    """The kernel's library, built once for its source and compiler and cached; and why not (None where it loaded)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    nvcc = _nvcc()
    if nvcc is None:
        return None, "no nvcc (set CUDA_HOME or put nvcc on PATH)"
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    text = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(text + version.encode() + " ".join(NVCC_FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"gated_swiglu-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [nvcc, *NVCC_FLAGS, "-o", str(built), *map(str, SOURCES), "-lcuda"], capture_output=True, text=True
            )
            if result.returncode != 0:
                return None, f"nvcc failed: {result.stderr.strip()[-500:]}"
            os.replace(built, target)  # atomic: a process beside this one sees the whole library or none
    lib = ctypes.CDLL(str(target))
    p, i = ctypes.c_void_p, ctypes.c_int
    for entry in (lib.raytrm_gated_swiglu, lib.raytrm_swiglu_down_backward):
        entry.argtypes = [p, p, p, p, i, i, i, i, p]
        entry.restype = i
    lib.raytrm_rotary_qkv.argtypes = [p, p, p, p, p, i, i, i, i, i, i, p]
    lib.raytrm_rotary_qkv.restype = i
    return lib, None


def _hopper_present() -> bool:
    return torch.cuda.is_available() and any(
        torch.cuda.get_device_capability(i) == HOPPER for i in range(torch.cuda.device_count())
    )


def register() -> bool:
    """Build or load the kernel, once a process, where a Hopper GPU is present; True where it loaded (the reason it
    did not is logged). Called when a model is built, so that under torch.compile `serves` reads a settled state."""
    global _lib, _why_not, _loaded
    if not _loaded:
        hopper = _hopper_present()
        _lib, _why_not = _build() if hopper or not torch.cuda.is_available() else (None, "no Hopper GPU")
        _loaded = True
        if _lib is None:
            # On a Hopper GPU the user can act on it (install nvcc, set CUDA_HOME); elsewhere nothing is missing.
            (logger.info if hopper else logger.debug)(
                "The gated SwiGLU product is not built: %s; the SwiGLU computes its product and gate apart", _why_not
            )
        else:
            logger.debug("The gated SwiGLU product is built (%s)", SOURCE.name)
    return _lib is not None


@torch.compiler.assume_constant_result
def _hopper(device: torch.device) -> bool:
    """Whether a CUDA device is a Hopper GPU (the kernel is built for sm_90a alone); a constant under torch.compile."""
    return _capability(device) == HOPPER


def _takes(t: torch.Tensor) -> bool:
    """Whether the kernels take t as their main input: bf16, non-empty and contiguous on a Hopper GPU, with the
    library built (`register`) and ENABLED."""
    return (
        ENABLED
        and _lib is not None
        and t.is_cuda
        and t.dtype == torch.bfloat16
        and t.numel() > 0
        and t.is_contiguous()
        and _hopper(t.device)
    )


def serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gated_swiglu takes x [..., 512] and the weight w [2 N, 512] (the gate's rows first) cast to x's
    dtype: x bf16 and contiguous on a Hopper GPU, N a multiple of 128, the kernel built (`register`), ENABLED."""
    return (
        x.shape[-1] == INNER
        and w.dim() == 2
        and w.shape[1] == INNER
        and w.shape[0] % (2 * COLUMN_TILE) == 0
        and _takes(x)
    )


def _kernel_order(w: torch.Tensor) -> torch.Tensor:
    """w [2 N, 512] with its rows in the kernel's order: within each 32 rows, the row of output column 8 q + 2 i + e
    (q, i < 4, e < 2) at 8 i + 2 q + e, so that the 8 columns that wgmma's accumulator layout gives a thread are 8
    consecutive output columns (csrc/gated_swiglu.cu); it spares the kernel a 4 x 4 exchange of words within each
    quad of lanes before every store. The order is its own inverse. Under torch.compile the rows move in the kernel
    that casts the weight to bf16 (`gated_swiglu`); as a copy of its own, 3 MB at TRM's shape, it took 7.3 us a call
    in the H200's step."""
    return w.reshape(-1, 4, 4, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def _run(entry: str, what: str, tensors: tuple[torch.Tensor | None, ...], rows: int, inner: int, *extra: int) -> None:
    """Launch the library's `entry` on the current stream of the first tensor's device, over the tensors' data (None
    as a null pointer), rows, inner, the inner dimension and `extra`; `what` names the kernel where the launch
    fails."""
    assert _lib is not None
    device = next(t for t in tensors if t is not None).device
    status = getattr(_lib, entry)(
        *(t.data_ptr() if t is not None else None for t in tensors),
        rows,
        inner,
        INNER,
        *extra,
        _multiprocessors(device),
        torch.cuda.current_stream(device).cuda_stream,
    )
    if status != 0:
        raise RuntimeError(f"the {what} kernel failed to launch: CUDA error {status}")


def _launch(x: torch.Tensor, w: torch.Tensor, keep_gate_up: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel over x [rows, 512] and w [2 N, 512] in the kernel's order (_kernel_order): (h, gate_up or None),
    fresh."""
    rows, inner = x.shape[0], w.shape[0] // 2
    x, w = _aligned(x.contiguous()), _aligned(w.contiguous())  # TMA copies start on 16 bytes
    h = x.new_empty(rows, inner)
    gate_up = x.new_empty(rows, 2 * inner) if keep_gate_up else None
    _run("raytrm_gated_swiglu", "gated SwiGLU", (x, w, h, gate_up), rows, inner)
    return h, gate_up


def serves_down_backward(gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether down_backward takes gate_up [..., 2 F] and w_down [512, F]: both bf16 on a Hopper GPU, gate_up
    contiguous, F a multiple of 256, the kernel built (`register`), ENABLED and DOWN_BACKWARD."""
    return (
        DOWN_BACKWARD
        and w_down.dtype == torch.bfloat16
        and w_down.dim() == 2
        and w_down.shape[0] == INNER
        and w_down.shape[1] % (2 * COLUMN_TILE) == 0
        and gate_up.shape[-1] == 2 * w_down.shape[1]
        and _takes(gate_up)
    )


def down_order(w_down: torch.Tensor) -> torch.Tensor:
    """w_down [512, F] as down_backward takes it: transposed, [F, 512], its rows in the kernel's order
    (_kernel_order). A copy, 1.5 MB at TRM's shape: in the caller's graph, so that under torch.compile it is an
    inductor kernel of its own."""
    return _kernel_order(w_down.t())


def down_backward(grad: torch.Tensor, gate_up: torch.Tensor, w_ordered: torch.Tensor) -> torch.Tensor:
    """gate_up's gradient (fresh, laid out as gate_up) for the gradient grad [..., 512] of
    (silu(gate) * up) @ w_down^T: the gate's gradient grad @ w_down, rounded to bf16, goes through the gate's
    backward in the product's epilogue (csrc/gated_swiglu.cu), with the bits of kernels.swiglu_down_backward's
    Triton kernel. w_ordered is down_order(w_down); where serves_down_backward(gate_up, w_down)."""
    inner = w_ordered.shape[0]
    rows = gate_up.numel() // (2 * inner)
    # TMA and cp.async copies start on 16 bytes
    grad, gate_up, w_ordered = (_aligned(t.contiguous()) for t in (grad, gate_up, w_ordered))
    grad_gate_up = torch.empty_like(gate_up)
    _run(
        "raytrm_swiglu_down_backward",
        "SwiGLU's down-projection backward",
        (grad, w_ordered, gate_up, grad_gate_up),
        rows,
        inner,
    )
    return grad_gate_up


# Opaque operators, as kernels.py's: h alone (the rounds without a gradient; w in the kernel's order, which the
# caller's graph gives), and h with gate_up, differentiable through gate_up (h's use, the down projection, computes
# gate_up's gradient: kernels.swiglu_down_after_gate; w as the layer has it, which its backward takes).
@torch.library.custom_op("raytrm::gated_swiglu", mutates_args=())
def _gated_swiglu_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _launch(x, w, keep_gate_up=False)[0]


@_gated_swiglu_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0] // 2)


@torch.library.custom_op("raytrm::gated_swiglu_keeping_gate_up", mutates_args=())
def _gated_swiglu_keeping_op(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h, gate_up = _launch(x, _kernel_order(w), keep_gate_up=True)
    assert gate_up is not None
    return h, gate_up


@_gated_swiglu_keeping_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], w.shape[0] // 2), x.new_empty(x.shape[0], w.shape[0])


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs)
    ctx.mark_non_differentiable(output[0])


def _backward(ctx: torch.autograd.function.FunctionCtx, _: object, grad: torch.Tensor) -> tuple:
    """x's and w's gradients from gate_up's, with the products a Linear's backward runs (cublaslt.mm's), so that
    they have its bits: w's as the transpose of x^T @ grad."""
    x, w = ctx.saved_tensors
    grad = grad.contiguous()
    return torch.ops.raytrm.mm(grad, w), torch.ops.raytrm.mm(x.t(), grad).t()


torch.library.register_autograd("raytrm::gated_swiglu_keeping_gate_up", _backward, setup_context=_setup)


def _flops(x_shape: torch.Size, w_shape: torch.Size, *args: object, **kwargs: object) -> int:
    """The gate/up product's FLOPs, as torch counts a linear layer's."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[0]


def _register_flops() -> None:
    from torch.utils.flop_counter import register_flop_formula

    for op in (torch.ops.raytrm.gated_swiglu, torch.ops.raytrm.gated_swiglu_keeping_gate_up):
        register_flop_formula(op)(_flops)


_register_flops()


def gated_swiglu(
    x: torch.Tensor, w: torch.Tensor, keep_gate_up: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h [..., N], gate_up [..., 2 N] or None) for x [..., 512] and w [2 N, 512] (the gate's rows first), both
    bf16. With keep_gate_up it is differentiable through gate_up (h is not)."""
    if not (serves(x, w) and w.dtype == x.dtype):
        raise ValueError(
            f"gated_swiglu takes bf16 x [..., {INNER}] and w [2 N, {INNER}] (N a multiple of {COLUMN_TILE}), "
            f"contiguous, on a Hopper GPU with the kernel built; got x {tuple(x.shape)} {x.dtype} on {x.device}, "
            f"w {tuple(w.shape)} {w.dtype}" + (f" ({_why_not})" if _why_not else "")
        )
    rows, inner = x.numel() // INNER, w.shape[0] // 2
    if keep_gate_up:
        h, gate_up = torch.ops.raytrm.gated_swiglu_keeping_gate_up(x.view(rows, INNER), w)
        return h.view(*x.shape[:-1], inner), gate_up.view(*x.shape[:-1], 2 * inner)
    h = torch.ops.raytrm.gated_swiglu(x.view(rows, INNER), _kernel_order(w))
    return h.view(*x.shape[:-1], inner), None
