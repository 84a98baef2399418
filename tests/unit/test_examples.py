"""Every example config and search space validates (and the benchmarks' own spaces), so the README's, the
examples' and docs/performance.md's commands work as written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raytrm import config as cfg
from raytrm.tune.space import load_space

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = ROOT / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.rglob("*.yaml")) + sorted((ROOT / "benchmarks").glob("*.yaml"))


def _is_space(path: Path) -> bool:
    data = yaml.safe_load(path.read_text())
    return isinstance(data, dict) and "raytrm_space" in data


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_config_validates(path):
    if _is_space(path):
        # A space of your own Hugging Face model takes the model and records from the command line.
        hf = (yaml.safe_load(path.read_text()).get("base") or {}).get("model", {}).get("name") == "hf"
        space = load_space(path, {"model": {"path": "model"}, "data": {"path": "records.csv"}} if hf else None)
        assert space.params and space.trials
        return
    experiment = cfg.load(cfg.ExperimentConfig, path)
    assert experiment.training.steps or experiment.training.time_budget_s


def test_there_are_examples():
    assert EXAMPLES
    assert any(_is_space(p) for p in EXAMPLES) and not all(_is_space(p) for p in EXAMPLES)
