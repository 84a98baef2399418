"""Device fast paths for raytrm's named operations, behind one registry (raytrm.fastpaths.registry).

A model calls an operation by name (raytrm.models.ops defines each with its plain formula); the registry runs the
first backend below that serves the call's inputs, or the formula. Backends, in the order they are asked:
- hopper: CUDA C++ kernels for Hopper GPUs, built with nvcc (the SwiGLU's gated product, the attention's projection
  with RoPE).
- triton: Triton kernels for NVIDIA GPUs in half precision (the SwiGLU's gate, its down projection with the residual
  norm, RoPE, the attention, TRM-MLP's position mixing).
- cublaslt: half-precision products on the cuBLASLt algorithm measured fastest for each shape; output widths padded
  to multiples of 8.
- onednn: fp32 linear layers on oneDNN on AMD's x86-64 CPUs.
- cpu: TRM-MLP's position mixing a cache-sized block of columns at a time.

RAYTRM_FASTPATHS=off turns every backend off (raytrm.fastpaths.registry).
"""

import logging

from raytrm.constants import FASTPATHS_ENV
from raytrm.fastpaths import cpu, cublaslt, hopper, onednn, registry, triton
from raytrm.fastpaths.registry import backends, call, choose, formula, op, served

logger = logging.getLogger(__name__)

__all__ = ["backends", "call", "choose", "formula", "op", "prepare", "served"]

registry.register(*hopper.BACKENDS, *triton.BACKENDS, *cublaslt.BACKENDS, *onednn.BACKENDS, *cpu.BACKENDS)


def prepare() -> None:
    """Load every backend, once a process (open cuBLASLt, register oneDNN's FLOPs, make Triton's operators, build the
    Hopper kernels), unless they are switched off. Models call it when they are built, so that torch.compile later
    traces conditions over a settled state."""
    global _told_off
    if registry.ENABLED:
        for load in (onednn.load, cublaslt.load, triton.load, hopper.load):
            load()
    elif not _told_off:
        logger.info("Fast paths are switched off (%s=off): every operation runs its plain formula", FASTPATHS_ENV)
        _told_off = True


_told_off = False
