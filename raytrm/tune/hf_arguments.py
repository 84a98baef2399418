"""A tuned profile of a Hugging Face model as the fields a user's own script hands transformers' `TrainingArguments`
(`raytrm export RUN_DIR --format hf`): the per-device batch, accumulation, learning rate and its schedule, warm-up,
weight decay, clipping, dtype, loader workers and seed, beside what TrainingArguments has no field for (the max
length to tokenize to, the threads to give torch, the model).
"""

from __future__ import annotations

from typing import Any

from raytrm import config as cfg
from raytrm.errors import UserError

#: raytrm's learning-rate schedules as transformers names them (warm-up first in both).
SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine_with_min_lr"}


def hf_arguments(profile: cfg.Profile, source: str) -> dict[str, Any]:
    """The profile's settings for a transformers training script; a profile of another family is one line."""
    if profile.model.name != "hf":
        raise UserError(
            f"{source}: --format hf exports a Hugging Face model's settings, but this run tuned model.name "
            f"{profile.model.name}; export it as a profile (drop --format)"
        )
    train = profile.training
    arguments: dict[str, Any] = {
        "per_device_train_batch_size": train.micro_batch,
        "gradient_accumulation_steps": train.global_batch_size // train.micro_batch,
        "learning_rate": train.lr,
        "lr_scheduler_type": SCHEDULES[train.schedule],
        "warmup_steps": train.warmup_steps,
        "weight_decay": train.weight_decay,
        "adam_beta1": train.betas[0],
        "adam_beta2": train.betas[1],
        "max_grad_norm": train.grad_clip or 0.0,
        "bf16": train.dtype == "bfloat16",
        "fp16": train.dtype == "float16",
        "dataloader_num_workers": train.dataloader_workers,
        "seed": train.seed,
    }
    if train.schedule == "cosine":
        arguments["lr_scheduler_kwargs"] = {"min_lr_rate": train.min_lr_ratio}
    if train.steps:
        arguments["max_steps"] = train.steps
    return {
        "training_arguments": arguments,
        "max_length": profile.model.seq_len,
        "threads": train.threads,
        "model": profile.model.path,
        "lora": {
            "r": profile.model.lora_rank,
            "lora_alpha": profile.model.lora_alpha,
            "lora_dropout": profile.model.lora_dropout,
            "target_modules": profile.model.lora_targets,
        }
        if profile.model.lora_rank
        else None,
        "tier": profile.tier,
        "measured_samples_per_sec": profile.measured.samples_per_sec,
    }
