"""The bench's own measurements: the samples a config sees in a horizon, and a tuned profile run against the tier
defaults side by side (tiny budget)."""

from __future__ import annotations

import json

from benchmarks.cli import main
from benchmarks.tune_measure import horizon_samples
from raytrm import config as cfg
from raytrm.tune.space import build_experiment, load_space, space_from_dict


def test_the_samples_a_config_sees_in_the_horizon():
    base = {"raytrm_space": 1, "params": {"model.H_cycles": {"type": "int", "low": 1, "high": 2}}}
    space = space_from_dict({**base, "horizon": {"minutes": 3}}, "<test>")
    assert horizon_samples(space.horizon, 100.0, fallback_s=15) == 18_000
    assert horizon_samples(space_from_dict({**base, "horizon": {"samples": 5000}}, "<t>").horizon, 100.0, 15) == 5000
    assert horizon_samples(space_from_dict(base, "<t>").horizon, 100.0, 15) == 1500  # none: the trial's own budget


def test_a_profile_is_compared_with_the_tier_defaults_side_by_side(tmp_path, capsys):
    space = load_space("quick")
    tuned = build_experiment(space.base, {"training.micro_batch_size": 16, "model.H_cycles": 1})
    limits = cfg.Limits(memory_budget_mb=4096)
    profile = cfg.Profile(tier="t", model=tuned.model, data=tuned.data, training=tuned.training, limits=limits)
    path = cfg.write_yaml(cfg.to_dict(profile), tmp_path / "p.yaml")
    quick = tmp_path / "quick.yaml"
    doc = cfg.read_yaml(load_space("quick").source)
    doc["budget"] = {"warmup_s": 0.2, "measure_s": 0.5, "eval_puzzles": 16, "evaluations": 2}
    doc["horizon"] = {"samples": 96}  # both sides train as long, three steps, and are judged there
    cfg.write_yaml(doc, quick)
    out_json = tmp_path / "out.json"
    assert main(["tune", "--space", str(quick), "--profile", str(path), "--repeats", "1", "--json", str(out_json)]) == 0
    out = json.loads(out_json.read_text())
    for side in ("tier defaults", "tuned profile"):
        (run,) = out["runs"][side]
        assert run["status"] == "ok" and run["samples_per_sec"] > 0 and 0 <= run["quality"] <= 1
    assert "tuned / defaults: quality x" in capsys.readouterr().out
