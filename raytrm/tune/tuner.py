"""`raytrm tune`: Optuna studies driven by Ray Tune, stored in the run directory, resumable.

A space with a horizon and the quality objective is tuned in stages (raytrm.tune.staged): a speed study per tier,
then one learning study that every tier's machines share, then each finished config timed on the other tiers. Any
other space has one study per tier, every knob in it.

After the searches each tier's pick is re-run on its machines (raytrm.tune.verify), exported as a profile
(raytrm.tune.profiles), printed as a table (raytrm.tune.tables) and plotted (raytrm.tune.plots); the run
directory's files are raytrm.tune.layout's.

Resume: the studies are the state; a staged run resumes each stage in order. A resumed driver records trials
whose result reached trials/ but not the study (its driver died between the two), marks trials that were still
running as FAIL (they are not rerun: a FAIL does not count and a new trial, with a new suggestion, replaces it), and
runs only what the requested count still needs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import optuna

from raytrm import config as cfg
from raytrm.distributed.cluster import alive_tiers, cluster_tiers, connect
from raytrm.errors import UserError
from raytrm.tune import objectives, staged
from raytrm.tune.layout import (
    SYNC_FILE,
    TRIALS_DIR,
    TUNE_FILE,
    check_kept,
    learning_study,
    load_state,
    open_storage,
    read_result,
    run_space,
    speed_study,
    stage_setup,
    staged_study,
    storage_url,
    study_name,
    trial_resources,
)
from raytrm.tune.plots import write_plots
from raytrm.tune.profiles import export_run
from raytrm.tune.search import completed_count, record
from raytrm.tune.space import SearchSpace, load_space
from raytrm.tune.studies import best_speed, running_trial
from raytrm.tune.tables import format_table
from raytrm.tune.verify import TierLeft, measure_rates, verify_best

logger = logging.getLogger(__name__)


def _prepare_data(space: SearchSpace) -> None:
    """Refuse missing data at the door; generate a dataset once here, before trials on this machine's nodes race to
    build it."""
    from raytrm.data.cache import dataset_dir_for
    from raytrm.families import family

    experiment = cfg.from_dict(cfg.ExperimentConfig, space.base, space.source, "base")
    family(experiment.model.name).require_data(experiment.data)
    if experiment.data.path:
        return
    try:
        dataset_dir_for(experiment.data)
    except Exception as e:  # trials will report the same problem with the trial's own config
        logger.warning("could not prepare the dataset here: %s", e)


def recover(study: optuna.Study, tier: str, run_dir: Path, objective: str, stage: str | None = None) -> None:
    """Finish the trials a dead driver left RUNNING: record a saved result, or mark FAIL (not rerun)."""
    from raytrm.tune.trial import result_name

    # WAITING trials (enqueued start points not yet asked for) stay queued: the next ask takes them.
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        saved = run_dir / TRIALS_DIR / result_name(stage, tier, t.number)
        if saved.is_file():
            record(study, running_trial(study, t), read_result(saved), objective)
            logger.info("trial %d of %s finished after its driver stopped: recorded its saved result", t.number, tier)
        else:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            logger.info(
                "trial %d of %s was cut off with its driver: marked failed, a new trial replaces it", t.number, tier
            )


def _state(
    run_dir: Path, space_file: str | None, resume: bool, base: dict[str, dict[str, Any]] | None = None
) -> tuple[SearchSpace, dict[str, Any]]:
    path = run_dir / TUNE_FILE
    if resume:
        if space_file or base:
            raise UserError("--resume continues the run's own space, model and data; drop --space and its settings")
        if not path.is_file():
            raise UserError(
                f"{run_dir}: not a tuning run (no {TUNE_FILE}); start one with `raytrm tune --out {run_dir}`"
            )
        state = load_state(run_dir)
        space = run_space(run_dir, state)
        check_kept(run_dir)
        return space, state
    if path.exists():
        raise UserError(f"{run_dir}: already holds a tuning run; continue it with `raytrm tune --resume {run_dir}`")
    space = load_space(space_file, base)
    return space, {"raytrm_tune": 1, "space_file": str(space.source), "space": space.to_dict()}


def run_tune(
    space_file: str | None = None,
    *,
    trials: int | None = None,
    out: str | None = None,
    resume: str | None = None,
    address: str | None = None,
    tiers: list[str] | None = None,
    base: dict[str, dict[str, Any]] | None = None,
    stream: TextIO | None = None,
) -> dict[str, Path]:
    """Tune every tier of the cluster (or `tiers`), verify each best setting and export a profile per tier. base:
    fields set over the space's base experiment (raytrm.tune.space.load_space)."""
    if trials is not None and trials < 1:
        raise UserError(f"--trials {trials}: expected a number of trials >= 1")
    stream = stream or sys.stdout
    run_dir = Path(resume or out or Path("runs") / time.strftime("tune-%Y%m%d-%H%M%S"))
    space, state = _state(run_dir, space_file, bool(resume), base)
    if trials:
        space.trials = trials
    owned = connect(address)
    try:
        available = cluster_tiers()
        wanted = tiers or state.get("tiers") or space.tiers or sorted(available)
        missing = [t for t in wanted if t not in available]
        if missing:
            raise UserError(
                f"tier(s) {', '.join(missing)} have no machine in the Ray cluster (it has: "
                f"{', '.join(sorted(available))}); start one, or tune the tiers present"
            )
        is_staged = staged.is_staged(space)
        state.update(
            tiers=wanted,
            trials=space.trials,
            storage=storage_url(run_dir),
            studies={t: speed_study(space, t) if is_staged else study_name(space, t) for t in wanted},
        )
        if is_staged:
            state["learning_study"] = learning_study(space)
        state["space"]["trials"] = space.trials
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.write_yaml(state, run_dir / TUNE_FILE)
        _prepare_data(space)
        machines = {t: available[t] for t in wanted}
        run = _run_staged if is_staged else _run_studies
        lost = run(space, run_dir, machines, stream)
        _record_lost(run_dir, state, lost)
        for tier in wanted:
            if tier in lost:  # no machine of a lost tier is left to verify on
                continue
            try:
                verify_best(run_dir, tier)
            except TierLeft as e:
                logger.warning("%s before its best setting was verified", e)
                lost[tier] = {"not_run": 0, "at": time.time(), "died": []}
                _record_lost(run_dir, state, lost)
        paths = export_run(run_dir)
        print(format_table(run_dir), file=stream)
        write_plots(run_dir)
        return paths
    finally:
        if owned:
            import ray

            ray.shutdown()


def _record_lost(run_dir: Path, state: dict[str, Any], lost: dict[str, dict[str, Any]]) -> None:
    """Tiers whose machines all left the cluster, kept in the run's state as soon as they are known."""
    if lost:
        state["lost_tiers"] = {**state.get("lost_tiers", {}), **lost}
        cfg.write_yaml(state, run_dir / TUNE_FILE)


def _run_staged(
    space: SearchSpace, run_dir: Path, machines: dict[str, int], stream: TextIO
) -> dict[str, dict[str, Any]]:
    """The three steps of raytrm.tune.staged: each tier's speed search, the shared learning search, then each
    config that reached the horizon timed on the tiers it did not train on."""
    lost = _run_studies(staged.speed_space(space), run_dir, machines, stream, stage="speed")
    fastest = {t: best_speed(run_dir, t) for t in machines if t not in lost}
    for tier in [t for t, best in fastest.items() if best is None]:
        logger.warning("tier %s: no speed setting fits its limits; it runs no learning trial and gets no profile", tier)
        del fastest[tier]
    if not fastest:
        return lost
    rates = {t: best["samples_per_sec"] for t, best in fastest.items()}
    _measure_sync(space, run_dir, machines, rates, stream)
    extras = {t: {"speed": best["params"], "stretch": staged.stretch(rates, t)} for t, best in fastest.items()}
    print(
        "learning search on "
        + ", ".join(f"{t} (x{extras[t]['stretch']:.2f} the horizon)" if extras[t]["stretch"] > 1 else t for t in extras)
        + " with each tier's fastest speed knobs",
        file=stream,
    )
    learning = staged.learning_space(space)
    lost |= _run_studies(learning, run_dir, {t: machines[t] for t in fastest}, stream, stage="learning", extras=extras)
    measure_rates(run_dir, [t for t in fastest if t not in lost])
    return lost


def _measure_sync(
    space: SearchSpace, run_dir: Path, machines: dict[str, int], rates: dict[str, float], stream: TextIO
) -> None:
    """On a cluster of several machines: measure the link between them and choose the sync mode and round length
    for the base experiment at the speed stage's rates; kept in sync.json for the profiles (a resumed run keeps it)."""
    from raytrm.distributed.cluster_link import choose_for_cluster, measure_cluster_link, model_bytes

    path = run_dir / SYNC_FILE
    if path.is_file() or sum(machines.values()) < 2:
        return
    base = cfg.from_dict(cfg.ExperimentConfig, space.base, space.source, "base")
    nbytes = model_bytes(cfg.to_dict(base))
    link = measure_cluster_link(nbytes)
    if link is None:
        return
    record = choose_for_cluster(link, nbytes, base.training.global_batch_size, rates, machines)
    cfg.write_text_atomic(json.dumps(record, indent=2), path)
    every = f" H={record['every']}" if record["every"] else ""
    print(f"sync between the machines: {record['mode']}{every} ({record['reason']})", file=stream)


def _run_studies(
    space: SearchSpace,
    run_dir: Path,
    machines: dict[str, int],
    stream: TextIO,
    stage: str | None = None,
    extras: dict[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every tier's study in one Tune run; returns the tiers whose machines all left, with what they missed.

    stage "learning" is one study shared by the tiers (any machine may run its trials, each with its tier's
    `extras`); otherwise each tier has its own study.
    """
    from ray import tune
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    from raytrm.tune.progress import TrialProgress
    from raytrm.tune.ray_search import ConstrainedOptunaSearch, PrunerStopper, TierSearcher
    from raytrm.tune.trial import tune_trainable

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(run_dir)
    shared = stage == "learning"
    searchers, remaining, opened = {}, {}, set()
    for i, tier in enumerate(machines):
        name = staged_study(space, tier, stage)
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            load_if_exists=True,
            directions=["maximize"] * len(objectives.metric_names(space.objective)),
        )
        if name not in opened:
            recover(study, tier, run_dir, space.objective, stage)
            if not study.trials:
                for point in space.start_with:
                    study.enqueue_trial(point)
            opened.add(name)
        remaining[tier] = max(0, space.trials - completed_count(study))
        # A new seed per attempt: a resumed study must not replay the first attempt's random start. Tiers that
        # share a study sample with seeds of their own.
        seed = space.seed + len(study.trials) + (1000 * i if shared else 0)
        searchers[tier] = ConstrainedOptunaSearch(space, tier, name, storage, seed=seed, extra=(extras or {}).get(tier))
    pool = min(remaining.values()) if shared and remaining else None
    total = pool if shared else sum(remaining.values())
    if not total:
        logger.info("every %s has its %d trials; nothing to run", "study" if shared else "tier", space.trials)
        return {}
    prefix = f"{stage}-" if stage else ""
    attempt = sum(1 for _ in (run_dir / "ray").glob(f"{prefix}attempt-*")) if (run_dir / "ray").is_dir() else 0
    setup = stage_setup(space, run_dir, list(machines), stage)
    trainable = tune.with_parameters(tune_trainable, setup=setup)
    trainable = tune.with_resources(trainable, lambda config: PlacementGroupFactory([trial_resources(config["tier"])]))
    what = f"{stage} search: " if stage else "tuning "
    counts = (
        f"{pool} trials to run on {', '.join(machines)}"
        if shared
        else ", ".join(f"{t} ({n} to run)" for t, n in remaining.items())
    )
    print(f"{what}{counts}: study {storage_url(run_dir)}", file=stream)
    # Tune's own tables would bury the one-line-per-trial view; the classic output engine at verbose 0 is silent.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Tune's JSON and CSV logs, without its TensorBoard logger, which warns at every curve (a list it cannot plot).
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    searcher = TierSearcher(searchers, remaining, machines, space.objective, machines_now=alive_tiers, pool=pool)
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=searcher,
            num_samples=total,
            reuse_actors=False,  # a fresh process per trial: inter-op threads and OMP settings apply once per process
        ),
        run_config=tune.RunConfig(
            name=f"{prefix}attempt-{attempt}",
            storage_path=str((run_dir / "ray").resolve()),
            verbose=0,
            stop=PrunerStopper(searcher) if space.pruner != "none" else None,
            callbacks=[TrialProgress(stream, space.objective), JsonLoggerCallback(), CSVLoggerCallback()],
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    tuner.fit()
    return {tier: {**info, "died": searcher.died[tier]} for tier, info in searcher.lost.items()}
