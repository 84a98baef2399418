"""Learning curves in samples, the horizon of a space, and the methods replayed on a curve table."""

from __future__ import annotations

import math
import statistics

import pytest

from raytrm import config as cfg
from raytrm.bench.tune import _extrapolated, replay_horizon
from raytrm.errors import ConfigError
from raytrm.train.tasks import _standard_error
from raytrm.train.trainer import Trainer
from raytrm.tune.curves import is_speed_knob, learning_curve, quality_at, rungs
from raytrm.tune.space import space_from_dict
from raytrm.tune.trial import _evaluate


def test_rungs_are_whole_batches_a_factor_apart_up_to_the_horizon():
    assert rungs(2700, 32, count=4, eta=3) == [96, 288, 896, 2688]
    assert rungs(2700, 32, count=4, eta=3, extra=[500]) == [96, 288, 512, 896, 2688]
    assert rungs(10, 32) == [32]  # at least one global batch


def test_quality_between_points_is_linear_in_log_samples_and_unknown_beyond():
    points = [{"samples": 100, "quality": 0.5}, {"samples": 10_000, "quality": 0.7}]
    assert quality_at(points, 1000) == pytest.approx(0.6)
    assert quality_at(points, 50) == 0.5
    assert quality_at(points, 10_000) == 0.7
    assert quality_at(points, 20_000) is None


def test_speed_knobs_are_the_ones_that_leave_the_update_alone():
    assert is_speed_knob("training.micro_batch_size") and is_speed_knob("training.threads")
    assert not is_speed_knob("model.H_cycles") and not is_speed_knob("training.lr")


def test_curve_points_equal_training_that_many_samples_and_evaluating(tiny):
    config = tiny(training={"threads": 1})
    curve = learning_curve(cfg.to_dict(config), [64, 160], quality_metric="eval_cell_acc", eval_puzzles=32)
    assert [p["samples"] for p in curve["points"]] == [64, 160]
    assert curve["samples_per_sec"] > 0
    reference = Trainer(config)
    for _ in range(5):  # 160 samples = 5 steps of 32
        reference.train_step()
    expected = _evaluate(reference, config, reference.micro_batch, 32, "eval_cell_acc")
    assert curve["points"][1]["quality"] == expected["quality"]
    assert curve["points"][1]["stderr"] == expected["eval"]["eval_cell_acc_se"] > 0


def test_standard_error_is_the_sample_deviation_over_root_n():
    values = [0.2, 0.9, 0.55, 0.7, 0.31]
    expected = statistics.stdev(values) / math.sqrt(len(values))
    got = _standard_error(sum(values), sum(v * v for v in values), len(values))
    assert got == pytest.approx(expected)


def test_horizon_is_minutes_or_samples_not_both():
    base = {"raytrm_space": 1, "params": {"model.H_cycles": {"type": "int", "low": 1, "high": 2}}}
    space = space_from_dict({**base, "horizon": {"minutes": 3}}, "<test>")
    assert space.horizon.samples_at(100.0, fallback_s=15) == 18_000
    assert space_from_dict({**base, "horizon": {"samples": 5000}}, "<t>").horizon.samples_at(100.0, 15) == 5000
    assert space_from_dict(base, "<t>").horizon.samples_at(100.0, 15) == 1500  # none: the trial's own budget
    with pytest.raises(ConfigError, match=r"<test>: horizon: .*expected one of minutes or samples"):
        space_from_dict({**base, "horizon": {"minutes": 3, "samples": 10}}, "<test>")


def curve(rate, qualities, horizon=2700, batch=32, short=0.1):
    """A table row whose rungs sit at 1/27, 1/9, 1/3 and 1 of its horizon, plus the short trial's point."""
    at = rungs(horizon, batch, extra=[round(short * horizon)])
    return {
        "params": {"q": qualities[-1]},
        "samples_per_sec": rate,
        "horizon_samples": at[-1],
        "short_samples": max(batch, round(short * horizon / batch) * batch),
        "points": [{"samples": s, "quality": q} for s, q in zip(at, qualities, strict=True)],
    }


def test_replay_exposes_short_horizon_bias_and_the_prediction_avoids_it():
    # Points at 1/27, short (1/10), 1/9, 1/3 and the horizon. "fast" leads early and flattens; "deep" starts lower
    # and keeps climbing (the shape measured for H1 L1 against H3 L3); "poor" is worse throughout.
    rows = [
        curve(400, [0.60, 0.62, 0.63, 0.70, 0.72]),  # fast
        curve(150, [0.35, 0.47, 0.50, 0.65, 0.80]),  # deep
        curve(300, [0.45, 0.50, 0.51, 0.55, 0.58]),  # poor
    ]
    out = replay_horizon(rows, seeds=5)
    methods = out["methods"]
    assert out["optimum"] == 0.80 and out["optimum_params"] == {"q": 0.80}
    assert methods["short budget (today)"]["params"] == {"q": 0.72}
    assert methods["halving by quality so far"]["params"] == {"q": 0.72}
    assert methods["raytrm (halving by predicted horizon quality)"]["params"] == {"q": 0.80}
    assert methods["raytrm (halving by predicted horizon quality)"]["fraction"] == 1.0
    # 3 configs for 1/9 of the horizon, 1 on to the horizon: 3/9 + 8/9.
    assert methods["raytrm (halving by predicted horizon quality)"]["cost"] == pytest.approx(3 / 9 + 8 / 9)


def test_extrapolation_follows_the_log_slope_and_stays_in_bounds():
    points = [{"samples": 100, "quality": 0.5}, {"samples": 1000, "quality": 0.6}]
    assert _extrapolated(points, 10_000) == pytest.approx(0.7)
    noisy = [*points, {"samples": 10_000, "quality": 0.72}]  # least squares: slope 0.11 per decade, through the mean
    assert _extrapolated(noisy, 100_000) == pytest.approx(0.6067 + 0.11 * 2, abs=1e-3)
    assert _extrapolated(points, 10**30) == 1.0
    falling = [{"samples": 100, "quality": 0.6}, {"samples": 1000, "quality": 0.5}]
    assert _extrapolated(falling, 10_000) == 0.5
