"""The one Trainer: alone, inside a Tune trial or inside a Ray Train worker, the same optimizer steps.

Life cycle (as torchtitan's):
- construction: `Trainer(config, run_dir, threads=, interop_threads=, sync=, shares=)` applies the thread counts,
  picks the device and dtype, and builds from the config a task (raytrm.train.tasks: the model family's data, model,
  losses and evaluation; TRM's carry and sparse optimizer), the optimizer, the EMA and the compiled regions. It is
  handed a sync object (the contract of raytrm.train.sync; `LocalSync` alone) and this worker's share of each
  global batch; run_dir is recorded only (the run loop writes the directory).
- `train_step` does one optimizer step over one global batch: this worker's slots, cut into micro-batches, then the
  sync object's sums (gradients, metrics, carry slots that move) and the optimizer, and returns a `StepResult`;
  given `on_out_of_memory`, a step the allocator refuses is redone from the same state at the smaller cut it returns.
  `forward_backward` and `optimizer_step` are its two halves, for checks that look at the gradient in between.
  With `steps_alone` (a local round's inner steps) the step exchanges nothing: this worker's own samples' mean.
  `set_micro_batch` and `set_shares` re-cut the following global batches; neither changes a step's samples or
  gradient.
- `evaluate` scores the EMA weights on the held-out split.
- `state_dict` / `load_state_dict` capture everything a resume needs (model, optimizers, EMA, carry, step, RNG,
  data position, config).
- `close` releases the batch stream (and its loader processes), the overlapped all-reduce's hooks and the threads
  of side-by-side micro-batches.

The Trainer has no loop: raytrm.train.loop drives `train_step` and asks its hooks (memory, heat, evaluations, stop
rules, peers, metrics, checkpoints) around each step. Ray code wraps a Trainer; it never reaches into it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from raytrm import config as cfg
from raytrm.data.loader import global_batches
from raytrm.fastpaths import onednn
from raytrm.hardware import device as devices
from raytrm.models.trm import Carry, rows
from raytrm.train import threaded
from raytrm.train.checkpoint_fit import check_checkpoint_fits
from raytrm.train.compile import compile_regions, plan_compile, use_compile_caches
from raytrm.train.memory import cut
from raytrm.train.metrics import ResourceSampler
from raytrm.train.oom import is_out_of_memory
from raytrm.train.optim import AdamATan2, ModelEMA
from raytrm.train.peak import one_heap
from raytrm.train.shares import shard, split
from raytrm.train.sync import GradientSync, LocalSync, OverlappedAllReduce
from raytrm.train.tasks import Scalar, make_task
from raytrm.train.threads import apply_threads

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepResult:
    """What one optimizer step measured (loss, metrics and samples over the whole global batch)."""

    step: int
    loss: float
    metrics: dict[str, float | None]
    seconds: float
    samples: int
    #: This worker's forward and backward over its own share (alone: with the optimizer step, which the device runs
    #: right after them, and until its results reach the host).
    compute_seconds: float = 0.0
    sync_seconds: float = 0.0  # this worker's gradient all-reduce (0 alone)
    #: The dense weights' gradient norm before clipping (with several workers, the summed gradient's).
    grad_norm: float | None = None
    #: ||w_after - w_before|| / ||w_before|| over the dense weights, on steps that asked for it (`watch_update`).
    update_ratio: float | None = None


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
        sync: GradientSync | None = None,
        shares: Sequence[int] | None = None,
    ) -> None:
        self.config = config
        train = config.training
        self.run_dir = Path(run_dir) if run_dir else None
        self.threads = apply_threads(train.threads or threads, train.interop_threads or interop_threads)
        self.device = devices.pick_device(train.device)
        if self.device.type == "cpu":
            one_heap()  # before the micro-batch threads allocate: peaks that follow the cut, not the threads' timing
        self.dtype = devices.pick_dtype(
            self.device, config.model.forward_dtype if config.model.forward_dtype != "auto" else train.dtype
        )
        self.loss_dtype = devices.loss_dtype(self.device)
        use_compile_caches()  # before the model is built (Triton reads its switches as kernels are defined)

        # The task opens the data, seeds torch and builds the model (and TRM's sparse optimizer and carry).
        self.task = make_task(config, self.device, self.dtype, self.loss_dtype)
        self.train_data, self.test_data = self.task.train_data, self.task.test_data
        self.model = self.task.model
        self.optimizer = self._build_optimizer()
        self.sparse_optimizer = self.task.sparse_optimizer
        self.sync: GradientSync = sync or LocalSync()
        if self.sparse_optimizer is not None and self.sync.world_size > 1:
            # Every worker applies SignSGD to the union of the rows all workers touched, so tables stay equal.
            self.sparse_optimizer.gather = self.sync.gather_rows
        self.ema = ModelEMA(self.model, decay=train.ema_decay, warmup=train.ema_warmup) if train.ema else None
        #: The model's regions running compiled (after the EMA's copy, which stays eager for evaluation).
        self.compiled = compile_regions(self.model, plan_compile(train.compile, self.device.type))
        #: Tokens per training sample where throughput is counted in tokens (the language model), else None.
        self.tokens_per_sample = self.task.tokens_per_sample

        self.global_batch = train.global_batch_size
        #: Samples of each global batch per worker, in rank order; this worker trains the slots of `shard`.
        self.shares = list(shares) if shares else split(self.global_batch, [1.0] * self.sync.world_size)
        self.shard = shard(self.shares, self.sync.rank)
        self.cuts = cut(self.local_batch, train.micro_batch)
        self.last_compute_s = self.last_sync_s = 0.0
        #: Measure the next optimizer step's update/weight ratio (a copy of the weights: asked for on logged steps).
        self.watch_update = False
        self._grad_norm: torch.Tensor | None = None
        self._update_ratio: torch.Tensor | None = None
        #: Fraction of the gradient bytes whose sum started during the last backward, in the latest step.
        self.last_overlap = 0.0
        self._reducer: OverlappedAllReduce | None = None
        #: This worker steps alone on its own samples (the inner steps of a local round, raytrm.train.rounds): no
        #: gradient or metric is exchanged, the gradient is the mean over its own samples, the loss and metrics are
        #: its own, and the EMA waits for the round's synchronized parameters.
        self.steps_alone = False
        self.step = 0
        self.samples_seen = 0
        self.samples_seen_this_run = 0
        self.current_lr = lr_at(0, train, train.steps)
        self._batches = None
        self._prefetched: dict[str, torch.Tensor] | None = None  # the next global batch, gathered (see _prefetch)
        self._sample_bytes = 0  # input bytes of one sample, known from the first step
        self.resources = ResourceSampler()
        #: On a CPU with several threads, micro-batches run side by side, one share of the slots per thread (as many
        #: threads as torch has at each step: the thermal guard may halve them).
        self._threaded = (
            threaded.ThreadedMicroBatches(self.model) if threaded.available(self.device, bool(self.compiled)) else None
        )
        if self.device.type == devices.CPU and self.dtype == torch.float32:
            logger.info("CPU products: %s", onednn.reason())
        if self._threaded is not None and self.threads["threads"] > 1:
            logger.info(
                "micro-batches: one share of the slots per thread, %d threads side by side", self.threads["threads"]
            )

    @property
    def carry(self) -> Carry | None:
        """TRM's carry: one slot per sample of this worker's share (None before the first step and for transformers)."""
        return self.task.carry

    @property
    def local_batch(self) -> int:
        """This worker's share of the global batch (the whole batch alone)."""
        return self.shard.stop - self.shard.start

    def slot_bytes(self) -> int:
        """Bytes each sample of this worker's share holds for a whole step: its inputs and TRM's carry slot."""
        held = self._sample_bytes
        state = self.task.carry_state()
        if state is not None:
            held += sum(t[0].numel() * t.element_size() for t in state.values() if t.dim() > 0)
        return held

    def _build_optimizer(self) -> torch.optim.Optimizer:
        train = self.config.training
        kind = AdamATan2 if train.optimizer == "adam_atan2" else torch.optim.AdamW
        # On CUDA, AdamW's fused kernel updates every weight in a few launches, where the default runs a dozen
        # per-tensor-list kernels that the host launches one by one (1.3 ms a TRM step on an H200, the GPU idle).
        extra = {} if kind is AdamATan2 else {"eps": 1e-8, "fused": True if self.device.type == devices.CUDA else None}
        return kind(
            self.model.parameters(), lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, **extra
        )

    # -- data ------------------------------------------------------------------------------------------------------

    def _next_global_batch(self) -> dict[str, torch.Tensor]:
        if self._prefetched is not None:
            batch, self._prefetched = self._prefetched, None
            return batch
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

    def _prefetch(self) -> None:
        """Gather the next global batch while the device still runs this step, and queue its copy to the device
        behind this step's work; the task draws what the next step needs on the host too (prepare_step).

        On CUDA the batch goes through page-locked memory, so the host does not wait for the copy, and the next step
        starts on its first kernels: at its start the host used to spend 0.3 ms on the batch's copies and 0.25 ms on
        TRM's exploration draws with the device idle (TRM-attention on an H200's host). Elsewhere the copy stays at
        the step's start.
        """
        batch = self._next_global_batch()
        if self.device.type == devices.CUDA:
            batch = {k: devices.queued_copy(v, self.device) for k, v in batch.items()}
        self._prefetched = batch
        self.task.prepare_step(self.global_batch)

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
        sums = self._forward_backward(batch, on_out_of_memory, prefetch=batch is None)
        self.optimizer_step()
        # Alone, the host queues the forward, backward and optimizer step back to back and reads their results here,
        # once (with several workers, summing the gradients waited already).
        loss, metrics = self._read(*sums)
        if self.sync.world_size == 1:
            self.last_compute_s = time.perf_counter() - start
        devices.synchronize(self.device)
        seconds = time.perf_counter() - start
        grad_norm, ratio = (float(t) if t is not None else None for t in (self._grad_norm, self._update_ratio))
        times = (seconds, self.global_batch, self.last_compute_s, self.last_sync_s)
        return StepResult(self.step, loss, metrics, *times, grad_norm=grad_norm, update_ratio=ratio)

    def forward_backward(
        self, batch: dict[str, torch.Tensor] | None = None, on_out_of_memory: Callable[[int], int] | None = None
    ) -> tuple[float, dict[str, float | None]]:
        """Accumulate the gradient of one global batch, cut into micro-batches; each TRM slot keeps its own carry.

        Every micro-batch's loss is divided by a count of the whole global batch (the task's), so the accumulated
        gradient is the gradient of the whole batch whatever the cut; with several workers each accumulates its own
        slots and the sync object sums gradients and metrics. Returns the loss and the metrics as rates.
        """
        return self._read(*self._forward_backward(batch, on_out_of_memory))

    def _read(self, loss: Scalar, totals: dict[str, Scalar]) -> tuple[float, dict[str, float | None]]:
        """The loss and the metrics' rates on the host, from sums that may still be on the device (stepping alone:
        over this worker's own samples)."""
        loss_sum, sums = self._read_sums(loss, totals)
        if self.steps_alone and self.sync.world_size > 1:
            return loss_sum * self.global_batch / self.local_batch, self.task.rates(sums, self.local_batch)
        return loss_sum, self.task.rates(sums, self.global_batch)

    def _read_sums(self, loss: Scalar, totals: dict[str, Scalar]) -> tuple[float, dict[str, float]]:
        """The sums as host floats, with one wait for the device, not one a value."""
        keys = list(totals)
        values = [loss, *totals.values()]
        on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        if on_device:
            # In float64 where the device has it: the loss is summed in float64 there, and the host's floats are.
            stacked = torch.stack([values[i].to(devices.loss_dtype(self.device)) for i in on_device])
            for i, value in zip(on_device, stacked.tolist(), strict=True):
                values[i] = value
        floats = [float(v) for v in values]
        return floats[0], dict(zip(keys, floats[1:], strict=True))

    def _forward_backward(
        self,
        batch: dict[str, torch.Tensor] | None,
        on_out_of_memory: Callable[[int], int] | None,
        prefetch: bool = False,
    ) -> tuple[Scalar, dict[str, Scalar]]:
        """forward_backward without reading its results: the loss and metric sums, on the device alone. prefetch:
        gather the next global batch once the backward is queued, while the device runs it (before the workers'
        sums, which wait for the device)."""
        batch = self._next_global_batch() if batch is None else batch
        batch = {k: rows(v, self.shard).to(self.device, non_blocking=True) for k, v in batch.items()}
        self._sample_bytes = sum(math.prod(v.shape[1:]) * v.element_size() for v in batch.values() if v.dim() > 0)
        start = time.perf_counter()
        step = self.task.begin_step(batch, self.global_batch, self.shard)
        # Only allocators that raise need a copy to redo from; on the CPU nothing raises, so nothing is copied.
        saved = self.task.snapshot() if on_out_of_memory else None
        reducer = self._overlapped_reducer()
        if reducer is not None:
            reducer.start()
        redone = False
        while True:
            try:
                loss, totals = self._accumulate(batch, step, None if redone else reducer)
                break
            except Exception as error:
                if on_out_of_memory is None or not is_out_of_memory(error):
                    raise
                if reducer is not None and not redone:
                    # The peers are summing this step's buckets: send ours (void), so none of theirs waits forever.
                    reducer.abandon()
                redone = True
                self._discard_partial_step(saved)
                self.set_micro_batch(on_out_of_memory(self.step))
        if prefetch:
            self._prefetch()
        if self.sync.world_size > 1:
            devices.synchronize_compute(self.device)  # the balancer compares workers' compute times: count queued work
            self.last_compute_s = time.perf_counter() - start
            params = list(self.model.parameters())
            if self.steps_alone:
                # The task divided by the global batch's count: this worker's gradient is (b_i / B) of its own mean.
                self.last_sync_s = 0.0
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(self.global_batch / self.local_batch)
                return loss, totals
            keys = sorted(totals)
            local, local_totals = self._read_sums(loss, totals)
            values = [local, *(local_totals[k] for k in keys)]
            if reducer is None:
                self.last_sync_s = self.sync.all_reduce_gradients(params)
                summed = self.sync.sum_floats(values)
            else:
                self.last_sync_s = 0.0 if redone else reducer.finish()
                summed = self.sync.sum_floats([*values, float(redone)])
                if summed.pop() == 0:
                    reducer.commit()
                else:  # some rank redid its samples after sending its buckets: every rank sums its gradient again
                    self.last_sync_s += self.sync.all_reduce_gradients(params)
                self.last_overlap = reducer.overlapped_bytes / reducer.total_bytes
            loss, totals = summed[0], dict(zip(keys, summed[1:], strict=True))
        return loss, totals

    def _accumulate(
        self, batch: dict[str, torch.Tensor], step: Any, reducer: OverlappedAllReduce | None = None
    ) -> tuple[Scalar, dict[str, Scalar]]:
        """This worker's loss and metric sums over its micro-batches, added up on the device (the last
        micro-batch's backward arms the reducer)."""
        if not self.model.training:  # train() visits every module: 0.1-0.2 ms of host time a step, device idle
            self.model.train()
        totals: dict[str, Scalar] = {}
        loss_sum: Scalar = 0.0
        threads = threaded.side_by_side(self.local_batch, self.micro_batch, torch.get_num_threads())
        if self._threaded is not None and threads > 1 and reducer is None and not threaded.observed():
            groups = threaded.plan(self.local_batch, self.micro_batch, threads)
            results = self._threaded.run(groups, lambda model, part: self.task.micro_step(batch, part, step, model))
        else:
            results = []
            parts = self.slices()
            for i, part in enumerate(parts):
                if reducer is not None and i == len(parts) - 1:
                    reducer.arm()
                results.append(self.task.micro_step(batch, part, step))
        for loss, metrics in results:
            loss_sum += loss
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        return loss_sum, totals

    def _overlapped_reducer(self) -> OverlappedAllReduce | None:
        """The all-reduce overlapped with the last backward, where gradients finish early (the transformer)."""
        if self.sync.world_size == 1 or self.steps_alone or not self.task.overlaps_sync:
            return None
        if self._reducer is None:
            self._reducer = self.sync.overlapped(list(self.model.parameters()))
        return self._reducer

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
        """This worker's micro-batches, as slices of its own slots."""
        bounds = [0, *itertools.accumulate(self.cuts)]
        return [slice(a, b) for a, b in itertools.pairwise(bounds)]

    def set_micro_batch(self, micro_batch: int) -> list[int]:
        """Re-cut this worker's share into micro-batches of at most micro_batch; samples and gradient are unchanged."""
        self.cuts = cut(self.local_batch, micro_batch)
        return self.cuts

    def set_shares(self, shares: Sequence[int]) -> None:
        """Split the following global batches anew between the workers (every rank calls it with the same shares).

        TRM's carry slots move with their samples: the whole carry is gathered, then each worker keeps its new slots.
        """
        full = self._global_carry()
        self.shares = list(shares)
        self.shard = shard(self.shares, self.sync.rank)
        if full is not None:
            self.task.load_carry({k: v[self.shard] for k, v in full.items()}, self.device)
        self.cuts = cut(self.local_batch, self.micro_batch)

    def _global_carry(self) -> dict[str, torch.Tensor] | None:
        """The carry of every slot of the global batch (a collective with several workers); None without one."""
        state = self.task.carry_state()
        if state is None or self.sync.world_size == 1:
            return state
        return {k: self.sync.gather_slots(v, self.shard, self.global_batch) for k, v in state.items()}

    def optimizer_step(self) -> None:
        """Apply the accumulated gradient: main optimizer, SignSGD on the puzzle embedding, then the EMA."""
        train = self.config.training
        lr = self.current_lr = lr_at(self.step, train, train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # The norm before clipping is the one clipping computes anyway; without clipping, one read of the gradients.
        if train.grad_clip:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip)
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        watched = [p.detach() for p in self.model.parameters() if p.grad is not None] if self.watch_update else []
        before = torch._foreach_mul(watched, 1.0) if watched else None
        self.optimizer.step()
        self._update_ratio = _update_ratio(before, watched) if before is not None else None
        self.optimizer.zero_grad(set_to_none=True)
        if self.sparse_optimizer is not None:
            # The embedding follows the same warm-up and schedule, scaled to its own learning rate.
            self.sparse_optimizer.lr = lr * train.puzzle_emb_lr / train.lr
            self.sparse_optimizer.step()
        if self.ema is not None and not self.steps_alone:
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
        """Release the batch stream (and its worker processes, if any) and the overlapped all-reduce's hooks."""
        self._batches = self._prefetched = None
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
        if self._threaded is not None:
            self._threaded.close()

    # -- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs: model, optimizers, EMA, carry, step, RNG states, data position, config.

        The carry is the whole global batch's, so a resume may split it between another number of workers.
        """
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sparse_optimizer": self.sparse_optimizer.state_dict() if self.sparse_optimizer else None,
            "ema": self.ema.state_dict() if self.ema else None,
            "carry": self._global_carry(),
            "cuts": list(self.cuts),
            "shares": list(self.shares),
            "micro_batches": [int(row[0]) for row in self.sync.gather_floats([self.micro_batch])],
            "step": self.step,
            "samples_seen": self.samples_seen,
            "rng": {"torch": torch.get_rng_state(), **self.task.rng_state()},
            "config": cfg.to_dict(self.config),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's state; one written for another experiment, or whose tensors are not this
        config's shapes, is refused in one line before anything is restored (raytrm.train.checkpoint_fit)."""
        check_checkpoint_fits(state, self)
        self.model.load_state_dict(state["model"])
        _load_optimizer(self.optimizer, state["optimizer"])
        if self.sparse_optimizer and state["sparse_optimizer"]:
            _load_optimizer(self.sparse_optimizer, state["sparse_optimizer"])
        if self.ema and state["ema"]:
            self.ema.load_state_dict(state["ema"])
        # On as many workers as saved: the same split and cuts, so the same sums in the same order. On another
        # number: this run's split, each worker cutting at the micro-batch the run had reached.
        saved = [int(b) for b in state.get("shares", [self.global_batch])]
        same_workers = len(saved) == self.sync.world_size
        if same_workers:
            self.shares, self.shard = saved, shard(saved, self.sync.rank)
        carry = state["carry"]
        self.task.load_carry({k: v[self.shard] for k, v in carry.items()} if carry else None, self.device)
        micro = state.get("micro_batches") or [max(int(c) for c in state["cuts"])]
        self.cuts = cut(self.local_batch, int(micro[self.sync.rank] if same_workers else micro[0]))
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        if self.step < 0 or self.samples_seen < 0:  # the batch stream is a function of the step: no negative ones
            raise ValueError(f"step {self.step} and samples_seen {self.samples_seen}: expected counts >= 0")
        torch.set_rng_state(state["rng"]["torch"])
        self.task.load_rng_state(state["rng"])
        self._batches = self._prefetched = None  # restart the batch stream at the resumed step


def _update_ratio(before: list[torch.Tensor], after: list[torch.Tensor]) -> torch.Tensor:
    """||after - before|| / ||before|| over all the tensors taken as one vector (on the device, not read)."""
    torch._foreach_sub_(before, after)  # before now holds minus the update
    update = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(before)]))
    weights = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(after)]))
    return update / weights.clamp_min(torch.finfo(torch.float32).tiny)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """optimizer.load_state_dict, then the checks torch leaves to the first step, which would fail deep inside it.

    Numeric hyperparameters stay numbers (lr, eps) or tuples of as many numbers (betas), switches keep this run's
    values (amsgrad, maximize); every parameter's state is
    a mapping of the same keys: its step count a number or a 0-d tensor, every other entry (the moments) a tensor of
    the parameter's shape.
    """
    before = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for old, group in zip(before, optimizer.param_groups, strict=True):
        for key, value in old.items():
            if key not in group:  # torch takes the saved groups whole: a key they lack is gone until a step needs it
                raise KeyError(f"optimizer hyperparameter {key!r} is missing")
            new = group[key]
            if _number(value) and not _number(new):
                raise TypeError(f"optimizer hyperparameter {key!r}: got {new!r}, expected a number")
            if isinstance(value, bool) and new is not None and new is not value:  # amsgrad needs a state of its own
                raise ValueError(f"optimizer hyperparameter {key!r}: got {new!r}, this run's optimizer has {value!r}")
            if isinstance(value, tuple) and not (
                isinstance(new, (tuple, list)) and len(new) == len(value) and all(map(_number, new))
            ):
                raise ValueError(f"optimizer hyperparameter {key!r}: got {new!r}, expected {len(value)} numbers")
    keys = None
    for group in optimizer.param_groups:
        for param in group["params"]:
            saved = optimizer.state.get(param)
            if saved is not None and not isinstance(saved, dict):
                raise TypeError(f"optimizer state of a parameter: got {type(saved).__name__}, expected a mapping")
            if not saved:
                continue
            keys = set(saved) if keys is None else keys
            if set(saved) != keys:
                raise KeyError(f"optimizer state of a parameter holds {sorted(saved)}, the others {sorted(keys)}")
            for key, value in saved.items():
                tensor = isinstance(value, torch.Tensor)
                if key == "step" and (_number(value) or (tensor and value.shape == ())):
                    continue
                if key != "step" and tensor and value.shape == param.shape:
                    continue
                what = tuple(value.shape) if tensor else type(value).__name__
                raise ValueError(f"optimizer state {key!r} of a {tuple(param.shape)} parameter: got {what}")
