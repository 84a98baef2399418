"""Linux facts, sources and the probe document, on this machine and on a fake filesystem."""

from __future__ import annotations

import json

import psutil

from raytrm.hardware import linux, probe, sources
from raytrm.hardware.probe import PROBE_SCHEMA_VERSION, probe_document
from raytrm.hardware.tiers import match_tier

CPUINFO_X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model\t\t: 1
model name\t: AMD EPYC 7B13
processor\t: 1
model name\t: AMD EPYC 7B13
"""
CPUINFO_ARM = """processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm
Hardware\t: BCM2835
Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""


def test_cpuinfo_names():
    assert linux.parse_cpuinfo(CPUINFO_X86) == "AMD EPYC 7B13"
    assert linux.parse_cpuinfo(CPUINFO_ARM) == "Raspberry Pi 4 Model B Rev 1.4"
    assert linux.parse_cpuinfo("") == ""


def test_cpu_vendor_from_cpuinfo_or_the_processor_string(tmp_path, monkeypatch):
    assert linux.parse_cpu_vendor(CPUINFO_X86) == "AuthenticAMD"
    assert linux.parse_cpu_vendor(CPUINFO_ARM) == ""  # Arm's cpuinfo names no vendor_id
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cpuinfo").write_text(CPUINFO_X86)
    assert linux.cpu_vendor(str(tmp_path)) == "AuthenticAMD"
    # Without /proc (Windows), the processor string: "Intel64 Family 6 Model 143 Stepping 8, GenuineIntel".
    monkeypatch.setattr(linux.platform, "processor", lambda: "Intel64 Family 6 Model 143 Stepping 8, GenuineIntel")
    assert linux.cpu_vendor(str(tmp_path / "nowhere")) == "GenuineIntel"
    monkeypatch.setattr(linux.platform, "processor", lambda: "arm")
    assert linux.cpu_vendor(str(tmp_path / "nowhere")) == ""


def test_os_release():
    text = 'NAME="Debian GNU/Linux"\nPRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\n'
    assert linux.parse_os_release(text) == "Debian GNU/Linux 12 (bookworm)"


def _fake_root(tmp_path, thermal: bool, psi: bool):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text(CPUINFO_X86)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/os-release").write_text('PRETTY_NAME="Ubuntu 24.04 LTS"\n')
    dmi = tmp_path / "sys/devices/virtual/dmi/id"
    dmi.mkdir(parents=True)
    (dmi / "product_name").write_text("ThinkStation P3\n")
    if thermal:
        zone = tmp_path / "sys/class/thermal/thermal_zone0"
        zone.mkdir(parents=True)
        (zone / "temp").write_text("45000\n")
    if psi:
        (tmp_path / "proc/pressure").mkdir()
        (tmp_path / "proc/pressure/memory").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    return str(tmp_path)


def test_fake_linux_machine(tmp_path):
    root = _fake_root(tmp_path, thermal=True, psi=True)
    facts = linux.read_linux_facts(root)
    assert facts.chip == "AMD EPYC 7B13"
    assert facts.model_name == "ThinkStation P3"
    assert facts.os_version.startswith("Ubuntu 24.04 LTS (kernel ")
    assert sources.thermal_sources("linux", root)[0] == "linux-thermal-zones"
    assert sources.memory_pressure_sources("linux", root) == ["linux-psi", "psutil"]


def test_sources_without_sensors(tmp_path):
    root = _fake_root(tmp_path, thermal=False, psi=False)
    assert sources.thermal_sources("linux", root)[-1] == sources.THROUGHPUT
    assert "linux-thermal-zones" not in sources.thermal_sources("linux", root)
    assert sources.memory_pressure_sources("linux", root) == ["psutil"]


def test_probe_this_machine_gives_cores_memory_cpu_and_a_tier():
    hw = probe.detect()
    assert hw.os == "linux"
    assert hw.device == "cpu"
    assert hw.performance_cores == (psutil.cpu_count(logical=False) or psutil.cpu_count())
    assert hw.logical_cpus == psutil.cpu_count()
    assert hw.memory_bytes == psutil.virtual_memory().total
    assert hw.versions["torch"].startswith("2.")
    tier = match_tier(hw)
    assert tier.generic and tier.name.startswith("generic-cpu-")
    assert 0 < tier.memory_budget_mb < hw.memory_bytes / 2**20
    doc = json.loads(json.dumps(probe_document(hw, tier)))
    assert doc["raytrm_probe"] == PROBE_SCHEMA_VERSION
    assert doc["machine"]["device"] == "cpu"
    assert doc["tier"]["name"] == tier.name
    assert set(doc["machine"]) >= {
        "os",
        "os_version",
        "model_name",
        "chip",
        "performance_cores",
        "efficiency_cores",
        "memory_bytes",
        "memory_gb",
        "device",
        "bf16",
        "thermal_sources",
        "memory_pressure_sources",
        "versions",
    }
