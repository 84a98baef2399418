"""The methods replayed on a learning-curve table at the horizon, and a profile's rank in the table."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from benchmarks.tune_horizon import format_rank, rank_profile, replay_horizon, truncated
from raytrm.errors import UserError
from raytrm.tune.curves import rungs
from raytrm.tune.space import space_from_dict


def curve(h, rate, qualities, horizon=2700, batch=32, short=0.1):
    """A table row for H_cycles h whose rungs sit at 1/27, 1/9, 1/3 and 1 of its horizon, plus the short trial's
    point (at a tenth of it)."""
    at = rungs(horizon, batch, extra=[round(short * horizon)])
    return {
        "params": {"model.H_cycles": h},
        "samples_per_sec": rate,
        "horizon_samples": at[-1],
        "short_samples": max(batch, round(short * horizon / batch) * batch),
        "points": [{"samples": s, "quality": q} for s, q in zip(at, qualities, strict=True)],
    }


def space(trials: int, evaluations: int = 3):
    return space_from_dict(
        {
            "raytrm_space": 1,
            "params": {"model.H_cycles": {"type": "int", "low": 1, "high": 3}},
            "budget": {"evaluations": evaluations},
            "pruner": "successive_halving",
            "horizon": {"minutes": 3},
            "trials": trials,
        },
        "<test>",
    )


def test_replay_exposes_short_horizon_bias():
    # Points at 1/27, the short trial (1/10), 1/9, 1/3 and the horizon. H1 leads early and flattens; H3 starts lower
    # and keeps climbing (the shape measured for H1 L1 against H3 L3), passing H1 before a third of the horizon;
    # H2 is worse throughout.
    rows = [
        curve(1, 400, [0.60, 0.62, 0.63, 0.66, 0.72]),
        curve(3, 150, [0.35, 0.47, 0.50, 0.68, 0.80]),
        curve(2, 300, [0.45, 0.50, 0.51, 0.55, 0.58]),
    ]
    out = replay_horizon(rows, space(trials=6), seeds=5)
    methods = out["methods"]
    assert out["optimum"] == 0.80 and out["optimum_params"] == {"model.H_cycles": 3}
    assert methods["short budget (no horizon)"]["params"] == {"model.H_cycles": 1}
    assert methods["successive halving by quality so far"]["params"] == {"model.H_cycles": 1}
    # Each config for a tenth of the horizon (the short trial), rounded to batches: 256 / 2688 samples each.
    assert methods["short budget (no horizon)"]["cost"] == pytest.approx(3 * 256 / 2688)
    # Every config to a ninth, the best on to the horizon: 3/9 + 8/9.
    assert methods["successive halving by quality so far"]["cost"] == pytest.approx(3 / 9 + 8 / 9)
    tuned = methods["raytrm tune, 6 trials to the horizon, pruned at 1/9 and 1/3 (median of 5 seeds)"]
    assert 1 <= tuned["cost"] < 6 and 0 < tuned["fraction"] <= 1
    # The space's other evaluation plans beside it: without pruning every trial costs a whole horizon.
    assert methods["raytrm tune, 6 trials to the horizon, no pruning (median of 5 seeds)"]["cost"] == 6
    assert "raytrm tune, 6 trials to the horizon, pruned at 1/3 (median of 5 seeds)" in methods


def test_raytrm_replay_finds_the_optimum_when_the_lead_holds_and_its_cost_counts_the_rungs():
    rows = [
        curve(1, 400, [0.30, 0.40, 0.42, 0.50, 0.60]),
        curve(2, 300, [0.40, 0.50, 0.52, 0.60, 0.70]),
        curve(3, 150, [0.50, 0.60, 0.62, 0.70, 0.80]),
    ]
    out = replay_horizon(rows, space(trials=9), seeds=5)
    tuned = out["methods"]["raytrm tune, 9 trials to the horizon, pruned at 1/9 and 1/3 (median of 5 seeds)"]
    assert tuned["fraction"] == 1.0 and tuned["optimum_found"] == 5
    # At least one trial reaches the horizon; every pruned one costs a ninth or a third.
    assert 1 < tuned["cost"] < 9 and (tuned["cost"] * 9) == pytest.approx(round(tuned["cost"] * 9))
    # Random search trained to the horizon gets as many horizons as raytrm's median cost.
    (random_name,) = [n for n in out["methods"] if n.startswith("random")]
    assert out["methods"][random_name]["cost"] == math.ceil(tuned["cost"])


def test_a_third_of_the_horizon_is_the_table_up_to_its_third_rung():
    row = curve(1, 400, [0.60, 0.62, 0.63, 0.66, 0.72])
    (third,) = truncated([row], 1 / 3)
    assert [p["quality"] for p in third["points"]] == [0.60, 0.62, 0.63, 0.66]
    assert third["horizon_samples"] == 896


def test_a_profile_is_ranked_among_the_tables_configs_at_its_own_horizon():
    rows = [
        curve(1, 400, [0.60, 0.62, 0.63, 0.66, 0.72]),  # first at a third of the horizon, last at all of it
        curve(3, 150, [0.35, 0.47, 0.50, 0.64, 0.80]),
        curve(2, 300, [0.45, 0.50, 0.51, 0.65, 0.78]),
    ]

    def profile(h, minutes):
        return SimpleNamespace(
            model=SimpleNamespace(H_cycles=h),
            training=SimpleNamespace(time_budget_s=minutes * 60),
            measured=SimpleNamespace(objective={"horizon": {"minutes": minutes}}),
        )

    at_full = rank_profile(rows, 3.0, profile(3, 3.0))
    assert at_full["rank"] == 1 and [r["params"]["model.H_cycles"] for r in at_full["order"]] == [3, 2, 1]
    at_third = rank_profile(rows, 3.0, profile(3, 1.0))
    assert at_third["rank"] == 3 and at_third["order"][0]["quality"] == 0.66
    assert "the profile's config is 3 of 3" in format_rank(at_third)
    with pytest.raises(UserError, match="the table reaches 3 and 1: compare a profile tuned for one of those"):
        rank_profile(rows, 3.0, profile(3, 2.0))
    # Only the configs the profile's space could pick compete: here none searched, so the profile's own alone.
    assert rank_profile(rows, 3.0, profile(1, 1.0), searched=set())["order"] == [
        {"params": {"model.H_cycles": 1}, "quality": 0.66, "stderr": None}
    ]
