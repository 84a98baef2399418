"""Shares of one global batch for workers of unequal speed, so that they finish each step together.

Worker i trains slots [o_i, o_i + b_i) of every global batch, sum b_i = B, b_i >= 1. Its step time is close to a line
in its share, t_i = a_i + c_i b (a fixed cost, a per-sample cost), fitted from the steps it ran; the shares that
equalise the predicted times minimise the step, because every step waits for the slowest worker. Every rank runs the
same balancer on the same gathered times, so the code is deterministic: no clocks, no randomness, sorted iteration.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

_MIN_RATE = 1e-12  # seconds per sample: keeps a worker whose measured times are all 0 from dividing by zero


def _limits(total: int, n: int, caps: Sequence[int | None] | None) -> list[int]:
    """Each worker's upper bound (None: the whole batch), checked to leave room for `total` samples."""
    if n < 1 or total < n:
        raise ValueError(f"cannot split {total} samples between {n} workers: each needs at least one")
    limits = [total if c is None else int(c) for c in (caps if caps is not None else [None] * n)]
    if len(limits) != n:
        raise ValueError(f"caps {list(limits)} has {len(limits)} entries for {n} workers: give one per worker")
    if min(limits) < 1 or sum(limits) < total:
        raise ValueError(f"caps {limits} cannot hold {total} samples with at least one each: raise or drop a cap")
    return limits


def _fill(total: int, fixed: Sequence[float], speeds: Sequence[float], limits: Sequence[int]) -> list[float]:
    """Water-filling: b_i = clamp((T - fixed_i) * speed_i, 1, cap_i), with the level T at which they sum to total."""
    n = len(speeds)
    if total == n:
        return [1.0] * n

    def at(t: float) -> list[float]:
        return [min(max((t - a) * s, 1.0), c) for a, s, c in zip(fixed, speeds, limits, strict=True)]

    # The sum is piecewise linear in T, with a kink where a worker leaves its floor (low) or reaches its cap (high):
    # find the first kink past the total, then T is linear in between, with the same workers free.
    lows = [a + 1 / s for a, s in zip(fixed, speeds, strict=True)]
    highs = [a + c / s for a, s, c in zip(fixed, speeds, limits, strict=True)]
    kinks = sorted(set(lows + highs))
    k = next((k for k in range(1, len(kinks)) if sum(at(kinks[k])) >= total), len(kinks) - 1)
    free = [i for i in range(n) if lows[i] <= kinks[k - 1] and highs[i] >= kinks[k]]
    if not free:
        return at(kinks[k])
    bound = sum(1 if lows[i] >= kinks[k] else limits[i] for i in range(n) if i not in free)
    level = (total - bound + sum(fixed[i] * speeds[i] for i in free)) / sum(speeds[i] for i in free)
    return at(level)


def split(total: int, weights: Sequence[float], caps: Sequence[int | None] | None = None) -> list[int]:
    """Integer shares proportional to weights, each >= 1 and <= its cap, summing to total (largest remainder)."""
    limits = _limits(total, len(weights), caps)
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"share weights must be finite and > 0, got {list(weights)}")
    ideal = _fill(total, [0.0] * len(weights), weights, limits)
    shares = [int(x) for x in ideal]
    room = [i for i in range(len(shares)) if shares[i] < limits[i]]
    for i in sorted(room, key=lambda i: (shares[i] - ideal[i], i))[: total - sum(shares)]:
        shares[i] += 1
    return shares


def by_pace(total: int, paces: Sequence[float]) -> list[int]:
    """Shares in proportion to each worker's speed, 1 / its seconds per sample (`paces`); a worker not timed yet
    (NaN: a newcomer) counts as the mean speed of those timed, and with none timed the split is even."""
    speeds = [1 / p if math.isfinite(p) and p > 0 else math.nan for p in paces]
    timed = [s for s in speeds if not math.isnan(s)]
    mean = sum(timed) / len(timed) if timed else 1.0
    return split(total, [mean if math.isnan(s) else s for s in speeds])


def offsets(shares: Sequence[int]) -> list[int]:
    """Where each worker's slots begin in the global batch."""
    return [0, *itertools.accumulate(shares)][:-1]


def shard(shares: Sequence[int], rank: int) -> slice:
    """The slots of worker `rank` in every global batch."""
    start = offsets(shares)[rank]
    return slice(start, start + shares[rank])


@dataclass
class LinearTime:
    """t = fixed_s + per_sample_s * b: one worker's step time against its share."""

    fixed_s: float
    per_sample_s: float

    def predict(self, share: float) -> float:
        return self.fixed_s + self.per_sample_s * share


def fit_time(points: Sequence[tuple[int, float]]) -> LinearTime:
    """Least squares over the median time of each distinct share; proportional when the line is not physical."""
    if not points:
        raise ValueError("fit_time needs at least one (share, seconds) observation")
    by_share: dict[int, list[float]] = {}
    for b, t in points:
        by_share.setdefault(int(b), []).append(float(t))
    xs = sorted(by_share)  # sorted, not insertion order: every rank sums in the same order
    ys = [statistics.median(by_share[x]) for x in xs]  # the median shrugs off a step the OS interrupted
    proportional = LinearTime(0.0, max(sum(ys) / sum(xs), _MIN_RATE))
    if len(xs) < 2:
        return proportional
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if slope <= 0 or intercept < 0:  # noise, or a fixed cost that cannot be negative: trust the mean rate alone
        return proportional
    return LinearTime(intercept, slope)


def balanced(global_batch: int, models: Sequence[LinearTime], caps: Sequence[int | None] | None = None) -> list[int]:
    """Integer shares in [1, cap] that equalise the predicted times, rounded to minimise the slowest worker's."""
    limits = _limits(global_batch, len(models), caps)
    if not all(math.isfinite(m.per_sample_s) and m.per_sample_s > 0 for m in models):
        raise ValueError(f"per-sample times must be finite and > 0, got {[m.per_sample_s for m in models]}")
    ideal = _fill(global_batch, [m.fixed_s for m in models], [1 / m.per_sample_s for m in models], limits)
    shares = [int(x) for x in ideal]
    # The floors leave fewer samples than workers; each goes where it ends soonest, which keeps the max smallest.
    for _ in range(global_batch - sum(shares)):
        room = [i for i in range(len(models)) if shares[i] < limits[i]]
        best = min(room, key=lambda i: (models[i].predict(shares[i] + 1), i))
        shares[best] += 1
    return shares


@dataclass
class Rebalance:
    """One change of shares, with what the fitted lines predicted for the step."""

    step: int
    shares_from: list[int]
    shares_to: list[int]
    predicted_s_from: float | None  # None: moved by memory before any step time was fitted
    predicted_s_to: float | None
    reason: str

    def to_event(self) -> dict:
        return {
            "step": self.step,
            "event": "rebalance",
            "shares_from": list(self.shares_from),
            "shares_to": list(self.shares_to),
            "predicted_step_s_from": self.predicted_s_from,
            "predicted_step_s_to": self.predicted_s_to,
            "reason": self.reason,
        }

    @classmethod
    def from_event(cls, event: dict) -> Rebalance:
        """The Rebalance that `to_event` wrote."""
        return cls(**{k.replace("_step_s_", "_s_"): v for k, v in event.items() if k != "event"})


def _reason(models: Sequence[LinearTime], shares: Sequence[int], now: float, then: float) -> str:
    """One sentence for the log: which worker held the step back, and what the new shares should save."""
    times = list(map(LinearTime.predict, models, shares))
    slow = times.index(max(times))
    rates = [m.per_sample_s for m in models]
    fast = rates.index(min(rates))
    if rates[slow] >= 1.005 * rates[fast]:
        why = f"worker {slow} is {rates[slow] / rates[fast]:.2f}x slower per sample than worker {fast}"
    else:  # as fast per sample as any: too many samples for its fixed cost
        why = f"worker {slow} finishes last with {shares[slow]} samples and {models[slow].fixed_s:.3f} s of fixed cost"
    return f"{why}; predicted step {now:.3f} s -> {then:.3f} s"


def _over_caps(over: Sequence[int], shares: Sequence[int], caps: Sequence[int | None]) -> str:
    """The reason for a move forced by memory: which workers hold more samples than their budgets allow."""
    held = ", ".join(f"worker {i} holds {shares[i]} samples, its memory allows {caps[i]}" for i in over)
    return f"{held}: memory, not speed, moves these samples"


class ShareBalancer:
    """Decides each global batch's shares from per-worker step times; never changes the global batch.

    It fits each worker's line to its observations of the latest `window` steps, at least two (one per step, or one
    per local round), leaving out the first `warmup_steps`, and moves the shares when the lines predict a step at least
    `min_gain` faster, checked every `interval` steps. A smaller gain, at least `small_gain`, moves them once the same
    shares are proposed at `patience` decisions in a row: one sample more or less is a large part of a small share
    (a sixteenth of a MacBook's 16), and the step it saves is saved at every step after, while a proposal drawn by one
    slow step changes before it stands that long. A gain within `noise_z` standard errors of the fitted times (their
    jitter about the lines: steps of tens of milliseconds on a busy machine) waits the same way, however large: with
    times that jitter by a fifth, moving at once would move the shares every few steps and to no faster ones."""

    def __init__(
        self,
        global_batch: int,
        world_size: int,
        shares: Sequence[int] | None = None,
        caps: Sequence[int | None] | None = None,
        window: int = 8,
        warmup_steps: int = 1,
        min_gain: float = 0.05,
        interval: int = 1,
        small_gain: float = 0.005,
        patience: int = 3,
        noise_z: float = 2.0,
    ) -> None:
        self.shares = list(shares) if shares is not None else split(global_batch, [1.0] * world_size)
        if len(self.shares) != world_size or sum(self.shares) != global_batch or min(self.shares, default=0) < 1:
            raise ValueError(f"shares {self.shares} must be {world_size} numbers >= 1 summing to {global_batch}")
        ranges = (window >= 2, warmup_steps >= 0, interval >= 1, 0 <= small_gain <= min_gain < 1, patience >= 1)
        if not all(ranges) or not noise_z >= 0:
            raise ValueError(
                f"balancer window={window} (>= 2), warmup_steps={warmup_steps} (>= 0), interval={interval} (>= 1), "
                f"min_gain={min_gain} (in [0, 1)), small_gain={small_gain} (in [0, min_gain]), patience={patience} "
                f"(>= 1), noise_z={noise_z} (>= 0): one is out of range"
            )
        self.global_batch, self.world_size = global_batch, world_size
        self.caps = list(caps) if caps is not None else None
        self.window, self.warmup_steps, self.min_gain, self.interval = window, warmup_steps, min_gain, interval
        self.small_gain, self.patience, self.noise_z = small_gain, patience, noise_z
        #: The shares of a small gain proposed at the latest decisions, and at how many in a row.
        self._pending: tuple[list[int], int] | None = None
        self.events: list[Rebalance] = []
        self._seen = 0
        self._points: list[list[tuple[int, float]]] = [[] for _ in range(world_size)]
        self._steps: list[int] = []  # the steady steps behind each kept observation (every worker's the same)

    def shard(self, rank: int) -> slice:
        return shard(self.shares, rank)

    def observe(self, step: int, seconds: Sequence[float], steps: int = 1) -> None:
        """The step just run under the current shares took seconds[i] on worker i (its compute, not the sync); with
        `steps` > 1, seconds[i] is the median step of the last `steps` (a local round's), all under these shares.

        The warm-up's steps pay one-time costs (allocations, compilation, caches), so they are not on the line: an
        observation is kept when most of its steps are past the warm-up, where a median no longer sees them."""
        if len(seconds) != self.world_size:
            raise ValueError(f"step {step}: {len(seconds)} step times for {self.world_size} workers")
        if steps < 1:
            raise ValueError(f"step {step}: an observation covers at least one step, got {steps}")
        warm = min(steps, max(0, self.warmup_steps - self._seen))
        self._seen += steps
        if steps - warm <= warm:
            return
        for points, b, t in zip(self._points, self.shares, seconds, strict=True):
            points.append((b, float(t)))
        self._steps.append(steps - warm)
        # The newest observations that cover `window` steps, and at least two (a line through two shares after a
        # move): a step that ran slow for a passing reason (the mode's switch, another app) leaves the fit after as
        # many steps, or two local rounds, rather than `window` rounds.
        kept, covered = 0, 0
        while kept < len(self._steps) and (covered < self.window or kept < 2):
            kept += 1
            covered += self._steps[-kept]
        for points in self._points:
            del points[:-kept]
        del self._steps[:-kept]

    def set_caps(self, caps: Sequence[int | None] | None) -> str | None:
        """Each worker's most samples from now on (its memory model's); None for no cap. Caps that together cannot
        hold the global batch are dropped (the workers must take it anyway): returns why, else None."""
        if caps is not None and all(c is None for c in caps):
            caps = None
        try:
            _limits(self.global_batch, self.world_size, caps)
        except ValueError as error:
            self.caps = None
            return str(error)
        self.caps = list(caps) if caps is not None else None
        return None

    def decide(self, step: int) -> Rebalance | None:
        """Adopt new shares when the fitted lines predict a step at least min_gain faster and beyond their noise
        (small_gain, once proposed at `patience` decisions in a row), or at once when a worker holds more samples than
        its cap; else None."""
        caps = self.caps or [None] * self.world_size
        over = [i for i, (b, c) in enumerate(zip(self.shares, caps, strict=True)) if c is not None and b > c]
        memory = _over_caps(over, self.shares, caps) if over else None
        if sum(self._steps) < 2:  # fewer than two steady steps timed: only memory can move samples
            if memory is None:
                return None
            proposal = split(self.global_batch, [1.0] * self.world_size, self.caps)
            event = Rebalance(step, list(self.shares), proposal, None, None, memory)
        else:
            if step % self.interval and memory is None:
                return None
            models = [fit_time(p) for p in self._points]
            proposal = balanced(self.global_batch, models, self.caps)
            now, then = (max(map(LinearTime.predict, models, shares)) for shares in (self.shares, proposal))
            if proposal == self.shares:
                self._pending = None
                return None
            noise = self.noise_z * self._noise(models)
            patient = memory is None and then > now * (1 - max(self.min_gain, noise))  # waits for `patience`
            if patient and not self._stood(proposal, now, then):
                return None
            reason = memory or _reason(models, self.shares, now, then)
            if patient:
                within = f" (within the times' noise, {noise:.1%})" if noise > self.min_gain else ""
                reason += f", proposed at {self.patience} decisions in a row{within}"
            event = Rebalance(step, list(self.shares), proposal, now, then, reason)
        self.events.append(event)
        self.shares, self._pending = proposal, None
        return event

    def _noise(self, models: Sequence[LinearTime]) -> float:
        """The fitted step times' relative standard error, the largest of the workers': each worker's spread about
        its line (1.4826 median absolute deviations, a standard deviation for normal jitter) over the root of its
        points, times 1.25 for a median's."""
        worst = 0.0
        for model, points in zip(models, self._points, strict=True):
            spread = 1.4826 * statistics.median(abs(t / model.predict(b) - 1) for b, t in points)
            worst = max(worst, 1.25 * spread / math.sqrt(len(points)))
        return worst

    def _stood(self, proposal: list[int], now: float, then: float) -> bool:
        """Whether a move under min_gain saves small_gain and has been proposed at `patience` decisions in a row."""
        if then > now * (1 - self.small_gain):
            self._pending = None
            return False
        seen = self._pending[1] + 1 if self._pending is not None and self._pending[0] == proposal else 1
        self._pending = (list(proposal), seen)
        return seen >= self.patience

    def state_dict(self) -> dict:
        """Shares, kept observations and events as plain lists, numbers and strings."""
        return {
            "shares": list(self.shares),
            "points": [[[b, t] for b, t in points] for points in self._points],
            "events": [e.to_event() for e in self.events],
            "pending": None if self._pending is None else [list(self._pending[0]), self._pending[1]],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved balancer; one saved for another number of workers leaves this one's shares, unobserved.

        The warm-up starts again either way: a resumed process pays its one-time costs anew.
        """
        self._seen, self._pending = 0, None
        if len(state["shares"]) != self.world_size or sum(state["shares"]) != self.global_batch:
            self._points, self._steps = [[] for _ in range(self.world_size)], []
            return
        self.shares = [int(b) for b in state["shares"]]
        self._points = [[(int(b), float(t)) for b, t in points] for points in state["points"]]
        self._steps = [1] * len(self._points[0]) if self._points else []  # each saved point: at least one step
        self.events = [Rebalance.from_event(e) for e in state["events"]]
        pending = state.get("pending")  # absent from a checkpoint written before small gains waited
        self._pending = None if pending is None else ([int(b) for b in pending[0]], int(pending[1]))
