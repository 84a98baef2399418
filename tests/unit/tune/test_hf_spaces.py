"""The tuning spaces of the user's own Hugging Face model (hf-classify, hf-lm), and the score each space's quality
objective maximizes: the model family's own unless the space names another of its scores."""

from __future__ import annotations

import math

import pytest
import yaml

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.errors import ConfigError, UserError
from raytrm.families import Score, score
from raytrm.tune.space import load_space

USER = {"model": {"path": "/models/scibert"}, "data": {"path": "/data/mail.csv"}}


@pytest.mark.parametrize(
    "name, task, metric, learning",
    [
        ("hf-classify", "classify", "eval_macro_f1", {"model.seq_len", "training.lr", "training.warmup_steps"}),
        ("hf-lm", "lm", "eval_loss", {"model.lora_rank", "training.lr"}),
    ],
)
def test_the_hf_spaces_take_the_users_model_and_records(name, task, metric, learning):
    space = load_space(name, USER)
    base = cfg.from_dict(cfg.ExperimentConfig, space.base, name)
    assert (base.model.name, base.model.task, base.model.path, base.data.path) == (
        "hf",
        task,
        "/models/scibert",
        "/data/mail.csv",
    )
    assert space.quality_metric == metric and space.objective == "quality" and space.horizon.minutes
    speed = {"training.micro_batch_size", "training.threads"}
    assert set(space.parsed) == speed | learning
    assert space.to_dict()["base"]["model"]["path"] == "/models/scibert"  # the run's copy holds the user's model


def test_an_hf_space_without_the_users_model_names_the_flag(capsys):
    assert main(["validate", "hf-classify"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "base.model.path" in err and "--model-path" in err


def test_validate_shows_an_hf_space_with_the_users_model(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    args = ["validate", "hf-classify", "--model-path", str(model), "--data", "mail.csv", "--text-fields", "a", "b"]
    assert main(args) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["base"]["model"]["path"] == str(model.resolve())
    assert shown["base"]["data"]["path"] == str((tmp_path.cwd() / "mail.csv").resolve())  # trials run elsewhere
    assert shown["base"]["data"]["text_fields"] == ["a", "b"] and shown["quality_metric"] == "eval_macro_f1"


def test_a_hub_name_stays_a_name(capsys):
    assert main(["validate", "hf-lm", "--model-path", "gpt2", "--data", "notes.jsonl"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["base"]["model"]["path"] == "gpt2"


def write(tmp_path, base, **fields):
    doc = {"raytrm_space": 1, "base": base, "params": {"training.lr": {"type": "log", "low": 1e-4, "high": 1e-2}}}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({**doc, **fields}))
    return path


@pytest.mark.parametrize(
    "base, metric",
    [
        ({"data": {"name": "sudoku"}}, "eval_cell_acc"),
        ({"model": {"name": "transformer", "task": "lm"}, "data": {"name": "text"}}, "eval_loss"),
        ({"model": {"name": "transformer", "task": "classify"}, "data": {"name": "text"}}, "eval_macro_f1"),
        ({"model": {"name": "hf", "task": "lm", "path": "m"}, "data": {"name": "records"}}, "eval_loss"),
    ],
)
def test_a_space_that_names_no_score_takes_its_familys_own(tmp_path, base, metric):
    assert load_space(write(tmp_path, base)).quality_metric == metric


def test_a_score_the_model_does_not_have_is_one_line_naming_those_it_has(tmp_path):
    base = {"model": {"name": "hf", "task": "classify", "path": "m"}, "data": {"name": "records"}}
    with pytest.raises(ConfigError) as caught:
        load_space(write(tmp_path, base, quality_metric="eval_cell_acc"))
    message = str(caught.value)
    assert "quality_metric" in message and "eval_macro_f1, eval_accuracy" in message
    assert load_space(write(tmp_path, base, quality_metric="eval_accuracy")).quality_metric == "eval_accuracy"


def test_a_loss_is_maximized_as_the_mean_probability_of_the_right_token():
    loss = Score("eval_loss", loss=True)
    assert loss.quality(0.0) == 1.0 and loss.quality(math.log(4)) == pytest.approx(0.25)
    assert loss.quality(2.0) > loss.quality(3.0)  # a lower loss is a higher quality
    assert Score("eval_macro_f1").quality(0.7) == 0.7


def test_score_lookup_refuses_an_unknown_name():
    model = cfg.ModelConfig(name="transformer", task="lm")
    assert score(model) == Score("eval_loss", loss=True)
    with pytest.raises(UserError, match=r"model.name transformer \(lm\) has no such score; expected one of eval_loss"):
        score(model, "eval_accuracy")


def test_tune_refuses_the_users_model_with_resume(tmp_path, capsys):
    assert main(["tune", "--resume", str(tmp_path), "--model-path", "m"]) == 2
    assert "drop --space and its settings" in capsys.readouterr().err
