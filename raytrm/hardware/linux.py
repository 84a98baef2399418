"""Linux machine facts from /proc, /sys, /etc/os-release and psutil."""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)


@dataclass
class LinuxFacts:
    """What a Linux machine says about itself."""

    chip: str
    model_name: str
    os_version: str
    memory_bytes: int
    physical_cores: int
    logical_cpus: int
    notes: list[str] = field(default_factory=list)


def parse_cpuinfo(text: str) -> str:
    """The CPU name from /proc/cpuinfo ('model name' on x86, 'Model'/'Hardware' on Arm boards)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            found.setdefault(key.strip().lower(), value.strip())
    for key in ("model name", "model", "hardware", "cpu model", "processor"):
        if key in found and not found[key].isdigit():
            return found[key]
    return ""


def parse_cpu_vendor(text: str) -> str:
    """The CPU's maker from /proc/cpuinfo's vendor_id ('AuthenticAMD', 'GenuineIntel'; x86 only), or ''."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "vendor_id":
            return value.strip()
    return ""


def cpu_vendor(root: str = "/") -> str:
    """This x86 CPU's maker: /proc/cpuinfo's vendor_id, else the vendor string in platform.processor() (Windows
    names it there); '' where neither says."""
    vendor = parse_cpu_vendor(_read(str(Path(root) / "proc/cpuinfo")))
    if vendor:
        return vendor
    processor = platform.processor()
    return next((v for v in ("AuthenticAMD", "GenuineIntel") if v in processor), "")


def parse_os_release(text: str) -> str:
    """PRETTY_NAME from /etc/os-release, unquoted."""
    for line in text.splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return ""


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def read_linux_facts(root: str = "/") -> LinuxFacts:
    """Read this Linux machine's facts; root lets tests point at a fake filesystem."""
    base = Path(root)
    notes = []
    chip = parse_cpuinfo(_read(str(base / "proc/cpuinfo"))) or platform.processor()
    model = _read(str(base / "sys/devices/virtual/dmi/id/product_name")).strip()
    if not model:
        notes.append("machine model unknown: no readable DMI product name")
    distro = parse_os_release(_read(str(base / "etc/os-release")))
    os_version = f"{distro} (kernel {platform.release()})" if distro else f"kernel {platform.release()}"
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False)
    if not physical:
        physical = logical
        notes.append("physical core count unknown: using the logical CPU count")
    return LinuxFacts(
        chip=chip,
        model_name=model,
        os_version=os_version,
        memory_bytes=int(psutil.virtual_memory().total),
        physical_cores=int(physical),
        logical_cpus=int(logical),
        notes=notes,
    )
