"""The one place that picks the compute device, its dtype and its collective backend.

No other module names a device kind or a collective backend: they ask here. Each choice is logged with its reason.
torch is imported lazily so that `raytrm --help` and config validation stay fast.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CPU, CUDA, MPS = "cpu", "cuda", "mps"
DEVICE_KINDS = (CPU, CUDA, MPS)
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def available_kind() -> tuple[str, str]:
    """The best device kind present, and why: CUDA, then Apple's MPS, then the CPU."""
    import torch

    if torch.cuda.is_available():
        return CUDA, f"CUDA is available ({torch.cuda.get_device_name(0)})"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return MPS, "Apple Metal (MPS) is available"
    if mps is not None and mps.is_built():
        return CPU, "torch has MPS built in but this machine's macOS/GPU does not offer it"
    return CPU, "no CUDA or MPS device"


def pick_device(requested: str = "auto") -> torch.device:
    """The torch.device to train on; 'auto' takes the best one present."""
    import torch

    from raytrm.errors import UserError

    kind, why = available_kind()
    if requested == "auto":
        logger.info("device %s: %s", kind, why)
        return torch.device(kind)
    if requested not in DEVICE_KINDS:
        raise UserError(f"device {requested!r}: expected auto, {', '.join(DEVICE_KINDS)}")
    if requested != CPU and requested != kind:
        raise UserError(
            f"device {requested!r} was asked for but is not available here ({why}); use --device auto or cpu"
        )
    logger.info("device %s: asked for", requested)
    return torch.device(requested)


@cache
def bf16_works(kind: str) -> bool:
    """Whether a bf16 matrix multiply runs and gives finite results on this device kind."""
    import torch

    if kind == CUDA:
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    try:
        a = torch.ones(8, 8, dtype=torch.bfloat16, device=kind)
        return bool(torch.isfinite((a @ a).float()).all())
    except (RuntimeError, TypeError) as e:
        logger.debug("bf16 on %s failed: %s", kind, e)
        return False


def pick_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    """The forward dtype: bf16 on CUDA where it works; fp32 on CPU and MPS (bf16 there is slow or unsafe)."""
    import torch

    if requested != "auto":
        dtype = getattr(torch, _DTYPES[requested])
        logger.info("dtype %s: asked for", requested)
        return dtype
    if device.type == CUDA and bf16_works(CUDA):
        logger.info("dtype bfloat16: CUDA supports it (fp32 master weights)")
        return torch.bfloat16
    logger.info("dtype float32: safe default on %s", device.type)
    return torch.float32


def loss_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the stablemax loss: float64 as the reference, float32 on MPS, which has no float64."""
    import torch

    return torch.float32 if device.type == MPS else torch.float64


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend for gradients on this device (gloo cannot reduce MPS tensors: stage on CPU)."""
    return "nccl" if device.type == CUDA else "gloo"


def collective_device(device: torch.device) -> torch.device:
    """Where a collective's tensors live: the device itself for NCCL, the CPU for gloo (so MPS is staged there)."""
    import torch

    return device if collective_backend(device) == "nccl" else torch.device(CPU)


def page_locked(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t in page-locked memory where it is on the host and bound for CUDA, so that its copy there with
    non_blocking=True is queued without the host waiting for the device; else t itself."""
    import torch

    return t.pin_memory() if t.device.type == CPU and torch.device(device).type == CUDA else t


def queued_copy(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on device. From the host to CUDA it goes through page-locked memory, so the copy joins the device's queue
    without the host waiting for it. The device's type decides, not t.is_pinned(), which can start a CUDA context
    on a GPU host training on its CPU."""
    import torch

    device = torch.device(device)
    return page_locked(t, device).to(device, non_blocking=device.type == CUDA)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so host clocks measure it."""
    import torch

    if device.type == CUDA:
        torch.cuda.synchronize(device)
    elif device.type == MPS:
        torch.mps.synchronize()


def synchronize_compute(device: torch.device) -> None:
    """Wait for this thread's queued compute only: on CUDA the current stream, not the collectives on their own
    streams (a worker's compute time must not include waiting for a slower peer's all-reduce)."""
    import torch

    if device.type == CUDA:
        torch.cuda.current_stream(device).synchronize()
    else:
        synchronize(device)


def empty_cache(device: torch.device) -> None:
    """Return cached allocator blocks to the device after an out-of-memory error."""
    import torch

    if device.type == CUDA:
        torch.cuda.empty_cache()
    elif device.type == MPS:
        torch.mps.empty_cache()


def accelerator_memory(kind: str) -> dict[str, int]:
    """Device memory facts: total (CUDA) or the recommended working set (MPS); empty on CPU."""
    import torch

    if kind == CUDA and torch.cuda.is_available():
        return {"total_bytes": int(torch.cuda.get_device_properties(0).total_memory)}
    if kind == MPS:
        rec = getattr(torch.mps, "recommended_max_memory", None)
        return {"recommended_max_bytes": int(rec())} if rec else {}
    return {}
