"""The measurements behind `python -m benchmarks tune`, each run in this process as a trial runs (the space's budget):

- every point of a space's (discrete) grid once, for the replay of searches on it (benchmarks.tune_replay);
- each learning config's curve to the space's horizon, for the replay at the horizon (benchmarks.tune_horizon);
- a tuned profile against the space's base at the tier's hand-written defaults, in alternation.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.tune.curves import is_speed_knob
from raytrm.tune.params import grid_points
from raytrm.tune.space import SearchSpace, build_experiment
from raytrm.tune.space_sections import Horizon


def point_key(point: dict[str, Any]) -> str:
    """A grid point as a table's key: its parameters as sorted JSON."""
    return json.dumps(point, sort_keys=True)


def grid(space: SearchSpace) -> list[dict[str, Any]]:
    """Every combination of the space's parameters (each must be discrete)."""
    for name, p in space.parsed.items():
        if p.values() is None or p.type == "float":
            raise UserError(f"{space.source}: params.{name}: the replay bench needs discrete parameters (choices/int)")
    return grid_points(space.parsed) or []


def measure_grid(space: SearchSpace, out: Path) -> list[dict[str, Any]]:
    """Measure every grid point with the space's budget, in this process; writes the table to out."""
    from raytrm.tune.trial import measure, resolve_for_node

    rows = []
    for point in grid(space):
        experiment, limits = resolve_for_node(cfg.to_dict(build_experiment(space.base, point)), {})
        result = measure(
            experiment,
            memory_budget_mb=limits["memory_budget_mb"],
            thermal_cap=limits["thermal_cap"],
            **space.measure_args(),
        )
        rows.append({"params": point, "result": {k: v for k, v in result.items() if k != "eval"}})
        out.write_text(json.dumps({"space": space.to_dict(), "rows": rows}, indent=1, default=str))
    return rows


def learning_grid(space: SearchSpace) -> list[dict[str, Any]]:
    """Every combination of the space's learning knobs; speed knobs stay at the base's values (the curve ignores
    them)."""
    return [{k: v for k, v in point.items() if not is_speed_knob(k)} for point in _unique(space, grid(space))]


def _unique(space: SearchSpace, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen, out = set(), []
    for point in points:
        key = point_key({k: v for k, v in point.items() if not is_speed_knob(k)})
        if key not in seen:
            seen.add(key)
            out.append(point)
    return out


def horizon_samples(horizon: Horizon, samples_per_sec: float, fallback_s: float) -> float:
    """The samples a config sees in the horizon at this throughput (fallback_s of training without one)."""
    if horizon.samples is not None:
        return float(horizon.samples)
    seconds = horizon.minutes * 60 if horizon.minutes is not None else fallback_s
    return seconds * samples_per_sec


def measure_curves(space: SearchSpace, out: Path, throughput_s: float = 10.0) -> list[dict[str, Any]]:
    """Each learning config's throughput here, then its learning curve to the space's horizon (in samples, so a
    loaded machine changes how long it takes, not what it measures); writes the table to out as it goes.

    The throughputs are measured first, one after the other, so they see the machine in one state. A curve is
    evaluated at the horizon, at a third, a ninth and a 27th of it, and at the samples a trial of the space's
    budget sees (what today's short trials compare).
    """
    from raytrm import config as cfg
    from raytrm.tune.curves import learning_curve, rungs
    from raytrm.tune.trial import measure, resolve_for_node

    points = learning_grid(space)
    experiments = [resolve_for_node(cfg.to_dict(build_experiment(space.base, p)), {})[0] for p in points]
    rates = []
    for experiment in experiments:
        result = measure(
            experiment,
            warmup_s=space.budget.warmup_s,
            measure_s=throughput_s,
            memory_budget_mb=None,
            thermal_cap=None,
            max_throughput_decay=1.0,
            eval_puzzles=1,
        )
        rates.append(result["samples_per_sec"])
    short_s = space.budget.warmup_s + space.budget.measure_s
    rows: list[dict[str, Any]] = []
    for point, experiment, rate in zip(points, experiments, rates, strict=True):
        batch = experiment["training"]["global_batch_size"]
        horizon = horizon_samples(space.horizon, rate, short_s)
        at = rungs(round(horizon), batch, count=4, eta=3, extra=[round(short_s * rate)])
        curve = learning_curve(
            experiment, at, quality_metric=space.quality_metric, eval_puzzles=space.budget.eval_puzzles
        )
        rows.append(
            {
                "params": point,
                "samples_per_sec": rate,
                "horizon_samples": at[-1],
                "short_samples": max(batch, round(short_s * rate / batch) * batch),
                "points": curve["points"],
            }
        )
        out.write_text(json.dumps({"space": space.to_dict(), "curves": rows}, indent=1, default=str))
    return rows


def against_defaults(space: SearchSpace, profile_path: Path, repeats: int) -> dict[str, Any]:
    """The tuned profile's settings against the space's base with the tier's hand-written defaults, in alternation.

    Both run as a trial does (the space's warm-up, window and evaluation; with a horizon, trained to it and judged
    there); alternating the two, repeat after repeat, lets a change in the machine's load reach both alike. Returns
    each side's runs and medians.
    """
    from raytrm.tune.trial import measure, resolve_for_node

    profile = cfg.load_profile(profile_path)
    tuned = cfg.to_dict(cfg.ExperimentConfig(model=profile.model, data=profile.data, training=profile.training))
    tuned["training"].update(steps=None, time_budget_s=None)  # the bench's own budget decides the length
    sides = {
        "tier defaults": resolve_for_node(cfg.to_dict(build_experiment(space.base, {})), {})[0],
        "tuned profile": resolve_for_node(tuned, {})[0],
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, experiment in sides.items():
            result = measure(experiment, memory_budget_mb=None, thermal_cap=None, **space.measure_args())
            runs[name].append({k: result[k] for k in ("status", "quality", "samples_per_sec", "peak_memory_mb")})
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("quality", "samples_per_sec", "peak_memory_mb")}
        for name, rs in runs.items()
    }
    return {"space": space.name, "profile": str(profile_path), "repeats": repeats, "runs": runs, "medians": medians}


def format_against(out: dict[str, Any]) -> str:
    lines = [f"{'settings':<14} {'quality':>8} {'samples/s':>10} {'peak MiB':>9}   (medians of {out['repeats']})"]
    for name, m in out["medians"].items():
        lines.append(f"{name:<14} {m['quality']:>8.4f} {m['samples_per_sec']:>10.1f} {m['peak_memory_mb']:>9.0f}")
    base, tuned = out["medians"]["tier defaults"], out["medians"]["tuned profile"]
    if base["quality"] > 0 and base["samples_per_sec"] > 0:
        lines.append(
            f"tuned / defaults: quality x{tuned['quality'] / base['quality']:.2f}, "
            f"samples/s x{tuned['samples_per_sec'] / base['samples_per_sec']:.2f}"
        )
    return "\n".join(lines)
