"""The names in a tuning run directory and what each trial of a search is handed."""

from __future__ import annotations

from raytrm.constants import RESOURCE_MACHINE, tier_resource
from raytrm.tune import layout
from raytrm.tune.space import space_from_dict

SPACE = {
    "raytrm_space": 1,
    "name": "s",
    "params": {"model.H_cycles": {"type": "int", "low": 1, "high": 2}},
    "budget": {"warmup_s": 1, "measure_s": 2, "evaluations": 2},
    "limits": {"memory_budget_mb": 2048, "tiers": {"macbook-air-8gb": {"thermal_cap": "serious"}}},
    "horizon": {"samples": 64},
}


def test_study_names_per_tier_and_stage():
    space = space_from_dict(SPACE, "<test>")
    assert layout.staged_study(space, "t", None) == layout.study_name(space, "t") == "s-t"
    assert layout.staged_study(space, "t", "speed") == layout.speed_study(space, "t") == "s-t-speed"
    assert layout.staged_study(space, "t", "learning") == layout.learning_study(space) == "s-learning"


def test_a_trial_holds_one_machine_unit_of_its_tier():
    assert layout.trial_resources("t") == {"CPU": 1, RESOURCE_MACHINE: 1, tier_resource("t"): 1}


def test_each_stage_hands_its_trials_the_measurement_it_needs(tmp_path):
    space = space_from_dict(SPACE, "<test>")
    learning = layout.stage_setup(space, tmp_path, ["macbook-air-8gb"], "learning")
    assert learning["measure"]["horizon"] == {"samples": 64} and learning["evaluations"] == 2
    assert learning["limits"] == {"macbook-air-8gb": {"memory_budget_mb": 2048, "thermal_cap": "serious"}}
    assert learning["run_dir"] == str(tmp_path.resolve()) and learning["stage"] == "learning"
    speed = layout.stage_setup(space, tmp_path, ["macbook-air-8gb"], "speed")
    assert speed["measure"]["horizon"] is None and speed["measure"]["evaluate_quality"] is False
    assert speed["evaluations"] == 1
    throughput = layout.stage_setup(space_from_dict({**SPACE, "objective": "throughput"}, "<t>"), tmp_path, [])
    assert throughput["measure"]["horizon"] is None and "evaluate_quality" not in throughput["measure"]
