"""From a tuning run to profiles: the best feasible trial per tier, re-run for verification, written as a Profile.

measured.samples_per_sec / peak_memory_mb / thermal_max are the chosen trial's; measured.objective holds the
objective value(s) by name, the trial's throughput decay and quality, and `verify_*`: the same settings re-run
for a verification window on the tier's machine before export (absent when no verification ran, e.g. an export
of a run whose driver never reached that point).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import optuna

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.tune import objectives
from raytrm.tune.progress import format_params
from raytrm.tune.space import describe_horizon, horizon_of, space_from_dict
from raytrm.tune.tuner import PROFILES_DIR, TUNE_FILE, VERIFY_DIR, trial_resources

logger = logging.getLogger(__name__)


def _state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / TUNE_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: not a tuning run (no {TUNE_FILE}); tune first with `raytrm tune --out {run_dir}`")
    state = cfg.read_yaml(path)
    if not state.get("tiers"):
        raise UserError(f"{path}: the run never reached its studies; resume it with `raytrm tune --resume {run_dir}`")
    return state


def ranked(run_dir: Path, tier: str) -> tuple[list[optuna.trial.FrozenTrial], Any, dict[str, Any]]:
    """(feasible trials best first, the space, the run state) of one tier's study."""
    state = _state(run_dir)
    space = space_from_dict(state["space"], str(run_dir / TUNE_FILE))
    if tier not in state["tiers"]:
        raise UserError(f"--tier {tier}: not tuned in {run_dir} (tiers: {', '.join(state['tiers'])})")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=state["studies"][tier], storage=state["storage"])
    return objectives.best_trials(study, space.objective, space.pareto.throughput_slack), space, state


def verify_best(run_dir: Path, tier: str) -> dict[str, Any] | None:
    """Re-run the tier's best settings on one of its machines (Ray must be connected); kept in verify/<tier>.json."""
    import ray

    from raytrm.tune.trial import measure

    best, space, _ = ranked(run_dir, tier)
    if not best:
        return None
    attrs = best[0].user_attrs
    remote = ray.remote(
        num_cpus=1,
        resources={k: v for k, v in trial_resources(tier).items() if k != "CPU"},
        max_calls=1,  # a fresh process, as the trial had
    )(measure)
    result = ray.get(
        remote.remote(
            attrs["experiment"],
            memory_budget_mb=attrs.get("memory_budget_mb"),
            thermal_cap=attrs.get("thermal_cap"),
            # The verification re-measures speed, memory and heat in the verification window; with a horizon the
            # trial's quality is the one reached there, which a shorter run does not re-measure.
            **{**space.measure_args(space.verify_s), "horizon": None},
        )
    )
    result["trial"] = best[0].number
    path = run_dir / VERIFY_DIR / f"{tier}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    return result


def build_profile(run_dir: Path, tier: str) -> cfg.Profile:
    """The tier's profile: best feasible trial's settings, the tier's limits, what was measured."""
    best, space, state = ranked(run_dir, tier)
    if not best:
        raise UserError(f"{run_dir}: no feasible trial for tier {tier}; widen the space or the limits and tune again")
    trial = best[0]
    attrs = trial.user_attrs
    experiment = json.loads(json.dumps(attrs["experiment"]))
    training = experiment["training"]
    if not training.get("steps") and not training.get("time_budget_s"):
        # A profile trains for the horizon it was tuned for (--steps or --time-budget change it); a space without a
        # horizon was tuned for its trial's length, so that is what the profile trains for.
        horizon = space.horizon
        if horizon.samples is not None:
            training["steps"] = math.ceil(horizon.samples / training["global_batch_size"])
        else:
            training["time_budget_s"] = (
                horizon.minutes * 60 if horizon.minutes is not None else space.budget.warmup_s + space.verify_s
            )
    names = objectives.metric_names(space.objective)
    objective: dict[str, Any] = dict(zip(names, trial.values, strict=True))
    objective.update(
        objective=space.objective,
        quality=attrs.get("quality"),
        horizon_samples=attrs.get("horizon_samples"),
        throughput_decay=attrs.get("throughput_decay"),
        horizon=horizon_of(space),
    )
    verify_path = run_dir / VERIFY_DIR / f"{tier}.json"
    if verify_path.is_file():
        v = json.loads(verify_path.read_text())
        if v.get("trial") == trial.number:
            objective.update(
                verify_samples_per_sec=v.get("samples_per_sec"),
                verify_peak_memory_mb=v.get("peak_memory_mb"),
                verify_quality=None if horizon_of(space) else v.get("quality"),
                verify_status=v.get("status"),
            )
    hardware = {k: v for k, v in (attrs.get("hardware") or {}).items() if k in cfg.HardwareSummary.__annotations__}
    data = {
        "tier": tier,
        "hardware": hardware,
        **{k: experiment[k] for k in ("model", "data", "training")},
        "limits": {
            "memory_budget_mb": int(attrs.get("memory_budget_mb") or 1),
            "thermal_cap": attrs.get("thermal_cap") or "fair",
        },
        "measured": {
            "samples_per_sec": attrs.get("samples_per_sec", 0.0),
            "peak_memory_mb": attrs.get("peak_memory_mb", 0.0),
            "thermal_max": attrs.get("thermal_max", "unknown"),
            "objective": objective,
            "trial": trial.number,
            "study": f"{state['studies'][tier]} @ {state['storage']}",
        },
    }
    return cfg.from_dict(cfg.Profile, data, f"{run_dir} (tier {tier})")


def export_run(run_dir: str | Path, tier: str | None = None, out: str | None = None) -> dict[str, Path]:
    """Write the profile of one tier (or of every tier with a feasible trial); returns tier -> path."""
    run_dir = Path(run_dir)
    tiers = [tier] if tier else _state(run_dir)["tiers"]
    if out and len(tiers) > 1:
        raise UserError(f"--out names one file but {run_dir} has tiers {', '.join(tiers)}; add --tier")
    written = {}
    for name in tiers:
        try:
            profile = build_profile(run_dir, name)
        except UserError as e:
            if tier:
                raise
            logger.warning("%s", e)
            continue
        written[name] = cfg.write_yaml(profile, Path(out) if out else run_dir / PROFILES_DIR / f"{name}.yaml")
    if not written:
        raise UserError(f"{run_dir}: no tier has a feasible trial; nothing to export")
    return written


def format_table(run_dir: str | Path) -> str:
    """Per tier: best settings, samples/s, peak memory vs budget, objective, verification and the runner-up."""
    run_dir = Path(run_dir)
    lines = []
    state = _state(run_dir)
    for tier in state["tiers"]:
        best, space, _ = ranked(run_dir, tier)
        horizon = describe_horizon(horizon_of(space))
        at = f" at the horizon ({horizon})" if horizon and space.objective != "throughput" else ""
        lines.append(f"tier {tier}  ({len(best)} feasible trials, objective {space.objective}{at})")
        lost = state.get("lost_tiers", {}).get(tier)
        if lost:
            lines.append(
                f"  LOST     : its last machine left the cluster; trial(s) {lost['died'] or 'none'} died with it "
                f"(recorded failed, with what they measured), {lost['not_run']} never ran, nothing was verified"
            )
        if not best:
            lines.append("  no feasible trial: no profile")
            continue
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
        verify = run_dir / VERIFY_DIR / f"{tier}.json"
        if verify.is_file():
            v = json.loads(verify.read_text())
            quality = "" if horizon_of(space) else f"  quality {v.get('quality', 0):.4g}"
            lines.append(
                f"  verified : samples/s {v.get('samples_per_sec', 0):.1f}  peak "
                f"{v.get('peak_memory_mb', 0):.0f} MiB{quality}  ({v.get('status')})"
            )
        profile = run_dir / PROFILES_DIR / f"{tier}.yaml"
        if profile.is_file():
            lines.append(f"  profile  : {profile}")
    return "\n".join(lines)
