"""Machine tiers: the table in tiers.yaml (shipped with raytrm: raytrm.constants.spaces_dir), and the rule that picks
a machine's tier."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from raytrm.config import THERMAL_STATES, from_dict, read_yaml
from raytrm.constants import SPACES_DIR_ENV, spaces_dir
from raytrm.errors import ConfigError
from raytrm.schema import check_version, spec

if TYPE_CHECKING:
    from raytrm.hardware.probe import HardwareInfo

TIERS_SCHEMA_VERSION = 1
PERFORMANCE_CORES = "performance_cores"
GiB = 1024**3


@dataclass
class TierMatch:
    """The rule: every key given must match; keys left out match anything."""

    os: str | None = spec(None, "operating system", choices=("darwin", "linux"))
    chip: str | list | None = spec(None, "glob(s) on the chip name, e.g. 'Apple M*'")
    chip_variant: list | None = spec(None, "chip variants, of '', Pro, Max, Ultra")
    model: str | list | None = spec(None, "glob(s) on the model name, e.g. 'MacBook Air*'")
    device: str | None = spec(None, "compute device", choices=("cpu", "cuda", "mps"))
    memory_gb: list | None = spec(None, "[min, max) of total memory in GiB")


@dataclass
class TierDefaults:
    """Training settings before tuning."""

    threads: int | str = spec(PERFORMANCE_CORES, "torch threads: a number, or performance_cores")
    interop_threads: int = spec(1, "torch inter-op threads", ge=1)
    dataloader_workers: int = spec(0, "data loader worker processes", ge=0)
    dtype: str = spec("float32", "training dtype", choices=("auto", "float32", "bfloat16", "float16"))


@dataclass
class TierSpec:
    """One row of tiers.yaml."""

    name: str = spec("", "tier name, used in profiles and file names")
    description: str = spec("", "one line for people")
    match: TierMatch = spec(TierMatch(), "which machines belong to this tier")
    memory_budget_mb: int = spec(1, "training memory budget in MiB", ge=1)
    thermal_cap: str = spec("fair", "hottest thermal state tolerated while training", choices=THERMAL_STATES)
    defaults: TierDefaults = spec(TierDefaults(), "training settings before tuning")


@dataclass
class TierTable:
    """The whole of tiers.yaml."""

    raytrm_tiers: int = spec(TIERS_SCHEMA_VERSION, "schema version", choices=(TIERS_SCHEMA_VERSION,))
    classes: dict = spec({}, "YAML anchors shared by tiers (not read otherwise)")
    tiers: list = spec([], "tier rows, first match wins")


@dataclass
class Tier:
    """The tier chosen for a machine, its limits and defaults resolved against that machine."""

    name: str
    memory_budget_mb: int
    thermal_cap: str
    threads: int
    interop_threads: int
    dataloader_workers: int
    dtype: str
    reason: str
    generic: bool = False
    notes: list[str] = field(default_factory=list)


def default_tiers_path() -> Path:
    return spaces_dir() / "tiers.yaml"


def load_tiers(path: str | Path | None = None) -> list[TierSpec]:
    """Read and validate tiers.yaml; every error names the file, the row and the field."""
    path = Path(path) if path else default_tiers_path()
    data = read_yaml(path)
    if isinstance(data, dict) and "raytrm_tiers" in data:  # a table without it is of the first version
        again = "write the table for this version (`raytrm validate tiers` shows the shipped one and where it lies)"
        check_version(data, str(path), "raytrm_tiers", TIERS_SCHEMA_VERSION, "", again)
    table = from_dict(TierTable, data, str(path))
    rows, seen = [], set()
    for i, raw in enumerate(table.tiers):
        row = from_dict(TierSpec, raw, str(path), f"tiers[{i}]")
        if not row.name:
            raise ConfigError(str(path), f"tiers[{i}].name", row.name, "a non-empty tier name")
        if row.name in seen:
            raise ConfigError(str(path), f"tiers[{i}].name", row.name, "a name used once", "rename one of them")
        lo_hi = row.match.memory_gb
        if lo_hi is not None and (
            len(lo_hi) != 2 or not all(isinstance(v, (int, float)) for v in lo_hi) or lo_hi[0] >= lo_hi[1]
        ):
            raise ConfigError(str(path), f"tiers[{i}].match.memory_gb", lo_hi, "[min, max) with min < max")
        threads = row.defaults.threads
        if (isinstance(threads, str) and threads != PERFORMANCE_CORES) or (isinstance(threads, int) and threads < 1):
            raise ConfigError(
                str(path), f"tiers[{i}].defaults.threads", threads, f"a number >= 1 or '{PERFORMANCE_CORES}'"
            )
        seen.add(row.name)
        rows.append(row)
    return rows


def _globs(value: str | list | None) -> list[str] | None:
    return [value] if isinstance(value, str) else value


def mismatch(rule: TierMatch, hw: HardwareInfo) -> str | None:
    """Why the rule does not match the machine, or None when it does."""
    if rule.os and rule.os != hw.os:
        return f"os {hw.os} is not {rule.os}"
    if rule.device and rule.device != hw.device:
        return f"device {hw.device} is not {rule.device}"
    chips = _globs(rule.chip)
    if chips and not any(fnmatch.fnmatchcase(hw.chip, g) for g in chips):
        return f"chip {hw.chip!r} matches none of {chips}"
    if rule.chip_variant is not None and hw.chip_variant not in rule.chip_variant:
        return f"chip variant {hw.chip_variant!r} is not one of {rule.chip_variant}"
    models = _globs(rule.model)
    if models and not any(fnmatch.fnmatchcase(hw.model_name, g) for g in models):
        return f"model {hw.model_name!r} matches none of {models}"
    if rule.memory_gb is not None:
        lo, hi = rule.memory_gb
        if not lo <= hw.memory_gb < hi:
            return f"memory {hw.memory_gb:.0f} GiB is outside [{lo}, {hi})"
    return None


def _resolve_threads(value: int | str, hw: HardwareInfo) -> int:
    return max(1, hw.performance_cores) if value == PERFORMANCE_CORES else int(value)


def generic_budget_mb(memory_bytes: int) -> int:
    """Budget for an unlisted machine: total less max(2.5 GiB, 25%), the same headroom as the listed tiers."""
    total_mb = memory_bytes / 2**20
    return max(256, int(total_mb - max(2560, 0.25 * total_mb)))


def match_tier(hw: HardwareInfo, tiers: list[TierSpec] | None = None) -> Tier:
    """The first tier whose rule matches; a machine no rule matches gets a generic tier, never an error."""
    tiers = load_tiers() if tiers is None else tiers
    for row in tiers:
        if mismatch(row.match, hw) is None:
            d = row.defaults
            return Tier(
                name=row.name,
                memory_budget_mb=row.memory_budget_mb,
                thermal_cap=row.thermal_cap,
                threads=_resolve_threads(d.threads, hw),
                interop_threads=d.interop_threads,
                dataloader_workers=d.dataloader_workers,
                dtype=d.dtype,
                reason=f"matches tier rule {row.name!r} ({_describe(row.match)})",
            )
    mem_gb = max(1, math.floor(hw.memory_gb + 0.5))
    name = f"generic-{hw.device}-{mem_gb}gb-{hw.performance_cores}c"
    return Tier(
        name=name,
        memory_budget_mb=generic_budget_mb(hw.memory_bytes),
        thermal_cap="serious",
        threads=max(1, hw.performance_cores),
        interop_threads=1,
        dataloader_workers=0,
        dtype="auto" if hw.device == "cuda" else "float32",
        reason="no rule in tiers.yaml matches this machine; tier derived from its memory and cores",
        generic=True,
        notes=[
            "to name this machine's tier, copy the shipped tiers.yaml (`raytrm validate tiers` says where it lies) "
            f"into a folder of your own, add a rule, and set {SPACES_DIR_ENV} to that folder"
        ],
    )


def _describe(rule: TierMatch) -> str:
    parts = [f"{k}={v}" for k, v in vars(rule).items() if v is not None]
    return ", ".join(parts) or "matches anything"
