"""The one Trainer: alone, inside a Tune trial or inside a Ray Train worker, the same optimizer steps.

Life cycle (as torchtitan's):
- `Trainer(config, run_dir, threads=, interop_threads=, sync=, shares=)` applies the thread counts, picks the device
  and dtype, and builds from the config its family's task (raytrm.families: the data, model, losses, evaluation),
  the optimizer, the EMA, the compiled regions, and the run's sync strategy (raytrm.sync.strategy) over the
  collectives it is handed (none alone) with this worker's share of each global batch.
- `train_step`: accumulate this worker's micro-batches, reduce them with the sync strategy, apply the optimizer;
  a step the allocator refuses is redone from the same state at the smaller cut `on_out_of_memory` returns.
  `forward_backward` and `optimizer_step` are its halves. `set_micro_batch` and `set_shares` re-cut the following
  global batches, never a step's samples or gradient; a micro-batch counts samples, or a classifier's padded tokens
  (raytrm.train.micro_batches: the task's `cut_width`).
- `evaluate` scores the EMA weights on the held-out split; `state_dict` / `load_state_dict` hold everything a resume
  needs (raytrm.train.trainer_state); `close` releases the batch stream, the sync's hooks and the threads.

The Trainer has no loop: raytrm.train.loop drives `train_step` and asks its hooks around each step. Ray code wraps a
Trainer; it never reaches into it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from raytrm import config as cfg
from raytrm.families import build_task
from raytrm.families.task import Scalar
from raytrm.fastpaths import onednn
from raytrm.hardware import device as devices
from raytrm.models.trm import Carry, rows
from raytrm.sync.contract import GradientSync, LocalSync
from raytrm.sync.mode import read_sums
from raytrm.sync.shares import shard, split
from raytrm.sync.strategy import SyncStrategy
from raytrm.train import side_by_side, trainer_state
from raytrm.train.batches import BatchStream
from raytrm.train.compile import compile_regions, plan_compile, use_compile_caches
from raytrm.train.memory.oom import is_out_of_memory
from raytrm.train.memory.peak import one_heap
from raytrm.train.micro_batches import MicroBatches
from raytrm.train.optim import ModelEMA, build_optimizer, lr_at, step_weights
from raytrm.train.resources import ResourceSampler
from raytrm.train.torch_threads import apply_threads

logger = logging.getLogger(__name__)

PACE_STEPS = 8  # the latest steps a worker's pace (seconds per sample) is the median of


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
        self.task = build_task(config, self.device, self.dtype, self.loss_dtype)
        self.train_data, self.test_data = self.task.train_data, self.task.test_data
        self.model = self.task.model
        self.optimizer = build_optimizer(self.model, train, self.device)
        self.sparse_optimizer = self.task.sparse_optimizer
        self.sync: GradientSync = sync or LocalSync()
        self.ema = ModelEMA(self.model, decay=train.ema_decay, warmup=train.ema_warmup) if train.ema else None
        #: The model's regions running compiled (after the EMA's copy, which stays eager for evaluation).
        self.compiled = compile_regions(self.model, plan_compile(train.compile, self.device.type))
        #: Tokens per training sample where throughput is counted in tokens (the language model), else None.
        self.tokens_per_sample = self.task.tokens_per_sample

        self.global_batch = train.global_batch_size
        #: Samples of each global batch per worker, in rank order; this worker trains the slots of `shard`.
        self.shares = list(shares) if shares else split(self.global_batch, [1.0] * self.sync.world_size)
        self.shard = shard(self.shares, self.sync.rank)
        #: The cut of this worker's share into micro-batches, in samples or in padded tokens (`cut.unit`).
        self.cut = MicroBatches(self.local_batch, train.micro_batch, self.task.cut_width)
        self.last_compute_s = self.last_sync_s = 0.0
        #: This worker's compute seconds per sample of its share over its latest steps (several workers): what a new
        #: membership splits the global batch by (raytrm.train.elastic).
        self.paces: collections.deque[float] = collections.deque(maxlen=PACE_STEPS)
        #: Measure the next optimizer step's update/weight ratio (a copy of the weights: asked for on logged steps).
        self.watch_update = False
        self.widest = False  #: run the batches at their widest (task.widest): the steps the memory governor fits on
        self._grad_norm: torch.Tensor | None = None
        self._update_ratio: torch.Tensor | None = None
        #: Fraction of the gradient bytes whose sum started during the last backward, in the latest step.
        self.last_overlap = 0.0
        self.step = 0
        self.samples_seen = 0
        self.samples_seen_this_run = 0
        self.current_lr = lr_at(0, train, train.steps)
        workers = train.dataloader_workers
        self.batches = BatchStream(self.train_data, self.global_batch, train.seed, workers, self.device)
        self._sample_bytes = 0  # input bytes of one sample, known from the first step
        self.resources = ResourceSampler()
        #: How this worker's steps join its peers' (raytrm.sync.strategy): the one sync object of the run.
        self.strategy = SyncStrategy(self, sync, train, overlaps=self.task.overlaps_sync)
        #: On a CPU with several threads, micro-batches run side by side (raytrm.train.micro_batches says how each cut
        #: shares them), on as many threads as torch has at each step: the thermal guard may halve them.
        threaded = side_by_side.available(self.device, bool(self.compiled))
        self._threaded = side_by_side.ThreadedMicroBatches(self.model) if threaded else None
        if self.device.type == devices.CPU and self.dtype == torch.float32:
            logger.info("CPU products: %s", onednn.reason())
        if self._threaded is not None and self.threads["threads"] > 1:
            logger.info("micro-batches on %d threads side by side, cut in %s", self.threads["threads"], self.cut.unit)

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

    # -- one optimizer step ----------------------------------------------------------------------------------------

    def train_step(
        self, batch: dict[str, torch.Tensor] | None = None, on_out_of_memory: Callable[[int], int] | None = None
    ) -> StepResult:
        """One optimizer step over one global batch: forward_backward, then optimizer_step. A step the allocator
        refuses (CUDA, MPS) is redone at the cut on_out_of_memory returns: the same samples and draws from the same
        state (TRM's carry), so nothing is lost or doubled."""
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
        """Accumulate the gradient of one global batch, cut into micro-batches, and reduce it with the sync strategy;
        returns the loss and the metrics as rates. Every micro-batch's loss is divided by a count of the whole global
        batch (the task's), so the gradient is the whole batch's whatever the cut and the shares."""
        return self._read(*self._forward_backward(batch, on_out_of_memory))

    def _read(self, loss: Scalar, totals: dict[str, Scalar], samples: int) -> tuple[float, dict[str, float | None]]:
        """The loss and the metrics' rates on the host, from sums over `samples` samples that may still be on the
        device (the global batch's, or this worker's own inside a local round)."""
        loss_sum, sums = read_sums(loss, totals, self.device)
        return loss_sum * self.global_batch / samples, self.task.rates(sums, samples)

    def _forward_backward(
        self,
        batch: dict[str, torch.Tensor] | None,
        on_out_of_memory: Callable[[int], int] | None,
        prefetch: bool = False,
    ) -> tuple[Scalar, dict[str, Scalar], int]:
        """forward_backward without reading its results: the loss and metric sums (on the device alone) and the
        samples they cover. prefetch: gather the next global batch once the backward is queued, while the device runs
        it (before the workers' sums, which wait for the device)."""
        batch = self.batches.next(self.step) if batch is None else batch
        batch = {k: rows(v, self.shard).to(self.device, non_blocking=True) for k, v in batch.items()}
        batch = self.task.widest(batch) if self.widest else batch
        self._sample_bytes = sum(math.prod(v.shape[1:]) * v.element_size() for v in batch.values() if v.dim() > 0)
        start = time.perf_counter()
        step = self.task.begin_step(batch, self.global_batch, self.shard)
        # Only allocators that raise need a copy to redo from; on the CPU nothing raises, so nothing is copied.
        saved = self.task.snapshot() if on_out_of_memory else None
        while True:
            try:
                loss, totals = self._accumulate(batch, step)
                break
            except Exception as error:
                if on_out_of_memory is None or not is_out_of_memory(error):
                    raise
                self._discard_partial_step(saved)
                self.set_micro_batch(on_out_of_memory(self.step))
        if prefetch:  # the next step's batch and the task's draws for it, while the device still runs this one
            self.batches.prefetch(self.step)
            self.task.prepare_step(self.global_batch)
        if self.sync.world_size > 1:
            devices.synchronize_compute(self.device)  # the balancer compares workers' compute times: count queued work
            self.last_compute_s = time.perf_counter() - start
            self.paces.append(self.last_compute_s / self.local_batch)
        reduced = self.strategy.reduce(loss, totals)
        self.last_sync_s = reduced.sync_seconds
        if reduced.overlap is not None:
            self.last_overlap = reduced.overlap
        return reduced.loss, reduced.totals, reduced.samples

    def _accumulate(self, batch: dict[str, torch.Tensor], step: Any) -> tuple[Scalar, dict[str, Scalar]]:
        """This worker's loss and metric sums over its micro-batches, added up on the device: side by side on a CPU's
        threads, or one after another through the sync strategy (which may start the gradient's sum in the last one)."""
        if not self.model.training:  # train() visits every module: host time every step, with the device idle
            self.model.train()
        totals: dict[str, Scalar] = {}
        loss_sum: Scalar = 0.0
        alone = self._threaded is None or self.strategy.overlapped or side_by_side.observed()
        parts, rounds = self.cut.plan(self.task.slot_costs(step), 1 if alone else torch.get_num_threads())
        if rounds and self._threaded is not None:  # side by side on the CPU's threads
            results = self._threaded.run_rounds(rounds, lambda model, p: self.task.micro_step(batch, p, step, model))
        else:
            results = [self.task.micro_step(batch, part, step) for part in self.strategy.micro_batches(parts)]
        for loss, metrics in results:
            loss_sum += loss
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        return loss_sum, totals

    def _discard_partial_step(self, saved: Any) -> None:
        """Forget the gradient and state updates (TRM's carry) of a step that failed part-way."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.sparse_optimizer is not None:
            self.sparse_optimizer.zero_grad()
        self.task.restore(saved)
        devices.empty_cache(self.device)

    @property
    def micro_batch(self) -> int:
        """The cut in its unit (`cut.unit`): the largest micro-batch in samples, or the padded tokens one may hold."""
        return self.cut.largest

    @property
    def cuts(self) -> list[int]:
        """The samples of each micro-batch (of the latest step, where the cut counts padded tokens)."""
        return self.cut.counts

    def slices(self, lengths: Sequence[int] | None = None) -> list[slice]:
        """This worker's micro-batches, as slices of its own slots (a cut in tokens: of records of these lengths)."""
        return self.cut.parts(lengths)

    def set_micro_batch(self, micro_batch: int) -> list[int]:
        """Re-cut this worker's share, micro_batch a micro-batch at most (the cut's unit); the gradient is unchanged."""
        return self.cut.set(micro_batch)

    @property
    def pace(self) -> float | None:
        """This worker's median compute seconds per sample over its latest steps (None before its first, or alone)."""
        return statistics.median(self.paces) if self.paces else None

    def set_shares(self, shares: Sequence[int]) -> None:
        """Split the following global batches anew between the workers (every rank calls it with the same shares).
        TRM's carry slots move with their samples: the whole carry is gathered, then each worker keeps its new slots."""
        full = self.global_carry()
        self.shares = list(shares)
        self.shard = shard(self.shares, self.sync.rank)
        if full is not None:
            self.task.load_carry({k: v[self.shard] for k, v in full.items()}, self.device)
        self.cut.set(self.micro_batch, self.local_batch)

    def global_carry(self) -> dict[str, torch.Tensor] | None:
        """The carry of every slot of the global batch (a collective with several workers); None without one."""
        state = self.task.carry_state()
        if state is None or self.sync.world_size == 1:
            return state
        return {k: self.sync.gather_slots(v, self.shard, self.global_batch) for k, v in state.items()}

    def optimizer_step(self) -> None:
        """Apply the accumulated gradient: main optimizer, SignSGD on the puzzle embedding, then the EMA."""
        train = self.config.training
        lr = self.current_lr = lr_at(self.step, train, train.steps)
        self._grad_norm, self._update_ratio = step_weights(
            self.optimizer, self.model, lr, train.grad_clip, watch=self.watch_update
        )
        if self.sparse_optimizer is not None:
            # The embedding follows the same warm-up and schedule, scaled to its own learning rate.
            self.sparse_optimizer.lr = lr * train.puzzle_emb_lr / train.lr
            self.sparse_optimizer.step()
        if self.ema is not None and not self.strategy.steps_alone:
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
            result = self.task.evaluate(self.cut.samples_at_widest(), max_batches)
        model.train(was_training)
        return result

    def close(self) -> None:
        """Release the batch stream (and its worker processes, if any) and the overlapped all-reduce's hooks."""
        self.batches.restart()
        self.strategy.close()
        if self._threaded is not None:
            self._threaded.close()

    # -- state -----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs (raytrm.train.trainer_state): model, optimizers, EMA, carry, step, RNG states,
        data position, config; with several workers a collective."""
        return trainer_state.capture(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's state; one written for another experiment, or whose tensors are not this
        config's shapes, is refused in one line before anything is restored (raytrm.train.checkpoint_fit)."""
        trainer_state.restore(self, state)
