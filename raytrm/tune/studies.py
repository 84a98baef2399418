"""Reading a tuning run's studies: each tier's feasible trials best first; for a staged run, each tier's speed
settings fastest first, the learning configs that trained to the horizon, and how each of them does on a tier.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import optuna

from raytrm.errors import UserError
from raytrm.tune import objectives, staged
from raytrm.tune.layout import RATES_DIR, read_result, read_state, run_space, study_db


@functools.lru_cache(maxsize=8)
def _storage(url: str, device: int, inode: int) -> optuna.storages.RDBStorage:
    """One storage per study file (a file put in its place is another): opening one checks its schema against
    optuna's migration scripts, read from disk each time, and a table or an export opens the run's studies a dozen
    times."""
    return optuna.storages.RDBStorage(url)


def load_study(state: dict[str, Any], name: str) -> optuna.Study:
    """One of the run's studies, by name, from the storage its state names; a storage that does not hold it is one
    line."""
    import sqlalchemy.exc

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = study_db(state)
    fix = "restore the run's study.db, or tune again into a new directory (--out NEW_DIR)"
    try:
        stat = db.stat()
        return optuna.load_study(study_name=name, storage=_storage(state["storage"], stat.st_dev, stat.st_ino))
    except KeyError:  # optuna's answer for a study name the storage does not hold
        raise UserError(f"{db}: no study {name!r}, which tune.yaml names; {fix}") from None
    except (sqlalchemy.exc.SQLAlchemyError, RuntimeError) as e:  # a damaged file, or a schema optuna cannot read
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{db}: cannot read study {name!r} ({first}); {fix}") from None


def _check_tier(run_dir: Path, state: dict[str, Any], tier: str) -> None:
    if tier not in state["tiers"]:
        raise UserError(f"--tier {tier}: not tuned in {run_dir} (tiers: {', '.join(state['tiers'])})")


def ranked(run_dir: Path, tier: str) -> tuple[list[optuna.trial.FrozenTrial], Any, dict[str, Any]]:
    """(feasible trials best first, the space, the run state) of one tier's study."""
    state = read_state(run_dir)
    space = run_space(run_dir, state)
    _check_tier(run_dir, state, tier)
    study = load_study(state, state["studies"][tier])
    return objectives.best_trials(study, space.objective, space.pareto.throughput_slack), space, state


def speed_options(run_dir: Path, tier: str) -> list[dict[str, Any]]:
    """A staged run's tier's feasible speed trials, fastest first: params, samples/s and number of each."""
    state = read_state(run_dir)
    best = objectives.best_trials(load_study(state, state["studies"][tier]), "throughput")
    return [{"params": dict(t.params), "samples_per_sec": t.values[0], "trial": t.number} for t in best]


def best_speed(run_dir: Path, tier: str) -> dict[str, Any] | None:
    """The fastest feasible speed trial of a staged run's tier; None if none fits."""
    options = speed_options(run_dir, tier)
    return options[0] if options else None


def reached_horizon(run_dir: Path) -> list[optuna.trial.FrozenTrial]:
    """A staged run's learning trials that trained to the horizon and fit their own tier's limits."""
    state = read_state(run_dir)
    study = load_study(state, state["learning_study"])
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return [t for t in done if objectives.is_feasible(t.constraints) and t.user_attrs.get("curve")]


def rate_path(run_dir: Path, tier: str, trial: int) -> Path:
    """Where a staged run keeps the run of learning trial `trial`'s config on `tier`."""
    return run_dir / RATES_DIR / f"{tier}-{trial}.json"


def rates(run_dir: Path, tier: str) -> dict[int, dict[str, Any]]:
    """A staged run's rate runs on `tier`, by learning trial number."""
    out = {}
    for path in (run_dir / RATES_DIR).glob(f"{tier}-*.json"):
        number = path.stem.rsplit("-", 1)[-1]
        if number.isdigit():
            out[int(number)] = read_result(path)
    return out


def staged_candidates(run_dir: Path, tier: str) -> tuple[list[staged.Candidate], dict[str, Any] | None]:
    """A staged run's learning configs as they do on `tier`, best first, and the tier's fastest speed setting."""
    state = read_state(run_dir)
    _check_tier(run_dir, state, tier)
    space = run_space(run_dir, state)
    on_tier = rates(run_dir, tier)
    speed = best_speed(run_dir, tier)
    if speed is None:
        return [], None
    return staged.candidates(reached_horizon(run_dir), on_tier, space.horizon, tier), speed


def running_trial(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> optuna.Trial:
    """A live handle on a trial the study holds as RUNNING (its driver died), to record a result it saved: Optuna
    builds one from the trial's storage id, which a FrozenTrial keeps private (the only use of it in raytrm)."""
    return optuna.Trial(study, frozen._trial_id)
