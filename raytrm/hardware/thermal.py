"""The thermal state where a sensor answers: macOS NSProcessInfo, or the hottest Linux thermal zone.

One reading per call, cheap enough for every logging step. Where nothing answers the reading is empty, never an
error: the sensorless signal (throughput falling at constant work) is the trainer's to watch.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Callable
from pathlib import Path

from raytrm.config import THERMAL_STATES


def state_from_nsprocessinfo(value: object) -> str | None:
    """NSProcessInfoThermalState 0..3 as nominal, fair, serious, critical; anything else is unknown (None)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(THERMAL_STATES):
        return THERMAL_STATES[value]
    return None


def _nsprocessinfo() -> int | None:
    try:
        from Foundation import NSProcessInfo  # pyobjc-framework-Cocoa, optional
    except ImportError:
        return None
    try:
        return int(NSProcessInfo.processInfo().thermalState())
    except (AttributeError, TypeError, ValueError):
        return None


def hottest_zone_celsius(root: str = "/") -> float | None:
    """The highest temperature among Linux thermal zones, in degrees C (sysfs reports millidegrees)."""
    hottest = None
    for path in glob.glob(os.path.join(root, "sys/class/thermal/thermal_zone*/temp")):
        try:
            celsius = int(Path(path).read_text().strip()) / 1000
        except (OSError, ValueError):
            continue
        hottest = celsius if hottest is None else max(hottest, celsius)
    return hottest


class ThermalReader:
    """Reads what this platform offers; fields absent from the reading are unknown here."""

    def __init__(
        self, platform: str = sys.platform, root: str = "/", nsprocessinfo: Callable[[], int | None] = _nsprocessinfo
    ) -> None:
        self.platform, self.root, self._nsprocessinfo = platform, root, nsprocessinfo

    def read(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.platform == "darwin":
            state = state_from_nsprocessinfo(self._nsprocessinfo())
            if state is not None:
                out["thermal_state"] = state
        elif self.platform.startswith("linux"):
            celsius = hottest_zone_celsius(self.root)
            if celsius is not None:
                out["temperature_c"] = celsius
        return out
