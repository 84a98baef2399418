"""Tuning run directories recorded without Ray: the studies, trial results and re-runs a driver would have left."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from raytrm import config as cfg
from raytrm.tune import layout
from raytrm.tune.params import suggest
from raytrm.tune.search import record
from raytrm.tune.space import build_experiment, space_from_dict

AIR, STUDIO = "macbook-air-8gb", "mac-desktop-16gb"
BASE = {
    "model": {"variant": "mlp_t", "hidden_size": 32, "L_layers": 1, "H_cycles": 1, "L_cycles": 1, "halt_max_steps": 2},
    "data": {"name": "sudoku", "train_puzzles": 200, "test_puzzles": 16, "augment": 0, "givens": 40},
    "training": {"global_batch_size": 16, "lr": 3.0e-3, "warmup_steps": 2, "threads": 1},
}
PARAMS = {
    "training.micro_batch_size": {"type": "categorical", "choices": [8, 16]},
    "model.L_cycles": {"type": "int", "low": 1, "high": 2},
}


def _result(space: Any, params: dict[str, Any], **figures: Any) -> dict[str, Any]:
    return {
        "status": "ok",
        "memory_budget_mb": 1000,
        "thermal_cap": "fair",
        "thermal_max": "unknown",
        "peak_memory_mb": 500.0,
        "experiment": cfg.to_dict(build_experiment(space.base, params)),
        **figures,
    }


def _tell(study: optuna.Study, space: Any, params: dict[str, Any], result: dict[str, Any], objective: str) -> None:
    study.enqueue_trial(params)
    trial = study.ask()
    suggest(trial, {name: space.parsed[name] for name in params})
    record(study, trial, result, objective)


def _state(run: Path, space: Any, tiers: list[str], studies: dict[str, str], **more: Any) -> None:
    state = {"raytrm_tune": 1, "space": space.to_dict(), "tiers": tiers, "storage": layout.storage_url(run)}
    cfg.write_yaml({**state, "studies": studies, **more}, run / layout.TUNE_FILE)


@pytest.fixture
def plain_run(tmp_path: Path) -> Path:
    """One study for tier AIR, no horizon: four trials, #3 the best, #2 the runner-up, #3 verified."""
    return make_plain_run(tmp_path)


def make_plain_run(tmp_path: Path) -> Path:
    run = tmp_path / "plain"
    run.mkdir()
    space = space_from_dict({"raytrm_space": 1, "name": "plain", "base": BASE, "params": PARAMS}, "<test>")
    study = optuna.create_study(storage=layout.storage_url(run), study_name="plain-air", direction="maximize")
    for number in range(4):
        params = {"training.micro_batch_size": 8 if number % 2 else 16, "model.L_cycles": 1 + number % 2}
        result = _result(space, params, quality=0.5 + 0.1 * number, samples_per_sec=100.0 + number)
        _tell(study, space, params, result, "quality")
    _state(run, space, [AIR], {AIR: "plain-air"})
    verified = {"trial": 3, "status": "ok", "samples_per_sec": 99.0, "peak_memory_mb": 480.0, "quality": 0.75}
    (run / layout.VERIFY_DIR).mkdir()
    (run / layout.VERIFY_DIR / f"{AIR}.json").write_text(json.dumps(verified))
    return run


def curve(qualities: list[float], rate: float) -> list[dict[str, Any]]:
    """Evaluations at 16, 32 and 64 samples, at `rate` samples/s."""
    points = zip((16, 32, 64), qualities, strict=True)
    return [{"samples": s, "quality": q, "stderr": 0.01, "seconds": s / rate} for s, q in points]


@pytest.fixture
def staged_run(tmp_path: Path) -> Path:
    """A staged run over AIR and STUDIO, horizon 64 samples: both learning configs trained on STUDIO, timed on AIR
    (config 1 with AIR's second speed setting there); STUDIO's pick verified."""
    return make_staged_run(tmp_path)


def copy_run(template: Path, tmp_path: Path) -> Path:
    """A copy of a run directory made once, with tune.yaml's storage pointing at the copy's own study.db."""
    import shutil

    run = Path(shutil.copytree(template, tmp_path / template.name))
    state = cfg.read_yaml(run / layout.TUNE_FILE)
    state["storage"] = layout.storage_url(run)
    cfg.write_yaml(state, run / layout.TUNE_FILE)
    return run


def make_staged_run(tmp_path: Path) -> Path:
    doc = {"raytrm_space": 1, "name": "tiny", "base": BASE, "params": PARAMS, "horizon": {"samples": 64}}
    space = space_from_dict(doc, "<test>")
    run = tmp_path / "staged"
    run.mkdir()
    storage = layout.storage_url(run)
    for tier, rates in ((AIR, (80.0, 120.0)), (STUDIO, (300.0, 400.0))):
        name = layout.speed_study(space, tier)
        study = optuna.create_study(storage=storage, study_name=name, direction="maximize")
        for micro, rate in zip((8, 16), rates, strict=True):
            params = {"training.micro_batch_size": micro}
            _tell(study, space, params, _result(space, params, samples_per_sec=rate), "throughput")
    learning = optuna.create_study(storage=storage, study_name=layout.learning_study(space), direction="maximize")
    for depth, qualities in ((1, [0.3, 0.4, 0.5]), (2, [0.2, 0.4, 0.6])):
        params = {"model.L_cycles": depth}
        result = _result(
            space, {**params, "training.micro_batch_size": 16}, quality=qualities[-1], samples_per_sec=400.0 / depth
        )
        _tell(learning, space, params, {**result, "tier": STUDIO, "curve": curve(qualities, 400.0 / depth)}, "quality")
    for number, speed in ((0, 16), (1, 8)):
        params = {"model.L_cycles": number + 1, "training.micro_batch_size": speed}
        rate = _result(space, params, samples_per_sec=60.0, peak_memory_mb=700.0)
        rate["speed_params"] = {"training.micro_batch_size": speed}
        (run / layout.RATES_DIR).mkdir(exist_ok=True)
        (run / layout.RATES_DIR / f"{AIR}-{number}.json").write_text(json.dumps(rate))
    studies = {tier: layout.speed_study(space, tier) for tier in (AIR, STUDIO)}
    _state(run, space, [AIR, STUDIO], studies, learning_study=layout.learning_study(space))
    verified = {"trial": 1, "status": "ok", "samples_per_sec": 190.0, "peak_memory_mb": 520.0}
    (run / layout.VERIFY_DIR).mkdir()
    (run / layout.VERIFY_DIR / f"{STUDIO}.json").write_text(json.dumps(verified))
    return run
