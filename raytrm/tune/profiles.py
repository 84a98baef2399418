"""From a tuning run to profiles (`raytrm export`): the best feasible trial per tier, written as a Profile.

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

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.train.run.directory import guard_output
from raytrm.tune import objectives
from raytrm.tune.hf_arguments import hf_arguments
from raytrm.tune.layout import PROFILES_DIR, read_state, read_sync, run_space
from raytrm.tune.space import SearchSpace, horizon_of
from raytrm.tune.studies import ranked, staged_candidates
from raytrm.tune.verify import verification

logger = logging.getLogger(__name__)


class NothingToExport(UserError):
    """A tier of a sound run that has no profile to give (no feasible trial): skipped when exporting every tier."""


def _horizon_training(training: dict[str, Any], space: SearchSpace) -> None:
    """A profile trains for the horizon it was tuned for (--steps or --time-budget change it); a space without a
    horizon was tuned for its trial's length, so that is what the profile trains for."""
    if training.get("steps") or training.get("time_budget_s"):
        return
    horizon = space.horizon
    if horizon.samples is not None:
        training["steps"] = math.ceil(horizon.samples / training["global_batch_size"])
    else:
        training["time_budget_s"] = (
            horizon.minutes * 60 if horizon.minutes is not None else space.budget.warmup_s + space.verify_s
        )


def _verified(run_dir: Path, tier: str, trial: int, quality: bool) -> dict[str, Any]:
    """The verification's figures for the objective record, where it re-ran this trial."""
    v = verification(run_dir, tier)
    if v is None or v.get("trial") != trial:
        return {}
    return {
        "verify_samples_per_sec": v.get("samples_per_sec"),
        "verify_peak_memory_mb": v.get("peak_memory_mb"),
        "verify_quality": v.get("quality") if quality else None,
        "verify_status": v.get("status"),
    }


def _staged_profile(run_dir: Path, tier: str, state: dict[str, Any]) -> cfg.Profile:
    """A staged run's profile: the tier's best learning config at the horizon, with the tier's speed knobs."""
    choices, speed = staged_candidates(run_dir, tier)
    feasible = [c for c in choices if c.feasible]
    if not feasible or speed is None:
        why = "no speed setting fits its limits" if speed is None else "no learning config reached the horizon there"
        raise NothingToExport(f"{run_dir}: tier {tier}: {why}; widen the space or the limits and tune again")
    best = feasible[0]
    space = run_space(run_dir, state)
    verify = _verified(run_dir, tier, best.trial, quality=False)
    experiment = json.loads(json.dumps(best.experiment))
    _horizon_training(experiment["training"], space)
    rate, reached = best.rate, best.reached
    objective = {
        "quality": reached.quality,
        "objective": "quality",
        "quality_stderr": reached.stderr,
        "horizon": horizon_of(space),
        "horizon_samples": round(reached.samples),
        "extrapolated": reached.extrapolated,
        "trained_on": best.trained_on,
        "speed_trial": speed["trial"],
        "throughput_decay": rate.get("throughput_decay"),
        **verify,
    }
    study = f"{state['learning_study']} @ {state['storage']}"
    return _profile(run_dir, tier, experiment, rate, objective, best.trial, study)


def build_profile(run_dir: Path, tier: str) -> cfg.Profile:
    """The tier's profile: best feasible trial's settings, the tier's limits, what was measured."""
    state = read_state(run_dir)
    if state.get("learning_study"):
        return _staged_profile(run_dir, tier, state)
    best, space, state = ranked(run_dir, tier)
    if not best:
        raise NothingToExport(
            f"{run_dir}: no feasible trial for tier {tier}; widen the space or the limits and tune again"
        )
    trial = best[0]
    attrs = trial.user_attrs
    experiment = json.loads(json.dumps(attrs["experiment"]))
    _horizon_training(experiment["training"], space)
    names = objectives.metric_names(space.objective)
    objective: dict[str, Any] = dict(zip(names, trial.values, strict=True))
    objective.update(
        objective=space.objective,
        quality=attrs.get("quality"),
        horizon_samples=attrs.get("horizon_samples"),
        throughput_decay=attrs.get("throughput_decay"),
        horizon=horizon_of(space),
    )
    objective.update(_verified(run_dir, trial=trial.number, tier=tier, quality=not horizon_of(space)))
    study = f"{state['studies'][tier]} @ {state['storage']}"
    return _profile(run_dir, tier, experiment, attrs, objective, trial.number, study)


def _profile(
    run_dir: Path,
    tier: str,
    experiment: dict[str, Any],
    figures: dict[str, Any],
    objective: dict[str, Any],
    trial: int,
    study: str,
) -> cfg.Profile:
    """A profile from the settings that were measured, the run's figures for them (limits, samples/s, peak, heat,
    hardware: a trial's or a rate run's) and the objective's record."""
    hardware = {k: v for k, v in (figures.get("hardware") or {}).items() if k in cfg.HardwareSummary.__annotations__}
    sync = _with_sync(experiment["training"], run_dir)
    data = {
        "tier": tier,
        "hardware": hardware,
        **{k: experiment[k] for k in ("model", "data", "training")},
        "limits": {
            "memory_budget_mb": int(figures.get("memory_budget_mb") or 1),
            "thermal_cap": figures.get("thermal_cap") or "fair",
        },
        "measured": {
            "samples_per_sec": figures.get("samples_per_sec") or 0.0,
            "peak_memory_mb": figures.get("peak_memory_mb") or 0.0,
            "thermal_max": figures.get("thermal_max") or "unknown",
            "objective": objective,
            "trial": trial,
            "study": study,
            "sync": sync,
        },
    }
    return cfg.from_dict(cfg.Profile, data, f"{run_dir} (tier {tier})")


def _with_sync(training: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The sync mode the tuner chose from the link between the cluster's machines, into the profile's training
    settings where the experiment left it to `auto` (a round length searched as a learning knob is kept); returns
    the record for measured.sync ({} on one machine)."""
    record = read_sync(run_dir)
    if record is None:
        return {}
    if training.get("sync_mode", "auto") == "auto":
        training["sync_mode"] = record["mode"]
        if record["mode"] == "local":
            training["sync_every"] = training.get("sync_every") or record["every"]
            if training.get("sync_overlap") is None:
                training["sync_overlap"] = min(record["overlap"], training["sync_every"] - 1)
        else:
            training["sync_every"] = training["sync_overlap"] = None
    return record


def _check_out(out: Path, form: str = "profile") -> None:
    """--out names the profile file to write: a directory, or a file that is not a profile (a checkpoint, a run's
    config, tune.yaml), is refused and left as it is; an earlier profile (of the form asked) is replaced, as an
    export again means."""
    if out.exists() and not out.is_dir():
        guard_output(out)  # a run's own file or a checkpoint: named as such
    if out.is_dir():
        raise UserError(f"--out {out}: a directory; expected the profile's file name; fix: e.g. --out {out}/TIER.yaml")
    if not out.exists():
        return
    key = "training_arguments" if form == "hf" else "raytrm_profile"
    try:
        data = cfg.read_yaml(out)  # JSON is YAML too
    except UserError:
        data = None
    if not isinstance(data, dict) or key not in data:
        raise UserError(
            f"--out {out}: an existing file that is not a raytrm profile; refusing to replace it; fix: give --out a "
            "new file name (or an earlier profile, to replace it)"
        )


def export_run(
    run_dir: str | Path, tier: str | None = None, out: str | None = None, form: str = "profile"
) -> dict[str, Path]:
    """Write the profile of one tier (or of every tier with a feasible trial); returns tier -> path. form "hf": a
    Hugging Face model's settings as TrainingArguments' fields, in JSON (raytrm.tune.hf_arguments)."""
    run_dir = Path(run_dir)
    tiers = [tier] if tier else read_state(run_dir)["tiers"]
    if out and len(tiers) > 1:
        raise UserError(f"--out names one file but {run_dir} has tiers {', '.join(tiers)}; add --tier")
    if out:
        _check_out(Path(out), form)
    written = {}
    for name in tiers:
        try:
            profile = build_profile(run_dir, name)
        except NothingToExport as e:
            if tier:
                raise
            logger.warning("%s", e)
            continue
        if form == "hf":
            target = Path(out) if out else run_dir / PROFILES_DIR / f"{name}.hf.json"
            arguments = hf_arguments(profile, str(run_dir))
            written[name] = cfg.write_text_atomic(json.dumps(arguments, indent=2) + "\n", target)
            continue
        written[name] = cfg.write_yaml(profile, Path(out) if out else run_dir / PROFILES_DIR / f"{name}.yaml")
    if not written:
        raise UserError(f"{run_dir}: no tier has a feasible trial; nothing to export")
    return written
