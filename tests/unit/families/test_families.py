"""The model families' registry: every family module registers itself, and the Trainer, the size rule and the
embedded defaults find each family there by its name alone."""

from __future__ import annotations

import pytest

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.families import family, names
from raytrm.families.byte_transformer import TransformerTask
from raytrm.families.trm import TRMTask
from raytrm.train.trainer import Trainer


def test_every_family_module_registers_itself_and_names_its_data():
    assert names() == ["hf", "transformer", "trm"]
    assert family("trm").data_kinds == ("sudoku", "maze") and family("transformer").data_kinds == ("text",)
    assert family("hf").data_kinds == ("records",)


def test_an_unknown_family_is_one_line_naming_the_known_ones():
    known = "hf, transformer, trm"
    with pytest.raises(UserError, match=rf"model\.name 'hf2': no such model family; expected one of {known}"):
        family("hf2")


def test_each_embedded_default_is_a_valid_experiment_of_its_family():
    for name in names():
        default = family(name).embedded_default
        if name == "hf":  # a model the user brings: valid once its path is given (--model-path)
            default = {**default, "model": {**default["model"], "path": "a-model-directory"}}
        config = cfg.from_dict(cfg.ExperimentConfig, default, name)
        assert config.model.name == name and config.data.name in family(name).data_kinds
        assert config.training.lr == family(name).anchor.lr


def test_the_trainer_builds_the_task_of_the_configs_family(tiny):
    assert isinstance(Trainer(tiny()).task, TRMTask)
    text = cfg.from_dict(
        cfg.ExperimentConfig,
        {
            "model": {"name": "transformer", "hidden_size": 32, "num_heads": 4, "layers": 1, "seq_len": 16},
            "data": {"name": "text"},
            "training": {"global_batch_size": 4, "device": "cpu"},
        },
    )
    assert isinstance(Trainer(text).task, TransformerTask)
