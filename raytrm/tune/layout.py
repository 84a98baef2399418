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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from raytrm import config as cfg
from raytrm.constants import RESOURCE_MACHINE, tier_resource
from raytrm.errors import ConfigError, UserError
from raytrm.schema import check_fields, check_version, read_json, spec
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
    if path.is_file():
        check_sqlite(path)
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


# -- the run's state and the files it keeps ---------------------------------------------------------------------

TUNE_SCHEMA_VERSION = 1
#: What to do with a tune.yaml that does not read: raytrm writes it, and the studies it names are the run's state.
DAMAGED = "tune.yaml is written by `raytrm tune`: restore it, or tune again into a new directory (--out NEW_DIR)"
SQLITE_MAGIC = b"SQLite format 3\x00"


@dataclass
class TuneState:
    """tune.yaml, as raytrm.tune.tuner writes it and every command on the run reads it."""

    raytrm_tune: int = spec(TUNE_SCHEMA_VERSION, "schema version", choices=(TUNE_SCHEMA_VERSION,))
    space_file: str | None = spec(None, "the space file the run started from")
    space: dict = spec({}, "the space as validated, with the trials asked for")
    tiers: list = spec([], "the tiers tuned; empty until the run reaches its studies")
    trials: int | None = spec(None, "trials per tier", ge=1)
    storage: str | None = spec(None, "the studies' Optuna storage, sqlite:///RUN_DIR/study.db")
    studies: dict = spec({}, "tier -> its study (its speed study in a staged run)")
    learning_study: str | None = spec(None, "a staged run's learning study, which its tiers share")
    lost_tiers: dict = spec({}, "tier -> {not_run, at, died}: tiers whose machines all left the cluster mid-run")

    def validate(self, source: str, prefix: str = "") -> None:
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, str) or not tier or tier in self.tiers[:i]:
                raise ConfigError(source, f"tiers[{i}]", tier, "a tier name, once", DAMAGED)
        for tier, name in self.studies.items():
            if not isinstance(tier, str) or not isinstance(name, str) or not name:
                raise ConfigError(source, f"studies.{tier}", name, "the name of the tier's study", DAMAGED)
        for tier, lost in self.lost_tiers.items():
            where = f"lost_tiers.{tier}"
            if not isinstance(lost, dict):
                raise ConfigError(source, where, lost, "a mapping: not_run, at, died", DAMAGED)
            check_fields(lost, source, {"not_run": "int", "at": "number", "died": "list"}, f"{where}.", fix=DAMAGED)
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in lost.get("died") or []):
                raise ConfigError(source, f"{where}.died", lost["died"], "a list of trial numbers", DAMAGED)
        if self.storage is not None and not self.storage.startswith("sqlite:///"):
            # Any other URL would have the run connect where its file says: a database server, not its own study.db.
            raise ConfigError(source, "storage", self.storage, f"sqlite:///RUN_DIR/{STUDY_DB}", DAMAGED)


def load_state(run_dir: Path) -> dict[str, Any]:
    """tune.yaml of a run at any point, checked against TuneState (the space itself is checked by run_space)."""
    path = run_dir / TUNE_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: not a tuning run (no {TUNE_FILE}); tune first with `raytrm tune --out {run_dir}`")
    state = cfg.read_yaml(path)
    check_version(
        state,
        str(path),
        "raytrm_tune",
        TUNE_SCHEMA_VERSION,
        DAMAGED,
        "tune again with this version into a new directory (--out NEW_DIR)",
    )
    try:
        cfg.from_dict(TuneState, state, str(path))
    except ConfigError as e:
        raise ConfigError(e.source, e.path, e.received, e.expected, e.fix or DAMAGED) from None
    return state


def read_state(run_dir: Path) -> dict[str, Any]:
    """tune.yaml of a run that reached its studies: the space, the tiers, the storage and the study names."""
    state = load_state(run_dir)
    path = run_dir / TUNE_FILE
    if not state.get("tiers"):
        raise UserError(f"{path}: the run never reached its studies; resume it with `raytrm tune --resume {run_dir}`")
    if not state.get("storage"):
        raise ConfigError(str(path), "storage", state.get("storage"), f"sqlite:///RUN_DIR/{STUDY_DB}", DAMAGED)
    missing = [tier for tier in state["tiers"] if tier not in state["studies"]]
    if missing:
        raise ConfigError(
            str(path), "studies", state["studies"], f"a study for each tier ({', '.join(missing)} has none)", DAMAGED
        )
    return state


def run_space(run_dir: Path, state: dict[str, Any]) -> SearchSpace:
    """The space a run was tuned with, as its tune.yaml keeps it."""
    if "space" not in state:
        raise ConfigError(str(run_dir / TUNE_FILE), "space", None, "the run's search space (a mapping)", DAMAGED)
    return space_from_dict(state["space"], f"{run_dir / TUNE_FILE}: space")


def study_db(state: dict[str, Any]) -> Path:
    """The SQLite file of a run's studies, checked to be one (a file of something else is one line, not a
    traceback from deep in the database driver)."""
    path = Path(state["storage"].removeprefix("sqlite:///"))
    if not path.is_file():
        raise UserError(
            f"{path}: no such file, yet tune.yaml keeps the run's studies there; restore it (or tune.yaml's storage, "
            "if the run directory moved), or tune again into a new directory (--out NEW_DIR)"
        )
    check_sqlite(path)
    return path


def check_sqlite(path: Path) -> None:
    """A study storage file is SQLite's (or empty, which SQLite takes for a new database)."""
    with path.open("rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head and head != SQLITE_MAGIC:
        raise UserError(
            f"{path}: not an SQLite database, yet it is where the run keeps its studies; it was replaced or "
            "damaged: restore it, or tune again into a new directory (--out NEW_DIR)"
        )


#: A trial's result (trials/, rates/, verify/): the fields raytrm reads of it and their kinds; null means not measured.
RESULT_FIELDS = {
    **dict.fromkeys(
        (
            "samples_per_sec",
            "tokens_per_sec",
            "peak_memory_mb",
            "predicted_memory_mb",
            "throughput_decay",
            "quality",
            "horizon_samples",
            "steps",
            "measure_seconds",
            "memory_budget_mb",
            "max_throughput_decay",
            "started_at",
            "ended_at",
        ),
        "number",
    ),
    **dict.fromkeys(
        ("status", "error", "thermal_max", "thermal_cap", "tier", "stage", "node_id", "node_address"), "str"
    ),
    **dict.fromkeys(("experiment", "hardware", "params", "speed", "speed_params", "eval"), "dict"),
    **dict.fromkeys(("curve", "health"), "list"),
    "trial": "int",
    "trial_number": "int",
}


def read_result(path: Path) -> dict[str, Any]:
    """A result a trial or a re-run kept in the run directory (JSON), its fields checked: damage is one line."""
    fix = f"a trial's result is written by `raytrm tune`: delete {path.name} to drop it, or restore it"
    result = read_json(path, fix)
    check_fields(result, str(path), RESULT_FIELDS, fix=fix)
    for i, point in enumerate(result.get("curve") or []):
        if not isinstance(point, dict):
            raise ConfigError(str(path), f"curve[{i}]", point, "a mapping: samples, quality, stderr, seconds", fix)
        check_fields(
            point,
            str(path),
            dict.fromkeys(("samples", "quality", "stderr", "seconds"), "number"),
            f"curve[{i}].",
            fix=fix,
        )
    return result


def check_kept(run_dir: Path) -> None:
    """Read every file a run keeps besides tune.yaml (the study storage, results, the sync record), so a resume
    refuses a damaged one before it runs anything, not at its export hours later."""
    if (run_dir / STUDY_DB).is_file():
        check_sqlite(run_dir / STUDY_DB)
    for folder in (TRIALS_DIR, RATES_DIR, VERIFY_DIR):
        for path in sorted((run_dir / folder).glob("*.json")):
            read_result(path)
    read_sync(run_dir)


def read_sync(run_dir: Path) -> dict[str, Any] | None:
    """sync.json: the link between a cluster's machines and the sync mode chosen from it; None on one machine."""
    path = run_dir / SYNC_FILE
    if not path.is_file():
        return None
    fix = f"it is written by `raytrm tune` on a cluster: delete {SYNC_FILE} to export without it, or restore it"
    record = read_json(path, fix)
    check_fields(record, str(path), {"mode": "str"}, required=("mode",), fix=fix)
    if record["mode"] not in cfg.SYNC_MODES[1:]:
        raise ConfigError(str(path), "mode", record["mode"], f"one of {', '.join(cfg.SYNC_MODES[1:])}", fix)
    local = record["mode"] == "local"
    check_fields(
        record, str(path), {"every": "int", "overlap": "int"}, required=("every", "overlap") if local else (), fix=fix
    )
    if local and (record["every"] < 1 or record["overlap"] < 0):
        raise ConfigError(
            str(path),
            "every",
            f"every={record['every']}, overlap={record['overlap']}",
            "a local round of every >= 1 steps and overlap >= 0",
            fix,
        )
    return record


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
