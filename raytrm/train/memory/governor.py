"""Memory-adaptive batching: choose the micro-batch from measured peaks, shrink under pressure, grow back.

The governor only decides how a global batch is cut; the trainer guarantees the cut never changes the samples or
the gradient. It probes on real training steps, smallest cut first, because a re-cut step is as good as any other:
nothing is spent on probing. A line fitted to the small probe cuts predicts large ones poorly (two peaks 8 samples
apart, each a few tens of MiB off, can give a slope 20% off), so the chosen cut is approached at most doubling per
step, refitting on each step's peak: the last move extrapolates from a cut at least half its size. A trial's
governor holds instead: it probes two smaller cuts of the asked micro-batch, fits, and then keeps the asked one,
whose predicted peak the trial checks against the budget. Given the cuts and peaks an earlier run of the same
model measured on this machine (`known_points`), it skips the probe and the approach and starts at the cut their fit
chooses: on a GPU the walk's small cuts make slow steps and the first step at each new cut records CUDA graphs for its
shape. Decisions are pure functions of what it is told (step peaks, pressure, out-of-memory errors, known points), so
tests script them.

A cut counts samples, or padded tokens (`unit`; raytrm.train.micro_batches): a Hugging Face classifier's micro-batch
holds at most so many tokens counted as its records x its longest record. Then the fit is peak = fixed + per-token x
the tokens a step had in flight at once (`after_step`'s size: under the cut, as records come in whole), the probe's
cuts are whole records at their widest (the warm-up one record), and the cut moves by at least one such record
(`widest_sample` tokens).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

from raytrm.train.memory.fit import MemoryFit, fit

logger = logging.getLogger(__name__)

MiB = 2**20


@dataclass
class GovernorSettings:
    """Thresholds of the governor, as fractions of the budget."""

    margin: float = 0.10  # the chosen micro-batch's predicted peak stays under (1 - margin) x budget
    high_water: float = 0.95  # a measured peak above this shrinks the micro-batch at the next step
    low_water: float = 0.70  # peaks below this for grow_after steps let it grow back towards the target
    grow_after: int = 20
    probe_steps: int = 3  # steps measured at increasing cuts before the fit (the first one is warm-up)
    approach: float = 2.0  # after the fit, a step's cut is at most this times the largest measured, until the target


@dataclass
class MemoryGovernor:
    """Decides the micro-batch of each step under a memory budget."""

    budget_bytes: int
    global_batch: int
    max_micro_batch: int
    settings: GovernorSettings = field(default_factory=GovernorSettings)
    #: The cuts measured before the fit, smallest first; empty: a few small ones (see __post_init__).
    probe_cuts: tuple[int, ...] = ()
    #: After the probe, keep max_micro_batch whatever the fit says, and never re-cut (a trial measures its cut).
    hold: bool = False
    #: (cut, peak bytes) an earlier run of the same model measured on this machine: start at their fit's cut.
    known_points: tuple[tuple[int, int], ...] = ()
    #: What a cut counts: "samples", or "tokens" (padded: a micro-batch's records x its longest record).
    unit: str = "samples"
    #: The units one sample holds at its widest (in tokens, max length): the least a cut holds and moves by.
    widest_sample: int = 1
    events: list[dict] = field(default_factory=list)
    fit: MemoryFit | None = None
    target: int | None = None
    peak_bytes: int = 0
    _points: list[tuple[int, int]] = field(default_factory=list)
    _probe: list[int] = field(default_factory=list)
    _calm_steps: int = 0
    _current: int = 0
    _approaching: bool = False  # moving up to the fitted target, refitting on each step's peak
    _known: bool = False  # the points began with known ones: none of them is a warm-up step's

    def __post_init__(self) -> None:
        top, one = min(self.max_micro_batch, self.global_batch), self.widest_sample
        if self.known_points and not self.hold and len({cut for cut, _ in self.known_points}) >= 2:
            self._points, self._known = [(int(b), int(p)) for b, p in self.known_points], True
            self._refit()
            assert self.fit is not None
            self.target = min(self._fitting(self.settings.margin), self.global_batch)
            self._current = top
            self._event(
                0,
                "choose",
                self.target,
                f"the fit kept from an earlier run of this model here ({len(self.fit.points)} cuts) predicts "
                f"{self.fit.predict(self.target) / MiB:.0f} MiB of {self.budget_bytes / MiB:.0f} MiB at micro-batch "
                f"{self.target} {self.unit}; no probe",
            )
            return
        if self.probe_cuts or self.hold:
            self._probe = list(self.probe_cuts)
        else:
            # Small, increasing probe cuts: the first step warms up at the smallest (one-time allocations land there).
            # In tokens the warm-up holds one record at max length, which may be a large share of the budget: where
            # the last probe passes the high-water mark, the fit still has two cuts besides the warm-up's.
            first = one * max(1, min(4, top // one // 8 or 1))
            cuts = (first, 2 * first, 4 * first) if one == 1 else (one, first, 2 * first)
            self._probe = sorted({min(top, cut) for cut in cuts})
            while len(self._probe) < self.settings.probe_steps:
                self._probe.insert(0, self._probe[0])
        self._current = self._probe[0] if self._probe else top

    @property
    def micro_batch(self) -> int:
        return self._current

    @property
    def probing(self) -> bool:
        """The next step is a probe step: its cut is measured for the fit, not yet chosen."""
        return bool(self._probe)

    @property
    def measuring(self) -> bool:
        """The next step's peak goes into the fit: a probe step, or a step of the approach to the target. Such a step
        should cost what the costliest of its kind could (a Hugging Face model's records padded to max length), so
        that the cut the fit chooses holds whatever records a later step draws."""
        return bool(self._probe) or self._approaching

    @property
    def settled(self) -> bool:
        """Probed, fitted and at its target: its points are worth keeping for the next run of the model."""
        return not self._probe and not self._approaching and self.fit is not None and not self.hold

    def measured_points(self) -> list[tuple[int, int]]:
        """The newest measured peak per cut, the fit's points (a warm-up step's left out, as the fit does)."""
        return sorted(self._fit_points().items())

    def predicted_peak(self, micro_batch: int) -> float | None:
        """The fit's peak at a micro-batch, in bytes; None before the fit."""
        return self.fit.predict(micro_batch) if self.fit is not None else None

    def _event(self, step: int, kind: str, new: int, reason: str) -> None:
        event = {
            "step": step,
            "event": kind,
            "micro_batch_from": self._current,
            "micro_batch_to": new,
            "unit": self.unit,
            "reason": reason,
        }
        self.events.append(event)
        logger.info("step %d: %s micro-batch %d -> %d %s: %s", step, kind, self._current, new, self.unit, reason)
        self._current = new

    def after_step(self, step: int, peak_bytes: int, pressure: str | None = None, size: int | None = None) -> int:
        """Record a step's measured peak (and the system's pressure); returns the micro-batch for the next step.

        size: the units the step had in flight at once, where they fall short of its cut (a cut in tokens holds whole
        records); the cut itself where not given."""
        self.peak_bytes = max(self.peak_bytes, peak_bytes)
        self._points.append((self._current if size is None else int(size), peak_bytes))
        if self._probe:
            self._probe.pop(0)
            if self._probe and peak_bytes > self.settings.high_water * self.budget_bytes and self._cuts_measured() >= 2:
                # The larger probes would only go further past the budget: fit on the cuts measured so far.
                logger.info(
                    "step %d: peak %.0f MiB at probe cut %d %s is above %.0f%% of the budget: larger probes skipped",
                    step,
                    peak_bytes / MiB,
                    self._current,
                    self.unit,
                    100 * self.settings.high_water,
                )
                self._probe.clear()
            if self._probe:
                self._current = self._probe[0]
                return self._current
            if self.hold:
                self._refit()
                self._current = min(self.max_micro_batch, self.global_batch)
                return self._current
            return self._choose(step)
        if self.hold:
            return self._current
        budget, one = self.budget_bytes, self.widest_sample
        if peak_bytes > self.settings.high_water * budget or pressure in ("warn", "critical"):
            why = (
                f"pressure {pressure}"
                if pressure in ("warn", "critical")
                else f"peak {peak_bytes / MiB:.0f} MiB above {self.settings.high_water:.0%} of the budget"
            )
            self._refit()
            if pressure in ("warn", "critical"):
                # The system, not this step, is short of memory: shed a real share of the activations.
                share = 2 if pressure == "critical" else 3  # keep half, or three quarters
                smaller = max(one, min(self._current - one, self._current * share // 4))
            else:
                smaller = max(one, min(self._current - one, self._fitting(self.settings.margin)))
                self.target = smaller  # the fit promised more than this machine gives: aim lower from now on
            if smaller < self._current:
                self._event(step, "shrink", smaller, why)
            self._calm_steps, self._approaching = 0, False
        elif self._approaching:
            self._approach(step)
        elif peak_bytes < self.settings.low_water * budget and self.target and self._current < self.target:
            self._calm_steps += 1
            if self._calm_steps >= self.settings.grow_after:
                self._event(
                    step,
                    "grow",
                    self.target,
                    f"peaks under {self.settings.low_water:.0%} of the budget for {self._calm_steps} steps",
                )
                self._calm_steps = 0
        else:
            self._calm_steps = 0
        return self._current

    def share_cap(self, share: int, slot_bytes: float) -> int | None:
        """The most samples of each global batch this worker can hold under its budget, or None (no fit yet, or
        held samples cost nothing).

        A held sample costs slot_bytes for the whole step (TRM's carry slot, its inputs), a micro-batch sample only
        while its micro-batch runs. So the share may grow until the held samples and a micro-batch of one fill the
        budget less the margin; the governor then cuts smaller micro-batches, and the balancer sees them as time.
        """
        if self.fit is None or not self._points or slot_bytes <= 0:
            return None
        micro, peak = self._points[-1]  # the last step held today's share
        held = peak - self.fit.per_sample_bytes * (micro - self.widest_sample)
        room = (1 - self.settings.margin) * self.budget_bytes - held
        return max(1, share + math.floor(room / slot_bytes))

    def on_out_of_memory(self, step: int) -> int:
        """An allocator refused a step (CUDA, MPS): halve the micro-batch for the redo of the same samples."""
        if self._current <= self.widest_sample:
            raise MemoryError(
                f"out of memory at micro-batch {self._current} {self.unit} (one sample a micro-batch): the model does "
                "not fit this device"
            )
        self._probe.clear()
        self._approaching = False
        self.target = max(self.widest_sample, self._current // 2)
        self._event(step, "out-of-memory", self.target, "the allocator raised out-of-memory; the step is redone")
        return self._current

    def _cuts_measured(self) -> int:
        return len({cut for cut, _ in self._points})

    def _fit_points(self) -> dict[int, int]:
        # The newest point per micro-batch: old peaks at a size predate what the process holds now. The warm-up step
        # (the first, where one-time allocations land) is left out unless its cut was measured again.
        return dict(self._points[1:] if len(self._points) > 2 and not self._known else self._points)

    def _refit(self) -> None:
        self.fit = fit(sorted(self._fit_points().items()))

    def _next_cut(self) -> int:
        """The target, or as far towards it as one step of the approach may move (self.target is set)."""
        assert self.target is not None
        largest = max(b for b, _ in self._points)
        return min(self.target, max(self._current + self.widest_sample, math.floor(self.settings.approach * largest)))

    def _approach(self, step: int) -> None:
        """One step of the approach: refit with this step's peak, aim again, move on at most `approach` times."""
        self._refit()
        self.target = min(self._fitting(self.settings.margin), self.global_batch)
        if self.target <= self._current:
            # The refit puts the target here or below; the high-water mark, not the fit, shrinks a measured cut.
            self.target, self._approaching = self._current, False
            return
        nearer = self._next_cut()
        self._approaching = nearer < self.target
        self._event(
            step,
            "approach",
            nearer,
            f"refit on {len(self.fit.points)} cuts predicts {self.fit.predict(self.target) / MiB:.0f} MiB at "
            f"micro-batch {self.target} {self.unit}, {self.fit.predict(nearer) / MiB:.0f} MiB at {nearer}",
        )

    def _fitting(self, margin: float) -> int:
        assert self.fit is not None
        fits = self.fit.largest_micro_batch(self.budget_bytes, margin=margin, limit=self.max_micro_batch)
        return max(self.widest_sample, fits)  # no cut holds less than one sample

    def _choose(self, step: int) -> int:
        self._refit()
        assert self.fit is not None
        predicted_fixed = self.fit.fixed_bytes
        if predicted_fixed > (1 - self.settings.margin) * self.budget_bytes:
            from raytrm.errors import UserError

            raise UserError(
                f"memory budget {self.budget_bytes / MiB:.0f} MiB is below what training needs before any sample "
                f"({predicted_fixed / MiB:.0f} MiB measured); raise --memory-budget-mb or shrink the model"
            )
        self.target = min(self._fitting(self.settings.margin), self.global_batch)
        nearer = self._next_cut()
        self._approaching = nearer < self.target
        approach = (
            f"; approached at most {self.settings.approach:g}x a step, refitting on each" if self._approaching else ""
        )
        per = f"{self.fit.per_sample_bytes / MiB:.{2 if self.widest_sample == 1 else 4}f} MiB/{self.unit[:-1]}"
        self._event(
            step,
            "choose",
            nearer,
            f"fit {self.fit.fixed_bytes / MiB:.0f} MiB + {per} predicts {self.fit.predict(self.target) / MiB:.0f} MiB "
            f"of {self.budget_bytes / MiB:.0f} MiB at micro-batch {self.target} {self.unit}{approach}",
        )
        return self._current

    def state_dict(self) -> dict[str, object]:
        """What a resumed run needs to cut its steps exactly as the uninterrupted run would."""
        return {
            "current": self._current,
            "target": self.target,
            "points": list(self._points),
            "probe": list(self._probe),
            "calm_steps": self._calm_steps,
            "approaching": self._approaching,
            "known": self._known,
            "peak_bytes": self.peak_bytes,
            "events": list(self.events),
            "unit": self.unit,
        }

    def load_state_dict(self, state: dict) -> None:
        target = state["target"]
        # A checkpoint from before cuts counted tokens counts samples (absent: "samples"), each at its widest.
        scale = self.widest_sample if state.get("unit", "samples") != self.unit else 1
        if scale != 1:
            logger.info("the checkpoint's memory governor counts samples: cuts patched to %s (x %d)", self.unit, scale)
        self._current, self.target = int(state["current"]) * scale, None if target is None else int(target) * scale
        self._points = [(int(b) * scale, int(p)) for b, p in state["points"]]
        self._probe = [int(b) * scale for b in state["probe"]]
        self._calm_steps, self.peak_bytes = int(state["calm_steps"]), int(state["peak_bytes"])
        self._approaching = bool(state.get("approaching", False))  # absent from checkpoints before the approach
        self._known = bool(state.get("known", False))  # absent from checkpoints before known points
        json.dumps(state["events"])  # they go to summary.json: refuse what could not (a TypeError) before training
        self.events = list(state["events"])
        if self._points and not self._probe:
            self._refit()

    def summary(self, micro_batch: int | None = None) -> dict[str, object]:
        """Budget, the fit, the predicted peak at the micro-batch in use and the measured peak, every adaptation."""
        micro = micro_batch or self._current
        return {
            "memory_budget_mb": self.budget_bytes / MiB,
            "micro_batch": micro,
            "micro_batch_unit": self.unit,
            "predicted_peak_mb": self.fit.predict(micro) / MiB if self.fit else None,
            "measured_peak_mb": self.peak_bytes / MiB,
            "fit": self.fit.to_dict(self.unit) if self.fit else None,
            "adaptations": list(self.events),
        }
