"""The one Trainer: alone, inside a Tune trial or inside a Ray Train worker, the same training loop.

Life cycle (as torchtitan's): `__init__` builds every component from its config, `train_step` does one optimizer
step over one global batch (micro-batches x accumulation), `train` loops until the step count or the time budget,
`evaluate` scores the EMA weights on held-out data, `state_dict` / `load_state_dict` capture everything a resume
needs, `close` releases files. Ray code wraps a Trainer; it never reaches into it. What differs between model
families (TRM's carry and halting, the transformer's losses, their data and evaluations) is a task
(raytrm.train.tasks) the Trainer builds from the config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from raytrm import config as cfg
from raytrm.data.loader import global_batches
from raytrm.hardware import device as devices
from raytrm.models.trm import Carry
from raytrm.train.memory import cut
from raytrm.train.metrics import ResourceSampler
from raytrm.train.oom import is_out_of_memory
from raytrm.train.optim import AdamATan2, ModelEMA
from raytrm.train.tasks import make_task
from raytrm.train.threads import apply_threads

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepResult:
    """What one optimizer step measured."""

    step: int
    loss: float
    metrics: dict[str, float | None]
    seconds: float
    samples: int


def lr_at(step: int, train: cfg.TrainConfig, total_steps: int | None) -> float:
    """Linear warm-up to lr, then constant or cosine down to min_lr_ratio * lr."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.schedule == "cosine" and total_steps:
        progress = min(1.0, (step - train.warmup_steps) / max(1, total_steps - train.warmup_steps))
        floor = train.min_lr_ratio
        return train.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    return train.lr


class Trainer:
    """Trains TRM or a transformer on one process; see the module docstring for the life cycle."""

    def __init__(
        self,
        config: cfg.ExperimentConfig,
        run_dir: str | Path | None = None,
        *,
        threads: int | None = None,
        interop_threads: int | None = None,
    ) -> None:
        self.config = config
        train = config.training
        self.run_dir = Path(run_dir) if run_dir else None
        self.threads = apply_threads(train.threads or threads, train.interop_threads or interop_threads)
        self.device = devices.pick_device(train.device)
        self.dtype = devices.pick_dtype(
            self.device, config.model.forward_dtype if config.model.forward_dtype != "auto" else train.dtype
        )
        self.loss_dtype = devices.loss_dtype(self.device)

        # The task opens the data, seeds torch and builds the model (and TRM's sparse optimizer and carry).
        self.task = make_task(config, self.device, self.dtype, self.loss_dtype)
        self.train_data, self.test_data = self.task.train_data, self.task.test_data
        self.model = self.task.model
        self.optimizer = self._build_optimizer()
        self.sparse_optimizer = self.task.sparse_optimizer
        self.ema = ModelEMA(self.model, decay=train.ema_decay, warmup=train.ema_warmup) if train.ema else None
        #: Tokens per training sample where throughput is counted in tokens (the language model), else None.
        self.tokens_per_sample = self.task.tokens_per_sample

        self.global_batch = train.global_batch_size
        self.cuts = cut(self.global_batch, train.micro_batch)
        self.step = 0
        self.samples_seen = 0
        self.samples_seen_this_run = 0
        self.current_lr = lr_at(0, train, train.steps)
        self._batches = None
        self.resources = ResourceSampler()

    @property
    def carry(self) -> Carry | None:
        """TRM's carry: one slot per sample of the global batch (None before the first step, and for transformers)."""
        return self.task.carry

    def _build_optimizer(self) -> torch.optim.Optimizer:
        train = self.config.training
        kind = AdamATan2 if train.optimizer == "adam_atan2" else torch.optim.AdamW
        extra = {} if kind is AdamATan2 else {"eps": 1e-8}
        return kind(
            self.model.parameters(), lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, **extra
        )

    # -- data ------------------------------------------------------------------------------------------------------

    def _next_global_batch(self) -> dict[str, torch.Tensor]:
        if self._batches is None:
            self._batches = global_batches(
                self.train_data.batch,
                len(self.train_data),
                self.global_batch,
                self.config.training.seed,
                first_step=self.step,
                workers=self.config.training.dataloader_workers,
            )
        return next(self._batches)

    # -- one optimizer step ----------------------------------------------------------------------------------------

    def train_step(
        self, batch: dict[str, torch.Tensor] | None = None, on_out_of_memory: Callable[[int], int] | None = None
    ) -> StepResult:
        """One optimizer step over one global batch: forward_backward, then optimizer_step.

        If the allocator raises out-of-memory (CUDA, MPS) and on_out_of_memory is given, it is told the step and
        returns a smaller micro-batch; the same samples (with TRM, the same exploration draws) are redone from the
        same state (TRM's carry), so nothing is lost or doubled.
        """
        start = time.perf_counter()
        loss, metrics = self.forward_backward(batch, on_out_of_memory=on_out_of_memory)
        self.optimizer_step()
        devices.synchronize(self.device)
        return StepResult(self.step, loss, metrics, time.perf_counter() - start, self.global_batch)

    def forward_backward(
        self, batch: dict[str, torch.Tensor] | None = None, on_out_of_memory: Callable[[int], int] | None = None
    ) -> tuple[float, dict[str, float | None]]:
        """Accumulate the gradient of one global batch, cut into micro-batches; each TRM slot keeps its own carry.

        Every micro-batch's loss is divided by a count of the whole global batch (the task's), so the accumulated
        gradient is the gradient of the whole batch whatever the cut. Returns the loss and the metrics as rates.
        """
        batch = self._next_global_batch() if batch is None else batch
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        step = self.task.begin_step(batch, self.global_batch)
        # Only allocators that raise need a copy to redo from; on the CPU nothing raises, so nothing is copied.
        saved = self.task.snapshot() if on_out_of_memory else None
        while True:
            try:
                return self._accumulate(batch, step)
            except Exception as error:
                if on_out_of_memory is None or not is_out_of_memory(error):
                    raise
                self._discard_partial_step(saved)
                self.set_micro_batch(on_out_of_memory(self.step))

    def _accumulate(self, batch: dict[str, torch.Tensor], step: Any) -> tuple[float, dict]:
        self.model.train()
        totals: dict[str, float] = {}
        loss_sum = 0.0
        for part in self.slices():
            loss, metrics = self.task.micro_step(batch, part, step)
            loss_sum += loss
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        return loss_sum, self.task.rates(totals, self.global_batch)

    def _discard_partial_step(self, saved: Any) -> None:
        """Forget the gradient and state updates (TRM's carry) of a step that failed part-way."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.sparse_optimizer is not None:
            self.sparse_optimizer.zero_grad()
        self.task.restore(saved)
        devices.empty_cache(self.device)

    @property
    def micro_batch(self) -> int:
        """The largest micro-batch of the current cut."""
        return max(self.cuts)

    def slices(self) -> list[slice]:
        """The global batch's micro-batches, as slices of its slots."""
        bounds = [0, *itertools.accumulate(self.cuts)]
        return [slice(a, b) for a, b in itertools.pairwise(bounds)]

    def set_micro_batch(self, micro_batch: int) -> list[int]:
        """Re-cut the global batch into micro-batches of at most micro_batch; samples and gradient are unchanged."""
        self.cuts = cut(self.global_batch, micro_batch)
        return self.cuts

    def optimizer_step(self) -> None:
        """Apply the accumulated gradient: main optimizer, SignSGD on the puzzle embedding, then the EMA."""
        train = self.config.training
        lr = self.current_lr = lr_at(self.step, train, train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if train.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.sparse_optimizer is not None:
            # The embedding follows the same warm-up and schedule, scaled to its own learning rate.
            self.sparse_optimizer.lr = lr * train.puzzle_emb_lr / train.lr
            self.sparse_optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model)
        self.step += 1
        self.samples_seen += self.global_batch
        self.samples_seen_this_run += self.global_batch

    # -- evaluation --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """The task's scores of the EMA weights on the held-out split (TRM: cell and exact accuracy and halting
        steps; language model: bits per byte; classifier: accuracy and macro-F1), each beside its baseline."""
        model, was_training = self.model, self.model.training
        model.eval()
        context = self.ema.swapped(model) if self.ema is not None else contextlib.nullcontext()
        with context:
            result = self.task.evaluate(self.micro_batch, max_batches)
        model.train(was_training)
        return result

    def close(self) -> None:
        """Release the batch stream (and its worker processes, if any)."""
        self._batches = None

    # -- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs: model, optimizers, EMA, carry, step, RNG states, data position, config."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sparse_optimizer": self.sparse_optimizer.state_dict() if self.sparse_optimizer else None,
            "ema": self.ema.state_dict() if self.ema else None,
            "carry": self.task.carry_state(),
            "cuts": list(self.cuts),
            "step": self.step,
            "samples_seen": self.samples_seen,
            "rng": {"torch": torch.get_rng_state(), **self.task.rng_state()},
            "config": cfg.to_dict(self.config),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["config"]
        mine = cfg.to_dict(self.config)
        for section in ("model", "data"):
            if saved[section] != mine[section]:
                raise cfg.UserError(
                    f"checkpoint was trained with a different {section} config; resume with the "
                    f"run's own config (see its config.yaml)"
                )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.sparse_optimizer and state["sparse_optimizer"]:
            self.sparse_optimizer.load_state_dict(state["sparse_optimizer"])
        if self.ema and state["ema"]:
            self.ema.load_state_dict(state["ema"])
        self.task.load_carry(state["carry"], self.device)
        self.cuts = [int(c) for c in state["cuts"]]
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        torch.set_rng_state(state["rng"]["torch"])
        self.task.load_rng_state(state["rng"])
        self._batches = None  # restart the batch stream at the resumed step
