"""Shares of one global batch for workers of unequal speed, so that they finish each step together.

Worker i trains slots [o_i, o_i + b_i) of every global batch, sum b_i = B, b_i >= 1. Its step time is close to a line
in its share, t_i = a_i + c_i b (a fixed cost, a per-sample cost), fitted from the steps it ran; the shares that
equalise the predicted times minimise the step, because every step waits for the slowest worker. Every rank runs the
same balancer on the same gathered times, so the code is deterministic: no clocks, no randomness.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


def split(total: int, weights: Sequence[float], caps: Sequence[int | None] | None = None) -> list[int]:
    """Integer shares proportional to weights, each >= 1 and <= its cap, summing to total (largest remainder)."""
    n = len(weights)
    if n < 1 or total < n:
        raise ValueError(f"cannot split {total} samples between {n} workers: each needs at least one")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"share weights must be finite and > 0, got {list(weights)}")
    limits = [c if c is not None else total for c in (caps or [None] * n)]
    if any(c < 1 for c in limits) or sum(limits) < total:
        raise ValueError(f"caps {list(limits)} cannot hold {total} samples with at least one each")
    fixed: dict[int, int] = {}
    while True:  # water-filling: clamp workers at a bound, share the rest among the others, until none crosses one
        free = [i for i in range(n) if i not in fixed]
        ideal: dict[int, float] = {}
        if not free:
            break
        left = total - sum(fixed.values())
        mass = sum(weights[i] for i in free)
        ideal = {i: left * weights[i] / mass for i in free}
        over = {i: limits[i] for i in free if ideal[i] > limits[i]}
        under = {i: 1 for i in free if ideal[i] < 1}
        if not over and not under:
            break
        fixed.update(over or under)
    shares = [fixed.get(i, 0) for i in range(n)]
    floors = {i: int(ideal[i]) for i in free}
    for i, b in floors.items():
        shares[i] = b
    remainder = total - sum(shares)
    for i in sorted(free, key=lambda i: (-(ideal[i] - floors[i]), i))[:remainder]:
        shares[i] += 1
    return shares


def offsets(shares: Sequence[int]) -> list[int]:
    """Where each worker's slots begin in the global batch."""
    out, at = [], 0
    for b in shares:
        out.append(at)
        at += b
    return out


def shard(shares: Sequence[int], rank: int) -> slice:
    """The slots of worker `rank`."""
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
    by_share: dict[int, list[float]] = {}
    for b, t in points:
        by_share.setdefault(int(b), []).append(float(t))
    xs = sorted(by_share)
    ys = [statistics.median(by_share[x]) for x in xs]
    proportional = LinearTime(0.0, sum(ys) / max(1, sum(xs)))
    if len(xs) < 2:
        return proportional
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if slope <= 0 or intercept < 0:  # noise, or a fixed cost that cannot be negative: trust the rate alone
        return proportional
    return LinearTime(intercept, slope)


def _predicted_max(models: Sequence[LinearTime], shares: Sequence[int]) -> float:
    return max(m.predict(b) for m, b in zip(models, shares, strict=True))


def balanced(global_batch: int, models: Sequence[LinearTime], caps: Sequence[int | None] | None = None) -> list[int]:
    """Integer shares (each in [1, cap]) that minimise the predicted time of the slowest worker."""
    n = len(models)
    limits = [c if c is not None else global_batch for c in (caps or [None] * n)]
    shares = [1] * n
    # Greedy by sample: each goes to the worker that would finish it soonest. With linear times this is optimal
    # for the max, and exact in integers; B is at most a few thousand.
    for _ in range(global_batch - n):
        best = min((i for i in range(n) if shares[i] < limits[i]), key=lambda i: (models[i].predict(shares[i] + 1), i))
        shares[best] += 1
    return shares


@dataclass
class Rebalance:
    """One change of shares, with what the fits predicted."""

    step: int
    shares_from: list[int]
    shares_to: list[int]
    predicted_s_from: float
    predicted_s_to: float
    reason: str

    def to_event(self) -> dict:
        return {
            "step": self.step,
            "event": "rebalance",
            "shares_from": self.shares_from,
            "shares_to": self.shares_to,
            "predicted_step_s_from": self.predicted_s_from,
            "predicted_step_s_to": self.predicted_s_to,
            "reason": self.reason,
        }


@dataclass
class ShareBalancer:
    """Decides each global batch's shares from per-worker step times; never changes the global batch."""

    global_batch: int
    world_size: int
    shares: list[int] = field(default_factory=list)
    caps: list[int | None] | None = None
    window: int = 8
    warmup_steps: int = 1
    min_gain: float = 0.05
    interval: int = 1
    events: list[Rebalance] = field(default_factory=list)
    _seen: int = 0
    _points: list[list[tuple[int, float]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shares = list(self.shares) or split(self.global_batch, [1.0] * self.world_size)
        if len(self.shares) != self.world_size or sum(self.shares) != self.global_batch or min(self.shares) < 1:
            raise ValueError(
                f"shares {self.shares} must be {self.world_size} numbers >= 1 summing to {self.global_batch}"
            )
        self._points = [[] for _ in range(self.world_size)]

    def shard(self, rank: int) -> slice:
        return shard(self.shares, rank)

    def observe(self, step: int, seconds: Sequence[float]) -> None:
        """The step just run under the current shares took seconds[i] on worker i (its compute, not the sync)."""
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return  # one-time costs (allocations, caches) are not the line
        for points, b, t in zip(self._points, self.shares, seconds, strict=True):
            points.append((b, float(t)))
            del points[: -self.window]

    def decide(self, step: int) -> Rebalance | None:
        """New shares when the fitted lines predict a step at least min_gain faster; else None."""
        if step % self.interval or any(len(p) < 2 for p in self._points):
            return None
        models = [fit_time(p) for p in self._points]
        proposal = balanced(self.global_batch, models, self.caps)
        now, then = _predicted_max(models, self.shares), _predicted_max(models, proposal)
        if proposal == self.shares or then > now * (1 - self.min_gain):
            return None
        rates = [m.per_sample_s for m in models]
        slow, fast = rates.index(max(rates)), rates.index(min(rates))
        reason = (
            f"worker {slow} takes {rates[slow] / max(rates[fast], 1e-12):.2f}x worker {fast}'s time per sample; "
            f"predicted step {now:.3f} s -> {then:.3f} s"
        )
        event = Rebalance(step, list(self.shares), proposal, now, then, reason)
        self.events.append(event)
        self.shares = proposal
        return event

    def state_dict(self) -> dict:
        return {
            "shares": list(self.shares),
            "seen": self._seen,
            "points": [[list(p) for p in points] for points in self._points],
            "events": [e.to_event() for e in self.events],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved balancer; one saved with another number of workers leaves this one fresh."""
        if len(state["shares"]) != self.world_size:
            return
        self.shares = [int(b) for b in state["shares"]]
        self._seen = int(state["seen"])
        self._points = [[(int(b), float(t)) for b, t in points] for points in state["points"]]
        self.events = [
            Rebalance(
                e["step"],
                e["shares_from"],
                e["shares_to"],
                e["predicted_step_s_from"],
                e["predicted_step_s_to"],
                e["reason"],
            )
            for e in state["events"]
        ]
