"""What the backends ask about a device and its tensors: capability, multiprocessors, TMA copies, alignment, the RoPE
tables' layout, and whether Triton runs in its CPU interpreter."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from raytrm.hardware import device as devices

F = TypeVar("F", bound=Callable[..., Any])

#: Half-precision dtypes, which the GPU backends take.
HALF = (torch.bfloat16, torch.float16)
#: The first compute capability whose GPUs copy tiles with TMA (Hopper). On earlier GPUs Triton rewrites a tensor
#: descriptor's copies into pointer loads, which spill far more than the pointer-load kernels they replaced, so those
#: GPUs keep the plain formulas where a kernel loads through descriptors.
TMA_CAPABILITY = (9, 0)
#: Hopper's compute capability, which raytrm's CUDA C++ kernels are built for (sm_90a: wgmma and setmaxnreg).
HOPPER = (9, 0)


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, Triton's own variable), as the tests
    do without a GPU. Triton reads it when a kernel is defined."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, read once."""
    return torch.cuda.get_device_capability(device)


def constant_under_compile(fn: F) -> F:
    """`torch.compiler.assume_constant_result`, without importing torch's compiler, which that function does first:
    a second of every process's start (each Ray worker and trial) that never compiles. The mark is the attribute
    dynamo's own decorator sets; the fast paths' fullgraph tests fail should it change."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_under_compile
def tma_device(device: torch.device) -> bool:
    """Whether a CUDA device copies tiles with TMA (TMA_CAPABILITY or later). A device's capability is fixed, so
    torch.compile, which meets this while tracing, calls it there and keeps the answer as a constant: no graph
    break."""
    return capability(device) >= TMA_CAPABILITY


@constant_under_compile
def hopper_device(device: torch.device) -> bool:
    """Whether a CUDA device is a Hopper GPU; a constant under torch.compile, as tma_device."""
    return capability(device) == HOPPER


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors, which persistent kernels fill; under Triton's interpreter 2, so that a program
    takes several units of work there too."""
    if device.type == devices.CUDA:
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where it does not start on 16 bytes, as a TMA copy's base must."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def rope_tables_fit(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether kernels read the RoPE tables for x [B, L, ...]: rows of unit stride, alike in strides, covering its L
    positions."""
    return cos.stride(-1) == 1 and sin.stride() == cos.stride() and cos.shape[0] >= x.shape[1]
