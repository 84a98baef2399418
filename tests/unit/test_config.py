"""Configs: defaults, YAML round trip, and one clear line for every kind of bad file."""

from __future__ import annotations

import dataclasses

import pytest

from raytrm import __version__, config
from raytrm.config import ExperimentConfig, ModelConfig, Profile, TrainConfig
from raytrm.errors import ConfigError, UserError


def test_every_field_has_a_description():
    for cls in (
        ModelConfig,
        config.DataConfig,
        TrainConfig,
        ExperimentConfig,
        Profile,
        config.Limits,
        config.Measured,
        config.HardwareSummary,
    ):
        for name, doc in config.describe(cls).items():
            assert doc, f"{cls.__name__}.{name} has no description"


def test_profile_round_trips_through_yaml(tmp_path):
    profile = config.from_dict(
        Profile,
        {
            "tier": "macbook-pro-16gb",
            "hardware": {
                "chip": "Apple M2 Pro",
                "memory_gb": 16,
                "device": "mps",
                "performance_cores": 8,
                "efficiency_cores": 4,
            },
            "model": {"variant": "mlp_t", "hidden_size": 256, "H_cycles": 3, "L_cycles": 4},
            "training": {
                "global_batch_size": 256,
                "micro_batch_size": 32,
                "grad_accum_steps": 8,
                "threads": 8,
            },
            "limits": {"memory_budget_mb": 12000, "thermal_cap": "fair"},
            "measured": {"samples_per_sec": 41.2, "peak_memory_mb": 9350, "objective": {"exact_acc": 0.5}},
        },
        "p.yaml",
    )
    path = config.write_yaml(profile, tmp_path / "p.yaml")
    again = config.load_profile(path)
    assert again == profile
    assert again.training.micro_batch == 32
    assert isinstance(again.hardware.memory_gb, float)


def test_micro_batch_follows_from_accumulation():
    t = config.from_dict(TrainConfig, {"global_batch_size": 96, "grad_accum_steps": 3})
    assert t.micro_batch == 32


def test_write_yaml_is_atomic_and_leaves_no_temp_files(tmp_path):
    config.write_yaml(ExperimentConfig(), tmp_path / "c.yaml")
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]
    assert config.load(ExperimentConfig, tmp_path / "c.yaml") == ExperimentConfig()


BAD_FILES = {
    # kind: (file text, pieces the one line must contain)
    "malformed": ("model:\n  hidden_size: [\n", ["malformed YAML", "line 3"]),
    "unknown key": (
        "model:\n  hiden_size: 128\n",
        ["model.hiden_size", "unknown field", "did you mean 'hidden_size'"],
    ),
    "wrong type": ("model:\n  hidden_size: big\n", ["model.hidden_size", "got 'big'", "expected an integer"]),
    "out of range": ("training:\n  lr: -0.1\n", ["training.lr", "got -0.1", "a value > 0"]),
    "infinite": ("training:\n  lr: .inf\n", ["training.lr", "got inf", "expected a finite number"]),
    "not a number": ("training:\n  weight_decay: .nan\n", ["training.weight_decay", "got nan", "a finite number"]),
    "bad choice": ("model:\n  variant: transformerish\n", ["model.variant", "one of attention, mlp_t"]),
    "bool for int": ("training:\n  steps: true\n", ["training.steps", "got True", "an integer or null"]),
    "inconsistent batch": (
        "training:\n  global_batch_size: 64\n  micro_batch_size: 10\n  grad_accum_steps: 4\n",
        ["training.micro_batch_size", "got 10", "= global_batch_size (64)", "fix:"],
    ),
    "not a mapping": ("- 1\n- 2\n", ["(top level)", "a mapping"]),
    "section not a mapping": ("model: 5\n", ["model", "got 5", "a mapping"]),
    "heads do not divide": (
        "model:\n  variant: attention\n  pos_encodings: rope\n  hidden_size: 100\n  num_heads: 8\n",
        ["model.num_heads", "a divisor of hidden_size 100"],
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_config_gives_one_clear_line(tmp_path, kind):
    text, pieces = BAD_FILES[kind]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        config.load(ExperimentConfig, path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    for piece in pieces:
        assert piece in message


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        config.load(ExperimentConfig, tmp_path / "nope.yaml")


def test_profile_needs_its_schema_version(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("tier: x\n")
    with pytest.raises(ConfigError, match=r"raytrm_profile.*raytrm export"):
        config.load_profile(path)
    path.write_text("raytrm_profile: 2\ntier: x\n")
    with pytest.raises(UserError) as newer:
        config.load_profile(path)
    assert str(newer.value) == (
        f"{path}: raytrm_profile 2 is newer than this raytrm ({__version__}) reads (1); upgrade raytrm (`pip install "
        "-U raytrm`), or export the profile again with this version (`raytrm export RUN_DIR`)"
    )
    for version in ("'1'", "0", "-3", "1.0", "true", "null"):
        path.write_text(f"raytrm_profile: {version}\ntier: x\n")
        with pytest.raises(
            ConfigError,
            match=r"raytrm_profile: got .*, expected a schema version, a whole number >= 1 "
            r"\(this raytrm reads 1\); fix: set raytrm_profile: 1, or export the profile again",
        ):
            config.load_profile(path)


def test_unknown_profile_field_is_an_error(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("raytrm_profile: 1\ntier: x\nmeasured:\n  samples_per_second: 3\n")
    with pytest.raises(UserError, match=r"measured.samples_per_second: unknown field; did you mean 'samples_per_sec'"):
        config.load_profile(path)


def test_configs_are_plain_dataclasses():
    assert dataclasses.asdict(ExperimentConfig())["training"]["betas"] == [0.9, 0.95]
    a, b = TrainConfig(), TrainConfig()
    a.betas.append(1)
    assert b.betas == [0.9, 0.95], "mutable defaults must not be shared"


def test_fields_apply_to_their_family_only():
    with pytest.raises(
        ConfigError, match=r"model.H_cycles: got 4, expected no value: it applies to trm, not transformer"
    ):
        config.from_dict(ExperimentConfig, {"model": {"name": "transformer", "H_cycles": 4}, "data": {"name": "text"}})
    with pytest.raises(ConfigError, match=r"data.givens: .* applies to sudoku, not maze"):
        config.from_dict(ExperimentConfig, {"data": {"name": "maze", "givens": 30}})
    assert "seq_len" in config.model_fields("transformer") and "seq_len" not in config.model_fields("trm")


def test_written_configs_hold_only_the_fields_that_apply_and_read_back_equal(tmp_path):
    trm = ExperimentConfig()
    written = config.to_dict(trm)
    assert "seq_len" not in written["model"] and "H_cycles" in written["model"]
    assert "text_field" not in written["data"] and "givens" in written["data"]
    text = config.from_dict(ExperimentConfig, {"model": {"name": "transformer"}, "data": {"name": "text"}})
    assert "H_cycles" not in config.to_dict(text)["model"] and "givens" not in config.to_dict(text)["data"]
    for experiment in (trm, text):
        path = config.write_yaml(config.to_dict(experiment), tmp_path / "c.yaml")
        assert config.load(ExperimentConfig, path) == experiment


def test_config_errors_survive_pickling_as_ray_workers_send_them():
    import pickle

    from raytrm.errors import ConfigError

    error = ConfigError("run.yaml", "training.lr", -1, "a value > 0", "give a positive learning rate")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ConfigError and str(again) == str(error)
