"""What a Trainer's checkpoint holds, and how a checkpoint is restored into a Trainer (invariant 6: resume is exact).

The state is complete: the model (what trains of it, where its task says: LoRA's adapters, whose base weights are the
model directory's), optimizers, EMA, the carry of every slot of the global batch (so a resume may split it between
another number of workers), the shares and cuts, the step, the samples seen, the RNG states and the config.
A state is checked against the Trainer before anything is restored (raytrm.train.checkpoint_fit): one written for
another experiment, or with tensors of other shapes, is refused in one line.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from raytrm import config as cfg
from raytrm.sync.shares import shard
from raytrm.train.checkpoint_fit import check_checkpoint_fits, model_state
from raytrm.train.micro_batches import SAMPLES
from raytrm.train.optim import load_optimizer_state

logger = logging.getLogger(__name__)


def capture(trainer: Any, gathered: bool = True) -> dict[str, Any]:
    """Everything a resume needs (with several workers, a collective: the carry and the cuts are gathered).
    Without `gathered`, this worker's alone and no collective: no carry, its own micro-batch (what a peer that
    takes this worker's state after a change of workers needs, raytrm.train.elastic)."""
    return {
        "model": model_state(trainer),
        "optimizer": trainer.optimizer.state_dict(),
        "sparse_optimizer": trainer.sparse_optimizer.state_dict() if trainer.sparse_optimizer else None,
        "ema": trainer.ema.state_dict() if trainer.ema else None,
        "carry": trainer.global_carry() if gathered else None,
        "cuts": list(trainer.cuts),
        "shares": list(trainer.shares),
        "micro_batches": (
            [int(row[0]) for row in trainer.sync.gather_floats([trainer.micro_batch])]
            if gathered
            else [trainer.micro_batch]
        ),
        "micro_batch_unit": trainer.cut.unit,  # samples, or a classifier's padded tokens
        "step": trainer.step,
        "samples_seen": trainer.samples_seen,
        "rng": {"torch": torch.get_rng_state(), **trainer.task.rng_state()},
        "config": cfg.to_dict(trainer.config),
    }


def restore(trainer: Any, state: dict[str, Any]) -> None:
    """Load a checkpoint's state into the trainer, once it is checked to fit."""
    check_checkpoint_fits(state, trainer)
    load_trained = getattr(trainer.task, "load_trained_state", None)
    if load_trained is not None:
        load_trained(state["model"])
    else:
        trainer.model.load_state_dict(state["model"])
    load_optimizer_state(trainer.optimizer, state["optimizer"])
    if trainer.sparse_optimizer and state["sparse_optimizer"]:
        load_optimizer_state(trainer.sparse_optimizer, state["sparse_optimizer"])
    if trainer.ema and state["ema"]:
        trainer.ema.load_state_dict(state["ema"])
    # On as many workers as saved: the same split and cuts, so the same sums in the same order. On another
    # number: this run's split, each worker cutting at the micro-batch the run had reached.
    saved = [int(b) for b in state.get("shares", [trainer.global_batch])]
    same_workers = len(saved) == trainer.sync.world_size
    if same_workers:
        trainer.shares, trainer.shard = saved, shard(saved, trainer.sync.rank)
    carry = state["carry"]
    trainer.task.load_carry({k: v[trainer.shard] for k, v in carry.items()} if carry else None, trainer.device)
    micro = state.get("micro_batches") or [max(int(c) for c in state["cuts"])]
    micro_batch = int(micro[trainer.sync.rank] if same_workers else micro[0])
    if state.get("micro_batch_unit", SAMPLES) != trainer.cut.unit:  # written before a classifier's cut counted tokens
        patched = trainer.cut.units(micro_batch)
        logger.info("the checkpoint's micro-batch %d counts samples: patched to %d %s", micro_batch, patched, "tokens")
        micro_batch = patched
    trainer.cut.set(micro_batch, trainer.local_batch)
    trainer.step = int(state["step"])
    trainer.samples_seen = int(state["samples_seen"])
    if trainer.step < 0 or trainer.samples_seen < 0:  # the batch stream is a function of the step: no negative ones
        raise ValueError(f"step {trainer.step} and samples_seen {trainer.samples_seen}: expected counts >= 0")
    torch.set_rng_state(state["rng"]["torch"])
    trainer.task.load_rng_state(state["rng"])
    trainer.batches.restart()  # at the resumed step
