"""`raytrm tune` of the user's own Hugging Face classifier against the session's local Ray: the shipped hf-classify
space, shrunk to seconds, on a tiny offline model and records, exported as a profile that trains and as the
settings a transformers script takes."""

from __future__ import annotations

import json

import optuna
import pytest
import yaml

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.constants import spaces_dir
from raytrm.tune.layout import open_storage
from tests.support.hf_models import classifier_dir, write_records

TIER_A = "macbook-air-8gb"  # the conftest's head node

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def small_hf_space(tmp_path):
    """The shipped hf-classify space with its knobs, horizon and budget cut to what runs in seconds here."""
    space = yaml.safe_load((spaces_dir() / "hf-classify.yaml").read_text())
    space["base"]["training"].update(threads=1, lr=3e-3, warmup_steps=2)
    space.update(
        name="mail",
        params={
            "training.micro_batch_size": {"type": "categorical", "choices": [16, 32]},
            "model.seq_len": {"type": "categorical", "choices": [16, 48]},
        },
        horizon={"samples": 640},
        budget={"warmup_s": 1, "measure_s": 2, "eval_puzzles": 32, "evaluations": 1},
        pruner="none",
        trials=2,
        start_with=[],
        tiers=[TIER_A],
        limits={"max_throughput_decay": 1.0},
    )
    path = tmp_path / "mail.yaml"
    path.write_text(yaml.safe_dump(space))
    return path


def test_a_users_classifier_is_tuned_exported_and_trained_with_its_profile(ray_cluster, tmp_path, capsys):
    pytest.importorskip("transformers")
    model = classifier_dir(tmp_path / "model")
    records = write_records(tmp_path / "mail.csv", count=160)
    run = tmp_path / "tune"
    user = ["--model-path", str(model), "--data", str(records), "--text-fields", "subject", "body"]
    assert main(["tune", "--space", str(small_hf_space(tmp_path)), *user, "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.count(f"[{TIER_A} speed #") == 2 and out.count("[learning #") == 2, out

    # The learning search judged each max length by the macro-F1 it reached at the horizon.
    learning = optuna.load_study(study_name="mail-learning", storage=open_storage(run))
    trials = learning.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert sorted(t.params["model.seq_len"] for t in trials) == [16, 48]
    for trial in trials:  # its macro-F1 at the horizon (the last point of its curve), as it learned the records
        assert trial.values[0] == trial.user_attrs["curve"][-1]["quality"] > 0.5

    profile = cfg.load_profile(run / "profiles" / f"{TIER_A}.yaml")
    assert (profile.model.name, profile.model.path, profile.data.path) == ("hf", str(model), str(records))
    assert profile.model.seq_len == max(trials, key=lambda t: t.values[0]).params["model.seq_len"]

    # The settings of the user's own transformers script.
    assert main(["export", str(run), "--tier", TIER_A, "--format", "hf", "--out", str(tmp_path / "args.json")]) == 0
    arguments = json.loads((tmp_path / "args.json").read_text())["training_arguments"]
    assert arguments["learning_rate"] == profile.training.lr
    assert arguments["per_device_train_batch_size"] * arguments["gradient_accumulation_steps"] == 32

    # raytrm train --profile trains the user's model on the user's records with the tuned settings.
    trained = tmp_path / "trained"
    profile_path = str(run / "profiles" / f"{TIER_A}.yaml")
    assert main(["train", "--profile", profile_path, "--steps", "3", "--out", str(trained), "--quiet"]) == 0
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["steps"] == 3 and "eval_macro_f1" in summary
    assert (trained / "model" / "config.json").is_file()
