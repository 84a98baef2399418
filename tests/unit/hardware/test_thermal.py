"""Thermal readings: NSProcessInfo states as the SDK header numbers them, Linux zones in millidegrees."""

from __future__ import annotations

import pytest

from raytrm.hardware.thermal import ThermalReader, hottest_zone_celsius, state_from_nsprocessinfo


@pytest.mark.parametrize(
    "value, state",
    [
        (0, "nominal"),
        (1, "fair"),
        (2, "serious"),
        (3, "critical"),
        (4, None),
        (-1, None),
        (None, None),
        (True, None),
        ("1", None),
    ],
)
def test_nsprocessinfo_states(value, state):
    assert state_from_nsprocessinfo(value) == state


def test_darwin_reader_with_a_scripted_state():
    states = iter([0, 2, None])
    reader = ThermalReader(platform="darwin", nsprocessinfo=lambda: next(states))
    assert reader.read() == {"thermal_state": "nominal"}
    assert reader.read() == {"thermal_state": "serious"}
    assert reader.read() == {}  # pyobjc missing or the call failed: unknown, not an error


def test_linux_zones(tmp_path):
    for i, milli in enumerate(["45000", "61500", "garbage"]):
        zone = tmp_path / f"sys/class/thermal/thermal_zone{i}"
        zone.mkdir(parents=True)
        (zone / "temp").write_text(milli + "\n")
    assert hottest_zone_celsius(str(tmp_path)) == 61.5
    assert ThermalReader(platform="linux", root=str(tmp_path)).read() == {"temperature_c": 61.5}
    assert ThermalReader(platform="linux", root=str(tmp_path / "none")).read() == {}


def test_psutil_sensors_when_no_zone(monkeypatch):
    from collections import namedtuple

    import raytrm.hardware.thermal as thermal

    Temp = namedtuple("Temp", "label current high critical")
    monkeypatch.setattr(thermal, "hottest_zone_celsius", lambda root: None)
    monkeypatch.setattr(
        thermal.psutil,
        "sensors_temperatures",
        lambda: {"coretemp": [Temp("Core 0", 55.0, 80, 90), Temp("Core 1", 71.0, 80, 90)]},
        raising=False,
    )
    assert ThermalReader(platform="linux").read() == {"temperature_c": 71.0}
