"""Peak memory of a region of code: what the memory model fits and what the budget is checked against.

CPU (Linux): the kernel's own high-water mark of resident memory (VmHWM), reset before the region by writing 5 to
/proc/self/clear_refs, so the peak is exact and costs nothing while the region runs. CPU elsewhere (macOS): a
sampling thread reads the resident size every few milliseconds. CUDA: the allocator's peak, reset before the region.
MPS has no peak API: the sampling thread reads the allocator's current allocation instead.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
from collections.abc import Callable
from pathlib import Path

import psutil

from raytrm.hardware.device import CUDA, MPS

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _vm_hwm() -> int | None:
    try:
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_hwm() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, where this process runs on it (Linux); None elsewhere (macOS)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_heap() -> bool:
    """Give freed heap back to the OS (glibc malloc_trim), so resident memory reflects what is in use again.

    glibc keeps freed blocks, above all in the per-thread arenas torch's threads allocate from: after a large step
    the resident size stays near its peak, and a smaller step would look as large. Returns False where there is no
    glibc (macOS's allocator returns memory by itself).
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


_M_ARENA_MAX = -8  # glibc's mallopt parameter


def one_heap() -> bool:
    """Make every thread allocate from glibc's main heap (mallopt M_ARENA_MAX = 1), so a step's peak is a function of
    the step.

    glibc gives each new thread an arena of its own (up to eight a core) and keeps freed blocks in it; with
    micro-batches on threads side by side, which arena a tensor lands in follows the threads' timing, and so does the
    resident peak, which the memory governor's fit needs to be a function of the cut. Torch's tensors are few and
    large, so threads rarely contend for the one heap. Call before threads allocate: arenas made before stay in
    use. Returns False without glibc (macOS's allocator has no arenas to pin).
    """
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, 1))


class _Sampler(threading.Thread):
    """Reads a gauge every interval and keeps the maximum."""

    def __init__(self, gauge: Callable[[], int], interval_s: float) -> None:
        super().__init__(daemon=True)
        self.gauge, self.interval_s = gauge, interval_s
        self.peak = gauge()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.peak = max(self.peak, self.gauge())

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, self.gauge())
        return self.peak


class PeakMemory:
    """Context manager: `with PeakMemory(device) as peak: ...` then `peak.bytes` and `peak.method`."""

    def __init__(self, device_type: str = "cpu", interval_s: float = 0.002) -> None:
        self.device_type, self.interval_s = device_type, interval_s
        self.bytes = 0
        self.method = ""
        self._sampler: _Sampler | None = None

    def __enter__(self) -> PeakMemory:
        if self.device_type == CUDA:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.method = "cuda-allocator-peak"
        elif self.device_type == MPS:
            import torch

            self._sampler = _Sampler(torch.mps.current_allocated_memory, self.interval_s)
            self.method = "mps-allocated-sampled"
        elif _vm_hwm() is not None and _reset_hwm():
            self.method = "linux-vmhwm"
        else:
            process = psutil.Process()
            self._sampler = _Sampler(lambda: int(process.memory_info().rss), self.interval_s)
            self.method = "rss-sampled"
        if self._sampler is not None:
            self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device_type == CUDA:
            import torch

            torch.cuda.synchronize()
            self.bytes = int(torch.cuda.max_memory_allocated())
        elif self._sampler is not None:
            self.bytes = self._sampler.stop()
        else:
            self.bytes = _vm_hwm() or 0
