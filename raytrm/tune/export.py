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
from raytrm.tune import objectives, staged
from raytrm.tune.progress import format_params
from raytrm.tune.space import SearchSpace, describe_horizon, horizon_of, space_from_dict
from raytrm.tune.tuner import PROFILES_DIR, TUNE_FILE, VERIFY_DIR, stage_setup, trial_resources

logger = logging.getLogger(__name__)


def _state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / TUNE_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: not a tuning run (no {TUNE_FILE}); tune first with `raytrm tune --out {run_dir}`")
    state = cfg.read_yaml(path)
    if not state.get("tiers"):
        raise UserError(f"{path}: the run never reached its studies; resume it with `raytrm tune --resume {run_dir}`")
    return state


RATES_DIR = "rates"


def _space(run_dir: Path, state: dict[str, Any]) -> SearchSpace:
    return space_from_dict(state["space"], str(run_dir / TUNE_FILE))


def _study(state: dict[str, Any], name: str) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=state["storage"])


def speed_options(run_dir: Path, tier: str) -> list[dict[str, Any]]:
    """A staged run's tier's feasible speed trials, fastest first: params, samples/s and number of each."""
    state = _state(run_dir)
    best = objectives.best_trials(_study(state, state["studies"][tier]), "throughput")
    return [{"params": dict(t.params), "samples_per_sec": t.values[0], "trial": t.number} for t in best]


def best_speed(run_dir: Path, tier: str) -> dict[str, Any] | None:
    """The fastest feasible speed trial of a staged run's tier; None if none fits."""
    options = speed_options(run_dir, tier)
    return options[0] if options else None


def _remote_trial(tier: str) -> Any:
    """run_trial as a Ray task on one machine unit of the tier, in a fresh process as a trial has."""
    import ray

    from raytrm.tune.trial import run_trial

    resources = {k: v for k, v in trial_resources(tier).items() if k != "CPU"}
    return ray.remote(num_cpus=1, resources=resources, max_calls=1)(run_trial)


def reached_horizon(run_dir: Path) -> list[optuna.trial.FrozenTrial]:
    """A staged run's learning trials that trained to the horizon and fit their own tier's limits."""
    state = _state(run_dir)
    done = _study(state, state["learning_study"]).get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return [t for t in done if objectives.is_feasible(t.constraints) and t.user_attrs.get("curve")]


def measure_rates(run_dir: Path, tiers: list[str]) -> None:
    """Time each learning config that reached the horizon on every tier it did not train on (Ray connected), with
    that tier's fastest speed knobs that fit it there (staged.time_with_fitting_speed): short runs, kept in
    rates/TIER-N.json (a resumed run keeps what is there)."""
    import ray

    state = _state(run_dir)
    space = _space(run_dir, state)
    setup = stage_setup(space, run_dir, tiers, "speed")
    jobs, trials = {}, {t.number: t for t in reached_horizon(run_dir)}
    for tier in tiers:
        options = speed_options(run_dir, tier)
        for number, trial in trials.items():
            path = run_dir / RATES_DIR / f"{tier}-{number}.json"
            if options and trial.user_attrs.get("tier") != tier and not path.is_file():
                jobs[(tier, number)] = options

    def submit(job: tuple[str, int], option: dict[str, Any]) -> Any:
        tier, number = job
        config = {"tier": tier, "trial_number": number, "params": dict(trials[number].params)}
        return _remote_trial(tier).remote({**config, "speed": option["params"]}, setup)

    def wait(ref: Any) -> dict[str, Any]:
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as e:  # the tier's node left mid-run: recorded, and the other runs go on
            return {"status": "failed", "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}

    for (tier, number), result in staged.time_with_fitting_speed(jobs, submit, wait).items():
        path = run_dir / RATES_DIR / f"{tier}-{number}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text_atomic(json.dumps(result, default=str), path)
        logger.info("%s: %.1f samples/s (%s)", path.name, result.get("samples_per_sec") or 0, result.get("status"))


def staged_candidates(run_dir: Path, tier: str) -> tuple[list[staged.Candidate], dict[str, Any] | None]:
    """A staged run's learning configs as they do on `tier`, best first, and the tier's fastest speed setting."""
    state = _state(run_dir)
    if tier not in state["tiers"]:
        raise UserError(f"--tier {tier}: not tuned in {run_dir} (tiers: {', '.join(state['tiers'])})")
    space = _space(run_dir, state)
    rates = {}
    for path in (run_dir / RATES_DIR).glob(f"{tier}-*.json"):
        number = path.stem.rsplit("-", 1)[-1]
        if number.isdigit():
            rates[int(number)] = json.loads(path.read_text())
    speed = best_speed(run_dir, tier)
    if speed is None:
        return [], None
    return staged.candidates(reached_horizon(run_dir), rates, space.horizon, tier), speed


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

    state = _state(run_dir)
    if state.get("learning_study"):
        return _verify_staged(run_dir, tier)
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


def _verify_staged(run_dir: Path, tier: str) -> dict[str, Any] | None:
    """Re-run the tier's pick (best learning config, the tier's speed knobs) for the verification window."""
    import ray

    choices, speed = staged_candidates(run_dir, tier)
    feasible = [c for c in choices if c.feasible]
    if not feasible or speed is None:
        return None
    space = _space(run_dir, _state(run_dir))
    setup = stage_setup(space, run_dir, [tier], "speed")
    setup["measure"]["measure_s"] = space.verify_s
    best = feasible[0]
    # The speed settings it was timed with there: the tier's fastest, or the next that fit it.
    config = {"tier": tier, "trial_number": best.trial, "params": best.params}
    config["speed"] = best.rate.get("speed_params") or speed["params"]
    result = ray.get(_remote_trial(tier).remote(config, setup))
    result["trial"] = feasible[0].trial
    path = run_dir / VERIFY_DIR / f"{tier}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    return result


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
    verify_path = run_dir / VERIFY_DIR / f"{tier}.json"
    if not verify_path.is_file():
        return {}
    v = json.loads(verify_path.read_text())
    if v.get("trial") != trial:
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
        raise UserError(f"{run_dir}: tier {tier}: {why}; widen the space or the limits and tune again")
    best = feasible[0]
    space = _space(run_dir, state)
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
    state = _state(run_dir)
    if state.get("learning_study"):
        return _staged_profile(run_dir, tier, state)
    best, space, state = ranked(run_dir, tier)
    if not best:
        raise UserError(f"{run_dir}: no feasible trial for tier {tier}; widen the space or the limits and tune again")
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


def _lost_line(state: dict[str, Any], tier: str) -> list[str]:
    lost = state.get("lost_tiers", {}).get(tier)
    if not lost:
        return []
    return [
        f"  LOST     : its last machine left the cluster; trial(s) {lost['died'] or 'none'} died with it "
        f"(recorded failed, with what they measured), {lost['not_run']} never ran, nothing was verified"
    ]


def _staged_lines(run_dir: Path, tier: str, state: dict[str, Any]) -> list[str]:
    """A staged run's tier: its speed pick, the best learning configs at its horizon, verification and profile."""
    space = _space(run_dir, state)
    choices, speed = staged_candidates(run_dir, tier)
    speed_trials = len(_study(state, state["studies"][tier]).trials)
    learning = _study(state, state["learning_study"]).trials
    lines = [
        f"tier {tier}  (quality at the horizon, {describe_horizon(horizon_of(space))} on this tier; {speed_trials} "
        f"speed trials here, {len(learning)} learning trials on all tiers, {len(reached_horizon(run_dir))} trained "
        "to the horizon)",
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
    verify = run_dir / VERIFY_DIR / f"{tier}.json"
    if verify.is_file():
        v = json.loads(verify.read_text())
        lines.append(
            f"  verified : samples/s {v.get('samples_per_sec', 0):.1f}  peak {v.get('peak_memory_mb', 0):.0f} MiB  "
            f"({v.get('status')})"
        )
    profile = run_dir / PROFILES_DIR / f"{tier}.yaml"
    if profile.is_file():
        lines.append(f"  profile  : {profile}")
    return lines


def format_table(run_dir: str | Path) -> str:
    """Per tier: best settings, samples/s, peak memory vs budget, objective, verification and the runner-up."""
    run_dir = Path(run_dir)
    lines = []
    state = _state(run_dir)
    for tier in state["tiers"]:
        if state.get("learning_study"):
            lines += _staged_lines(run_dir, tier, state)
            continue
        best, space, _ = ranked(run_dir, tier)
        horizon = describe_horizon(horizon_of(space))
        at = f" at the horizon ({horizon})" if horizon and space.objective != "throughput" else ""
        lines.append(f"tier {tier}  ({len(best)} feasible trials, objective {space.objective}{at})")
        lines += _lost_line(state, tier)
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
