"""The sampler with constraints, driven directly (no Ray) through the tuner's own code path: suggest + record.

The injected trial has a known shape: quality peaks at micro_batch 16, H_cycles 2, lr 3e-3; memory grows with the
micro-batch and H_cycles, and the budget cuts off micro_batch 64 (and 32 at H_cycles 4): 30% of the grid. The
constrained search must find the best feasible point and waste fewer trials on infeasible ones
as it learns the boundary.
"""

from __future__ import annotations

import logging
import math

import optuna
import pytest

from raytrm.tune import objectives
from raytrm.tune.search import make_sampler, optimize, record
from raytrm.tune.space import space_from_dict

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = {
    "raytrm_space": 1,
    "base": {"model": {"hidden_size": 32}, "training": {"global_batch_size": 64}},
    "params": {
        "training.micro_batch_size": {"type": "categorical", "choices": [4, 8, 16, 32, 64]},
        "model.H_cycles": {"type": "int", "low": 1, "high": 4},
        "training.lr": {"type": "log", "low": 1.0e-4, "high": 1.0e-1},
    },
    "trials": 40,
    "startup_trials": 8,
}
BUDGET_MB = 1000


def fake_trial(params):
    mb, h, lr = params["training.micro_batch_size"], params["model.H_cycles"], params["training.lr"]
    peak = 200 + mb * (10 + 4 * h)
    quality = 0.9 - 0.05 * abs(math.log2(mb / 16)) - 0.06 * abs(h - 2) - 0.08 * abs(math.log10(lr / 3e-3))
    status = "ok"
    if peak > BUDGET_MB:  # the trial stops as over budget: it measured no quality
        quality, status = 0.0, "over_budget"
    return {
        "quality": quality,
        "samples_per_sec": 10.0 * mb / (1 + h),
        "peak_memory_mb": peak,
        "status": status,
        "memory_budget_mb": BUDGET_MB,
        "thermal_max": "unknown",
        "thermal_cap": "fair",
        "throughput_decay": 0.0,
        "max_throughput_decay": 0.3,
    }


def feasible(params):
    return fake_trial(params)["status"] == "ok"


def run(seed, sampler="tpe", trials=40):
    space = space_from_dict({**SPACE, "sampler": sampler, "trials": trials}, "<test>")
    study = optuna.create_study(direction="maximize", sampler=make_sampler(space, seed))
    optimize(study, space.parsed, fake_trial, trials, "quality")
    return study


def test_record_sets_constraints_and_measurements():
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    trial.suggest_int("x", 1, 3)
    cons = record(
        study,
        trial,
        {
            **fake_trial({"training.micro_batch_size": 64, "model.H_cycles": 4, "training.lr": 1e-3}),
            "experiment": {"a": 1},
        },
        "quality",
    )
    frozen = study.trials[0]
    assert frozen.state == optuna.trial.TrialState.COMPLETE
    assert frozen.constraints == cons and cons["memory"] > 0 and cons["failed"] == 0
    assert frozen.user_attrs["status"] == "over_budget" and frozen.user_attrs["experiment"] == {"a": 1}
    assert objectives.best_trials(study, "quality") == []


def test_a_crashing_trial_is_an_infeasible_point_not_a_gap():
    study = optuna.create_study(direction="maximize")
    space = space_from_dict(SPACE, "<test>")

    def crash(params):
        raise RuntimeError("killed")

    optimize(study, space.parsed, crash, 2, "quality")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert all(t.constraints["failed"] == 1 for t in study.trials)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_finds_the_feasible_optimum(seed):
    study = run(seed)
    best = objectives.best_trials(study, "quality")[0]
    assert feasible(best.params)
    assert best.values[0] >= 0.9 - 0.05, best.params


def test_infeasible_trials_become_rarer():
    # Over seeds, the second half of each study proposes fewer over-budget configs than the first.
    first = second = 0
    for seed in range(8):
        trials = run(seed).trials
        bad = [not objectives.is_feasible(t.constraints) for t in trials]
        first += sum(bad[: len(bad) // 2])
        second += sum(bad[len(bad) // 2 :])
    logging.getLogger(__name__).info("infeasible: first half %d, second half %d", first, second)
    assert second < first * 0.6, (first, second)  # measured: 25 -> 7


def test_pareto_pick_rule():
    points = [[0.9, 50.0], [0.8, 100.0], [0.85, 95.0], [0.7, 60.0]]
    assert objectives.pareto_front(points) == [0, 1, 2]
    # best throughput 100; within 10%: points 1 and 2; highest quality among them: 2
    assert objectives.pick(points, "pareto", 0.1)[:2] == [2, 1]
    assert objectives.pick(points, "pareto", 0.5)[0] == 0
    assert objectives.pick([[1.0], [3.0], [2.0]], "quality") == [1, 2, 0]


def test_constraints_of_heat_and_decay():
    base = {"memory_budget_mb": 100, "peak_memory_mb": 50, "max_throughput_decay": 0.2, "thermal_cap": "fair"}
    assert objectives.is_feasible(objectives.constraints({**base, "thermal_max": "unknown", "throughput_decay": 0.1}))
    assert objectives.constraints({**base, "thermal_max": "serious"})["thermal"] == 1
    assert objectives.constraints({**base, "throughput_decay": 0.5})["decay"] == pytest.approx(0.3)
    assert objectives.constraints({**base, "peak_memory_mb": 150})["memory"] == pytest.approx(0.5)


def test_the_pruner_stops_trials_that_fall_behind_at_an_intermediate_evaluation():
    from raytrm.tune.search import completed_count, make_pruner

    space = space_from_dict({**SPACE, "pruner": "median", "budget": {"evaluations": 3}}, "<test>")

    def learning_curve(params):
        # Quality grows over the window towards the fake trial's final quality; the curve's order is its end's.
        result = fake_trial(params)
        result["intermediate"] = [(k, result["quality"] * k / 3) for k in (1, 2)]
        return result

    study = optuna.create_study(direction="maximize", sampler=make_sampler(space, 0), pruner=make_pruner(space))
    optimize(study, space.parsed, learning_curve, 30, space.objective)
    pruned = study.get_trials(states=(optuna.trial.TrialState.PRUNED,))
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert pruned and completed_count(study) == 30
    # A pruned trial keeps its intermediate evaluations and its constraints, and was behind when it stopped.
    finals = sorted(t.value for t in complete if objectives.is_feasible(t.constraints))
    median_final = finals[len(finals) // 2]
    for t in pruned:
        assert t.intermediate_values and set(t.constraints) == set(objectives.CONSTRAINTS)
        assert fake_trial(t.params)["quality"] < median_final
    # The best point is still found among the trials that ran to the end.
    assert max(finals) > 0.8


def test_a_pruner_needs_a_single_objective_and_intermediate_evaluations():
    from raytrm.errors import ConfigError

    with pytest.raises(ConfigError, match="pruner: got 'median', expected none for a pareto study"):
        space_from_dict({**SPACE, "pruner": "median", "objective": "pareto", "budget": {"evaluations": 2}}, "<t>")
    with pytest.raises(ConfigError, match=r"budget.evaluations: got 1, expected 2 or more with pruner median"):
        space_from_dict({**SPACE, "pruner": "median"}, "<t>")
