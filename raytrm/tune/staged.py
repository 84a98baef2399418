"""Tuning to a horizon in two searches: speed knobs per tier, learning knobs once for all tiers, joined by curves.

Speed knobs (raytrm.tune.curves.SPEED_FIELDS) change how fast samples come and never the update; learning knobs
change what is learned, and what a config has learned after N samples is the same on every machine. So a space with
a horizon and the quality objective is tuned in three steps:

1. speed: each tier searches its speed knobs alone, at the base learning config, for samples/s under its memory,
   heat and decay limits, in short runs (the budget's warm-up and window, no evaluation): study NAME-TIER-speed.
2. learning: one study, NAME-learning, searches the learning knobs. Each trial runs on whichever machine is free,
   with that tier's fastest speed knobs, and trains for the horizon of the fastest tier (a trial on a tier that the
   speed search found f times slower trains f times longer, so its curve reaches as many samples), evaluated at the
   rungs 1/9, 1/3 and 1 of that. The successive-halving pruner stops the trials that are behind at a rung; a trial
   that goes on continues in its own process from where it was, so nothing is trained twice. Every evaluation is a
   point of the config's learning curve: samples, seconds of training, quality and its standard error.
3. rates: each config that reached the horizon is run briefly on every tier it did not train on, with that tier's
   speed knobs, for its samples/s and peak memory there.

On tier t a config reaches what its curve shows at horizon_s x (its samples/s on t) / (its samples/s where it
trained), read on the curve's own clock (so its warm-up is counted as the user's run would count it), interpolated
in log samples, or extrapolated and flagged where the curve stops short. The tier's profile is the best config that
fits the tier's limits there, with the tier's speed knobs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from raytrm.tune import objectives
from raytrm.tune.curves import extrapolate, is_speed_knob, quality_at
from raytrm.tune.params import grid_points, grid_size
from raytrm.tune.space import SearchSpace, horizon_of
from raytrm.tune.space_sections import Horizon

#: A tier slower than the fastest trains its learning trials this much longer again, so the curve covers the fastest
#: tier's horizon even where a config's speed ratio between tiers differs from the base config's.
STRETCH_MARGIN = 1.1


def is_staged(space: SearchSpace) -> bool:
    """Whether the space is tuned in stages: a horizon, and quality as the objective."""
    return bool(horizon_of(space)) and space.objective == "quality"


def _points(start_with: Sequence[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """The start points restricted to `names`, without repeats, in order."""
    out: list[dict[str, Any]] = []
    for point in start_with:
        part = {k: v for k, v in point.items() if k in names}
        if part and part not in out:
            out.append(part)
    return out


def speed_space(space: SearchSpace) -> SearchSpace:
    """The space of step 1: the speed knobs, throughput as the objective, short runs without evaluation; a grid no
    larger than its trials is run point by point (a sampler would repeat points of a small grid)."""
    parsed = {k: p for k, p in space.parsed.items() if is_speed_knob(k)}
    size = grid_size(parsed)
    trials = space.speed_trials or (min(size, space.trials) if size else space.trials)
    start_with = _with_grid(_points(space.start_with, list(parsed)), parsed, size, trials)
    if size and size <= trials:
        trials = size
    return dataclasses.replace(
        space,
        params={k: v for k, v in space.params.items() if k in parsed},
        parsed=parsed,
        objective="throughput",
        pruner="none",
        trials=trials,
        startup_trials=None,
        start_with=start_with,
    )


def learning_space(space: SearchSpace) -> SearchSpace:
    """The space of step 2: the learning knobs, quality at the horizon as the objective; a grid no larger than the
    trials is run point by point, in order."""
    parsed = {k: p for k, p in space.parsed.items() if not is_speed_knob(k)}
    size = grid_size(parsed)
    trials = min(size, space.trials) if size else space.trials
    return dataclasses.replace(
        space,
        params={k: v for k, v in space.params.items() if k in parsed},
        parsed=parsed,
        trials=trials,
        start_with=_with_grid(_points(space.start_with, list(parsed)), parsed, size, trials),
    )


def _with_grid(start_with: list[dict[str, Any]], parsed: dict[str, Any], size: int | None, trials: int) -> list:
    """The start points, then every other point of a grid that the trials cover whole."""
    if not size or size > trials:
        return start_with
    return start_with + [p for p in grid_points(parsed) or [] if p not in start_with]


def stretch(rates: dict[str, float], tier: str) -> float:
    """How many horizons a learning trial on `tier` trains so its curve covers the fastest tier's horizon."""
    fastest = max(rates.values())
    if rates.get(tier, 0) <= 0 or rates[tier] >= fastest:
        return 1.0
    return fastest / rates[tier] * STRETCH_MARGIN


@dataclasses.dataclass
class AtHorizon:
    """What a learning config reaches on one tier in the horizon."""

    quality: float
    samples: float
    stderr: float | None
    extrapolated: bool  # the curve stopped short of these samples


def _samples_at(points: Sequence[dict[str, Any]], seconds: float) -> tuple[float, bool]:
    """Samples the curve's run had seen after `seconds` of training (linear between points, from 0 at 0 s);
    beyond the last point, at the rate of the last stretch, flagged."""
    known = [(0.0, 0.0)] + [(p["seconds"], p["samples"]) for p in points]
    for (t0, s0), (t1, s1) in itertools.pairwise(known):
        if seconds <= t1:
            return (s0 + (s1 - s0) * (seconds - t0) / (t1 - t0) if t1 > t0 else s1), False
    (t0, s0), (t1, s1) = known[-2], known[-1]
    rate = (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0
    return s1 + rate * (seconds - t1), not math.isclose(seconds, t1, rel_tol=1e-6)


def at_horizon(curve: Sequence[dict[str, Any]], horizon: Horizon, speed_ratio: float = 1.0) -> AtHorizon | None:
    """Where a curve gets in the horizon on a tier `speed_ratio` times as fast as the machine that measured it.

    A horizon in samples is the same on every tier; one in minutes is read on the curve's own clock at
    minutes x 60 x speed_ratio. None for a curve without points.
    """
    points = sorted((p for p in curve if p.get("samples")), key=lambda p: p["samples"])
    if not points:
        return None
    if horizon.samples is not None:
        samples, short = float(horizon.samples), horizon.samples > points[-1]["samples"] * (1 + 1e-9)
    elif all(p.get("seconds") is not None for p in points):
        samples, short = _samples_at(points, horizon.minutes * 60 * speed_ratio)
    else:
        return None
    quality = extrapolate(points, samples) if short else quality_at(points, samples)
    nearest = min(points, key=lambda p: abs(math.log(p["samples"]) - math.log(max(samples, 1.0))))
    return AtHorizon(quality=quality, samples=samples, stderr=nearest.get("stderr"), extrapolated=short)


@dataclasses.dataclass
class Candidate:
    """A learning config that reached the horizon, as it would do on one tier."""

    trial: int  # number in the learning study
    params: dict[str, Any]  # its learning knobs
    trained_on: str  # the tier whose machine measured its curve
    reached: AtHorizon
    rate: dict[str, Any]  # its short run on this tier (or its own trial's figures, on the tier it trained on)
    experiment: dict[str, Any]
    curve: list[dict[str, Any]]

    @property
    def feasible(self) -> bool:
        return self.rate.get("status") == "ok" and objectives.is_feasible(objectives.constraints(self.rate))


def candidates(
    learning_trials: Sequence[Any], rates: dict[int, dict[str, Any]], horizon: Horizon, tier: str
) -> list[Candidate]:
    """The completed learning trials as they would do on `tier`, best first: those that fit the tier's limits by
    quality at the horizon, then those that do not. `rates` maps a trial number to its run on the tier (a trial
    that trained on the tier needs none: its own figures are used); a trial with neither is left out."""
    out = []
    for t in learning_trials:
        attrs = t.user_attrs
        own = attrs.get("tier") == tier
        rate = attrs if own else rates.get(t.number)
        if rate is None or not attrs.get("curve") or not attrs.get("samples_per_sec"):
            continue
        ratio = 1.0 if own else (rate.get("samples_per_sec") or 0.0) / attrs["samples_per_sec"]
        reached = at_horizon(attrs["curve"], horizon, ratio) if ratio > 0 else None
        if reached is None:
            continue
        out.append(
            Candidate(
                trial=t.number,
                params=dict(t.params),
                trained_on=attrs.get("tier", "?"),
                reached=reached,
                rate={k: rate[k] for k in _RATE_KEYS if rate.get(k) is not None},
                experiment=rate.get("experiment") or {},
                curve=list(attrs["curve"]),
            )
        )
    return sorted(out, key=lambda c: (not c.feasible, -c.reached.quality, -(c.rate.get("samples_per_sec") or 0)))


#: How many of a tier's speed settings, fastest first, a config is tried with before it counts as not fitting there.
SPEED_TRIES = 3


def time_with_fitting_speed(
    jobs: dict[Any, list[dict[str, Any]]],
    submit: Callable[[Any, dict[str, Any]], Any],
    wait: Callable[[Any], dict[str, Any]],
    tries: int = SPEED_TRIES,
) -> dict[Any, dict[str, Any]]:
    """Time each job (a config on a tier) with the tier's fastest speed setting; one whose run breaks the tier's
    limits there (a deeper or wider config may not fit the cut the base config did) runs again with the next
    setting, up to `tries`. Jobs run in rounds, each round's runs submitted together (one per job) before any is
    waited for. Returns each job's last result, with the speed settings it ran with ("speed_params")."""
    option = dict.fromkeys(jobs, 0)
    results: dict[Any, dict[str, Any]] = {}
    pending = [job for job, options in jobs.items() if options]
    while pending:
        refs = {job: submit(job, jobs[job][option[job]]) for job in pending}
        pending = []
        for job, ref in refs.items():
            result = {**wait(ref), "speed_params": jobs[job][option[job]]["params"]}
            results[job] = result
            fits = result.get("status") == "ok" and objectives.is_feasible(objectives.constraints(result))
            if not fits and option[job] + 1 < min(tries, len(jobs[job])):
                option[job] += 1
                pending.append(job)
    return results


_RATE_KEYS = (
    "status",
    "samples_per_sec",
    "peak_memory_mb",
    "thermal_max",
    "throughput_decay",
    "memory_budget_mb",
    "thermal_cap",
    "max_throughput_decay",
    "error",
    "hardware",
    "speed_params",
)
