"""A training run on disk: the resolved config, metrics.jsonl, checkpoints and summary.json in one directory.

With several workers (a sync object), every rank runs this same loop; rank 0 alone writes the run directory,
evaluates and shows progress, and the others read its checkpoint through the sync object when resuming.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.hardware.pressure import MemoryReader
from raytrm.hardware.thermal import ThermalReader
from raytrm.train import checkpoint as ckpt
from raytrm.train.adaptive import GovernorSettings, MemoryGovernor
from raytrm.train.metrics import MetricsLog, Progress
from raytrm.train.peak import PeakMemory, trim_heap
from raytrm.train.peers import Peers
from raytrm.train.sync import GradientSync
from raytrm.train.thermal_guard import ThermalGuard
from raytrm.train.threads import apply_threads
from raytrm.train.trainer import Trainer

logger = logging.getLogger(__name__)

CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINT_DIR = "config.yaml", "metrics.jsonl", "summary.json", "checkpoints"


def resumable_config(run_dir: Path) -> cfg.ExperimentConfig:
    """The config a run directory was started with; refused with the fix when the directory is not a run."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise UserError(
            f"{run_dir}: not a raytrm run directory (no {CONFIG_FILE}); start one with `raytrm train --out {run_dir}`"
        )
    return cfg.load(cfg.ExperimentConfig, path)


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
) -> dict[str, Any]:
    """Train to the config's step count or time budget, recording everything in run_dir; returns the summary.

    The readers and governor settings are injectable so tests can script pressure, heat and thresholds. With a
    sync object this is one worker of several: `shares` splits the global batch (default: equally), `balance`
    lets measured step times move the shares, and `on_checkpoint(step, path)` is told of each checkpoint on every
    rank (the path on rank 0, None elsewhere).
    """
    train = config.training
    if not train.steps and not train.time_budget_s:
        raise UserError("training needs a stopping rule; give --steps N or --time-budget SECONDS")
    run_dir = Path(run_dir)
    trainer = Trainer(config, run_dir, sync=sync, shares=shares)
    rank0 = trainer.sync.rank == 0
    peers = Peers(trainer, balance=balance)
    governor = _governor(trainer, governor_settings)
    resumed_from = None
    if resume:
        state = ckpt.latest_good_checkpoint(run_dir / CHECKPOINT_DIR) if rank0 else None
        state = trainer.sync.broadcast_object(state)
        if state is None:
            raise UserError(
                f"{run_dir}: nothing to resume, no checkpoint in {run_dir / CHECKPOINT_DIR}; "
                "drop --resume to start afresh"
            )
        with ckpt.restoring(state):
            trainer.load_state_dict(state)
            peers.load_state_dict(state.get("shares_balancer"))
            if governor is not None and rank0 and state.get("memory_governor"):
                governor.load_state_dict(state["memory_governor"])
        resumed_from = trainer.step
        logger.info("resumed %s at step %d", run_dir, trainer.step)
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.write_yaml(config, run_dir / CONFIG_FILE)
    log = MetricsLog(run_dir / METRICS_FILE, resume_step=resumed_from) if rank0 else None
    bar = Progress(train.steps, train.time_budget_s, enabled=progress and rank0)
    try:
        readers = (memory_reader or MemoryReader(device=trainer.device), thermal_reader or ThermalReader())
        summary = _loop(trainer, governor, peers, log, bar, run_dir, *readers, on_checkpoint=on_checkpoint)
    finally:
        bar.close()
        if log is not None:
            log.close()
        trainer.close()
    summary["resumed_from_step"] = resumed_from
    if rank0:
        write_json(summary, run_dir / SUMMARY_FILE)
    return summary


def _governor(trainer: Trainer, settings: GovernorSettings | None) -> MemoryGovernor | None:
    """A memory governor when the config sets a budget; it starts the run at its first probe cut."""
    train = trainer.config.training
    if not train.memory_budget_mb:
        return None
    governor = MemoryGovernor(
        budget_bytes=train.memory_budget_mb * 2**20,
        global_batch=train.global_batch_size,
        max_micro_batch=train.micro_batch_size or train.global_batch_size,
        settings=settings or GovernorSettings(),
    )
    trainer.set_micro_batch(governor.micro_batch)
    return governor


def _loop(
    trainer: Trainer,
    governor: MemoryGovernor | None,
    peers: Peers,
    log: MetricsLog | None,
    bar: Progress,
    run_dir: Path,
    memory: MemoryReader,
    thermal: ThermalReader,
    on_checkpoint: Callable[[int, Path | None], None] | None = None,
) -> dict[str, Any]:
    train = trainer.config.training
    rank0 = log is not None  # the one worker that writes the run directory and evaluates

    def write(record: dict[str, Any]) -> None:
        if log is not None:
            log.write(record)

    start = time.perf_counter()
    train_seconds, window_seconds, window_samples = 0.0, 0.0, 0
    last_accuracy = None  # of the latest step in which some sequence halted
    step_peak, peak_method = 0, ""
    guard = (
        ThermalGuard(cap=train.thermal_cap, action=train.thermal_action, threads=trainer.threads["threads"])
        if train.thermal_cap
        else None
    )
    thermal_scale = 1.0  # the guard's share of the micro-batch, on top of the memory governor's choice

    def save() -> Path | None:
        state = trainer.state_dict()  # with several workers, a collective: every rank takes part
        state["shares_balancer"] = peers.state_dict()
        if governor is not None:
            state["memory_governor"] = governor.state_dict()
        path = ckpt.save_checkpoint(state, run_dir / CHECKPOINT_DIR, trainer.step) if rank0 else None
        if on_checkpoint is not None:
            on_checkpoint(trainer.step, path)
        return path

    while not (train.steps and trainer.step >= train.steps) and not peers.stop(
        bool(train.time_budget_s and time.perf_counter() - start >= train.time_budget_s)
    ):
        seen = len(governor.events) if governor is not None else 0
        with PeakMemory(trainer.device.type) as peak:
            result = trainer.train_step(on_out_of_memory=governor.on_out_of_memory if governor else None)
        step_peak, peak_method = max(step_peak, peak.bytes), peak.method
        base_micro = train.micro_batch  # what the config asks for, before the guard's share
        events: list[dict[str, Any]] = []  # this worker's adaptations; rank 0 writes every worker's
        if governor is not None:
            base_micro = governor.after_step(trainer.step, peak.bytes, memory.read().pressure)
            events += governor.events[seen:]
        logging_step = trainer.step % train.log_interval == 0 or trainer.step == train.steps
        heat = thermal.read() if guard is not None or logging_step else {}
        if guard is not None:
            decision = guard.observe(trainer.step, heat.get("thermal_state"), result.samples / result.seconds)
            if decision.event:
                events.append(decision.event)
            if decision.threads:
                apply_threads(decision.threads)
                guard.reset_baseline()
            if decision.micro_batch_scale:
                thermal_scale = min(1.0, thermal_scale * decision.micro_batch_scale)
            if decision.pause_s:
                time.sleep(decision.pause_s)
        micro = max(1, int(base_micro * thermal_scale)) if governor is not None or thermal_scale < 1 else None
        if micro is not None and micro != trainer.micro_batch:
            if micro < trainer.micro_batch:
                trim_heap()  # otherwise the freed activations stay resident and the smaller cut looks as large
            trainer.set_micro_batch(micro)
            if guard is not None:
                guard.reset_baseline()
        # A share cap matters only beside other workers: alone, the step skips measuring it.
        cap = (
            governor.share_cap(trainer.local_batch, trainer.slot_bytes())
            if governor is not None and not peers.alone
            else None
        )
        for event in peers.after_step(result, cap, events):
            write(event)
        train_seconds += result.seconds
        window_seconds += result.seconds
        window_samples += result.samples
        if result.metrics.get("accuracy") is not None:
            last_accuracy = result.metrics["accuracy"]
        if logging_step:
            record = {
                "step": trainer.step,
                "samples_per_sec": window_samples / max(window_seconds, 1e-9),
                **_tokens_per_sec(trainer, window_samples / max(window_seconds, 1e-9)),
                "loss": result.loss,
                **result.metrics,
                "lr": trainer.current_lr,
                **trainer.resources.sample(),
                **heat,
            }
            if peers.rows:
                record["workers"] = peers.rows
            window_seconds, window_samples = 0.0, 0
            if rank0 and train.eval_interval and trainer.step % train.eval_interval == 0:
                record.update(trainer.evaluate())
            write(record)
            shown = {"samples/s": record["samples_per_sec"]}
            if "tokens_per_sec" in record:
                shown["tokens/s"] = record["tokens_per_sec"]
            shown["loss"] = result.loss
            if result.metrics.get("bits_per_byte") is not None:
                shown["bpb"] = result.metrics["bits_per_byte"]
            shown["acc"] = last_accuracy if last_accuracy is not None else "-"
            shown["rss_mb"] = record["rss_mb"]
            bar.update(trainer.step, shown)
        if train.checkpoint_interval and trainer.step % train.checkpoint_interval == 0:
            save()
    final_eval = trainer.evaluate() if rank0 else {}
    path = save()
    peak_rss = trainer.resources.sample()["peak_rss_mb"]
    return {
        "steps": trainer.step,
        "samples_seen": trainer.samples_seen,
        "wall_seconds": time.perf_counter() - start,
        "train_seconds": train_seconds,
        "samples_per_sec": trainer.samples_seen_this_run / max(train_seconds, 1e-9),
        **_tokens_per_sec(trainer, trainer.samples_seen_this_run / max(train_seconds, 1e-9)),
        "peak_rss_mb": peak_rss,
        "peak_step_mb": step_peak / 2**20,
        "peak_method": peak_method,
        "micro_batches": list(trainer.cuts),
        "memory": governor.summary(trainer.micro_batch) if governor is not None else None,
        "memory_budget_mb": train.memory_budget_mb,
        "thermal_cap": train.thermal_cap,
        "thermal_max": guard.hottest if guard is not None else None,
        "thermal_events": list(guard.events) if guard is not None else [],
        **final_eval,
        "checkpoint": str(path),
        "device": trainer.device.type,
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "threads": trainer.threads,
        **peers.summary(),
    }


def _tokens_per_sec(trainer: Trainer, samples_per_sec: float) -> dict[str, float]:
    """Throughput in tokens beside samples, for models whose samples are token sequences (the language model)."""
    return {"tokens_per_sec": samples_per_sec * trainer.tokens_per_sample} if trainer.tokens_per_sample else {}
