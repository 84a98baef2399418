"""The thermal guard: above the tier's cap it lowers the load, then pauses to cool, and recovers when it can.

Fed once per step with the thermal state where a sensor answers, and always with the step's throughput: at constant
work a sustained fall in samples/s is how throttling shows on a machine without sensors (most Linux VMs, and a Mac
whose NSProcessInfo is unsupported), so the guard infers "serious" from it. Decisions are pure functions of what it
is told; its hook (`ThermalHook`) applies them in the training loop (threads, micro-batch, sleep) and logs them.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from raytrm.config import THERMAL_STATES
from raytrm.hardware.thermal import ThermalReader
from raytrm.train import loop as decisions
from raytrm.train.loop import Hook, Loop, Step

logger = logging.getLogger(__name__)


def rank(state: str | None) -> int:
    """nominal 0 < fair 1 < serious 2 < critical 3; unknown counts as nominal."""
    return THERMAL_STATES.index(state) if state in THERMAL_STATES else 0


@dataclass
class GuardSettings:
    patience: int = 5  # steps above the cap at lowered load before pausing
    pause_s: float = 20.0  # one cooling pause
    recover_after: int = 10  # steps at or below the cap before the load is restored
    baseline_steps: int = 10  # steps after warm-up that set the throughput baseline
    warmup_steps: int = 5
    decline: float = 0.25  # a median throughput this far under the baseline reads as throttling
    window: int = 5


@dataclass
class Decision:
    """What the loop should do before the next step."""

    threads: int | None = None  # set torch threads to this
    micro_batch_scale: float | None = None  # multiply the micro-batch by this (restore: 1 / the earlier scale)
    pause_s: float = 0.0
    event: dict | None = None


@dataclass
class ThermalGuard:
    cap: str
    action: str  # "threads" or "micro_batch"
    threads: int
    settings: GuardSettings = field(default_factory=GuardSettings)
    events: list[dict] = field(default_factory=list)
    hottest: str = "nominal"
    _steps_seen: int = 0
    _baseline: float | None = None
    _early: list[float] = field(default_factory=list)
    _recent: deque = field(default_factory=lambda: deque(maxlen=5))
    _lowered: bool = False
    _hot_steps: int = 0
    _cool_steps: int = 0

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.settings.window)

    def reset_baseline(self) -> None:
        """The work per step changed (a new cut, new threads): throughput is measured afresh."""
        self._baseline, self._early, self._steps_seen = None, [], 0
        self._recent.clear()

    def inferred_state(self, samples_per_sec: float) -> str | None:
        """'serious' when the recent median throughput fell well under the baseline at constant work."""
        self._steps_seen += 1
        if self._steps_seen <= self.settings.warmup_steps:
            return None
        if self._baseline is None:
            self._early.append(samples_per_sec)
            if len(self._early) >= self.settings.baseline_steps:
                self._baseline = statistics.median(self._early)
            return None
        self._recent.append(samples_per_sec)
        if len(self._recent) < self._recent.maxlen:
            return None
        return "serious" if statistics.median(self._recent) < (1 - self.settings.decline) * self._baseline else None

    def _event(self, step: int, kind: str, reason: str, state: str) -> dict:
        event = {"step": step, "event": f"thermal-{kind}", "thermal_state": state, "reason": reason}
        self.events.append(event)
        logger.info("step %d: thermal %s: %s", step, kind, reason)
        return event

    def observe(self, step: int, state: str | None, samples_per_sec: float) -> Decision:
        """One step's reading; returns what to change before the next step."""
        sensed = state if state in THERMAL_STATES else None
        inferred = None if sensed else self.inferred_state(samples_per_sec)
        current = sensed or inferred or "nominal"
        source = "sensor" if sensed else ("throughput decline" if inferred else "no sign of heat")
        if rank(current) > rank(self.hottest):
            self.hottest = current
        over = rank(current) > rank(self.cap)
        if over:
            self._cool_steps = 0
            self._hot_steps += 1
            why = f"{current} ({source}) is above the cap {self.cap}"
            if not self._lowered:
                self._lowered, self._hot_steps = True, 0
                if self.action == "threads" and self.threads > 1:
                    return Decision(
                        threads=max(1, self.threads // 2),
                        event=self._event(
                            step, "lower-load", f"{why}: threads {self.threads} -> {max(1, self.threads // 2)}", current
                        ),
                    )
                return Decision(
                    micro_batch_scale=0.5, event=self._event(step, "lower-load", f"{why}: micro-batch halved", current)
                )
            if self._hot_steps >= self.settings.patience:
                self._hot_steps = 0
                return Decision(
                    pause_s=self.settings.pause_s,
                    event=self._event(
                        step, "pause", f"{why} at lowered load: cooling {self.settings.pause_s:.0f} s", current
                    ),
                )
            return Decision()
        self._hot_steps = 0
        if self._lowered:
            self._cool_steps += 1
            if self._cool_steps >= self.settings.recover_after:
                self._lowered, self._cool_steps = False, 0
                event = self._event(
                    step,
                    "recover",
                    f"{current} for {self.settings.recover_after} steps, within the cap {self.cap}: load restored",
                    current,
                )
                if self.action == "threads" and self.threads > 1:
                    return Decision(threads=self.threads, event=event)
                return Decision(micro_batch_scale=2.0, event=event)
        return Decision()


class ThermalHook(Hook):
    """The heat in the loop: read at each step where a guard acts on it, else only for the steps with a metrics row
    (which shows it); the guard's decisions are applied before the next step."""

    def __init__(self, reader: ThermalReader, guard: ThermalGuard | None = None) -> None:
        self.reader, self.guard = reader, guard

    def after_step(self, loop: Loop, step: Step) -> list[decisions.Decision]:
        if self.guard is None and not step.logged:
            return []
        step.heat = self.reader.read()
        if self.guard is None:
            return []
        result = step.result
        decision = self.guard.observe(result.step, step.heat.get("thermal_state"), result.samples / result.seconds)
        if decision.event:
            step.events.append(decision.event)
        out: list[decisions.Decision] = []
        if decision.threads:
            out.append(decisions.Threads(decision.threads))
            self.guard.reset_baseline()
        if decision.micro_batch_scale:
            out.append(decisions.Scale(decision.micro_batch_scale))
        if decision.pause_s:
            out.append(decisions.Pause(decision.pause_s))
        return out

    def on_recut(self, loop: Loop) -> None:
        if self.guard is not None:
            self.guard.reset_baseline()  # the work per step changed: throughput is measured afresh

    def summary(self) -> dict[str, Any]:
        """The heat's part of summary.json."""
        return {
            "thermal_max": self.guard.hottest if self.guard is not None else None,
            "thermal_events": list(self.guard.events) if self.guard is not None else [],
        }
