"""Re-runs of chosen settings on a tier's own machines (Ray connected), each in a fresh process as a trial has.

- verification: before export, each tier's pick is re-run for the space's verification window; the result is kept
  in verify/TIER.json, and the profile and the run's table show it beside the trial's figures.
- rates (a staged run's third step): each learning config that reached the horizon is timed on every tier it did
  not train on, with that tier's speed settings; kept in rates/TIER-N.json.

A re-run waits for its result only while its tier has a machine in the cluster: Ray would hold a task for a tier with
none left (or the resubmission of a result lost with its machine) forever.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.distributed.cluster import alive_tiers
from raytrm.tune import staged
from raytrm.tune.layout import VERIFY_DIR, read_result, read_state, run_space, stage_setup, trial_resources
from raytrm.tune.studies import ranked, rate_path, reached_horizon, speed_options, staged_candidates

logger = logging.getLogger(__name__)

#: How often a re-run's wait looks for its result and for its tier's machines.
POLL_S = 2.0


class TierLeft(RuntimeError):
    """The tier's last machine left the cluster while a re-run waited for it."""


def _remote(fn: Any, tier: str) -> Any:
    """fn as a Ray task on one machine unit of the tier, in a fresh process, as the trial had."""
    import ray

    resources = {k: v for k, v in trial_resources(tier).items() if k != "CPU"}
    return ray.remote(num_cpus=1, resources=resources, max_calls=1)(fn)


def result_on_tier(
    ref: Any, tier: str, machines_now: Callable[[], dict[str, int]] = alive_tiers, poll_s: float = POLL_S
) -> dict[str, Any]:
    """The result of a re-run on the tier; a failed result where it raised or its machine died under it (Ray retries
    it on another of the tier's machines first). TierLeft, the task cancelled, once the tier has no machine left."""
    import ray

    while True:
        done, _ = ray.wait([ref], timeout=poll_s)
        if done:
            try:
                return ray.get(ref)
            except ray.exceptions.RayError as e:
                cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e  # what the re-run raised
                name, first = type(cause).__name__, next(iter(str(cause).strip().splitlines()), "")
                return {"status": "failed", "error": f"{name}: {first}" if first else name}
        if not machines_now().get(tier):
            ray.cancel(ref, force=True)
            raise TierLeft(f"tier {tier}: its last machine left the cluster")


def measure_rates(run_dir: Path, tiers: list[str]) -> None:
    """Time each learning config that reached the horizon on every tier it did not train on (Ray connected), with
    that tier's fastest speed knobs that fit it there (staged.time_with_fitting_speed): short runs, kept in
    rates/TIER-N.json (a resumed run keeps what is there)."""
    from raytrm.tune.trial import run_trial

    space = run_space(run_dir, read_state(run_dir))
    setup = stage_setup(space, run_dir, tiers, "speed")
    jobs, trials = {}, {t.number: t for t in reached_horizon(run_dir)}
    for tier in tiers:
        options = speed_options(run_dir, tier)
        for number, trial in trials.items():
            if options and trial.user_attrs.get("tier") != tier and not rate_path(run_dir, tier, number).is_file():
                jobs[(tier, number)] = options

    def submit(job: tuple[str, int], option: dict[str, Any]) -> Any:
        tier, number = job
        config = {"tier": tier, "trial_number": number, "params": dict(trials[number].params)}
        return tier, _remote(run_trial, tier).remote({**config, "speed": option["params"]}, setup)

    def wait(submitted: tuple[str, Any]) -> dict[str, Any]:
        tier, ref = submitted
        try:
            return result_on_tier(ref, tier)
        except TierLeft as e:  # recorded, and the other tiers' runs go on
            return {"status": "failed", "error": str(e)}

    for (tier, number), result in staged.time_with_fitting_speed(jobs, submit, wait).items():
        path = rate_path(run_dir, tier, number)
        path.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text_atomic(json.dumps(result, default=str), path)
        logger.info("%s: %.1f samples/s (%s)", path.name, result.get("samples_per_sec") or 0, result.get("status"))


def verify_best(run_dir: Path, tier: str) -> dict[str, Any] | None:
    """Re-run the tier's best settings on one of its machines (Ray must be connected); kept in verify/<tier>.json.
    TierLeft where the tier's last machine left the cluster first."""
    from raytrm.tune.trial import measure

    if read_state(run_dir).get("learning_study"):
        return _verify_staged(run_dir, tier)
    best, space, _ = ranked(run_dir, tier)
    if not best:
        return None
    attrs = best[0].user_attrs
    ref = _remote(measure, tier).remote(
        attrs["experiment"],
        memory_budget_mb=attrs.get("memory_budget_mb"),
        thermal_cap=attrs.get("thermal_cap"),
        # The verification re-measures speed, memory and heat in the verification window; with a horizon the trial's
        # quality is the one reached there, which a shorter run does not re-measure.
        **{**space.measure_args(space.verify_s), "horizon": None},
    )
    result = result_on_tier(ref, tier)
    return _keep(run_dir, tier, result, best[0].number)


def _verify_staged(run_dir: Path, tier: str) -> dict[str, Any] | None:
    """Re-run the tier's pick (best learning config, the tier's speed knobs) for the verification window."""
    from raytrm.tune.trial import run_trial

    choices, speed = staged_candidates(run_dir, tier)
    feasible = [c for c in choices if c.feasible]
    if not feasible or speed is None:
        return None
    space = run_space(run_dir, read_state(run_dir))
    setup = stage_setup(space, run_dir, [tier], "speed")
    setup["measure"]["measure_s"] = space.verify_s
    best = feasible[0]
    # The speed settings it was timed with there: the tier's fastest, or the next that fit it.
    config = {"tier": tier, "trial_number": best.trial, "params": best.params}
    config["speed"] = best.rate.get("speed_params") or speed["params"]
    return _keep(run_dir, tier, result_on_tier(_remote(run_trial, tier).remote(config, setup), tier), best.trial)


def _keep(run_dir: Path, tier: str, result: dict[str, Any], trial: int) -> dict[str, Any]:
    result["trial"] = trial
    path = run_dir / VERIFY_DIR / f"{tier}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    return result


def verification(run_dir: Path, tier: str) -> dict[str, Any] | None:
    """The tier's kept verification re-run (its result and the trial it re-ran); None where none ran."""
    path = run_dir / VERIFY_DIR / f"{tier}.json"
    return read_result(path) if path.is_file() else None
