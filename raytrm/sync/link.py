"""Which sync mode and round length keep the workers' wait for each other under a share of the step: a model of the
link from timed sums, and the choice from it and a step's time.

A sum of b bytes over the workers takes latency + b / rate: a line fitted to sums of growing buffers, each timed as
the slowest worker saw it. Each step, exact sync sums the model's gradient (B bytes) and a few small values (the
metrics, the peers' times, the stop rule's agreement: SMALL_EXCHANGES latencies); compressed sums B / 2 bytes;
local rounds sum B bytes of deltas once per H steps, less what travels behind `overlap` inner steps. A step's share
of waiting is wait / (step + wait). The choice is the first of exact, compressed and local that keeps the share at
most the target. Local weighs two rounds, each the fewest inner steps that keep the share (longer rounds drift
further apart): the exchange in the open, and the exchange behind as many steps as it takes, in a round at least
OVERLAP_ROUND times as long. It takes the one that waits less: the modes bench measured rounds of 5 to 50 steps,
behind or not, within 0.01 of exact sync's quality, while a round that waits a full target's share in the open
waits more still on a real pair.

Each exchange also waits for the slowest worker's compute: shares sized to each worker's speed leave only the noise
of its step times, which the choice counts once it has measured them (`Lateness`, from the workers' step times). A
round of H steps waits for the noise of H steps summed, about sqrt(H) times a step's: exact sync pays it every step,
local rounds once per H, so noisy machines on a fast link may still take short rounds.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from raytrm.sync.contract import GradientSync

#: The most of a step's wall time the workers may spend waiting on each other.
TARGET_SHARE = 0.05
#: Small exchanges a step makes besides the gradient (metrics, the peers' rows, the stop rule's agreement).
SMALL_EXCHANGES = 3
#: The longest round the choice proposes (DiLoCo's own).
MAX_EVERY = 500
#: The shortest round, in steps its exchange travels behind, in which the choice lets it travel behind (a default
#: from the sync modes' quality rows of docs/performance.md).
OVERLAP_ROUND = 5
MODES = ("exact", "compressed", "local")


@dataclasses.dataclass
class Link:
    """Seconds to sum b bytes over the workers: latency_s + b / bytes_per_s."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def describe(self) -> str:
        return f"{mbit_text(self.bytes_per_s * 8 / 1e6)} Mbit/s and {self.latency_s * 1e3:.2f} ms a sum"

    def to_dict(self) -> dict[str, float]:
        return {"mbit_s": self.bytes_per_s * 8 / 1e6, "latency_ms": self.latency_s * 1e3}


def mbit_text(mbit: float) -> str:
    """A rate in Mbit/s as the run's lines give it: whole above 100, one decimal below."""
    return f"{mbit:.0f}" if mbit >= 100 else f"{mbit:.1f}"


def fit_link(points: Sequence[tuple[float, float]]) -> Link:
    """Least squares of seconds on bytes over (bytes, seconds) points; a latency below 0 is taken as 0."""
    if not points:
        raise ValueError("fit_link needs at least one timed sum")
    xs, ys = [float(b) for b, _ in points], [float(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    latency = my - slope * mx
    if slope <= 0 or latency < 0:  # noise: the largest sum alone says the rate, with no fixed cost
        big = max(range(len(xs)), key=lambda i: xs[i])
        return Link(0.0, max(xs[big], 1.0) / max(ys[big], 1e-9))
    return Link(latency, 1.0 / slope)


def measure_link(
    sync: GradientSync,
    device: torch.device,
    model_bytes: int,
    *,
    budget_s: float = 0.3,
    start_bytes: int = 1 << 16,
    max_bytes: int = 1 << 26,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Link, float]:
    """Time sums of growing buffers (x4 each) until one takes budget_s or reaches the model's bytes (or max_bytes),
    twice each, the slowest worker's time; returns the fitted link and the probe's seconds. A collective: every
    rank calls it at the same point, and all reach the same sizes (they decide on the gathered times)."""
    begin = clock()

    def timed(buffer: torch.Tensor) -> float:
        worst = []
        for _ in range(2):
            start = clock()
            sync.sum_tensors([buffer]).wait()
            mine = clock() - start
            worst.append(max(row[0] for row in sync.gather_floats([mine])))
        return min(worst)

    tiny = torch.zeros(1, device=device)
    sync.sum_tensors([tiny]).wait()  # connections and first-call costs, not timed
    points = [(4.0, timed(tiny))]
    size = max(4, min(start_bytes, model_bytes))
    while True:
        buffer = torch.zeros(size // 4, device=device)
        seconds = timed(buffer)
        points.append((float(buffer.numel() * 4), seconds))
        if seconds >= budget_s or size >= min(model_bytes, max_bytes):
            break
        size *= 4
    return fit_link(points), clock() - begin


@dataclasses.dataclass
class Choice:
    """A sync mode with its round length and overlap (local), the share of a step it should wait, and why."""

    mode: str
    every: int | None
    overlap: int
    share: float | None  # predicted; None where nothing was predicted (a mode set by the config)
    reason: str

    def event(self, step: int, **extra: Any) -> dict[str, Any]:
        """The metrics.jsonl line of this choice."""
        return {
            "step": step,
            "event": "sync-choice",
            "mode": self.mode,
            "every": self.every,
            "overlap": self.overlap,
            "predicted_share": self.share,
            **extra,
            "reason": self.reason,
        }


@dataclasses.dataclass
class Lateness:
    """The workers' step times without sync, measured over the same steps (one row a worker): how long an exchange
    after a round of `every` steps waits for the slowest worker's compute."""

    times: Sequence[Sequence[float]]

    def seconds(self, every: int) -> float:
        """The mean over the workers of the slowest one's time for a round less their own, over the consecutive
        rounds of `every` steps measured; a round longer than half the steps measured takes the longest measured,
        grown by the square root of the ratio (the independent noise of steps adds up so)."""
        steps = min((len(row) for row in self.times), default=0)
        if len(self.times) < 2 or steps == 0:
            return 0.0
        size = min(every, max(1, steps // 2))
        waits = []
        for start in range(0, steps - size + 1, size):
            sums = [sum(row[start : start + size]) for row in self.times]
            waits.append(max(sums) - statistics.fmean(sums))
        return statistics.fmean(waits) * math.sqrt(every / size)


NO_LATENESS = Lateness(())


def step_share(
    link: Link, step_s: float, nbytes: float, every: int = 1, overlap: int = 0, late: Lateness = NO_LATENESS
) -> float:
    """The predicted share of a step spent waiting when `nbytes` are summed every `every` steps, the sum travelling
    behind `overlap` of them and starting when the slowest worker is done (`late`)."""
    exposed = _exposed(link, step_s, nbytes, every, overlap, late)
    return exposed / (every * step_s + exposed)


def _exposed(link: Link, step_s: float, nbytes: float, every: int, overlap: int, late: Lateness) -> float:
    travel = link.seconds(nbytes) + late.seconds(every)
    return max(0.0, travel - overlap * step_s) + SMALL_EXCHANGES * link.latency_s


def fewest_steps(
    link: Link, step_s: float, nbytes: float, overlap: int, target: float, late: Lateness = NO_LATENESS
) -> int:
    """The fewest inner steps per round (more than `overlap`) whose share is at most target (MAX_EVERY + 1 where
    none is, waiting for the slowest as `late` says)."""
    exposed = _exposed(link, step_s, nbytes, 1, overlap, NO_LATENESS)
    every = max(overlap + 1, math.ceil(exposed * (1 - target) / (target * max(step_s, 1e-9)) - 1e-9))
    while every <= MAX_EVERY and step_share(link, step_s, nbytes, every, overlap, late) > target:
        every += 1  # the wait for the slowest grows with the round, more slowly than the round
    return every


def choose(
    link: Link,
    step_s: float,
    model_bytes: int,
    *,
    modes: Sequence[str] = MODES,
    every: int | None = None,
    overlap: int | None = None,
    target: float = TARGET_SHARE,
    max_every: int = MAX_EVERY,
    overlap_ok: bool = True,
    late: Lateness = NO_LATENESS,
) -> Choice:
    """The first of `modes` (exact, compressed, local) whose predicted share is at most target; every and overlap,
    where given, fix local's round (else the fewest steps that meet the target, up to max_every). overlap_ok: the
    choice may let a round's exchange travel behind the next inner steps. late: the measured wait for the slowest
    worker (none before the steps are measured)."""
    exact = step_share(link, step_s, model_bytes, late=late)
    compressed = step_share(link, step_s, model_bytes / 2, late=late)
    lateness = late.seconds(1)
    waits = f", the slowest worker {lateness * 1e3:.0f} ms late a step" if lateness > 0 else ""
    said = (
        f"link {link.describe()}, a step {step_s:.3f} s without sync{waits}, {model_bytes / 1e6:.2f} MB to sum: exact "
        f"would wait {exact:.1%} of a step, compressed {compressed:.1%}"
    )
    if "exact" in modes and exact <= target:
        return Choice("exact", None, 0, exact, f"{said}; exact keeps it at most {target:.0%}")
    if "compressed" in modes and compressed <= target:
        return Choice("compressed", None, 0, compressed, f"{said}; compressed keeps it at most {target:.0%}")
    if overlap is not None:  # given: kept (below the round length)
        options, ratio = [overlap], 1
    else:  # chosen: behind as many steps as the sum takes, in rounds at least OVERLAP_ROUND times as long
        behind = math.ceil(link.seconds(model_bytes) / max(step_s, 1e-9))
        options, ratio = ([0, behind] if overlap_ok and behind > 0 else [0]), OVERLAP_ROUND

    def share_of(h: int, tau: int) -> float:
        return step_share(link, step_s, model_bytes, h, tau, late)

    if every is not None:
        taus = sorted({min(t, every // ratio, every - 1) for t in options})
        tau = min(taus, key=lambda t: (share_of(every, t), t))
        share = share_of(every, tau)
        return Choice("local", every, tau, share, f"{said}; local rounds of H={every} (set) wait {share:.1%}")

    steps = {t: max(fewest_steps(link, step_s, model_bytes, t, target, late), ratio * t) for t in options}
    tau = min(options, key=lambda t: (share_of(steps[t], t), steps[t], t))
    h = steps[tau]
    if h > max_every:
        h, tau = max_every, min(tau, max_every // ratio, max_every - 1)
        share = share_of(h, tau)
        return Choice("local", h, tau, share, f"{said}; even local rounds of H={h}, the longest, wait {share:.1%}")
    share = share_of(h, tau)
    behind = f", the exchange behind {tau} step(s)" if tau else ""
    return Choice("local", h, tau, share, f"{said}; local rounds of H={h}{behind} wait {share:.1%}")
