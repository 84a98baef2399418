"""Recorded Mac outputs through the whole probe: each Mac gets its chip, cores, memory and the right tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrm.hardware.probe import detect
from raytrm.hardware.tiers import match_tier

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "macos"


def mac_runner(sysctl: str, profiler: str):
    texts = {"sysctl hw machdep.cpu": sysctl, "sysctl hw.model": "", "system_profiler SPHardwareDataType": profiler}

    def run(argv: list[str]) -> str:
        name = texts[" ".join(argv)]
        return (FIXTURES / name).read_text() if name else ""

    return run


def no_device():
    return "mps", "Apple Metal (MPS) is available", False, {}


# sysctl fixture, system_profiler fixture, chip, performance, efficiency, memory GiB, tier (None = generic)
MACS = {
    "m1-air-16gb": (
        "sysctl_hw_m1_air_16gb.txt",
        "system_profiler_m1_air_16gb.txt",
        "Apple M1",
        4,
        4,
        16,
        "macbook-air-16gb",
    ),
    "m1-air-8gb": ("", "system_profiler_m1_air_8gb.txt", "Apple M1", 4, 4, 8, "macbook-air-8gb"),
    "m2-air-24gb": ("sysctl_hw_m2_air_24gb.txt", "", "Apple M2", 4, 4, 24, None),  # no model: generic
    "m1-pro-mbp": (
        "sysctl_a_perflevel_m1_pro.txt",
        "system_profiler_m1_pro_mbp_16gb.txt",
        "Apple M1 Pro",
        8,
        2,
        16,
        "macbook-pro-16gb",
    ),
    "m2-pro-mbp": ("", "system_profiler_m2_pro_mbp_16gb.txt", "Apple M2 Pro", 8, 4, 16, "macbook-pro-16gb"),
    "m3-max-128gb": ("sysctl_hw_m3_max_128gb.txt", "", "Apple M3 Max", 12, 4, 128, None),
    "m4-max-studio": ("", "system_profiler_m4_max_studio_128gb.txt", "Apple M4 Max", 12, 4, 128, "mac-desktop-128gb"),
    "m2-ultra-studio": (
        "",
        "system_profiler_m2_ultra_studio_192gb.txt",
        "Apple M2 Ultra",
        16,
        8,
        192,
        "mac-desktop-192gb",
    ),
    "m5-pro-mbp": (
        "sysctl_perflevel_names_m5_pro.txt",
        "system_profiler_m5_pro_mbp_24gb.txt",
        "Apple M5 Pro",
        15,
        0,
        24,
        "macbook-pro-24gb",
    ),
}


@pytest.mark.parametrize("name", sorted(MACS))
def test_recorded_mac_gets_its_tier(name):
    sysctl, profiler, chip, perf, eff, mem_gb, tier_name = MACS[name]
    hw = detect(platform="darwin", mac_run=mac_runner(sysctl, profiler), device_facts=no_device)
    assert (hw.chip, hw.performance_cores, hw.efficiency_cores) == (chip, perf, eff)
    assert hw.memory_bytes == mem_gb * 1024**3
    tier = match_tier(hw)
    if tier_name is None:
        assert tier.generic, f"{name} matched {tier.name} although its model is unknown"
    else:
        assert (tier.name, tier.generic) == (tier_name, False)
        assert tier.threads == perf


def test_m5_super_cores_are_not_efficiency_cores():
    hw = detect(platform="darwin", mac_run=mac_runner(*MACS["m5-pro-mbp"][:2]), device_facts=no_device)
    assert [(k["name"], k["count"]) for k in hw.core_kinds] == [("Super", 5), ("Performance", 10)]
