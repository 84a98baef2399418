"""Staged tuning to a horizon: the split of the knobs, the curve read at each tier's horizon, the pick per tier."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from raytrm.errors import ConfigError
from raytrm.tune import staged
from raytrm.tune.space import load_space, space_from_dict
from raytrm.tune.space_sections import Horizon

#: A curve measured on one machine: samples, seconds of training, quality (two rungs and the horizon of 60 s).
CURVE = [
    {"samples": 600, "seconds": 6.0, "quality": 0.80, "stderr": 0.004},
    {"samples": 2000, "seconds": 20.0, "quality": 0.90, "stderr": 0.003},
    {"samples": 6000, "seconds": 60.0, "quality": 0.95, "stderr": 0.002},
]


def test_quick_space_splits_into_a_speed_grid_per_tier_and_a_learning_grid():
    space = load_space("quick")
    assert staged.is_staged(space)
    speed, learning = staged.speed_space(space), staged.learning_space(space)
    assert set(speed.parsed) == {"training.micro_batch_size"} and set(learning.parsed) == {"model.L_cycles"}
    assert (speed.objective, speed.pruner, learning.objective) == ("throughput", "none", "quality")
    # Grids no larger than the trials are run point by point, each point once.
    assert speed.start_with == [{"training.micro_batch_size": 16}, {"training.micro_batch_size": 32}]
    assert learning.start_with == [{"model.L_cycles": n} for n in (1, 2, 3)] and learning.trials == 3


def test_a_grid_larger_than_the_trials_is_left_to_the_sampler_after_the_start_points():
    doc = load_space("horizon").to_dict()
    space = space_from_dict({**doc, "trials": 4, "start_with": [{"model.H_cycles": 1, "model.L_cycles": 2}]}, "<t>")
    learning = staged.learning_space(space)
    assert learning.trials == 4 and learning.start_with == [{"model.H_cycles": 1, "model.L_cycles": 2}]


def test_a_space_without_a_horizon_or_tuned_for_throughput_is_not_staged():
    assert not staged.is_staged(load_space("replay"))
    assert not staged.is_staged(load_space("transformer"))


def test_pareto_with_a_horizon_is_refused_with_the_fix(tmp_path):
    doc = {**load_space("quick").to_dict(), "objective": "pareto", "pruner": "none"}
    with pytest.raises(ConfigError, match="use objective: quality"):
        space_from_dict(doc, "pareto.yaml")


def test_a_slower_tier_trains_its_learning_trials_longer_by_its_speed_ratio_and_a_margin():
    rates = {"studio": 300.0, "air": 100.0}
    assert staged.stretch(rates, "studio") == 1.0
    assert staged.stretch(rates, "air") == pytest.approx(3.0 * staged.STRETCH_MARGIN)


def test_the_curve_is_read_at_the_horizon_on_its_own_clock_and_at_each_tiers_speed():
    horizon = Horizon(minutes=1)
    own = staged.at_horizon(CURVE, horizon)
    assert (own.quality, own.samples, own.extrapolated, own.stderr) == (0.95, 6000, False, 0.002)
    # A tier a third as fast gets to what the curve had after 20 s: its second point.
    slow = staged.at_horizon(CURVE, horizon, speed_ratio=1 / 3)
    assert slow.samples == pytest.approx(2000) and slow.quality == pytest.approx(0.90) and not slow.extrapolated
    # Half way between 6 s and 20 s in time is 1300 samples; quality is linear in log(samples) there.
    mid = staged.at_horizon(CURVE, horizon, speed_ratio=13 / 60)
    w = (math.log(1300) - math.log(600)) / (math.log(2000) - math.log(600))
    assert mid.samples == pytest.approx(1300) and mid.quality == pytest.approx(0.80 + w * 0.10)


def test_a_faster_tier_past_the_curve_is_extrapolated_and_flagged():
    fast = staged.at_horizon(CURVE, Horizon(minutes=1), speed_ratio=1.5)
    assert fast.extrapolated and fast.samples == pytest.approx(6000 + 30 * 100)  # the last stretch's 100 samples/s
    assert 0.95 < fast.quality <= 1.0


def test_a_horizon_in_samples_is_the_same_on_every_tier():
    for ratio in (0.5, 1.0, 2.0):
        at = staged.at_horizon(CURVE, Horizon(samples=2000), speed_ratio=ratio)
        assert (at.quality, at.samples, at.extrapolated) == (0.90, 2000, False)
    assert staged.at_horizon(CURVE, Horizon(samples=9000)).extrapolated


def trial(number, tier, curve, rate, **params):
    attrs = {
        "tier": tier,
        "curve": curve,
        "samples_per_sec": rate,
        "status": "ok",
        "peak_memory_mb": 100.0,
        "memory_budget_mb": 1000,
        "experiment": {"trained": tier},
    }
    return SimpleNamespace(number=number, params=params, user_attrs=attrs)


def scaled(curve, quality):
    return [{**p, "quality": q} for p, q in zip(curve, quality, strict=True)]


def test_each_tier_ranks_the_configs_by_what_they_reach_in_its_own_horizon():
    # Config 0 learns fast and stalls; config 1 starts slower and ends higher. On the tier where both were measured
    # (studio) 1 wins at the full horizon; on a tier a third as fast, which gets a third of the samples, 0 wins.
    fast_start = trial(0, "studio", scaled(CURVE, (0.85, 0.91, 0.92)), 100.0, H_cycles=1)
    slow_start = trial(1, "studio", scaled(CURVE, (0.70, 0.88, 0.96)), 100.0, H_cycles=3)
    on_air = {n: {"status": "ok", "samples_per_sec": 100 / 3, "experiment": {"trained": "air"}} for n in (0, 1)}
    studio = staged.candidates([fast_start, slow_start], {}, Horizon(minutes=1), "studio")
    air = staged.candidates([fast_start, slow_start], on_air, Horizon(minutes=1), "air")
    assert [c.trial for c in studio] == [1, 0] and [c.trial for c in air] == [0, 1]
    assert air[0].reached.quality == pytest.approx(0.91) and air[0].trained_on == "studio"
    assert air[0].experiment == {"trained": "air"}  # the profile runs what was timed on the tier


def test_a_config_over_a_tiers_memory_budget_there_ranks_after_every_one_that_fits():
    best = trial(0, "studio", scaled(CURVE, (0.9, 0.95, 0.99)), 100.0)
    fits = trial(1, "studio", CURVE, 100.0)
    over = {0: {"status": "ok", "samples_per_sec": 50.0, "peak_memory_mb": 3000.0, "memory_budget_mb": 1000}}
    over[1] = {"status": "ok", "samples_per_sec": 50.0, "peak_memory_mb": 300.0, "memory_budget_mb": 1000}
    ranked = staged.candidates([best, fits], over, Horizon(minutes=1), "air")
    assert [(c.trial, c.feasible) for c in ranked] == [(1, True), (0, False)]


def test_a_config_not_yet_timed_on_a_tier_is_left_out_there():
    assert staged.candidates([trial(0, "studio", CURVE, 100.0)], {}, Horizon(minutes=1), "air") == []


def test_a_config_that_does_not_fit_the_tiers_fastest_cut_is_timed_with_the_next():
    # Tier air's speed settings, fastest first; config 1 (wider) is over air's memory budget at micro-batch 32.
    options = [{"params": {"training.micro_batch_size": m}} for m in (32, 16, 8)]
    peaks = {(0, 32): 300.0, (1, 32): 1500.0, (1, 16): 800.0}
    submitted = []

    def submit(job, option):
        micro = option["params"]["training.micro_batch_size"]
        submitted.append((job, micro))
        return {
            "status": "ok",
            "samples_per_sec": 100.0,
            "peak_memory_mb": peaks[(job[1], micro)],
            "memory_budget_mb": 1000,
        }

    results = staged.time_with_fitting_speed({("air", 0): options, ("air", 1): options}, submit, lambda ref: ref)
    # One round with every job's fastest setting, then only the job that did not fit, with the next.
    assert submitted == [(("air", 0), 32), (("air", 1), 32), (("air", 1), 16)]
    assert results[("air", 1)]["speed_params"] == {"training.micro_batch_size": 16}
    assert results[("air", 0)]["speed_params"] == {"training.micro_batch_size": 32}


def test_a_config_that_fits_no_cut_keeps_its_last_try_and_ranks_as_not_fitting():
    options = [{"params": {"training.micro_batch_size": m}} for m in (32, 16, 8, 4)]
    over = {"status": "over_budget", "samples_per_sec": 0.0, "peak_memory_mb": 2000.0, "memory_budget_mb": 1000}
    calls = []
    results = staged.time_with_fitting_speed({"job": options}, lambda job, o: calls.append(o) or over, lambda r: r)
    assert len(calls) == staged.SPEED_TRIES and results["job"]["status"] == "over_budget"
