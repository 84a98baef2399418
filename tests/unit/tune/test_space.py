"""Space files: the shipped ones load; every kind of bad file is one line naming the file, field and fix."""

from __future__ import annotations

import pytest
import yaml

from raytrm.cli import main
from raytrm.errors import ConfigError, UserError
from raytrm.tune.space import build_experiment, load_space, space_from_dict

BASE = {
    "model": {"hidden_size": 32, "L_layers": 1},
    "data": {"name": "sudoku"},
    "training": {"global_batch_size": 32},
}


def write(tmp_path, **fields):
    doc = {
        "raytrm_space": 1,
        "base": BASE,
        "params": {"training.micro_batch_size": {"type": "categorical", "choices": [8, 16, 32]}},
    }
    doc.update(fields)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("name", ["quick", "sudoku", "maze", "transformer"])
def test_shipped_spaces_load(name):
    space = load_space(name)
    assert space.name == name and space.parsed and space.trials >= 1


def test_build_experiment_keeps_the_global_batch():
    exp = build_experiment(BASE, {"training.micro_batch_size": 8, "model.H_cycles": 3})
    assert (exp.training.global_batch_size, exp.training.micro_batch_size, exp.training.grad_accum_steps) == (32, 8, 4)
    exp = build_experiment(
        {**BASE, "training": {"global_batch_size": 32, "micro_batch_size": 16, "grad_accum_steps": 2}},
        {"training.grad_accum_steps": 4},
    )
    assert exp.training.micro_batch == 8 and exp.training.global_batch_size == 32


@pytest.mark.parametrize(
    "params, piece",
    [
        (
            {"training.micro_batchsize": {"type": "int", "low": 1, "high": 4}},
            "params.training.micro_batchsize: got 'training.micro_batchsize', expected a field of training; "
            "fix: did you mean training.micro_batch_size?",
        ),
        ({"model.H_cycles": {"type": "int", "low": 4, "high": 2}}, "low=4, high=2', expected low < high"),
        ({"model.H_cycles": {"type": "int", "low": 3, "high": 3}}, "the range is empty"),
        ({"training.threads": {"type": "categorical", "choices": []}}, "expected at least two values"),
        ({"model.seq_len": {"type": "int", "low": 64, "high": 128}}, "expected a field that applies to trm models"),
        ({"data.givens": {"type": "int", "low": 20, "high": 40}}, "fix them in base.data"),
        ({"training.steps": {"type": "int", "low": 1, "high": 9}}, "the budget section sets the run length"),
        (
            {"training.micro_batch_size": {"type": "int", "low": 8, "high": 32}},
            "params.training.micro_batch_size: got 9, expected values that build a valid experiment "
            "(training.micro_batch_size: expected micro_batch_size x grad_accum_steps (3) = global_batch_size (32))",
        ),
        (
            {"model.H_cycles": {"type": "int", "low": 0, "high": 2}},
            "params.model.H_cycles: got 0, expected values that build a valid experiment",
        ),
        ({"training.lr": {"type": "log", "low": 0.0, "high": 0.1}}, "low > 0 and no step for a log scale"),
        ({"training.lr": {"type": "float", "low": 0.1, "hgh": 0.2}}, "hgh: unknown field; did you mean 'high'?"),
    ],
)
def test_bad_params_are_one_clear_line(tmp_path, capsys, params, piece):
    path = write(tmp_path, params=params)
    with pytest.raises(UserError) as e:
        load_space(path)
    assert str(path) in str(e.value) and piece in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_tier_and_malformed_yaml_exit_2(tmp_path, capsys):
    path = write(tmp_path, limits={"tiers": {"macbook-air-9gb": {"memory_budget_mb": 4000}}})
    assert main(["tune", "--space", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "limits.tiers.macbook-air-9gb" in err[0] and "tiers.yaml" in err[0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("raytrm_space: 1\nparams: [\n")
    assert main(["tune", "--space", str(bad)]) == 2
    assert "malformed YAML" in capsys.readouterr().err


def test_known_and_generic_tier_overrides_load(tmp_path):
    path = write(
        tmp_path,
        limits={
            "tiers": {"macbook-air-8gb": {"memory_budget_mb": 4000}, "generic-cpu-24gb-2c": {"thermal_cap": "serious"}}
        },
    )
    assert load_space(path).limits.tiers["macbook-air-8gb"]["memory_budget_mb"] == 4000


def test_an_unreachable_cluster_address_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    from raytrm.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))  # this machine's ~/.ray/auth_token, whatever its state, is not read
    run = tmp_path / "run"
    assert main(["tune", "--address", "127.0.0.1:1", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--address 127.0.0.1:1: cannot reach a Ray head there" in err[0], err
    assert not run.exists()


def test_horizon_is_minutes_or_samples_not_both():
    base = {"raytrm_space": 1, "params": {"model.H_cycles": {"type": "int", "low": 1, "high": 2}}}
    assert space_from_dict({**base, "horizon": {"minutes": 3}}, "<test>").horizon.minutes == 3
    assert space_from_dict({**base, "horizon": {"samples": 5000}}, "<t>").horizon.samples == 5000
    with pytest.raises(ConfigError, match=r"<test>: horizon: .*expected one of minutes or samples"):
        space_from_dict({**base, "horizon": {"minutes": 3, "samples": 10}}, "<test>")


@pytest.mark.parametrize(
    ("base", "params", "piece"),
    [
        (
            {"training": {"global_batch_size": 32, "sync_mode": "local"}},
            {
                "training.sync_every": {"type": "categorical", "choices": [2, 4, 8]},
                "training.sync_overlap": {"type": "int", "low": 0, "high": 3},
                "model.L_cycles": {"type": "int", "low": 1, "high": 3},
            },
            "params: got {'training.sync_every': 2, 'training.sync_overlap': 2}, expected values that build a "
            "valid "
            "experiment (training.sync_overlap: expected fewer than sync_every (2) steps",
        ),
        (
            {
                "model": {"variant": "attention", "hidden_size": 96, "num_heads": 4},
                "training": {"global_batch_size": 48},
            },
            {
                "model.hidden_size": {"type": "categorical", "choices": [64, 96, 128]},
                "model.num_heads": {"type": "categorical", "choices": [2, 3, 4]},
                "training.micro_batch_size": {"type": "categorical", "choices": [16, 24, 48]},
            },
            "params: got {'model.hidden_size': 64, 'model.num_heads': 3}, expected values that build a valid "
            "experiment "
            "(model.num_heads: expected a divisor of hidden_size 64)",
        ),
        (
            {"training": {"global_batch_size": 32}},
            {
                "training.global_batch_size": {"type": "categorical", "choices": [32, 48]},
                "training.micro_batch_size": {"type": "categorical", "choices": [16, 32]},
            },
            "params: got {'training.global_batch_size': 48, 'training.micro_batch_size': 32}, expected values that "
            "build a valid experiment (training.micro_batch_size: expected micro_batch_size x grad_accum_steps",
        ),
        (
            {"training": {"global_batch_size": 32, "sync_mode": "local", "sync_every": 4}},
            {"training.sync_overlap": {"type": "int", "low": 0, "high": 500}},
            "params.training.sync_overlap: got 500, expected values that build a valid "
            "experiment (training.sync_overlap: expected fewer than sync_every (4) steps",
        ),
        (
            {"training": {"global_batch_size": 32}},
            {
                "training.sync_mode": {"type": "categorical", "choices": ["exact", "local"]},
                "training.sync_every": {"type": "int", "low": 2, "high": 8},
            },
            "params: got {'training.sync_every': 2, 'training.sync_mode': 'exact'}, expected values that build a "
            "valid "
            "experiment (training.sync_every: expected unset with sync_mode exact",
        ),
    ],
    ids=[
        "overlap-not-below-every",
        "heads-not-dividing-width",
        "micro-not-dividing-a-global",
        "long-range-end",
        "round-length-without-rounds",
    ],
)
def test_a_point_that_breaks_a_rule_across_fields_is_refused_naming_its_values(tmp_path, base, params, piece):
    """A point a trial can draw that builds no valid experiment fails `raytrm validate`, not the trial."""
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"raytrm_space": 1, "base": base, "params": params}))
    code = main(["validate", str(path)])
    with pytest.raises(ConfigError) as refused:
        load_space(path)
    assert code == 2
    assert str(refused.value).startswith(f"{path}: {piece}"), str(refused.value)
    assert "fix: " in str(refused.value)


def test_a_large_space_is_checked_pair_by_pair(tmp_path, monkeypatch):
    """Past MAX_CHECKED_POINTS the pairs of parameters are checked at their points, the others at the base's."""
    from raytrm.tune import space as space_module

    monkeypatch.setattr(space_module, "MAX_CHECKED_POINTS", 4)
    params = {
        "training.sync_every": {"type": "categorical", "choices": [4, 8]},
        "model.L_cycles": {"type": "int", "low": 1, "high": 3},
        "training.sync_overlap": {"type": "categorical", "choices": [0, 6]},
    }
    base = {"training": {"global_batch_size": 32, "sync_mode": "local"}}
    with pytest.raises(ConfigError, match=r"got \{'training.sync_every': 4, 'training.sync_overlap': 6\}"):
        space_from_dict({"raytrm_space": 1, "base": base, "params": params}, "<test>")
    params["training.sync_overlap"]["choices"] = [0, 3]
    assert space_from_dict({"raytrm_space": 1, "base": base, "params": params}, "<test>").parsed


def test_a_start_point_that_breaks_a_rule_names_itself(tmp_path):
    path = write(tmp_path, start_with=[{"training.micro_batch_size": 16}, {"training.micro_batch_size": 12}])
    with pytest.raises(ConfigError, match=r"start_with\[1\]: got \{'training.micro_batch_size': 12\}, expected values"):
        load_space(path)


@pytest.mark.parametrize(
    ("version", "piece"),
    [
        (2, "raytrm_space 2 is newer than this raytrm"),
        ("one", "raytrm_space: got 'one', expected a schema version, a whole number >= 1"),
        (0, "raytrm_space: got 0, expected a schema version"),
    ],
)
def test_a_space_of_another_version_says_what_to_do(tmp_path, capsys, version, piece):
    path = write(tmp_path, raytrm_space=version)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"raytrm: error: {path}: {piece}"), err
    with pytest.raises(UserError, match=piece):
        space_from_dict(yaml.safe_load(path.read_text()), "<test>")
