"""`raytrm data`, `raytrm train`, `import-checkpoint` and `export-checkpoint` as a user runs them."""

from __future__ import annotations

import json

import pytest
import torch

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.errors import UserError
from raytrm.train import checkpoint as ckpt
from raytrm.train.run.experiment import resolve_experiment


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("raytrm: error: ")
    return err[0]


def test_data_builds_both_kinds_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "sudoku"
    assert main(["data", "sudoku", "--out", str(out), "--count", "20", "--givens", "40", "--augment", "1"]) == 0
    meta = json.loads((out / "train" / "dataset.json").read_text())
    assert (meta["seq_len"], meta["vocab_size"]) == (81, 11)
    assert json.loads((out / "test" / "dataset.json").read_text())["total_groups"] == 2  # count / 10
    assert main(["data", "sudoku", "--out", str(out), "--count", "20"]) == 2
    assert "already exists" in one_error_line(capsys)
    assert main(["data", "maze", "--out", str(tmp_path / "maze"), "--count", "3", "--size", "11"]) == 0
    assert json.loads((tmp_path / "maze" / "train" / "dataset.json").read_text())["seq_len"] == 121


def test_train_then_resume(tiny, tmp_path, capsys):
    config = cfg.write_yaml(tiny(), tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), "--steps", "3", "--out", str(run), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "trained 3 steps" in out and "copying the givens scores" in out
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints"}
    assert main(["train", "--out", str(run), "--resume", "--steps", "5", "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_from_step"]) == (5, 3)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "event" not in r] == [1, 2, 3, 4, 5]
    # The tier's memory budget applies to command-line runs: the governor's choice is on record.
    assert summary["memory_budget_mb"] and any(r.get("event") == "choose" for r in records)


def test_resume_refusals(tiny, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--resume", "--steps", "2"]) == 2
    assert "not a raytrm run directory (no config.yaml)" in one_error_line(capsys)
    config = cfg.write_yaml(tiny(), tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), "--steps", "2", "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--hidden-size", "64"]) == 2
    line = one_error_line(capsys)
    stored = cfg.load(cfg.ExperimentConfig, run / "config.yaml").model.hidden_size
    assert "only --steps and --time-budget may change" in line
    assert f"model.hidden_size is {stored} there, 64 asked" in line
    (only,) = ckpt.list_checkpoints(run / "checkpoints")
    only.write_bytes(only.read_bytes()[:-10])  # torn by hand: the checksum no longer matches
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--quiet"]) == 2
    assert "no checkpoint verifies" in one_error_line(capsys)


def test_resume_takes_the_command_that_started_the_run_with_resume_appended(tiny, tmp_path, capsys):
    # A config with flags, as a person types it; the same line with --resume goes on from its checkpoint.
    config = cfg.write_yaml(tiny(), tmp_path / "tiny.yaml")
    command = ["train", "--config", str(config), "--steps", "2", "--hidden-size", "32", "--checkpoint-interval", "1"]
    command += ["--lr", "3e-3", "--out", str(tmp_path / "part"), "--quiet"]
    assert main(command) == 0
    capsys.readouterr()
    resumed = [*command, "--resume"]
    resumed[resumed.index("--steps") + 1] = "3"  # the one change a resume may make: how long it goes on
    assert main(resumed) == 0
    summary = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_from_step"]) == (3, 2)
    changed = [*resumed]
    changed[changed.index("--lr") + 1] = "1e-3"
    assert main(changed) == 2
    assert "training.lr is 0.003 there, 0.001 asked" in one_error_line(capsys)


def test_train_with_a_profile_uses_exactly_its_settings(tiny, tmp_path):
    # The profile trains for its horizon (600 s) unless told otherwise: --steps 2 replaces the horizon.
    experiment = tiny(
        training={"global_batch_size": 16, "micro_batch_size": 8, "grad_accum_steps": 2, "time_budget_s": 600}
    )
    profile = cfg.Profile(
        tier="test-tier",
        model=experiment.model,
        data=experiment.data,
        training=experiment.training,
        limits=cfg.Limits(memory_budget_mb=2000),
    )
    path = cfg.write_yaml(profile, tmp_path / "profile.yaml")
    run = tmp_path / "run"
    assert main(["train", "--profile", str(path), "--steps", "2", "--out", str(run), "--quiet"]) == 0
    used = cfg.load(cfg.ExperimentConfig, run / "config.yaml")
    assert used.model == profile.model and used.data == profile.data
    limits = {"memory_budget_mb": 2000, "thermal_cap": "fair"}  # from the profile's limits
    assert cfg.to_dict(used.training) == {**cfg.to_dict(profile.training), "steps": 2, "time_budget_s": None, **limits}


def test_bad_data_path_is_one_line(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "missing"), "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    assert "missing" in one_error_line(capsys)


def test_export_then_import_round_trips_the_ema_weights(tiny, tmp_path, capsys):
    config = cfg.write_yaml(tiny(), tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), "--steps", "3", "--out", str(run), "--quiet"]) == 0
    ref = tmp_path / "ref.pt"
    assert main(["export-checkpoint", str(run), "--out", str(ref)]) == 0
    exported = torch.load(ref, weights_only=True)
    assert all(k.startswith("_orig_mod.model.inner.") for k in exported)
    assert main(["import-checkpoint", str(ref), "--out", str(tmp_path / "imported"), "--config", str(config)]) == 0
    trained = ckpt.latest_good_checkpoint(run / "checkpoints")
    imported = ckpt.latest_good_checkpoint(tmp_path / "imported" / "checkpoints")
    assert imported["step"] == 0
    for name, value in trained["ema"]["shadow"].items():
        assert torch.equal(imported["model"][name], value), name
    assert torch.equal(imported["model"]["puzzle_emb.weight"], trained["model"]["puzzle_emb.weight"])
    capsys.readouterr()
    assert main(["import-checkpoint", str(config), "--out", str(tmp_path / "bad"), "--config", str(config)]) == 2
    one_error_line(capsys)


def test_distributed_flags_refused_before_any_worker_starts(tiny, tmp_path, capsys):
    config = cfg.write_yaml(tiny(), tmp_path / "config.yaml")
    base = ["train", "--config", str(config), "--steps", "1", "--quiet"]
    assert main([*base, "--workers", "0", "--out", str(tmp_path / "a")]) == 2
    assert "--workers 0: expected a number of workers >= 1" in one_error_line(capsys)
    limits = cfg.Limits(memory_budget_mb=2000)

    def write_profile(tier, name, **training):
        experiment = tiny(training=training)
        profile = cfg.Profile(tier=tier, model=experiment.model, data=experiment.data, training=experiment.training)
        profile.limits = limits
        return cfg.write_yaml(profile, tmp_path / name)

    profile = write_profile("t", "p.yaml")
    assert main(["train", "--profile", str(profile), "--profile", str(profile), "--out", str(tmp_path / "b")]) == 2
    assert "several --profile (one per tier) need --workers N or --address" in one_error_line(capsys)
    other = write_profile("u", "q.yaml", lr=1.0)
    assert main(["train", "--profile", str(profile), "--profile", str(other), "--workers", "2", "--steps", "1"]) == 2
    assert "profiles describe different experiments (training.lr differ)" in one_error_line(capsys)
    assert not any((tmp_path / name).exists() for name in "ab")


def test_a_data_path_is_checked_here_only_when_training_here(tmp_path):
    """A missing dataset is refused before anything runs on this machine; a distributed run's data lives on its
    nodes (each checks it there), so resolving it here leaves the path alone."""
    args = {"config_file": None, "profile_file": None, "out": None, "resume": False}
    overrides = {"data": {"path": str(tmp_path / "none")}}
    with pytest.raises(UserError, match="none: no such directory, so it is not a puzzle dataset"):
        resolve_experiment(**args, overrides=overrides)
    experiment, _ = resolve_experiment(**args, overrides=overrides, tier_defaults=False)
    assert experiment.data.path == str(tmp_path / "none") and experiment.training.threads is None
