"""The table of a tuning run, as `raytrm tune` prints it at the end and `raytrm report` keeps it: per tier, the
best settings and the runner-up with their figures, the verification re-run and the profile written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrm.tune import objectives
from raytrm.tune.layout import PROFILES_DIR, read_state, run_space
from raytrm.tune.space import describe_horizon, horizon_of
from raytrm.tune.studies import load_study, ranked, reached_horizon, staged_candidates
from raytrm.tune.verify import verification


def format_params(params: dict[str, Any]) -> str:
    """`micro_batch_size=16 threads=2 lr=0.0031`: the field names without their section."""
    parts = []
    for name, value in params.items():
        short = name.rsplit(".", 1)[-1]
        parts.append(f"{short}={value:.3g}" if isinstance(value, float) else f"{short}={value}")
    return " ".join(parts)


def _figure(result: dict[str, Any], key: str, spec: str) -> str:
    """A re-run's figure as the table shows it; one it did not measure (null, or absent) is "n/a", not a 0."""
    value = result.get(key)
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "n/a"


def _lost_line(state: dict[str, Any], tier: str) -> list[str]:
    lost = state.get("lost_tiers", {}).get(tier)
    if not lost:
        return []
    return [
        f"  LOST     : its last machine left the cluster; trial(s) {lost['died'] or 'none'} died with it "
        f"(recorded failed, with what they measured), {lost['not_run']} never ran, nothing was verified"
    ]


def _not_learning(trials: list[Any]) -> str:
    """How many of a study's trials were stopped as not learning, for a tier's header."""
    count = sum(1 for t in trials if t.user_attrs.get("status") == objectives.NOT_LEARNING)
    return f", {count} stopped as not learning" if count else ""


def _profile_line(run_dir: Path, tier: str) -> list[str]:
    profile = run_dir / PROFILES_DIR / f"{tier}.yaml"
    return [f"  profile  : {profile}"] if profile.is_file() else []


def _staged_lines(run_dir: Path, tier: str, state: dict[str, Any]) -> list[str]:
    """A staged run's tier: its speed pick, the best learning configs at its horizon, verification and profile."""
    space = run_space(run_dir, state)
    choices, speed = staged_candidates(run_dir, tier)
    speed_trials = len(load_study(state, state["studies"][tier]).trials)
    learning = load_study(state, state["learning_study"]).trials
    lines = [
        f"tier {tier}  (quality at the horizon, {describe_horizon(horizon_of(space))} on this tier; {speed_trials} "
        f"speed trials here, {len(learning)} learning trials on all tiers{_not_learning(learning)}, "
        f"{len(reached_horizon(run_dir))} trained to the horizon)",
        *_lost_line(state, tier),
    ]
    if speed is None:
        return [*lines, "  no speed setting fits the limits: no profile"]
    lines.append(
        f"  speed    #{speed['trial']}: {format_params(speed['params']) or 'base settings'}  "
        f"samples/s {speed['samples_per_sec']:.1f} at the base config"
    )
    feasible = [c for c in choices if c.feasible]
    if not feasible:
        return [*lines, "  no learning config that reached the horizon fits this tier's limits: no profile"]
    for label, c in zip(("best", "runner-up"), feasible, strict=False):
        r = c.reached
        error = f" +-{r.stderr:.2g}" if r.stderr else ""
        how = "extrapolated past its curve" if r.extrapolated else "on its curve"
        own_cut = c.rate.get("speed_params")
        cut = (
            f"  (with {format_params(own_cut)}: the tier's pick did not fit it)"
            if own_cut and own_cut != speed["params"]
            else ""
        )
        lines.append(f"  {label:<9} #{c.trial}: {format_params(c.params) or 'base settings'}{cut}")
        lines.append(
            f"            quality={r.quality:.4g}{error} at {r.samples:,.0f} samples ({how}; trained on "
            f"{c.trained_on})  "
            f"samples/s {c.rate.get('samples_per_sec') or 0:.1f}  peak {c.rate.get('peak_memory_mb') or 0:.0f} / "
            f"{c.rate.get('memory_budget_mb') or 0:.0f} MiB  thermal {c.rate.get('thermal_max') or 'unknown'}"
        )
    v = verification(run_dir, tier)
    if v is not None:
        lines.append(
            f"  verified : samples/s {_figure(v, 'samples_per_sec', '.1f')}  peak "
            f"{_figure(v, 'peak_memory_mb', '.0f')} MiB  ({v.get('status')})"
        )
    return lines + _profile_line(run_dir, tier)


def _study_lines(run_dir: Path, tier: str, state: dict[str, Any]) -> list[str]:
    """A tier with a study of its own: the best trial and the runner-up, verification and profile."""
    best, space, _ = ranked(run_dir, tier)
    horizon = describe_horizon(horizon_of(space))
    at = f" at the horizon ({horizon})" if horizon and space.objective != "throughput" else ""
    stopped = _not_learning(load_study(state, state["studies"][tier]).trials)
    lines = [
        f"tier {tier}  ({len(best)} feasible trials{stopped}, objective {space.objective}{at})",
        *_lost_line(state, tier),
    ]
    if not best:
        return [*lines, "  no feasible trial: no profile"]
    for label, trial in (("best", best[0]), ("runner-up", best[1] if len(best) > 1 else None)):
        if trial is None:
            continue
        a = trial.user_attrs
        values = " ".join(
            f"{n}={v:.4g}" for n, v in zip(objectives.metric_names(space.objective), trial.values, strict=True)
        )
        lines.append(f"  {label:<9} #{trial.number}: {format_params(trial.params)}")
        lines.append(
            f"            {values}  samples/s {a.get('samples_per_sec', 0):.1f}  peak "
            f"{a.get('peak_memory_mb', 0):.0f} / {a.get('memory_budget_mb') or 0:.0f} MiB  "
            f"thermal {a.get('thermal_max', 'unknown')}"
        )
    v = verification(run_dir, tier)
    if v is not None:
        quality = "" if horizon_of(space) else f"  quality {_figure(v, 'quality', '.4g')}"
        lines.append(
            f"  verified : samples/s {_figure(v, 'samples_per_sec', '.1f')}  peak "
            f"{_figure(v, 'peak_memory_mb', '.0f')} MiB{quality}  ({v.get('status')})"
        )
    return lines + _profile_line(run_dir, tier)


def format_table(run_dir: str | Path) -> str:
    """Per tier: best settings, samples/s, peak memory vs budget, objective, verification and the runner-up."""
    run_dir = Path(run_dir)
    state = read_state(run_dir)
    lines = []
    for tier in state["tiers"]:
        tier_lines = _staged_lines if state.get("learning_study") else _study_lines
        lines += tier_lines(run_dir, tier, state)
    return "\n".join(lines)
