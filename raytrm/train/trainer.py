"""The one Trainer: alone, inside a Tune trial or inside a Ray Train worker, the same training loop.

Life cycle (as torchtitan's): `__init__` builds every component from its config, `train_step` does one optimizer
step over one global batch (micro-batches x accumulation), `train` loops until the step count or the time budget,
`evaluate` scores the EMA weights on held-out puzzles, `state_dict` / `load_state_dict` capture everything a resume
needs, `close` releases files. Ray code wraps a Trainer; it never reaches into it.
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
from raytrm.data.cache import open_dataset_for
from raytrm.data.loader import global_batches
from raytrm.hardware import device as devices
from raytrm.models.losses import act_loss
from raytrm.models.trm import TRM, Carry, Exploration
from raytrm.train.memory import cut
from raytrm.train.metrics import ResourceSampler
from raytrm.train.oom import is_out_of_memory
from raytrm.train.optim import AdamATan2, ModelEMA, SignSGD
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
    """Trains TRM on one process; see the module docstring for the life cycle."""

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

        self.train_data, self.test_data = open_dataset_for(config.data)
        meta = self.train_data.metadata
        torch.manual_seed(train.seed)
        self.model = TRM(config.model, meta.vocab_size, meta.seq_len, meta.num_puzzle_identifiers, dtype=self.dtype).to(
            self.device
        )
        self.optimizer = self._build_optimizer()
        self.sparse_optimizer = (
            SignSGD(self.model.puzzle_emb, lr=train.puzzle_emb_lr, weight_decay=train.puzzle_emb_weight_decay)
            if self.model.puzzle_emb is not None
            else None
        )
        self.ema = ModelEMA(self.model, decay=train.ema_decay, warmup=train.ema_warmup) if train.ema else None
        self.explore_rng = torch.Generator().manual_seed(train.seed + 1)

        self.global_batch = train.global_batch_size
        self.cuts = cut(self.global_batch, train.micro_batch)
        # One carry for all slots of the global batch; micro-batches read and write their slice of it, so the cut
        # can change between steps without touching any slot's state.
        self.carry: Carry | None = None
        self.step = 0
        self.samples_seen = 0
        self.samples_seen_this_run = 0
        self.current_lr = lr_at(0, train, train.steps)
        self._batches = None
        self.resources = ResourceSampler()

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
        returns a smaller micro-batch; the same samples with the same exploration draws are redone from the same
        carry, so nothing is lost or doubled.
        """
        start = time.perf_counter()
        loss, metrics = self.forward_backward(batch, on_out_of_memory=on_out_of_memory)
        self.optimizer_step()
        devices.synchronize(self.device)
        return StepResult(self.step, loss, metrics, time.perf_counter() - start, self.global_batch)

    def forward_backward(
        self, batch: dict[str, torch.Tensor] | None = None, on_out_of_memory: Callable[[int], int] | None = None
    ) -> tuple[float, dict[str, float | None]]:
        """Accumulate the gradient of one global batch, cut into micro-batches; each slot keeps its own carry.

        Every micro-batch's loss is divided by the global batch size, so the accumulated gradient is the gradient
        of the whole batch whatever the cut. Returns the loss and the loss head's metrics as rates.
        """
        batch = self._next_global_batch() if batch is None else batch
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        model_cfg = self.config.model
        # Drawn for the whole global batch, then sliced: the draws do not depend on the cut (nor on a redo).
        exploration = Exploration.draw(
            self.global_batch,
            model_cfg.halt_exploration_prob,
            model_cfg.halt_max_steps,
            generator=self.explore_rng,
            device=self.device,
        )
        if self.carry is None:
            self.carry = self.model.initial_carry(batch)
        # Only allocators that raise need a copy to redo from; on the CPU nothing raises, so nothing is copied.
        saved = Carry.from_dict({k: v.clone() for k, v in self.carry.to_dict().items()}) if on_out_of_memory else None
        while True:
            try:
                return self._accumulate(batch, exploration)
            except Exception as error:
                if saved is None or not is_out_of_memory(error):
                    raise
                self._discard_partial_step(saved)
                self.set_micro_batch(on_out_of_memory(self.step))

    def _accumulate(self, batch: dict[str, torch.Tensor], exploration: Exploration) -> tuple[float, dict]:
        assert self.carry is not None
        self.model.train()
        totals: dict[str, float] = {}
        loss_sum = 0.0
        for part in self.slices():
            micro = {k: v[part] for k, v in batch.items()}
            carry, outputs = self.model(self.carry[part], micro, exploration[part])
            loss, metrics = act_loss(outputs, carry, global_batch_size=self.global_batch, compute_dtype=self.loss_dtype)
            loss.backward()
            self.carry.assign_(part, carry)
            loss_sum += float(loss.detach())
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        return loss_sum, _rates(totals, self.global_batch)

    def _discard_partial_step(self, saved: Carry) -> None:
        """Forget the gradient and carry updates of a step that failed part-way."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.sparse_optimizer is not None:
            self.sparse_optimizer.zero_grad()
        self.carry = saved
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
        """Cell and exact accuracy of the EMA weights on the test split, with the halting steps used."""
        model, was_training = self.model, self.model.training
        model.eval()
        context = self.ema.swapped(model) if self.ema is not None else contextlib.nullcontext()
        correct_cells = valid_cells = exact = count = steps_used = baseline_cells = 0.0
        n = len(self.test_data)
        size = self.micro_batch
        with context:
            for b, start in enumerate(range(0, n, size)):
                if max_batches is not None and b >= max_batches:
                    break
                idx = torch.arange(start, min(n, start + size)).numpy()
                batch = {k: torch.from_numpy(v).long().to(self.device) for k, v in self.test_data.batch(idx).items()}
                carry = model.initial_carry(batch)
                done = torch.zeros(len(idx), dtype=torch.bool, device=self.device)
                preds = torch.zeros_like(batch["labels"])
                used = torch.zeros(len(idx), dtype=torch.int32, device=self.device)
                for _ in range(self.config.model.halt_max_steps):
                    carry, out = model(carry, batch)
                    newly = carry.halted & ~done
                    preds[newly] = out["logits"][newly].argmax(-1)
                    used[newly] = carry.steps[newly]
                    done |= carry.halted
                    if bool(done.all()):
                        break
                labels = batch["labels"]
                mask = labels != -100
                hits = (preds == labels) & mask
                correct_cells += float(hits.sum())
                valid_cells += float(mask.sum())
                exact += float((hits.sum(-1) == mask.sum(-1)).sum())
                baseline_cells += float(((batch["inputs"] == labels) & mask).sum())
                steps_used += float(used.sum())
                count += len(idx)
        model.train(was_training)
        return {
            "eval_cell_acc": correct_cells / max(1, valid_cells),
            "eval_exact_acc": exact / max(1, count),
            "eval_steps": steps_used / max(1, count),
            "eval_copy_givens_acc": baseline_cells / max(1, valid_cells),
            "eval_puzzles": count,
        }

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
            "carry": self.carry.to_dict() if self.carry is not None else None,
            "cuts": list(self.cuts),
            "step": self.step,
            "samples_seen": self.samples_seen,
            "rng": {"torch": torch.get_rng_state(), "explore": self.explore_rng.get_state()},
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
        self.carry = Carry.from_dict(state["carry"]).to(self.device) if state["carry"] is not None else None
        self.cuts = [int(c) for c in state["cuts"]]
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        torch.set_rng_state(state["rng"]["torch"])
        self.explore_rng.set_state(state["rng"]["explore"])
        self._batches = None  # restart the batch stream at the resumed step


#: Loss-head metrics that are sums over the sequences that halted this step (the reference's convention).
HALTED_RATES = ("accuracy", "exact_accuracy", "q_halt_accuracy", "steps")


def _rates(totals: dict[str, float], batch_size: int) -> dict[str, float | None]:
    """Turn the loss head's sums into rates: per halted sequence (None when none halted), losses per sample."""
    halted = totals.get("count", 0.0)
    out: dict[str, float | None] = {"halted": halted}
    for key, value in totals.items():
        if key in HALTED_RATES:
            out[key] = value / halted if halted else None
        elif key != "count":
            out[key] = value / batch_size
    return out
