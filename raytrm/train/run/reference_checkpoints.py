"""Bring reference TRM checkpoints into raytrm runs, and write raytrm weights back in the reference layout."""

from __future__ import annotations

from pathlib import Path

import torch

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.models.reference_layout import load_reference_checkpoint, save_reference_checkpoint
from raytrm.train import checkpoint as ckpt
from raytrm.train.run.directory import CHECKPOINT_DIR, CONFIG_FILE, check_new_run_dir, guard_output, resumable_config
from raytrm.train.trainer import Trainer


def import_reference(checkpoint: str | Path, run_dir: str | Path, config_file: str | None = None) -> Path:
    """A new run directory whose step-0 checkpoint holds the reference weights (EMA starts from them)."""
    run_dir = Path(run_dir)
    check_new_run_dir(run_dir, resumable=False)
    experiment = cfg.load(cfg.ExperimentConfig, config_file) if config_file else cfg.ExperimentConfig()
    trainer = Trainer(experiment, run_dir)
    load_reference_checkpoint(checkpoint, trainer.model)
    if trainer.ema is not None:
        trainer.ema = type(trainer.ema)(trainer.model, decay=trainer.ema.decay, warmup=trainer.ema.warmup)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.write_yaml(experiment, run_dir / CONFIG_FILE)
    return ckpt.save_checkpoint(trainer.state_dict(), run_dir / CHECKPOINT_DIR, 0)


def export_reference(run_dir: str | Path, out: str | Path, ema: bool = True) -> Path:
    """The run's latest good weights (the EMA copy by default, as the reference saves) in the reference layout."""
    run_dir = Path(run_dir)
    guard_output(out)
    experiment = resumable_config(run_dir)
    state = ckpt.latest_good_checkpoint(run_dir / CHECKPOINT_DIR)
    if state is None:
        raise UserError(f"{run_dir}: no checkpoint to export; train first")
    trainer = Trainer(experiment, run_dir)
    with ckpt.restoring(state):
        trainer.load_state_dict(state)
    if ema and trainer.ema is not None:
        trainer.ema.copy_to(trainer.model)
    with torch.no_grad():
        return save_reference_checkpoint(trainer.model, out)
