"""A trial's measured window, as hooks of the training loop: warm-up, then the window or the horizon, its figures,
the hottest thermal state over it, and progress reports while it runs.

A trial measures one thing: sustained samples/s after warm-up (which includes the memory governor's probe steps,
so the window measures the asked micro-batch alone), the peak memory of its steps, the throughput decay from the
start to the end of the window, and the heat.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raytrm.config import THERMAL_STATES
from raytrm.hardware.thermal import ThermalReader
from raytrm.train.loop import Hook, Loop, Step, Stop
from raytrm.train.trainer import Trainer

MiB = 2**20
HEAT_EVERY = 10  # window steps between thermal readings


class MeasuredWindow(Hook):
    """The trial's clock: warmup_s seconds of warm-up (at least the memory probe), then a window of measure_s; or,
    with a horizon ({minutes: N} of training, or {samples: N}), the run to the horizon, measured after the warm-up.
    It ends the run at `position` 1."""

    def __init__(
        self, warmup_s: float, measure_s: float, horizon: dict[str, float] | None, decay_window: float
    ) -> None:
        self.warmup_s, self.measure_s, self.horizon, self.decay_window = warmup_s, measure_s, horizon, decay_window
        self.opened: float | None = None  # when the window opened, on the run's clock
        self.window: list[tuple[float, int]] = []  # (end time, samples) of each measured step
        self.warmup: list[tuple[float, int]] = []  # the same before the window (a horizon may end inside the warm-up)

    def position(self, loop: Loop) -> float:
        """How far through the run, 0 to 1."""
        if self.horizon and self.horizon.get("samples"):
            return loop.trainer.samples_seen / self.horizon["samples"]
        if self.horizon:
            return loop.t / (self.horizon["minutes"] * 60)
        return (loop.t - self.opened) / self.measure_s if self.opened is not None else 0.0

    def stop(self, loop: Loop) -> str | None:
        if self.position(loop) < 1:
            return None
        return "horizon reached" if self.horizon else "window measured"

    def before_step(self, loop: Loop) -> None:
        if self.opened is None and not loop.probing and loop.t >= self.warmup_s:
            self.opened = loop.t

    def after_step(self, loop: Loop, step: Step) -> None:
        (self.window if self.opened is not None else self.warmup).append((loop.step_end, step.result.samples))

    def figures(self, trainer: Trainer, peak_bytes: int, *, whole: bool = True) -> dict[str, Any]:
        """samples/s, peak, decay and steps of the window so far; whole: a run that ended inside its warm-up is
        measured over all of it (from the run's start)."""
        if whole and not self.window and self.warmup:
            return _figures(self.warmup, 0.0, peak_bytes, trainer, self.decay_window)
        return _figures(self.window, self.opened, peak_bytes, trainer, self.decay_window)


def _figures(
    window: list[tuple[float, int]], start: float | None, peak: int, trainer: Trainer, decay_window: float
) -> dict[str, Any]:
    end = window[-1][0] if window else start
    seconds = (end - start) if start is not None and end is not None else 0.0
    samples_per_sec = sum(s for _, s in window) / max(seconds, 1e-9) if window else 0.0
    figures = {
        "samples_per_sec": samples_per_sec,
        "peak_memory_mb": peak / MiB,
        "throughput_decay": _decay(window, start, decay_window),
        "steps": trainer.step,
        "measure_seconds": seconds,
    }
    if trainer.tokens_per_sample:
        figures["tokens_per_sec"] = samples_per_sec * trainer.tokens_per_sample
    return figures


def _decay(window: list[tuple[float, int]], start: float | None, share: float) -> float:
    """Relative drop of samples/s from the first to the last `share` of the window (0 when too few steps)."""
    if start is None or len(window) < 4:
        return 0.0
    times = [start] + [t for t, _ in window]
    n = max(1, int(len(window) * share))
    first = sum(s for _, s in window[:n]) / max(times[n] - times[0], 1e-9)
    last = sum(s for _, s in window[-n:]) / max(times[-1] - times[-1 - n], 1e-9)
    return max(0.0, (first - last) / first) if first > 0 else 0.0


def _rank(state: str) -> int:
    return THERMAL_STATES.index(state)


def hotter(a: str | None, b: str | None) -> str | None:
    """The hotter of two thermal states; unknown ones do not count."""
    known = [s for s in (a, b) if s in THERMAL_STATES]
    return max(known, key=THERMAL_STATES.index) if known else None


class HeatCap(Hook):
    """The hottest thermal state of the trial, read when its window opens, every HEAT_EVERY steps in it and at the
    end ("unknown" without a sensor); above the cap the run halts, so the machine cools and the trial is recorded
    too hot."""

    def __init__(self, reader: ThermalReader, cap: str | None, window: MeasuredWindow) -> None:
        self.reader, self.cap, self.window = reader, cap, window
        self.hottest: str | None = None
        self.too_hot = False
        self._opened = False

    def _read(self) -> None:
        self.hottest = hotter(self.hottest, self.reader.read().get("thermal_state"))

    def before_step(self, loop: Loop) -> None:
        if not self._opened and self.window.opened is not None:
            self._opened = True
            self._read()

    def after_step(self, loop: Loop, step: Step) -> Stop | None:
        if self.window.opened is not None and len(self.window.window) % HEAT_EVERY == 0:
            self._read()
        if self.cap and self.hottest is not None and _rank(self.hottest) > _rank(self.cap):
            self.too_hot = True
            return Stop(f"too hot: {self.hottest}, above the cap {self.cap}")
        return None

    def finish(self, loop: Loop) -> None:
        self._read()


class ProgressReports(Hook):
    """Calls `send(loop)` every `every_s` seconds of the window once it has measured a step (no evaluation), so a
    trial whose machine is lost mid-window is recorded with what it measured."""

    def __init__(self, window: MeasuredWindow, every_s: float, send: Callable[[Loop], None]) -> None:
        self.window, self.every_s, self.send = window, every_s, send
        self._last: float | None = None

    def before_step(self, loop: Loop) -> None:
        if self.window.opened is None or not self.window.window:
            return
        last = self._last if self._last is not None else self.window.opened
        if loop.t - last >= self.every_s:
            self._last = loop.t
            self.send(loop)
