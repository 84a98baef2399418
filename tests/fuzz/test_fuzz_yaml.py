"""Fuzzing the YAML surfaces: training configs, tune space files and profiles.

Property: loading a file either gives a valid object (one that raytrm writes back and reads again to the same text)
or refuses it with a UserError of one line; `raytrm validate FILE` exits 0, or 2 with one line on stderr.
"""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given
from mutations import (
    FUZZ,
    FUZZ_EXAMPLES,
    Counter,
    check_cli_refusal,
    load_or_refusal,
    run_cli,
    yaml_files,
)

from raytrm import config as cfg
from raytrm.constants import spaces_dir
from raytrm.tune.space import SearchSpace, load_space, space_from_dict

pytestmark = pytest.mark.slow

CONFIG = {
    "model": {"name": "trm", "variant": "mlp_t", "hidden_size": 64, "L_layers": 1, "H_cycles": 2, "L_cycles": 2},
    "data": {"name": "sudoku", "train_puzzles": 100, "test_puzzles": 10, "augment": 2, "givens": 40},
    "training": {
        "global_batch_size": 32,
        "micro_batch_size": 16,
        "grad_accum_steps": 2,
        "lr": 3.0e-3,
        "betas": [0.9, 0.95],
        "warmup_steps": 5,
        "steps": 100,
        "memory_budget_mb": 4096,
        "thermal_cap": "fair",
        "seed": 3,
    },
}

# What `raytrm tune` exports (raytrm.tune.profiles.build_profile), trimmed to a tiny model.
PROFILE = {
    "raytrm_profile": 1,
    "tier": "generic-linux-24gb",
    "hardware": {
        "chip": "Apple M2 Pro",
        "model": "Mac14,9",
        "memory_gb": 16.0,
        "device": "mps",
        "performance_cores": 8,
        "efficiency_cores": 4,
    },
    "model": CONFIG["model"],
    "data": CONFIG["data"],
    "training": {**CONFIG["training"], "threads": 8, "interop_threads": 2, "dataloader_workers": 0},
    "limits": {"memory_budget_mb": 12000, "thermal_cap": "fair"},
    "measured": {
        "samples_per_sec": 41.2,
        "peak_memory_mb": 9350.0,
        "thermal_max": "nominal",
        "objective": {
            "quality": 0.61,
            "objective": "quality",
            "quality_reached": 0.55,
            "throughput_decay": 0.02,
            "horizon": {"minutes": 30},
            "verify_samples_per_sec": 40.8,
        },
        "trial": 7,
        "study": "quick-generic @ sqlite:///runs/tune/study.db",
    },
}


def _round_trips(cls: type, obj: object, source: str) -> None:
    """An accepted file is written back as raytrm writes it, and that text reads back to the same text."""
    text = cfg.dump_yaml(obj)
    again = cfg.from_dict(cls, yaml.safe_load(text), source)
    assert cfg.dump_yaml(again) == text


def _validate_agrees(path, loaded: object | None, kind: str) -> bool:
    """`raytrm validate` exits 0 or 2 with one line; on a file it reads as `kind`, it agrees with the library."""
    code, out, err = run_cli(["validate", str(path)])
    if code == 0:
        assert err == "" and (out.startswith("#") or "valid tier table" in out), (out, err)
    else:
        check_cli_refusal(code, err)
    try:
        data = yaml.safe_load(path.read_bytes())
    except Exception:  # not YAML at all: validate must have refused it
        return code == 2
    read_as = "training config"
    if isinstance(data, dict) and "raytrm_tiers" in data:
        read_as = "tier table"
    elif isinstance(data, dict) and "raytrm_profile" in data:
        read_as = "profile"
    return read_as != kind or (code == 0) == (loaded is not None)


def test_training_configs(tmp_path):
    counter = Counter("training configs")
    path = tmp_path / "config.yaml"

    @FUZZ
    @given(yaml_files(CONFIG))
    def prop(content: bytes) -> None:
        path.write_bytes(content)
        loaded, error = load_or_refusal(cfg.load, cfg.ExperimentConfig, path)
        if loaded is not None:
            assert isinstance(loaded, cfg.ExperimentConfig)
            _round_trips(cfg.ExperimentConfig, loaded, str(path))
        assert _validate_agrees(path, loaded, "training config")
        counter.add(error is not None)

    prop()
    print(counter.report())
    assert counter.ran >= FUZZ_EXAMPLES


def test_profiles(tmp_path):
    counter = Counter("profiles")
    path = tmp_path / "profile.yaml"
    assert cfg.from_dict(cfg.Profile, PROFILE)  # the seed itself is valid

    @FUZZ
    @given(yaml_files(PROFILE))
    def prop(content: bytes) -> None:
        path.write_bytes(content)
        loaded, error = load_or_refusal(cfg.load_profile, path)
        if loaded is not None:
            assert isinstance(loaded, cfg.Profile)
            _round_trips(cfg.Profile, loaded, str(path))
        assert _validate_agrees(path, loaded, "profile")
        counter.add(error is not None)

    prop()
    print(counter.report())
    assert counter.ran >= FUZZ_EXAMPLES


def test_tune_spaces(tmp_path, tiers_read_once):
    counter = Counter("tune spaces")
    # quick.yaml with every optional section filled, so edits reach them too.
    seed = yaml.safe_load((spaces_dir() / "quick.yaml").read_text())
    seed.update(
        tiers=["macbook-air-8gb", "generic-linux-24gb"],
        start_with=[{"training.micro_batch_size": 16, "model.L_cycles": 2}],
        horizon={"minutes": 30},
        pareto={"throughput_slack": 0.1},
        startup_trials=3,
    )
    seed["params"]["training.lr"] = {"type": "float", "low": 1.0e-3, "high": 1.0e-2, "log": True}
    seed["params"]["training.warmup_steps"] = {"type": "int", "low": 0, "high": 20, "step": 5}
    seed["limits"].update(memory_budget_mb=4096, tiers={"macbook-air-8gb": {"memory_budget_mb": 3000}})
    assert space_from_dict(seed, "<seed>")
    path = tmp_path / "space.yaml"

    @FUZZ
    @given(yaml_files(seed))
    def prop(content: bytes) -> None:
        path.write_bytes(content)
        loaded, error = load_or_refusal(load_space, path)
        if loaded is not None:
            assert isinstance(loaded, SearchSpace) and loaded.parsed
            again = space_from_dict(loaded.to_dict(), str(path))
            assert cfg.dump_yaml(again.to_dict()) == cfg.dump_yaml(loaded.to_dict())
        counter.add(error is not None)

    prop()
    print(counter.report())
    assert counter.ran >= FUZZ_EXAMPLES
