"""A training run on disk: the resolved config, metrics.jsonl, checkpoints and summary.json in one directory.

`run_training` builds the Trainer, picks the loop's hooks (stop rules, Ctrl-C and SIGTERM, memory governor, thermal
guard, step times, peers, health checks, evaluations, metrics, checkpoints), runs raytrm.train.loop and writes the
summary: why the run stopped, and its warm-up apart from its steady rate. With several workers (a sync
object), every rank runs this same loop; rank 0 alone writes the run directory, evaluates and shows progress, and
the others read its checkpoint through the sync object when resuming.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.families import family
from raytrm.hardware.pressure import MemoryReader
from raytrm.hardware.thermal import ThermalReader
from raytrm.sync.contract import GradientSync
from raytrm.train.checkpoint import latest_good_checkpoint
from raytrm.train.checkpoint_fit import check_checkpoint_fits
from raytrm.train.elastic import Elastic
from raytrm.train.loop import Hook, Loop
from raytrm.train.memory.governor import GovernorSettings
from raytrm.train.run.directory import CHECKPOINT_DIR, CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from raytrm.train.run.directory import resumable_config as resumable_config
from raytrm.train.run.evaluations import IntervalEvaluation
from raytrm.train.run.health import EARLY_STOP_HALTS, Health
from raytrm.train.run.memory_budget import MemoryBudget
from raytrm.train.run.metrics import MetricsLog, Progress
from raytrm.train.run.peers import PeersHook
from raytrm.train.run.recording import Checkpoints, MetricsRows, StepTimes, tokens_per_sec
from raytrm.train.run.stop_rules import Interrupts, StepLimit, TimeBudget
from raytrm.train.run.thermal_guard import ThermalGuard, ThermalHook
from raytrm.train.trainer import Trainer

logger = logging.getLogger(__name__)


def check_resume(config: cfg.ExperimentConfig, run_dir: str | Path) -> None:
    """What a distributed run's driver checks before any worker starts (so that a refusal is one line, with no retries
    and no worker's traceback): the run's newest good checkpoint exists and fits config, checked against a trainer
    built here on the CPU. Where the data is not at its path here, the workers check it where they run."""
    run_dir = Path(run_dir)
    state = latest_good_checkpoint(run_dir / CHECKPOINT_DIR)
    if state is None:
        raise UserError(_nothing_to_resume(run_dir))
    if config.data.path and not Path(config.data.path).expanduser().exists():
        logger.info("the checkpoint's shapes are checked on the workers: %s is not on this machine", config.data.path)
        return
    here = dataclasses.replace(config.training, device="cpu", compile="off")
    trainer = Trainer(dataclasses.replace(config, training=here), run_dir)
    try:
        check_checkpoint_fits(state, trainer, config)
    finally:
        trainer.close()


def _nothing_to_resume(run_dir: Path) -> str:
    return f"{run_dir}: nothing to resume, no checkpoint in {run_dir / CHECKPOINT_DIR}; drop --resume to start afresh"


def write_json(data: dict[str, Any], path: Path) -> None:
    """Write JSON atomically."""
    cfg.write_text_atomic(json.dumps(data, indent=2), path)


def run_training(
    config: cfg.ExperimentConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = False,
    memory_reader: MemoryReader | None = None,
    thermal_reader: ThermalReader | None = None,
    governor_settings: GovernorSettings | None = None,
    sync: GradientSync | None = None,
    shares: Sequence[int] | None = None,
    balance: bool = True,
    on_checkpoint: Callable[[int, Path | None], None] | None = None,
    elastic: Elastic | None = None,
    join_sync: Callable[[], GradientSync] | None = None,
) -> dict[str, Any]:
    """Train to the config's step count or time budget, recording everything in run_dir; returns the summary.

    The readers and governor settings are injectable so tests can script pressure, heat and thresholds. With a
    sync object this is one worker of several: `shares` splits the global batch (default: equally), `balance`
    lets measured step times move the shares, and `on_checkpoint(step, path)` is told of each checkpoint on every
    rank (the path on rank 0, None elsewhere).
    """
    started = time.perf_counter()
    train = config.training
    if not train.steps and not train.time_budget_s:
        raise UserError("training needs a stopping rule; give --steps N or --time-budget SECONDS")
    run_dir = Path(run_dir)
    trainer = Trainer(config, run_dir, sync=sync, shares=shares)
    if join_sync is not None:
        assert elastic is not None and not resume, "a worker joins an elastic run in progress"
        elastic.enter(trainer, join_sync)
    rank0 = trainer.sync.rank == 0
    peers = PeersHook(trainer, balance=balance)
    memory = MemoryBudget.adapting(trainer, governor_settings, memory_reader)
    parts: dict[str, Any] = {"shares_balancer": peers}
    if memory is not None:
        parts["memory_governor"] = memory
    if trainer.strategy.distributed:  # a worker of a group (of one after a loss, too)
        parts["sync"] = CurrentStrategy(trainer)
    checkpoints = Checkpoints(trainer, run_dir / CHECKPOINT_DIR, train.checkpoint_interval, parts, on_checkpoint)
    resumed_from = None
    if resume:
        if not checkpoints.restore():
            raise UserError(_nothing_to_resume(run_dir))
        resumed_from = trainer.step
        logger.info("resumed %s at step %d", run_dir, trainer.step)
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.write_yaml(config, run_dir / CONFIG_FILE)
    log = MetricsLog(run_dir / METRICS_FILE, resume_step=resumed_from) if rank0 else None
    bar = Progress(train.steps, train.time_budget_s, enabled=progress and rank0)
    try:
        guard = (
            ThermalGuard(cap=train.thermal_cap, action=train.thermal_action, threads=trainer.threads["threads"])
            if train.thermal_cap
            else None
        )
        thermal = ThermalHook(thermal_reader or ThermalReader(), guard)
        evaluations = IntervalEvaluation(trainer, train.eval_interval, elastic.alone if elastic is not None else None)
        times = StepTimes(started)
        alone = trainer.sync.world_size == 1
        interrupts = Interrupts() if alone else None  # with several workers, Ray ends the workers itself
        health = Health(trainer, halt_on=EARLY_STOP_HALTS if train.early_stop else ()) if train.health_checks else None
        hooks: list[Hook | None] = [
            StepLimit(train.steps) if train.steps else None,
            TimeBudget(train.time_budget_s) if train.time_budget_s else None,
            interrupts,
            memory,  # decides the cut from the step's peak (the loop applies it, then the heat's share of it)
            thermal,
            times,  # reads, at the step's end, whether the memory governor still probes
            peers,  # exchanges once this worker's cut is decided
            health,  # its events go into this step's metrics line
            evaluations,
            MetricsRows(trainer, log, bar, evaluations.row_scores),
            checkpoints,  # after the final evaluation, as before the loop
        ]
        loop = Loop(
            trainer, [h for h in hooks if h is not None], logged=lambda step: _logged(step, train), regroup=elastic
        )
        with interrupts.installed() if interrupts is not None else contextlib.nullcontext():
            loop.run()
        if rank0:
            _finish(trainer, run_dir)
        summary = _summary(trainer, loop, memory, thermal, peers, evaluations.final, checkpoints.last)
        summary.update(times.summary())
        summary.update(trainer.strategy.summary())
        if elastic is not None:
            summary["membership"] = elastic.changes
    finally:
        bar.close()
        if log is not None:
            log.close()
        trainer.close()
    summary["resumed_from_step"] = resumed_from
    if rank0:
        write_json(summary, run_dir / SUMMARY_FILE)
    return summary


class CurrentStrategy:
    """The checkpoint part of the run's sync strategy, whichever it is now (an elastic run builds a new one when
    its workers change)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.trainer.strategy.load_state_dict(state)


def _finish(trainer: Trainer, run_dir: Path) -> None:
    """What the family leaves besides the checkpoints (the Hugging Face model's directory), after the final one: of
    the weights the final evaluation scored (the EMA's, where the run keeps one)."""
    finish = family(trainer.config.model.name).finish
    if finish is None:
        return
    with trainer.ema.swapped(trainer.model) if trainer.ema is not None else contextlib.nullcontext():
        finish(trainer.task, run_dir)


def _logged(step: int, train: cfg.TrainConfig) -> bool:
    """A metrics row every log_interval steps, and at the last step."""
    return step % train.log_interval == 0 or step == train.steps


def _stop_text(reason: str | None, train: cfg.TrainConfig) -> str | None:
    """Why the run ended, with the limit it reached."""
    if reason == "steps reached":
        return f"steps reached ({train.steps})"
    if reason == "time budget":
        return f"time budget ({train.time_budget_s:g} s)"
    return reason


def _summary(
    trainer: Trainer,
    loop: Loop,
    memory: MemoryBudget | None,
    thermal: ThermalHook,
    peers: PeersHook,
    final_eval: dict[str, Any],
    checkpoint: Path | None,
) -> dict[str, Any]:
    """summary.json: counts, throughput, memory, heat, final scores, the last checkpoint, device and workers."""
    train = trainer.config.training
    rate = trainer.samples_seen_this_run / max(loop.train_seconds, 1e-9)
    return {
        "stop_reason": _stop_text(loop.stop_reason, train),
        "steps": trainer.step,
        "samples_seen": trainer.samples_seen,
        "wall_seconds": loop.now(),
        "train_seconds": loop.train_seconds,
        "samples_per_sec": rate,
        **tokens_per_sec(trainer, rate),
        "peak_rss_mb": trainer.resources.sample()["peak_rss_mb"],
        "peak_step_mb": loop.peak_bytes / 2**20,
        "peak_method": loop.peak_method,
        "micro_batches": list(trainer.cuts),
        "memory": memory.summary() if memory is not None else None,
        "memory_budget_mb": train.memory_budget_mb,
        "thermal_cap": train.thermal_cap,
        **thermal.summary(),
        **final_eval,
        "checkpoint": str(checkpoint),
        "device": trainer.device.type,
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "threads": trainer.threads,
        **peers.summary(),
    }
