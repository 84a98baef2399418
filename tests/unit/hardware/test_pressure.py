"""Memory readers against outputs recorded on real Macs (tests/fixtures/macos; its README cites each) and fake PSI."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrm.hardware import pressure
from raytrm.hardware.device import CPU, CUDA, MPS
from raytrm.hardware.pressure import (
    MemoryReader,
    MemoryReading,
    parse_memory_pressure,
    parse_pressure_level,
    parse_psi,
    parse_vm_stat,
    psi_level,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "macos"
PSI_IDLE = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def scripted(outputs: dict[str, str], calls: list | None = None):
    """A `run` answering by command name, like the Mac would."""

    def run(argv: list[str]) -> str:
        if calls is not None:
            calls.append(list(argv))
        return outputs.get(argv[0], "")

    return run


def write_psi(root: Path, text: str) -> str:
    (root / "proc/pressure").mkdir(parents=True)
    (root / "proc/pressure/memory").write_text(text)
    return str(root)


# --- sysctl kern.memorystatus_vm_pressure_level (§2.4) ---


@pytest.mark.parametrize(
    ("text", "level"),
    [
        (fixture("sysctl_pressure_level_1_intel.txt"), "normal"),
        (fixture("sysctl_pressure_level_4_intel.txt"), "critical"),
        ("kern.memorystatus_vm_pressure_level: 2\n", "warn"),
        ("kern.memorystatus_vm_pressure_level = 4", "critical"),
        ("1\n", "normal"),  # the -n form
        ("2", "warn"),
        ("4\n", "critical"),
        ("3\n", None),  # not an XNU level
        ("0", None),
        ("", None),
        ("sysctl: unknown oid 'kern.memorystatus_vm_pressure_level'", None),
    ],
)
def test_pressure_level(text, level):
    assert parse_pressure_level(text) == level


def test_pressure_level_ignores_the_prompt_line_that_names_the_key():
    text = fixture("sysctl_pressure_level_1_intel.txt")
    assert "sysctl kern.memorystatus_vm_pressure_level" in text.splitlines()[0]
    assert parse_pressure_level(text) == "normal"


# --- memory_pressure (§2.1-2.3) ---


@pytest.mark.parametrize(
    ("name", "total", "pages", "free_percent", "free", "compressor"),
    [
        ("memory_pressure_16gb.txt", 17179869184, 1048576, 57.0, 11961, 308084),
        ("memory_pressure_mini2_32gb.txt", 34359738368, 2097152, 87.0, 15123, 120555),
    ],
)
def test_full_memory_pressure(name, total, pages, free_percent, free, compressor):
    stats = parse_memory_pressure(fixture(name))
    assert stats.total_bytes == total
    assert stats.page_size == 16384 and stats.total_bytes == pages * stats.page_size
    assert stats.free_percent == free_percent
    assert stats.counts["free"] == free and stats.counts["compressor"] == compressor
    assert stats.page_bytes()["free"] == free * 16384
    # the resident pages it lists account for most of the machine, never more than all of it
    resident = sum(stats.counts[k] for k in ("free", "active", "inactive", "speculative", "wired", "compressor"))
    assert 0.9 * pages < resident <= pages


def test_memory_pressure_16gb_every_counter():
    assert parse_memory_pressure(fixture("memory_pressure_16gb.txt")).counts == {
        "free": 11961, "purgeable": 1058, "purged": 216965, "swapins": 0, "swapouts": 0,
        "active": 282752, "inactive": 267051, "speculative": 14941, "throttled": 0, "wired": 123956,
        "compressor": 308084, "decompressions": 833069, "compressions": 1712223,
        "pageins": 2339379, "pageouts": 18868,
    }  # fmt: skip


def test_memory_pressure_q():
    stats = parse_memory_pressure(fixture("memory_pressure_q_68.txt"))
    assert stats.free_percent == 68.0
    assert stats.page_size is None and stats.counts == {} and stats.page_bytes() == {}


@pytest.mark.parametrize("text", ["", "memory_pressure: command not found", "System-wide memory free percentage: %"])
def test_memory_pressure_without_a_percentage(text):
    assert parse_memory_pressure(text).free_percent is None


# --- vm_stat (§2.1, 2.2, 2.5) ---


def test_vm_stat_head_16gb():
    stats = parse_vm_stat(fixture("vm_stat_head_16gb.txt"))
    assert stats.page_size == 16384
    assert stats.counts["translation_faults"] == 113228151  # a quoted key
    assert stats.page_bytes() == {
        "free": 12216 * 16384, "active": 282766 * 16384, "inactive": 267123 * 16384, "speculative": 14945 * 16384,
        "throttled": 0, "wired": 123968 * 16384, "purgeable": 1058 * 16384,
    }  # fmt: skip


def test_vm_stat_full_agrees_with_memory_pressure_on_the_same_host():
    vm = parse_vm_stat(fixture("vm_stat_mini2_32gb.txt"))
    mp = parse_memory_pressure(fixture("memory_pressure_mini2_32gb.txt"))
    # the two commands name the same counters differently
    for name in ("compressor", "compressions", "decompressions", "purgeable", "purged", "swapins"):
        assert vm.counts[name] == mp.counts[name], name
    assert vm.page_bytes()["stored_in_compressor"] == 329758 * 16384
    assert vm.page_bytes()["file_backed"] == 516277 * 16384 and vm.page_bytes()["anonymous"] == 1268414 * 16384
    assert "pageins" not in vm.page_bytes()  # an event counter, not pages in memory


def test_vm_stat_apple_silicon_hmcl():
    stats = parse_vm_stat(fixture("vm_stat_hmcl_apple_silicon.txt"))
    assert stats.page_size == 16384
    assert stats.page_bytes()["free"] == 3857 * 16384
    assert stats.page_bytes()["compressor"] == 442179 * 16384
    assert stats.counts["translation_faults"] == 8667427138


def test_vm_stat_intel_4096():
    stats = parse_vm_stat(fixture("vm_stat_head_intel_4096.txt"))
    assert stats.page_size == 4096
    assert stats.page_bytes() == {"free": 6127229 * 4096}


def test_vm_stat_without_a_header_gives_counts_but_no_bytes():
    stats = parse_vm_stat("Pages free:    12216.\n")
    assert stats.counts == {"free": 12216} and stats.page_bytes() == {}


# --- Linux PSI ---


@pytest.mark.parametrize(
    ("some", "full", "level"),
    [(0.0, 0.0, "normal"), (9.99, 0.0, "normal"), (10.0, 0.0, "warn"), (39.9, 5.0, "warn"), (40.0, 0.0, "critical"),
     (12.0, 10.0, "critical")],
)  # fmt: skip
def test_psi_level(some, full, level):
    text = f"some avg10={some:.2f} avg60=1.00 avg300=0.50 total=123\nfull avg10={full:.2f} avg60=0 avg300=0 total=7"
    assert psi_level(parse_psi(text)) == level


def test_parse_psi():
    text = "some avg10=12.50 avg60=4.03 avg300=1.17 total=98765432\nfull avg10=3.10 avg60=1.00 avg300=0.25 total=123\n"
    assert parse_psi(text) == {
        "some": {"avg10": 12.5, "avg60": 4.03, "avg300": 1.17, "total": 98765432.0},
        "full": {"avg10": 3.1, "avg60": 1.0, "avg300": 0.25, "total": 123.0},
    }
    assert psi_level(parse_psi("")) is None
    assert psi_level(parse_psi("full avg10=50.00 avg60=0 avg300=0 total=1")) is None  # no "some" line


def test_linux_reader_with_psi(tmp_path):
    root = write_psi(tmp_path, "some avg10=41.20 avg60=20.11 avg300=6.40 total=301234567\n"
                               "full avg10=8.75 avg60=4.02 avg300=1.30 total=98123456\n")  # fmt: skip
    reading = MemoryReader(platform="linux", root=root).read()
    assert reading.pressure == "critical"
    assert reading.source == (pressure.PSUTIL, pressure.LINUX_PSI)
    assert reading.rss_bytes > 0 and reading.available_bytes > 0
    assert reading.free_percent is None and reading.device_allocated_bytes is None


def test_linux_reader_without_psi(tmp_path):
    reading = MemoryReader(platform="linux", root=str(tmp_path)).read()
    assert reading.pressure is None and reading.source == (pressure.PSUTIL,)


# --- macOS reader through a scripted runner ---


def test_darwin_reader_reads_sysctl_each_time_and_memory_pressure_only_when_asked():
    calls: list = []
    run = scripted({"sysctl": "4\n", "memory_pressure": fixture("memory_pressure_q_68.txt")}, calls)
    reader = MemoryReader(platform="darwin", run=run)
    quick = reader.read()
    assert quick.pressure == "critical" and quick.free_percent is None
    assert calls == [["sysctl", "-n", "kern.memorystatus_vm_pressure_level"]]
    detailed = reader.read(detailed=True)
    assert detailed.pressure == "critical" and detailed.free_percent == 68.0
    assert calls[1:] == [["sysctl", "-n", "kern.memorystatus_vm_pressure_level"], ["memory_pressure", "-Q"]]
    assert detailed.source == (pressure.PSUTIL, pressure.SYSCTL_LEVEL, pressure.MEMORY_PRESSURE)


def test_darwin_reader_reads_the_full_memory_pressure_report_too():
    run = scripted({"sysctl": fixture("sysctl_pressure_level_1_intel.txt"),
                    "memory_pressure": fixture("memory_pressure_16gb.txt")})  # fmt: skip
    reading = MemoryReader(platform="darwin", run=run).read(detailed=True)
    assert reading.pressure == "normal" and reading.free_percent == 57.0


def test_a_failing_runner_never_raises(caplog):
    def broken(argv: list[str]) -> str:
        raise OSError(f"{argv[0]}: no such file")

    reader = MemoryReader(platform="darwin", run=broken)
    for _ in range(3):
        reading = reader.read(detailed=True)
        assert reading.pressure is None and reading.free_percent is None
        assert reading.source == (pressure.PSUTIL,)
    assert sum("sysctl" in r.getMessage() for r in caplog.records) == 1  # warned once, not every step


def test_a_runner_that_returns_junk_is_unknown():
    reader = MemoryReader(platform="darwin", run=lambda argv: None)  # type: ignore[arg-type,return-value]
    assert reader.read(detailed=True).pressure is None


def test_psutil_failure_is_unknown(monkeypatch):
    def boom():
        raise RuntimeError("psutil says no")

    monkeypatch.setattr(pressure.psutil, "virtual_memory", boom)
    reading = MemoryReader(platform="freebsd").read()
    assert reading.available_bytes is None and reading.rss_bytes > 0 and reading.pressure is None


# --- device allocator gauges ---


def test_injected_gauges():
    reading = MemoryReader(platform="freebsd", device=CUDA, allocated=lambda: 123, peak=lambda: 456).read()
    assert (reading.device_allocated_bytes, reading.device_peak_bytes) == (123, 456)
    assert reading.source[-1] == f"torch.{CUDA}"


def test_default_gauges_follow_the_device_kind(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2000)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 3000)
    cuda = MemoryReader(platform="freebsd", device=torch.device(CUDA)).read()
    assert (cuda.device_allocated_bytes, cuda.device_peak_bytes) == (1000, 2000)
    mps = MemoryReader(platform="freebsd", device=torch.device(MPS)).read()
    assert (mps.device_allocated_bytes, mps.device_peak_bytes) == (3000, None)  # MPS has no peak API
    cpu = MemoryReader(platform="freebsd", device=torch.device(CPU)).read()
    assert (cpu.device_allocated_bytes, cpu.device_peak_bytes) == (None, None)
    assert MemoryReader(platform="freebsd").read().source == (pressure.PSUTIL,)


def test_a_failing_gauge_is_unknown():
    def boom() -> int:
        raise RuntimeError("Torch not compiled with CUDA enabled")

    reading = MemoryReader(platform="freebsd", device=CUDA, allocated=boom, peak=boom).read()
    assert reading.device_allocated_bytes is None and reading.device_peak_bytes is None


def test_default_cuda_gauge_on_a_machine_without_cuda_is_unknown():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gauge answers")
    reading = MemoryReader(platform="freebsd", device=CUDA).read()
    assert reading.device_allocated_bytes in (None, 0)  # torch returns 0 or raises when CUDA is absent


def test_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, raytrm.hardware.pressure, raytrm.hardware.thermal; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_reading_defaults_are_unknown():
    assert MemoryReading() == MemoryReading(None, None, None, None, None, None, ())
