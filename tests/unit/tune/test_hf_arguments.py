"""`raytrm export --format hf`: a tuned Hugging Face profile as transformers' TrainingArguments fields."""

from __future__ import annotations

import pytest

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.errors import UserError
from raytrm.tune.hf_arguments import hf_arguments


def _profile(**training) -> cfg.Profile:
    return cfg.from_dict(
        cfg.Profile,
        {
            "raytrm_profile": 1,
            "tier": "macbook-air-16gb",
            "model": {"name": "hf", "path": "/models/minilm", "task": "classify", "seq_len": 128, "lora_rank": 8},
            "data": {"name": "records", "path": "mail.csv", "text_fields": ["subject", "body"]},
            "training": {
                "global_batch_size": 32,
                "micro_batch_size": 8,
                "grad_accum_steps": 4,
                "lr": 2e-4,
                "warmup_steps": 30,
                "threads": 4,
                "dtype": "float32",
                "schedule": "cosine",
                "min_lr_ratio": 0.1,
                "steps": 500,
                **training,
            },
            "limits": {"memory_budget_mb": 9000},
            "measured": {"samples_per_sec": 41.5},
        },
        "p.yaml",
    )


def test_a_profile_becomes_training_arguments_with_the_max_length_and_threads_beside():
    out = hf_arguments(_profile(), "run")
    assert out["training_arguments"] == {
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 4,
        "learning_rate": 2e-4,
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
        "warmup_steps": 30,
        "weight_decay": 1.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "max_grad_norm": 0.0,
        "bf16": False,
        "fp16": False,
        "dataloader_num_workers": 0,
        "seed": 0,
        "max_steps": 500,
    }
    assert (out["max_length"], out["threads"], out["model"], out["tier"]) == (
        128,
        4,
        "/models/minilm",
        "macbook-air-16gb",
    )
    assert out["lora"] == {"r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "target_modules": None}


def test_the_arguments_are_what_transformers_takes():
    transformers = pytest.importorskip("transformers", reason="needs transformers (the hf extra)")
    arguments = hf_arguments(_profile(schedule="constant"), "run")["training_arguments"]
    made = transformers.TrainingArguments(output_dir="unused", report_to=[], **arguments)
    assert made.per_device_train_batch_size == 8 and made.gradient_accumulation_steps == 4
    assert getattr(made.lr_scheduler_type, "value", made.lr_scheduler_type) == "constant_with_warmup"


def test_a_profile_of_another_family_is_one_line():
    trm = cfg.from_dict(cfg.Profile, {"raytrm_profile": 1, "limits": {"memory_budget_mb": 900}}, "p.yaml")
    with pytest.raises(UserError, match=r"this run tuned model\.name trm; export it as a profile"):
        hf_arguments(trm, "run")


def test_export_format_hf_of_a_trm_run_is_refused_in_one_line(plain_run, capsys):
    assert main(["export", str(plain_run), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--format hf exports a Hugging Face model's settings" in err[0]
    assert not list(plain_run.rglob("*.hf.json"))
