"""The SwiGLU's gate/up product and its gate in one kernel on Hopper GPUs (CUDA C++, csrc/gated_swiglu.cu).

h = silu(x @ w_gate^T) * (x @ w_up^T), and gate_up = x @ w^T beside it where asked for, with the bits of cuBLAS's
product followed by raytrm's Triton gate kernel (kernels.swiglu_gate). The kernel keeps each tile's results in
registers and gates them while the tensor cores run the next tile's products, where the gate's arithmetic costs
nothing; writing h costs more (H200, TRM's Sudoku shape: README, Performance). It is built with nvcc at its first
use and cached under constants.cache_dir(); without nvcc, a Hopper GPU or a build that succeeds, `serves` is False
and callers compute the product and the gate apart. Not yet used by the model: whether it can pay in TRM's rounds
is issue 14's open question.
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
from raytrm.models.kernels import _capability, _multiprocessors

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gated_swiglu.cu"
#: The kernel's fixed shapes: the inner dimension (TRM's hidden size 512) and its tiles' columns.
INNER = 512
COLUMN_TILE = 128
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
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(NVCC_FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"gated_swiglu-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [nvcc, *NVCC_FLAGS, "-o", str(built), str(SOURCE), "-lcuda"], capture_output=True, text=True
            )
            if result.returncode != 0:
                return None, f"nvcc failed: {result.stderr.strip()[-500:]}"
            os.replace(built, target)  # atomic: a process beside this one sees the whole library or none
    lib = ctypes.CDLL(str(target))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.raytrm_gated_swiglu.argtypes = [p, p, p, p, i, i, i, i, p]
    lib.raytrm_gated_swiglu.restype = i
    return lib, None


def register() -> bool:
    """Build or load the kernel, once a process; True where it loaded (the reason it did not is logged)."""
    global _lib, _why_not, _loaded
    if not _loaded:
        _lib, _why_not = _build()
        _loaded = True
        if _lib is None:
            logger.debug("The gated SwiGLU product is not built: %s", _why_not)
    return _lib is not None


def serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gated_swiglu takes x [..., 512] and w [2 N, 512]: bf16 on a Hopper GPU, contiguous, N a multiple of
    128, both starting on 16 bytes, and the kernel built."""
    return (
        x.is_cuda
        and x.dtype == w.dtype == torch.bfloat16
        and x.shape[-1] == INNER
        and w.dim() == 2
        and w.shape[1] == INNER
        and w.shape[0] % (2 * COLUMN_TILE) == 0
        and x.numel() > 0
        and x.is_contiguous()
        and w.is_contiguous()
        and x.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
        and _capability(x.device) == (9, 0)
        and register()
    )


def gated_swiglu(
    x: torch.Tensor, w: torch.Tensor, keep_gate_up: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h [..., N], gate_up [..., 2 N] or None) for x [..., 512] and w [2 N, 512] (the gate's rows first)."""
    if not serves(x, w):
        raise ValueError(
            f"gated_swiglu takes bf16 x [..., {INNER}] and w [2 N, {INNER}] (N a multiple of {COLUMN_TILE}), "
            f"contiguous, on a Hopper GPU with the kernel built; got x {tuple(x.shape)} {x.dtype} on {x.device}, "
            f"w {tuple(w.shape)} {w.dtype}" + (f" ({_why_not})" if _why_not else "")
        )
    assert _lib is not None
    rows, inner = x.numel() // INNER, w.shape[0] // 2
    h = x.new_empty(*x.shape[:-1], inner)
    gate_up = x.new_empty(*x.shape[:-1], 2 * inner) if keep_gate_up else None
    status = _lib.raytrm_gated_swiglu(
        x.data_ptr(),
        w.data_ptr(),
        h.data_ptr(),
        gate_up.data_ptr() if gate_up is not None else None,
        rows,
        inner,
        INNER,
        _multiprocessors(x.device),
        torch.cuda.current_stream(x.device).cuda_stream,
    )
    if status != 0:
        raise RuntimeError(f"the gated SwiGLU kernel failed to launch: CUDA error {status}")
    return h, gate_up
