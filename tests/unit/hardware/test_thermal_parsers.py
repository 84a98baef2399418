"""pmset and powermetrics thermal parsers against outputs recorded on real Macs (tests/fixtures/macos, README cites
each), and the order in which ThermalReader asks its macOS sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrm.hardware.thermal import POWERMETRICS, ThermalReader, parse_pmset_therm, parse_powermetrics_thermal

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "macos"
PRESENT = ("powermetrics", "pmset")


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


class FakeMac:
    """Scripted commands and a clock; `calls` records what the reader ran."""

    def __init__(self, outputs: dict[str, str], root: bool = True, present: tuple[str, ...] = PRESENT):
        self.outputs, self.root, self.present = outputs, root, present
        self.calls: list[list[str]] = []
        self.now = 0.0

    def run(self, argv: list[str]) -> str:
        self.calls.append(list(argv))
        return self.outputs.get(argv[0], "")

    def reader(self, nsprocessinfo=lambda: None, interval: float = 30.0) -> ThermalReader:
        return ThermalReader(
            platform="darwin",
            nsprocessinfo=nsprocessinfo,
            run=self.run,
            which=lambda name: f"/usr/bin/{name}" if name in self.present else None,
            is_root=lambda: self.root,
            command_interval_s=interval,
            clock=lambda: self.now,
        )


# --- pmset -g therm (§3.1, §3.2) ---


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("pmset_therm_m1_pro.txt", {}),  # Apple Silicon: three "Note: No ... recorded" lines, no information
        ("pmset_therm_intel_node_exporter.txt",
         {"cpu_speed_limit": 100, "cpu_scheduler_limit": 100, "cpu_available_cpus": 12, "thermal_state": "nominal"}),
        ("pmset_therm_intel_2011_throttled.txt",
         {"cpu_speed_limit": 35, "cpu_scheduler_limit": 100, "cpu_available_cpus": 8, "thermal_state": "critical"}),
        ("pmset_thermlog_intel.txt",
         {"cpu_speed_limit": 100, "cpu_scheduler_limit": 100, "cpu_available_cpus": 8, "thermal_state": "nominal"}),
        ("pmset_thermlog_intel_throttled.txt",
         {"cpu_speed_limit": 28, "cpu_scheduler_limit": 40, "cpu_available_cpus": 8, "thermal_state": "critical"}),
    ],
)  # fmt: skip
def test_pmset_recorded(name, expected):
    assert parse_pmset_therm(fixture(name)) == expected


@pytest.mark.parametrize(
    ("speed", "scheduler", "state"),
    [(100, 100, "nominal"), (99, 100, "serious"), (51, 100, "serious"), (50, 100, "critical"), (100, 60, "serious")],
)
def test_pmset_state_bands(speed, scheduler, state):
    # not recorded outputs: the recorded layout with other limits, to pin the bands between the recorded 100 and 35
    text = f"CPU Power notify\n\tCPU_Scheduler_Limit \t= {scheduler}\n\tCPU_Speed_Limit \t= {speed}\n"
    assert parse_pmset_therm(text)["thermal_state"] == state


def test_pmset_thermlog_stream_takes_the_latest_block():
    text = fixture("pmset_thermlog_intel.txt") + fixture("pmset_thermlog_intel_throttled.txt")
    assert parse_pmset_therm(text)["cpu_speed_limit"] == 28
    text = fixture("pmset_thermlog_intel_throttled.txt") + fixture("pmset_thermlog_intel.txt")
    assert parse_pmset_therm(text)["thermal_state"] == "nominal"


@pytest.mark.parametrize("text", ["", "pmset: command not found", "CPU_Speed_Limit = fast"])
def test_pmset_without_limits(text):
    assert parse_pmset_therm(text) == {}


# --- powermetrics -s thermal (§3.3) ---


def test_powermetrics_recorded_m2_air():
    assert parse_powermetrics_thermal(fixture("powermetrics_thermal_m2_air.txt")) == "nominal"


def test_powermetrics_recorded_blank_line_layout():
    assert parse_powermetrics_thermal(fixture("powermetrics_thermal_blank_lines.txt")) == "nominal"


@pytest.mark.parametrize(
    ("level", "state"),
    [("Nominal", "nominal"), ("Moderate", "fair"), ("Heavy", "serious"), ("Trapping", "critical"),
     ("Sleeping", "critical"), ("heavy", "serious"), ("Bogus", None)],
)  # fmt: skip
def test_powermetrics_levels(level, state):
    # the recorded block with its last sample's level replaced: Moderate..Sleeping are reported only in prose (§3.3)
    text = fixture("powermetrics_thermal_m2_air.txt")
    head, _, _ = text.rpartition("Current pressure level: Nominal")
    assert parse_powermetrics_thermal(f"{head}Current pressure level: {level}\n") == state


def test_powermetrics_without_a_level():
    assert parse_powermetrics_thermal("") is None
    assert parse_powermetrics_thermal("powermetrics must be invoked as the superuser\n") is None


# --- ThermalReader's macOS order: NSProcessInfo, then powermetrics (root), then pmset ---


def test_nsprocessinfo_answers_first_and_no_command_runs():
    mac = FakeMac({"powermetrics": "Current pressure level: Heavy\n"})
    assert mac.reader(nsprocessinfo=lambda: 1).read() == {"thermal_state": "fair"}
    assert mac.calls == []


def test_powermetrics_as_root_when_nsprocessinfo_is_silent():
    recorded = {"powermetrics": fixture("powermetrics_thermal_m2_air.txt"), "pmset": fixture("pmset_therm_m1_pro.txt")}
    mac = FakeMac(recorded)
    assert mac.reader().read() == {"thermal_state": "nominal"}
    assert mac.calls == [POWERMETRICS]


def test_not_root_skips_powermetrics_and_falls_back_to_pmset():
    mac = FakeMac({"powermetrics": "Current pressure level: Heavy\n",
                   "pmset": fixture("pmset_therm_intel_2011_throttled.txt")}, root=False)  # fmt: skip
    assert mac.reader().read()["thermal_state"] == "critical"
    assert [argv[0] for argv in mac.calls] == ["pmset"]


def test_powermetrics_missing_is_not_run():
    mac = FakeMac({"pmset": fixture("pmset_therm_m1_pro.txt")}, present=("pmset",))
    assert mac.reader().read() == {}
    assert [argv[0] for argv in mac.calls] == ["pmset"]


def test_commands_run_at_most_once_per_interval():
    mac = FakeMac({"powermetrics": "Current pressure level: Moderate\n"})
    reader = mac.reader(interval=30.0)
    assert reader.read() == {"thermal_state": "fair"}
    mac.now = 29.0
    assert reader.read() == {"thermal_state": "fair"}
    assert len(mac.calls) == 1
    mac.outputs["powermetrics"] = "Current pressure level: Heavy\n"
    mac.now = 30.5
    assert reader.read() == {"thermal_state": "serious"}
    assert len(mac.calls) == 2


def test_a_failing_runner_never_raises():
    def broken(argv: list[str]) -> str:
        raise TimeoutError(f"{argv[0]} timed out")

    reader = ThermalReader(platform="darwin", nsprocessinfo=lambda: None, run=broken, which=lambda n: n,
                           is_root=lambda: True)  # fmt: skip
    assert reader.read() == {}


def test_a_failing_nsprocessinfo_falls_back():
    def broken() -> int:
        raise AttributeError("thermalState")

    mac = FakeMac({"powermetrics": "Current pressure level: Trapping\n"})
    assert mac.reader(nsprocessinfo=broken).read() == {"thermal_state": "critical"}
