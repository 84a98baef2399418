"""A tuning run directory and the names in it: its files, its Optuna storage and study names, the run's state, and
what every trial of a search is handed (its setup and its Ray resources).

The run directory holds tune.yaml (the space as validated, the tiers and the study names), study.db (the Optuna
RDB storage: `optuna trials --study-name NAME --storage sqlite:///RUN_DIR/study.db` reads it), trials/ (each
trial's result as JSON), rates/ (staged: configs timed on other tiers), ray/ (Ray Tune's own logs), verify/ (the
re-run of each tier's best settings), profiles/ (one profile per tier), plots/ and, on a cluster of several machines,
sync.json (the link between them and the sync mode chosen from it).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import optuna

from raytrm import config as cfg
from raytrm.constants import RESOURCE_MACHINE, tier_resource
from raytrm.errors import UserError
from raytrm.tune.space import SearchSpace, space_from_dict, tier_limits

logger = logging.getLogger(__name__)

TUNE_FILE, STUDY_DB, TRIALS_DIR, RATES_DIR = "tune.yaml", "study.db", "trials", "rates"
VERIFY_DIR, PROFILES_DIR, PLOTS_DIR = "verify", "profiles", "plots"
SYNC_FILE = "sync.json"  # the link between the cluster's machines and the sync mode chosen from it


# -- the study storage and the studies in it ------------------------------------------------------------------------


def storage_url(run_dir: Path) -> str:
    """The SQLite URL of the run's study storage."""
    return f"sqlite:///{run_dir.resolve() / STUDY_DB}"


def open_storage(run_dir: Path, attempts: int = 5) -> optuna.storages.RDBStorage:
    """The run's study storage, its schema created if new.

    Two processes opening a new SQLite file at once (the driver and a dashboard, `optuna trials` or a test watching the
    run) race to create the schema, and the loser gets "table already exists" or a duplicate schema version. By then
    the schema exists, so opening again succeeds.
    """
    import sqlalchemy.exc

    path = run_dir / STUDY_DB
    for attempt in range(1, attempts + 1):
        try:
            return optuna.storages.RDBStorage(storage_url(run_dir))
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError) as e:
            error = str(e).splitlines()[0]
            logger.debug("opening %s failed (%s), attempt %d of %d", path, error, attempt, attempts)
            time.sleep(0.1 * attempt)
    raise UserError(f"{path}: cannot open the study storage ({error}); check that the run directory is writable")


def study_name(space: SearchSpace, tier: str) -> str:
    """A tier's study in a search of one study per tier."""
    return f"{space.name}-{tier}"


def speed_study(space: SearchSpace, tier: str) -> str:
    """A tier's study of its speed knobs in a staged search."""
    return f"{space.name}-{tier}-speed"


def learning_study(space: SearchSpace) -> str:
    """The study of the learning knobs in a staged search, shared by every tier."""
    return f"{space.name}-learning"


def staged_study(space: SearchSpace, tier: str, stage: str | None) -> str:
    """The study a tier's trials go to: its own, its speed search's, or the learning search all tiers share."""
    if stage == "speed":
        return speed_study(space, tier)
    return learning_study(space) if stage == "learning" else study_name(space, tier)


# -- the run's state ------------------------------------------------------------------------------------------------


def read_state(run_dir: Path) -> dict[str, Any]:
    """tune.yaml of a run that reached its studies: the space, the tiers, the storage and the study names."""
    path = run_dir / TUNE_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: not a tuning run (no {TUNE_FILE}); tune first with `raytrm tune --out {run_dir}`")
    state = cfg.read_yaml(path)
    if not state.get("tiers"):
        raise UserError(f"{path}: the run never reached its studies; resume it with `raytrm tune --resume {run_dir}`")
    return state


def run_space(run_dir: Path, state: dict[str, Any]) -> SearchSpace:
    """The space a run was tuned with, as its tune.yaml keeps it."""
    return space_from_dict(state["space"], str(run_dir / TUNE_FILE))


# -- what each trial is handed --------------------------------------------------------------------------------------


def trial_resources(tier: str) -> dict[str, float]:
    """One machine unit of the tier's node: trials that share a machine never run at once."""
    return {"CPU": 1, RESOURCE_MACHINE: 1, tier_resource(tier): 1}


def _limits(space: SearchSpace, tier: str) -> dict[str, Any]:
    """The space's override, else tiers.yaml's row; a tier not listed there (generic) is left to its node."""
    from raytrm.hardware.tiers import load_tiers

    own = tier_limits(space, tier)
    row = next((r for r in load_tiers() if r.name == tier), None)
    return {
        "memory_budget_mb": own.memory_budget_mb or (row.memory_budget_mb if row else None),
        "thermal_cap": own.thermal_cap or (row.thermal_cap if row else None),
    }


def stage_setup(space: SearchSpace, run_dir: Path, tiers: list[str], stage: str | None = None) -> dict[str, Any]:
    """What every trial of a search (or of one stage of a staged search) gets besides its own parameters."""
    measure = space.measure_args()
    if stage == "speed":  # speed, memory and heat in the budget's short window; no horizon, no evaluation
        measure.update(horizon=None, evaluate_quality=False)
    elif space.objective == "throughput":  # samples/s is measured in the budget; the horizon is the profile's length
        measure.update(horizon=None)
    return {
        "base": space.base,
        "measure": measure,
        "evaluations": 1 if stage == "speed" else space.budget.evaluations,
        "limits": {tier: _limits(space, tier) for tier in tiers},
        "pruner": space.pruner,
        "run_dir": str(run_dir.resolve()),
        "stage": stage,
    }
