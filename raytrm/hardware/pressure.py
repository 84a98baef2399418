"""Memory readings behind one interface: this process, the system's pressure, and the device allocator.

psutil answers everywhere; macOS adds the kernel's pressure level (`sysctl`) and, when asked, `memory_pressure -Q`;
Linux adds pressure-stall information (PSI). The parsers are pure functions over command output, tested against
outputs recorded on real Macs (tests/fixtures/macos). `read()` never raises: what does not answer stays None.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from raytrm.hardware.device import CUDA, MPS

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

PRESSURE_LEVELS = ("normal", "warn", "critical")
# NOTE_MEMORYSTATUS_PRESSURE_NORMAL/WARN/CRITICAL in XNU's bsd/sys/event.h are bit flags: 3 is not a level.
_XNU_LEVELS = {1: "normal", 2: "warn", 4: "critical"}
# PSI "some avg10" is the share of the last 10 s in which at least one task waited on memory (kernel
# Documentation/accounting/psi.rst). A healthy machine sits near 0 and brief reclaim gives a few percent; 10 % means
# reclaim or refaults steal a tenth of wall time (XNU's "warn": act before swapping); 40 % is thrashing, well before
# systemd-oomd's default kill limit of 60 % for 30 s (oomd.conf(5)). "full" (every task stalled at once) at 10 %
# means whole seconds of no progress: critical whatever "some" says.
PSI_WARN_SOME_AVG10 = 10.0
PSI_CRITICAL_SOME_AVG10 = 40.0
PSI_CRITICAL_FULL_AVG10 = 10.0
# Readings run every logging step: a wedged command must cost seconds at most, not stall training.
READ_TIMEOUT_S = 2.0
# Source names, as raytrm/hardware/sources.py reports them.
PSUTIL, SYSCTL_LEVEL, MEMORY_PRESSURE, LINUX_PSI = "psutil", "sysctl-pressure-level", "memory_pressure", "linux-psi"

_LEVEL_LINE = re.compile(r"^kern\.memorystatus_vm_pressure_level\s*[:=]\s*(-?\d+)\s*$", re.MULTILINE)
_FREE_PERCENT = re.compile(r"System-wide memory free percentage:\s*(\d+(?:\.\d+)?)\s*%")
_PAGE_SIZE = re.compile(r"page size of (\d+)")
_SYSTEM_HAS = re.compile(r"The system has (\d+) \((\d+) pages")
# `Pages free: 11961 ` (memory_pressure) and `Pages free:      12216.` (vm_stat); `"Translation faults": 1.`
_COUNT_LINE = re.compile(r'^\s*"?([A-Za-z][A-Za-z -]*?)"?:\s*(\d+)\.?\s*$')
_PSI_LINE = re.compile(r"^(some|full)\s+(.*)$")
# The two commands name the same counters differently: memory_pressure's "Pages used by compressor" is vm_stat's
# "Pages occupied by compressor", its "Pages compressed" vm_stat's "Compressions" (the same counts in the two
# recordings of one Mac, tests/fixtures/macos/*_mini2_32gb.txt).
_ALIASES = {
    "wired_down": "wired",
    "used_by_compressor": "compressor",
    "occupied_by_compressor": "compressor",
    "compressed": "compressions",
    "decompressed": "decompressions",
}
# Counts of resident pages (the rest are cumulative event counters: faults, pageins, compressions...).
PAGE_FIELDS = (
    "free", "active", "inactive", "speculative", "throttled", "wired", "purgeable",
    "file_backed", "anonymous", "stored_in_compressor", "compressor",
)  # fmt: skip


@dataclass(frozen=True)
class MemoryReading:
    """One sample of memory; None where this platform or device has no such reading."""

    rss_bytes: int | None = None  #: resident memory of this process (psutil)
    available_bytes: int | None = None  #: memory the system can give without swapping (psutil)
    pressure: str | None = None  #: "normal", "warn" or "critical" (XNU level or Linux PSI)
    free_percent: float | None = None  #: `memory_pressure -Q` system-wide free percentage (macOS, detailed reads)
    device_allocated_bytes: int | None = None  #: allocator's current allocation (CUDA or MPS)
    device_peak_bytes: int | None = None  #: CUDA's max allocated; MPS has no peak API
    source: tuple[str, ...] = ()  #: names of the sources that answered


@dataclass(frozen=True)
class PageStats:
    """Counters of `vm_stat` or `memory_pressure`, with the page size that turns page counts into bytes."""

    page_size: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    total_bytes: int | None = None  #: memory_pressure's "The system has N"
    free_percent: float | None = None  #: memory_pressure's "System-wide memory free percentage"

    def page_bytes(self) -> dict[str, int]:
        """The resident-page counts in bytes; empty without a page size."""
        if not self.page_size:
            return {}
        return {name: self.counts[name] * self.page_size for name in PAGE_FIELDS if name in self.counts}


def parse_pressure_level(text: str) -> str | None:
    """`sysctl kern.memorystatus_vm_pressure_level` (or its `-n` form) as normal, warn or critical."""
    text = text or ""
    match = _LEVEL_LINE.search(text)
    value = match.group(1) if match else text.strip()
    if not re.fullmatch(r"-?\d+", value):
        return None
    level = _XNU_LEVELS.get(int(value))
    if level is None:
        logger.debug("kern.memorystatus_vm_pressure_level %s is not an XNU level", value)
    return level


def _count_name(key: str) -> str:
    name = re.sub(r"[^a-z]+", "_", key.lower()).strip("_")
    name = name.removeprefix("pages_").removesuffix("_pages")
    return _ALIASES.get(name, name)


def _page_stats(text: str) -> PageStats:
    text = text or ""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        match = _COUNT_LINE.match(line)
        if match:
            counts.setdefault(_count_name(match.group(1)), int(match.group(2)))
    size, has, free = _PAGE_SIZE.search(text), _SYSTEM_HAS.search(text), _FREE_PERCENT.search(text)
    return PageStats(
        page_size=int(size.group(1)) if size else None,
        counts=counts,
        total_bytes=int(has.group(1)) if has else None,
        free_percent=float(free.group(1)) if free else None,
    )


def parse_memory_pressure(text: str) -> PageStats:
    """The full `memory_pressure` report or its `-Q` line; `-Q` gives only the free percentage."""
    return _page_stats(text)


def parse_vm_stat(text: str) -> PageStats:
    """`vm_stat`: the page size from its header ("page size of 16384 bytes") and every counter."""
    return _page_stats(text)


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """/proc/pressure/memory: {"some": {"avg10": ..., "avg60": ..., "avg300": ..., "total": ...}, "full": ...}."""
    out: dict[str, dict[str, float]] = {}
    for line in (text or "").splitlines():
        match = _PSI_LINE.match(line.strip())
        if not match:
            continue
        fields = {}
        for item in match.group(2).split():
            key, _, value = item.partition("=")
            try:
                fields[key] = float(value)
            except ValueError:
                continue
        out[match.group(1)] = fields
    return out


def psi_level(psi: dict[str, dict[str, float]]) -> str | None:
    """normal, warn or critical from PSI's 10-second averages (thresholds above); None without a "some" line."""
    some = psi.get("some", {}).get("avg10")
    if some is None:
        return None
    full = psi.get("full", {}).get("avg10", 0.0)
    if some >= PSI_CRITICAL_SOME_AVG10 or full >= PSI_CRITICAL_FULL_AVG10:
        return "critical"
    return "warn" if some >= PSI_WARN_SOME_AVG10 else "normal"


def run_command(argv: list[str], timeout_s: float = READ_TIMEOUT_S) -> str:
    """A command's stdout, or "" when it cannot run, fails or times out."""
    exe = shutil.which(argv[0]) or str(Path("/usr/sbin") / argv[0])  # sysctl and powermetrics live in /usr/sbin
    try:
        done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, errors="replace", timeout=timeout_s)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        logger.debug("%s failed: %s", " ".join(argv), exc)
        return ""
    return (done.stdout or "") if done.returncode == 0 else ""


def _device_gauges(device: object) -> tuple[Callable[[], int] | None, Callable[[], int] | None]:
    # torch is imported inside the gauges: importing this module must stay cheap, and only a run on that device
    # calls them. torch.mps has no peak-memory API, so its peak stays None.
    kind = getattr(device, "type", device)

    def cuda_allocated() -> int:
        import torch

        return int(torch.cuda.memory_allocated(device))

    def cuda_peak() -> int:
        import torch

        return int(torch.cuda.max_memory_allocated(device))

    def mps_allocated() -> int:
        import torch

        return int(torch.mps.current_allocated_memory())

    if kind == CUDA:
        return cuda_allocated, cuda_peak
    if kind == MPS:
        return mps_allocated, None
    return None, None


class MemoryReader:
    """Samples memory from whatever answers on this platform; cheap enough for every logging step."""

    def __init__(
        self,
        platform: str = sys.platform,
        run: Callable[[list[str]], str] | None = None,
        device: torch.device | str | None = None,
        *,
        root: str = "/",
        allocated: Callable[[], int] | None = None,
        peak: Callable[[], int] | None = None,
    ) -> None:
        self.platform, self.root = platform, root
        self._run = run or run_command
        kind = getattr(device, "type", device)
        default_allocated, default_peak = _device_gauges(device)
        self._allocated, self._peak = allocated or default_allocated, peak or default_peak
        self._device_source = f"torch.{kind}" if kind else "torch"
        self._process: psutil.Process | None = None
        self._failed: set[str] = set()

    def _call(self, name: str, fn: Callable[[], object]) -> object | None:
        try:
            return fn()
        except Exception as exc:  # a reading must never stop training, whatever an injected source does
            if name not in self._failed:  # say it once, not every step
                self._failed.add(name)
                logger.warning("memory source %s failed: %s", name, exc)
            return None

    def _process_rss(self) -> int:
        self._process = self._process or psutil.Process()
        return int(self._process.memory_info().rss)

    def _command(self, argv: list[str]) -> str:
        out = self._call(argv[0], lambda: self._run(list(argv)))
        return out if isinstance(out, str) else ""

    def _linux_pressure(self) -> str | None:
        path = os.path.join(self.root, "proc/pressure/memory")
        try:
            text = Path(path).read_text()
        except OSError as exc:  # no PSI (kernel < 4.20, psi=0, some containers): unknown, not an error
            logger.debug("%s: %s", path, exc)
            return None
        return psi_level(parse_psi(text))

    def read(self, detailed: bool = False) -> MemoryReading:
        """One sample; `detailed` adds `memory_pressure -Q` on macOS (it takes longer than sysctl)."""
        source: list[str] = []
        rss = self._call("psutil-rss", self._process_rss)
        available = self._call("psutil-available", lambda: int(psutil.virtual_memory().available))
        if rss is not None or available is not None:
            source.append(PSUTIL)
        pressure, free_percent = None, None
        if self.platform == "darwin":
            pressure = parse_pressure_level(self._command(["sysctl", "-n", "kern.memorystatus_vm_pressure_level"]))
            if pressure is not None:
                source.append(SYSCTL_LEVEL)
            if detailed:
                free_percent = parse_memory_pressure(self._command(["memory_pressure", "-Q"])).free_percent
                if free_percent is not None:
                    source.append(MEMORY_PRESSURE)
        elif self.platform.startswith("linux"):
            pressure = self._call(LINUX_PSI, self._linux_pressure)
            if pressure is not None:
                source.append(LINUX_PSI)
        allocated = self._call(self._device_source, self._allocated) if self._allocated else None
        peak = self._call(self._device_source, self._peak) if self._peak else None
        if allocated is not None or peak is not None:
            source.append(self._device_source)
        return MemoryReading(
            rss_bytes=rss if isinstance(rss, int) else None,
            available_bytes=available if isinstance(available, int) else None,
            pressure=pressure if isinstance(pressure, str) else None,
            free_percent=free_percent,
            device_allocated_bytes=int(allocated) if isinstance(allocated, (int, float)) else None,
            device_peak_bytes=int(peak) if isinstance(peak, (int, float)) else None,
            source=tuple(source),
        )
