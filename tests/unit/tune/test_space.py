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
            "training.micro_batch_size=9', expected values that build a valid experiment",
        ),
        ({"model.H_cycles": {"type": "int", "low": 0, "high": 2}}, "model.H_cycles=0"),
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
