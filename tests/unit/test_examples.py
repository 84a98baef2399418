"""Every example config validates, so the README's commands work as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrm import config as cfg

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_validates(path):
    experiment = cfg.load(cfg.ExperimentConfig, path)
    assert experiment.training.steps or experiment.training.time_budget_s


def test_there_are_examples():
    assert EXAMPLES
