"""Learning curves in samples: rungs, reading and extrapolating a curve, and measuring one."""

from __future__ import annotations

import math
import statistics

import pytest

from raytrm import config as cfg
from raytrm.families.task import standard_error
from raytrm.train.run.evaluations import evaluate_quality
from raytrm.train.trainer import Trainer
from raytrm.tune.curves import extrapolate, is_speed_knob, learning_curve, quality_at, rungs


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


@pytest.mark.slow
def test_curve_points_equal_training_that_many_samples_and_evaluating(tiny):
    config = tiny(training={"threads": 1})
    curve = learning_curve(cfg.to_dict(config), [64, 160], quality_metric="eval_cell_acc", eval_puzzles=32)
    assert [p["samples"] for p in curve["points"]] == [64, 160]
    assert curve["samples_per_sec"] > 0
    reference = Trainer(config)
    for _ in range(5):  # 160 samples = 5 steps of 32
        reference.train_step()
    expected = evaluate_quality(reference, 32, "eval_cell_acc")
    assert curve["points"][1]["quality"] == expected["quality"]
    assert curve["points"][1]["stderr"] == expected["eval"]["eval_cell_acc_se"] > 0


def test_standard_error_is_the_sample_deviation_over_root_n():
    values = [0.2, 0.9, 0.55, 0.7, 0.31]
    expected = statistics.stdev(values) / math.sqrt(len(values))
    got = standard_error(sum(values), sum(v * v for v in values), len(values))
    assert got == pytest.approx(expected)


def test_extrapolation_follows_the_log_slope_and_stays_in_bounds():
    points = [{"samples": 100, "quality": 0.5}, {"samples": 1000, "quality": 0.6}]
    assert extrapolate(points, 10_000) == pytest.approx(0.7)
    noisy = [*points, {"samples": 10_000, "quality": 0.72}]  # least squares: slope 0.11 per decade, through the mean
    assert extrapolate(noisy, 100_000) == pytest.approx(0.6067 + 0.11 * 2, abs=1e-3)
    assert extrapolate(points, 10**30) == 1.0
    falling = [{"samples": 100, "quality": 0.6}, {"samples": 1000, "quality": 0.5}]
    assert extrapolate(falling, 10_000) == 0.5
