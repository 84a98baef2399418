"""The sections of a space file beside its parameters: how long each trial runs (budget), the training the profile
is for (horizon), the limits a trial must respect, and how one point is picked from a Pareto front."""

from __future__ import annotations

from dataclasses import dataclass

from raytrm.config import THERMAL_STATES
from raytrm.schema import spec


@dataclass
class Budget:
    """How long each trial runs, in wall-clock seconds."""

    warmup_s: float = spec(5.0, "training before measuring (compilation, allocator, caches)", ge=0)
    measure_s: float = spec(
        20.0,
        "measured window: samples/s, peak memory, heat and throughput decay; with a horizon the trial trains to the "
        "horizon and measures from the warm-up to its end instead",
        gt=0,
    )
    eval_puzzles: int | None = spec(64, "test puzzles evaluated at the end of a trial; None = the whole split", ge=1)
    evaluations: int = spec(
        1,
        "evaluations in the measured window, evenly spaced, the last at its end (their time is not counted); a "
        "pruner compares trials at the earlier ones. With a horizon they sit 3x apart, the last at the horizon "
        "(1/3 and 1 for two; 1/9, 1/3 and 1 for three)",
        ge=1,
    )
    verify_s: float | None = spec(
        None, "measured window of the verification re-run of the best settings; None = measure_s", gt=0
    )
    decay_window: float = spec(
        0.25, "share of the measured window at each end compared for throughput decay", gt=0, le=0.5
    )


@dataclass
class Horizon:
    """How long the user trains with the profile: the length at which the tuner compares quality."""

    minutes: float | None = spec(None, "minutes of training on each tier (more samples on a faster one)", gt=0)
    samples: int | None = spec(None, "training samples, the same on every tier", ge=1)


@dataclass
class TierLimits:
    """Per-tier override of tiers.yaml's limits."""

    memory_budget_mb: int | None = spec(None, "training memory budget in MiB", ge=64)
    thermal_cap: str | None = spec(None, "hottest thermal state tolerated", choices=THERMAL_STATES)


@dataclass
class SpaceLimits:
    """Limits a trial must respect; memory and heat default to the tier's row in tiers.yaml."""

    memory_budget_mb: int | None = spec(None, "memory budget for every tier, overriding tiers.yaml", ge=64)
    thermal_cap: str | None = spec(None, "thermal cap for every tier, overriding tiers.yaml", choices=THERMAL_STATES)
    max_throughput_decay: float = spec(
        0.3, "largest tolerated drop of samples/s from the start to the end of the measured window", gt=0, le=1
    )
    tiers: dict = spec({}, "tier name -> {memory_budget_mb, thermal_cap}: overrides for one tier")


@dataclass
class Pareto:
    """How one point is picked from the (quality, throughput) Pareto front."""

    throughput_slack: float = spec(
        0.1, "pick the highest quality among front points within this fraction of the best throughput", ge=0, le=1
    )
