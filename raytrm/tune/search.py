"""The sampler, and how a trial's measurements reach it: one code path for Ray Tune, the tests and the bench replay.

`record` turns a result into objective values plus optuna 5 constraints (trial.set_constraint, value <= 0
feasible) and tells the study; TPE and GP read the constraints and learn the boundary of the feasible region. Ray Tune
drives the study through raytrm.tune.ray_search (an OptunaSearch whose on_trial_complete calls `record` instead of
a bare tell, so an out-of-memory, killed or overheated trial is a COMPLETE trial with a violated constraint, never a
FAIL the sampler ignores). This module needs no Ray.
"""

from __future__ import annotations

import json
import logging
import random
import warnings
from collections.abc import Callable
from typing import Any

import optuna

from raytrm.tune import objectives
from raytrm.tune.curves import HORIZON_ETA
from raytrm.tune.params import ParamSpec, grid_points, grid_size, suggest
from raytrm.tune.space import SearchSpace, horizon_of

logger = logging.getLogger(__name__)

#: Result keys kept on the optuna trial (user attributes), so export needs only the study.
KEPT = (
    "status",
    "error",
    "samples_per_sec",
    "tokens_per_sec",
    "peak_memory_mb",
    "predicted_memory_mb",
    "thermal_max",
    "throughput_decay",
    "quality",
    "horizon_samples",
    "curve",
    "steps",
    "measure_seconds",
    "memory_budget_mb",
    "thermal_cap",
    "max_throughput_decay",
    "eval",
    "health",
    "tier",
    "experiment",
    "hardware",
    "node_id",
    "node_address",
    "started_at",
    "ended_at",
)


#: The largest grid whose points the sampler keeps track of, to draw no point twice.
MAX_GRID = 4096


def make_sampler(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    """The space's sampler; TPE and GP use the trials' constraints (optuna 5 reads trial.constraints). On a grid
    (every parameter discrete) it never proposes a point already tried while untried ones remain."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if space.sampler == "random":
            sampler = optuna.samplers.RandomSampler(seed=seed)
        elif space.sampler == "gp":
            sampler = optuna.samplers.GPSampler(seed=seed, n_startup_trials=space.n_startup)
        else:
            sampler = optuna.samplers.TPESampler(
                seed=seed, n_startup_trials=space.n_startup, multivariate=True, constant_liar=True
            )
    size = grid_size(space.parsed)
    if not space.parsed or not size or size > MAX_GRID:
        return sampler
    return NoRepeats(sampler, space.parsed, grid_points(space.parsed), seed)


def _distribution(p: ParamSpec) -> optuna.distributions.BaseDistribution:
    if p.type == "categorical":
        return optuna.distributions.CategoricalDistribution(p.choices)
    return optuna.distributions.IntDistribution(int(p.low), int(p.high), log=p.log, step=int(p.step or 1))


class NoRepeats(optuna.samplers.BaseSampler):
    """A sampler over a grid that proposes no point already tried, running or pruned, while untried ones remain.

    TPE samples a small grid with replacement: on the quick space's nine learning configs it spends a third of six
    trials on repeats, which say nothing a new point would not. This wraps the space's sampler: its proposal stands
    unless it repeats a point, which is then replaced by an untried point drawn at random. Start points enqueued
    by start_with are taken as given (optuna fixes them before any sampler is asked).
    """

    def __init__(
        self, inner: optuna.samplers.BaseSampler, params: dict[str, ParamSpec], grid: list[dict[str, Any]], seed: int
    ) -> None:
        self.inner, self.grid = inner, grid
        self.distributions = {name: _distribution(p) for name, p in params.items()}
        self.rng = random.Random(seed)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()
        self.rng = random.Random()

    def infer_relative_search_space(
        self, study: optuna.Study, trial: optuna.trial.FrozenTrial
    ) -> dict[str, optuna.distributions.BaseDistribution]:
        return dict(self.distributions)  # every parameter is decided at once, so the point is known whole

    def sample_relative(
        self, study: optuna.Study, trial: optuna.trial.FrozenTrial, search_space: dict[str, Any]
    ) -> dict[str, Any]:
        own = self.inner.infer_relative_search_space(study, trial)
        point = dict(self.inner.sample_relative(study, trial, own)) if own else {}
        for name, distribution in self.distributions.items():
            if name not in point:
                point[name] = self.inner.sample_independent(study, trial, name, distribution)
        tried = [
            t.params
            for t in study.get_trials(deepcopy=False)
            if t.number != trial.number and t.state != optuna.trial.TrialState.FAIL
        ]
        if point in tried:
            untried = [p for p in self.grid if p not in tried]
            if untried:
                point = self.rng.choice(untried)
        return point

    def sample_independent(
        self, study: optuna.Study, trial: optuna.trial.FrozenTrial, param_name: str, param_distribution: Any
    ) -> Any:
        return self.inner.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.inner.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, state: Any, values: Any) -> None:
        self.inner.after_trial(study, trial, state, values)


def make_pruner(space: SearchSpace) -> optuna.pruners.BasePruner:
    """The space's pruner: it decides at a trial's intermediate evaluations whether the trial goes on."""
    if space.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=space.n_startup)
    if space.pruner == "successive_halving" and horizon_of(space):
        # Evaluations at 1/9, 1/3 and all of the horizon are numbered 1, 3 and 9: the best third goes on at each.
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=HORIZON_ETA)
    if space.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    return optuna.pruners.NopPruner()


def directions(objective: str) -> list[str]:
    return ["maximize"] * len(objectives.metric_names(objective))


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return json.loads(json.dumps(value, default=str))


def record(
    study: optuna.Study, trial: optuna.Trial, result: dict[str, Any], objective: str, pruned: bool = False
) -> dict[str, float]:
    """Set the result's constraints and measurements on the trial and tell the study; returns the constraints.

    A pruned trial is told as PRUNED: the samplers rank it by its last intermediate evaluation.
    """
    cons = objectives.constraints(result)
    for key, value in cons.items():
        trial.set_constraint(key, value)
    for key in KEPT:
        if result.get(key) is not None:
            trial.set_user_attr(key, _jsonable(result[key]))
    if pruned:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return cons
    values = objectives.objective_values(result, objective)
    study.tell(trial, values if len(values) > 1 else values[0])
    return cons


def failed_result(result: dict[str, Any] | None, why: str) -> dict[str, Any]:
    """A result for a trial that died before it reported: what it last said, status failed, worst objectives."""
    out = dict(result or {})
    out["status"] = "failed"
    out.setdefault("error", why)
    return out


def should_stop(trial: optuna.Trial, value: float, evaluation: int) -> bool:
    """Report an intermediate evaluation of the objective; True when the study's pruner stops the trial there."""
    trial.report(value, evaluation)
    return trial.should_prune()


def optimize(
    study: optuna.Study, params: dict[str, ParamSpec], fn: Callable[[dict], dict], n_trials: int, objective: str
) -> None:
    """Run n trials of fn in this process: ask, suggest, measure, record (the tests' and the replay's loop).

    A result may carry "intermediate": [(evaluation, value), ...], the objective at evaluations before the end;
    the study's pruner sees them in order, as it does in a Ray trial, and may stop the trial at one.
    """
    for _ in range(n_trials):
        trial = study.ask()
        values = suggest(trial, params)
        try:
            result = fn(values)
        except Exception as exc:  # the same rule as in a Ray trial: a crash is an infeasible point, not a gap
            result = failed_result(None, f"{type(exc).__name__}: {exc}")
        pruned = any(should_stop(trial, value, step) for step, value in result.get("intermediate", ()))
        record(study, trial, result, objective, pruned=pruned)


def completed_count(study: optuna.Study) -> int:
    """Trials that count toward the requested number: COMPLETE, feasible or not (failed ones are COMPLETE too),
    and PRUNED (stopped early by the pruner)."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=states))
