"""Which thermal and memory-pressure sources answer on this machine.

Only availability is decided here (thermal sources by asking the readers of thermal.py once). The names are
stable: they appear in `raytrm probe --json` and in run metadata.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

from raytrm.hardware.thermal import hottest_psutil_celsius, hottest_zone_celsius

#: Needs no sensor: a sustained fall of throughput at constant work is how throttling shows.
THROUGHPUT = "throughput"


def thermal_sources(platform: str = sys.platform, root: str = "/") -> list[str]:
    """Thermal sources in order of preference; always ends with the sensorless throughput source."""
    found = []
    if platform == "darwin":
        if importlib.util.find_spec("Foundation") is not None:
            found.append("nsprocessinfo")
        if shutil.which("powermetrics") and os.geteuid() == 0:
            found.append("powermetrics")
        if shutil.which("pmset"):
            found.append("pmset")
    elif platform.startswith("linux"):
        if hottest_zone_celsius(root) is not None:
            found.append("linux-thermal-zones")
        if hottest_psutil_celsius() is not None:
            found.append("psutil-sensors")
    found.append(THROUGHPUT)
    return found


def memory_pressure_sources(platform: str = sys.platform, root: str = "/") -> list[str]:
    """Memory-pressure sources in order of preference; psutil's available memory works everywhere."""
    found = []
    if platform == "darwin":
        if shutil.which("sysctl"):
            found.append("sysctl-pressure-level")
        if shutil.which("memory_pressure"):
            found.append("memory_pressure")
    elif platform.startswith("linux") and os.access(os.path.join(root, "proc/pressure/memory"), os.R_OK):
        found.append("linux-psi")
    found.append("psutil")
    return found
