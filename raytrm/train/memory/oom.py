"""Telling an out-of-memory failure from other errors, and reading the sizes an MPS one prints.

CUDA raises `torch.OutOfMemoryError`; MPS raises a plain RuntimeError whose message starts "MPS backend out of memory"
(aten/src/ATen/mps/MPSAllocator.mm); on CPU the allocator raises a RuntimeError, or the kernel kills the process
before anything can be caught. Recorded MPS messages are in tests/fixtures/macos (macos-outputs.md §6).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

logger = logging.getLogger(__name__)

MPS_OOM = "MPS backend out of memory"
# Messages of allocators that raise a bare RuntimeError: MPS; CUDA before torch 1.13 added OutOfMemoryError, and
# cudaMalloc calls outside the caching allocator (cuBLAS workspaces) ("CUDA error: out of memory"); the CPU
# allocator (c10/core/impl/alloc_cpu.cpp, "DefaultCPUAllocator: can't allocate memory"). A smaller batch is the
# remedy for each.
_OOM_MESSAGES = (MPS_OOM, "CUDA out of memory", "CUDA error: out of memory", "DefaultCPUAllocator: can't allocate")
# The unit names of both printers, with the same binary factors. The "GB" of older builds is 2**30 bytes, not 10**9:
# MPSAllocator.h's own format_size (pytorch/pytorch PR #76725, 2022) printed `size / 1073741824.0` as "GB" and
# `size / 1048576.0` as "MB"; newer builds call c10::CachingAllocator::format_size (c10/core/Allocator.h), which
# divides by the same 1073741824.0 and 1048576.0 and prints "GiB" / "MiB". The recorded messages agree: 16 GB M1
# machines print "max allowed: 18.13 GB" in old builds and "18.13 GiB" in new ones (§6.2), and 18.13 = 1.7 (the
# default high watermark ratio) x Metal's recommendedMaxWorkingSetSize of 10922.67 MiB on those machines (§7.2);
# read as 10**9 it would not be.
_UNITS = {
    "BYTES": 1,
    "KB": 2**10,
    "KIB": 2**10,
    "MB": 2**20,
    "MIB": 2**20,
    "GB": 2**30,
    "GIB": 2**30,
    "TB": 2**40,
    "TIB": 2**40,
}
_SIZE = r"(\d+(?:[.,]\d+)?)\s*(bytes|[KMGT]i?B)"
_MPS_MESSAGE = re.compile(
    re.escape(MPS_OOM)
    + rf" \(MPS allocated: {_SIZE}, other allocations: {_SIZE}(?:, max allowed: {_SIZE})?\)\."
    + rf"\s*Tried to allocate {_SIZE}(?: on (\w+) pool)?",
    re.IGNORECASE,
)
_CHAIN_LIMIT = 16  # causes followed at most, so a cyclic __context__ chain cannot loop


def _torch_oom_types() -> tuple[type[BaseException], ...]:
    # An exception raised by torch means torch is already imported: look it up instead of importing it, so that
    # classifying an ordinary error never pays torch's import time.
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    found = [getattr(torch, "OutOfMemoryError", None)]  # newer torch: the same class as torch.cuda.OutOfMemoryError
    with contextlib.suppress(AttributeError):
        found.append(torch.cuda.OutOfMemoryError)  # torch 1.13+
    return tuple(t for t in found if isinstance(t, type) and issubclass(t, BaseException))


def _is_oom_alone(exc: BaseException, torch_types: tuple[type[BaseException], ...]) -> bool:
    if isinstance(exc, MemoryError) or (torch_types and isinstance(exc, torch_types)):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _OOM_MESSAGES)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is a device or host allocation failure."""
    torch_types = _torch_oom_types()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < _CHAIN_LIMIT:
        if _is_oom_alone(current, torch_types):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__  # frameworks wrap the allocator's error
    return False


def _bytes(number: str, unit: str) -> int:
    # Decimal: the printed figure times the unit, rounded once, so a parsed size is exact and repeatable.
    value = Decimal(number.replace(",", ".")) * _UNITS[unit.upper()]
    return int(value.to_integral_value(rounding=ROUND_HALF_UP))


def parse_mps_oom(message: str) -> dict[str, int | str | None] | None:
    """allocated, other, max_allowed, tried (bytes) and pool from an MPS out-of-memory message; None if it is not one.

    max_allowed is None where PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 removed the limit (that message omits it). The
    printed sizes carry two decimals, so each is exact only to 0.005 of its unit.
    """
    match = _MPS_MESSAGE.search(message or "")
    if not match:
        return None
    groups = match.groups()
    try:
        sizes = [_bytes(groups[i], groups[i + 1]) if groups[i] is not None else None for i in range(0, 8, 2)]
    except (InvalidOperation, KeyError) as exc:
        logger.debug("MPS out-of-memory sizes not understood in %r: %s", message, exc)
        return None
    allocated, other, max_allowed, tried = sizes
    return {"allocated": allocated, "other": other, "max_allowed": max_allowed, "tried": tried, "pool": groups[8]}
