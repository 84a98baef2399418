"""`raytrm probe`: what machine this is, what it can compute on, and which tier raytrm tunes for."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform as _platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raytrm.hardware import device as devices
from raytrm.hardware import sources

PROBE_SCHEMA_VERSION = 1
GiB = 1024**3


@dataclass
class HardwareInfo:
    """One machine as raytrm sees it; the stable fields of `raytrm probe --json`."""

    os: str
    os_version: str
    arch: str
    model_name: str
    model_id: str
    chip: str
    chip_family: str
    chip_variant: str
    performance_cores: int
    efficiency_cores: int
    core_kinds: list[dict[str, Any]]
    logical_cpus: int
    memory_bytes: int
    device: str
    device_reason: str
    bf16: bool
    accelerator_memory: dict[str, int]
    thermal_sources: list[str]
    memory_pressure_sources: list[str]
    versions: dict[str, str]
    notes: list[str] = field(default_factory=list)

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GiB

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["memory_gb"] = round(self.memory_gb, 2)
        return out


def versions() -> dict[str, str]:
    """Versions of Python and the libraries raytrm runs on, without importing the heavy ones."""
    found = {"python": _platform.python_version()}
    for name in ("raytrm", "torch", "ray", "optuna"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _device_facts() -> tuple[str, str, bool, dict[str, int]]:
    kind, why = devices.available_kind()
    return kind, why, devices.bf16_works(kind), devices.accelerator_memory(kind)


def detect(
    platform: str = sys.platform,
    mac_run: Callable[[list[str]], str] | None = None,
    linux_root: str = "/",
    device_facts: Callable[[], tuple] = _device_facts,
) -> HardwareInfo:
    """Detect this machine; the arguments let tests replay recorded macOS output or a fake filesystem."""
    kind, why, bf16, accel = device_facts()
    common = dict(
        arch=_platform.machine(),
        device=kind,
        device_reason=why,
        bf16=bf16,
        accelerator_memory=accel,
        thermal_sources=sources.thermal_sources(platform, linux_root),
        memory_pressure_sources=sources.memory_pressure_sources(platform, linux_root),
        versions=versions(),
    )
    if platform == "darwin":
        from raytrm.hardware import macos

        mac = macos.read_mac_facts(mac_run)
        family, variant = macos.chip_family(mac.chip)
        return HardwareInfo(
            os="darwin",
            os_version=_platform.mac_ver()[0] or "unknown",
            model_name=mac.model_name,
            model_id=mac.model_id,
            chip=mac.chip,
            chip_family=family,
            chip_variant=variant,
            performance_cores=mac.performance_cores,
            efficiency_cores=mac.efficiency_cores,
            core_kinds=[dataclasses.asdict(k) for k in mac.core_kinds],
            logical_cpus=mac.logical_cpus,
            memory_bytes=mac.memory_bytes,
            notes=list(mac.notes),
            **common,
        )
    from raytrm.hardware import linux

    lx = linux.read_linux_facts(linux_root)
    return HardwareInfo(
        os="linux" if platform.startswith("linux") else platform,
        os_version=lx.os_version,
        model_name=lx.model_name,
        model_id="",
        chip=lx.chip,
        chip_family="",
        chip_variant="",
        performance_cores=lx.physical_cores,
        efficiency_cores=0,
        core_kinds=[{"name": "Physical", "count": lx.physical_cores}],
        logical_cpus=lx.logical_cpus,
        memory_bytes=lx.memory_bytes,
        notes=list(lx.notes),
        **common,
    )


def probe_document(hw: HardwareInfo, tier: Any) -> dict[str, Any]:
    """The `raytrm probe --json` document: schema version, machine, tier."""
    return {"raytrm_probe": PROBE_SCHEMA_VERSION, "machine": hw.to_dict(), "tier": dataclasses.asdict(tier)}


def _cores(hw: HardwareInfo) -> str:
    kinds = ", ".join(f"{k['count']} {k['name']}" for k in hw.core_kinds)
    return f"{kinds} ({hw.logical_cpus} logical)"


def format_table(hw: HardwareInfo, tier: Any) -> str:
    """The human-readable probe table."""
    accel = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in hw.accelerator_memory.items())
    rows = [
        ("OS", f"{hw.os} {hw.os_version} ({hw.arch})"),
        (
            "Model",
            " ".join(x for x in (hw.model_name, f"({hw.model_id})" if hw.model_id else "") if x) or "unknown",
        ),
        ("Chip", hw.chip or "unknown"),
        ("Cores", _cores(hw)),
        ("Memory", f"{hw.memory_gb:.1f} GiB"),
        ("Device", f"{hw.device}: {hw.device_reason}" + (f"; {accel}" if accel else "")),
        ("bf16", "works" if hw.bf16 else "not available"),
        ("Thermal", ", ".join(hw.thermal_sources)),
        ("Memory pressure", ", ".join(hw.memory_pressure_sources)),
        ("Versions", ", ".join(f"{k} {v}" for k, v in hw.versions.items())),
        ("Tier", tier.name),
        ("  why", tier.reason),
        (
            "  budget",
            f"{tier.memory_budget_mb} MiB of {hw.memory_bytes / 2**20:.0f} MiB, thermal cap {tier.thermal_cap}",
        ),
        (
            "  defaults",
            f"threads {tier.threads}, interop {tier.interop_threads}, "
            f"loader workers {tier.dataloader_workers}, dtype {tier.dtype}",
        ),
    ]
    rows += [("Note", n) for n in [*hw.notes, *tier.notes]]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
