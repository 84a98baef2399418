"""The library of raytrm's CUDA C++ kernels for Hopper GPUs (csrc/), built with nvcc and called through ctypes.

It is built when a model is built on a machine with a Hopper GPU (raytrm.fastpaths.prepare), once for its sources,
compiler and flags, and cached under constants.cache_dir(). Without nvcc, such a GPU or a build that succeeds, the
reason is kept (`why_not_built`) and logged, and the operations its kernels serve run otherwise.
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
from raytrm.fastpaths.device import HOPPER, hopper_device, multiprocessors

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
#: The library's sources: the gated SwiGLU product and the down projection's backward (raytrm.fastpaths.hopper.gated),
#: the attention's projection with RoPE (raytrm.fastpaths.hopper.rotary_qkv); and what they include.
SOURCES = (CSRC / "gated_swiglu.cu", CSRC / "rotary_qkv.cu")
HEADERS = (CSRC / "hopper.cuh",)
#: The kernels' fixed shapes: the inner dimension (TRM's hidden size 512) and their tiles' columns.
INNER = 512
COLUMN_TILE = 128
#: Tests and A/B runs turn this off: no kernel of the library serves then.
ENABLED = True
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC")

_lib: ctypes.CDLL | None = None
#: Why the library is not loaded (None where it is, or before `load`).
why_not_built: str | None = None
_loaded = False


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _build() -> tuple[ctypes.CDLL | None, str | None]:
    """The library, built once for its sources and compiler and cached; and why not (None where it loaded)."""
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


def load() -> bool:
    """Build or load the library, once a process, where a Hopper GPU is present; True where it loaded (the reason it
    did not is logged). Called when a model is built, so that under torch.compile the conditions read a settled
    state."""
    global _lib, why_not_built, _loaded
    if not _loaded:
        hopper = _hopper_present()
        _lib, why_not_built = _build() if hopper or not torch.cuda.is_available() else (None, "no Hopper GPU")
        _loaded = True
        if _lib is None:
            # On a Hopper GPU the user can act on it (install nvcc, set CUDA_HOME); elsewhere nothing is missing.
            (logger.info if hopper else logger.debug)(
                "raytrm's Hopper kernels are not built: %s; their operations run otherwise", why_not_built
            )
        else:
            logger.debug("raytrm's Hopper kernels are built (%s)", ", ".join(path.name for path in SOURCES))
    return _lib is not None


def takes_why_not(t: torch.Tensor) -> str | None:
    """Whether the kernels take t as their main input: bf16, non-empty and contiguous on a Hopper GPU, with the
    library built and ENABLED."""
    if not ENABLED:
        return "turned off (hopper.library.ENABLED)"
    if _lib is None:
        return why_not_built or "not built (fastpaths.prepare() builds it)"
    if not t.is_cuda:
        return "not on a CUDA GPU"
    if t.dtype != torch.bfloat16:
        return "not bf16"
    if t.numel() == 0:
        return "empty"
    if not t.is_contiguous():
        return "a strided view"
    if not hopper_device(t.device):
        return "not a Hopper GPU"
    return None


def run(entry: str, what: str, tensors: tuple[torch.Tensor | None, ...], rows: int, inner: int, *extra: int) -> None:
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
        multiprocessors(device),
        torch.cuda.current_stream(device).cuda_stream,
    )
    if status != 0:
        raise RuntimeError(f"the {what} kernel failed to launch: CUDA error {status}")
