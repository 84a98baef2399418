"""The thermal state where a sensor answers: macOS NSProcessInfo, powermetrics or pmset, or the hottest Linux zone.

One reading per call, cheap enough for every logging step: the commands run at most once per `command_interval_s`
and only where NSProcessInfo does not answer. Where nothing answers the reading is empty, never an error: the
sensorless signal (throughput falling at constant work) is the trainer's to watch. The command parsers are tested
against outputs recorded on real Macs (tests/fixtures/macos).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from raytrm.config import THERMAL_STATES
from raytrm.hardware.pressure import run_command

logger = logging.getLogger(__name__)

POWERMETRICS = ["powermetrics", "-s", "thermal", "-n", "1", "-i", "100"]  # one 100 ms sample, not the 5 s default
PMSET = ["pmset", "-g", "therm"]
# powermetrics' five thermal pressure levels onto NSProcessInfo's four states, by severity. Moderate is the first
# step up (fans, no throttling yet): fair. Heavy is where clocks drop: serious ("performance may be impacted"), even
# though ProcessInfo can say only nominal or fair at that moment: the guard should see the throttling it is there
# for. Trapping and Sleeping are the system forcing itself to cool: critical, as the MacThrottle app maps them.
_POWERMETRICS_STATES = {
    "nominal": "nominal",
    "moderate": "fair",
    "heavy": "serious",
    "trapping": "critical",
    "sleeping": "critical",
}
_PRESSURE_LEVEL = re.compile(r"Current pressure level:\s*([A-Za-z]+)")
_PMSET_LIMIT = re.compile(r"^\s*(CPU_Speed_Limit|CPU_Scheduler_Limit|CPU_Available_CPUs)\s*=\s*(\d+)\s*$", re.MULTILINE)
# A CPU limit below 100 % means macOS is already slowing the CPU: NSProcessInfo's "serious" ("system performance may
# be impacted"); at half speed or less a step takes at least twice as long: "critical" ("significantly impacted").
# pmset cannot see fans, so it never says "fair".
PMSET_CRITICAL_LIMIT = 50


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


def parse_powermetrics_thermal(text: str) -> str | None:
    """The latest "Current pressure level" of `powermetrics -s thermal` as nominal, fair, serious or critical."""
    levels = _PRESSURE_LEVEL.findall(text or "")
    if not levels:
        return None
    state = _POWERMETRICS_STATES.get(levels[-1].lower())
    if state is None:
        logger.debug("unknown powermetrics thermal pressure level %r", levels[-1])
    return state


def parse_pmset_therm(text: str) -> dict[str, object]:
    """`pmset -g therm` (or `-g thermlog`): the latest CPU limits and the state they imply; {} where none is printed.

    Apple Silicon prints only "Note: No ... has been recorded" lines, which say nothing about throttling.
    """
    limits: dict[str, int] = {}
    for key, value in _PMSET_LIMIT.findall(text or ""):
        limits[key] = int(value)  # a thermlog stream repeats the block: the last one is the current one
    out: dict[str, object] = {}
    if "CPU_Speed_Limit" in limits:
        out["cpu_speed_limit"] = limits["CPU_Speed_Limit"]
    if "CPU_Scheduler_Limit" in limits:
        out["cpu_scheduler_limit"] = limits["CPU_Scheduler_Limit"]
    if "CPU_Available_CPUs" in limits:
        out["cpu_available_cpus"] = limits["CPU_Available_CPUs"]
    percents = [v for k, v in limits.items() if k != "CPU_Available_CPUs"]
    if percents:
        lowest = min(percents)
        state = "nominal" if lowest >= 100 else "serious" if lowest > PMSET_CRITICAL_LIMIT else "critical"
        out["thermal_state"] = state
    return out


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


class ThermalReader:
    """Reads what this platform offers; fields absent from the reading are unknown here."""

    def __init__(
        self,
        platform: str = sys.platform,
        root: str = "/",
        nsprocessinfo: Callable[[], int | None] = _nsprocessinfo,
        *,
        run: Callable[[list[str]], str] | None = None,
        which: Callable[[str], str | None] = shutil.which,
        is_root: Callable[[], bool] = _is_root,
        command_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.platform, self.root, self._nsprocessinfo = platform, root, nsprocessinfo
        self._run = run or (lambda argv: run_command(argv, timeout_s=5.0))
        self._which, self._is_root, self._clock = which, is_root, clock
        self.command_interval_s = command_interval_s
        self._cached: dict[str, object] = {}
        self._cached_at: float | None = None

    def _command(self, argv: list[str]) -> str:
        try:
            out = self._run(list(argv))
        except Exception as exc:  # a reading must never stop training, whatever an injected runner does
            logger.debug("%s failed: %s", " ".join(argv), exc)
            return ""
        return out if isinstance(out, str) else ""

    def _from_commands(self) -> dict[str, object]:
        # powermetrics needs root and takes a sample; pmset answers only on Intel. Both are subprocesses, so
        # their answer is kept for command_interval_s rather than asked for at every logging step.
        now = self._clock()
        if self._cached_at is not None and now - self._cached_at < self.command_interval_s:
            return dict(self._cached)
        out: dict[str, object] = {}
        if self._is_root() and self._which(POWERMETRICS[0]):
            state = parse_powermetrics_thermal(self._command(POWERMETRICS))
            if state is not None:
                out["thermal_state"] = state
        if not out and self._which(PMSET[0]):
            out = parse_pmset_therm(self._command(PMSET))
        self._cached, self._cached_at = out, now
        return dict(out)

    def read(self) -> dict[str, object]:
        """thermal_state on macOS (NSProcessInfo first), temperature_c on Linux; {} where nothing answers."""
        out: dict[str, object] = {}
        if self.platform == "darwin":
            try:
                state = state_from_nsprocessinfo(self._nsprocessinfo())
            except Exception as exc:  # an injected or future pyobjc source must not stop training
                logger.debug("NSProcessInfo failed: %s", exc)
                state = None
            if state is not None:
                out["thermal_state"] = state
            else:
                out.update(self._from_commands())
        elif self.platform.startswith("linux"):
            celsius = hottest_zone_celsius(self.root)
            if celsius is None and self.root == "/":
                celsius = hottest_psutil_celsius()
            if celsius is not None:
                out["temperature_c"] = celsius
        return out


def hottest_psutil_celsius() -> float | None:
    """The hottest sensor psutil reports (hwmon drivers that expose no thermal zone), or None."""
    reader = getattr(psutil, "sensors_temperatures", None)
    try:
        sensors = reader() if reader else {}
    except (OSError, RuntimeError):
        return None
    readings = [entry.current for entries in sensors.values() for entry in entries if entry.current is not None]
    return max(readings) if readings else None
