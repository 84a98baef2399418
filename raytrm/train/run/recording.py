"""What `raytrm train` records as it goes, as hooks of the loop: metrics.jsonl with the progress line, each step's
time (the summary's warm-up apart from its steady rate), checkpoints.

With several workers every rank runs these hooks (a checkpoint is a collective), and rank 0 alone writes.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrm.train import checkpoint as ckpt
from raytrm.train.loop import Hook, Loop, Step
from raytrm.train.run.metrics import MetricsLog, Progress
from raytrm.train.trainer import Trainer


def tokens_per_sec(trainer: Trainer, samples_per_sec: float) -> dict[str, float]:
    """Throughput in tokens beside samples, for models whose samples are token sequences (the language model)."""
    return {"tokens_per_sec": samples_per_sec * trainer.tokens_per_sample} if trainer.tokens_per_sample else {}


class MetricsRows(Hook):
    """metrics.jsonl and the progress line: every step's events, and a row at each step the loop logs (its
    throughput since the last row, loss and metrics, resources, heat, every worker's row and any due scores).

    log: None on the ranks that do not write; scores(step): the evaluation due in that step's row, if any.
    """

    def __init__(
        self, trainer: Trainer, log: MetricsLog | None, bar: Progress, scores: Callable[[int], dict[str, Any]]
    ) -> None:
        self.trainer, self.log, self.bar, self.scores = trainer, log, bar, scores
        self.window_seconds, self.window_samples = 0.0, 0
        self.window_sync, self.window_steps = 0.0, 0  # this worker's seconds waiting on sync, and the steps
        self.last_accuracy: float | None = None  # of the latest step in which some sequence halted
        self.recorded = 0  # the latest step recorded

    def _write(self, record: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write(record)

    def on_regroup(self, loop: Loop) -> None:
        """A step that ran and then lost a peer in its sync (a local round's sum at its end) ended without its
        `end_step`; where the new membership kept this worker at it (not redone, not passed by a peer's state), it
        stands: its row now, without the peers' rows, which were not exchanged, and without an evaluation due there,
        which would hold the others on the membership while they go on."""
        step = loop.last_step
        if step is not None and step.result.step == self.trainer.step > self.recorded:
            self._record(step, scores=False)

    def end_step(self, loop: Loop, step: Step) -> None:
        self._record(step, scores=True)

    def _record(self, step: Step, scores: bool) -> None:
        trainer, result = self.trainer, step.result
        self.recorded = trainer.step
        for event in step.events:
            self._write(event)
        self.window_seconds += result.seconds
        self.window_samples += result.samples
        self.window_sync += result.sync_seconds
        self.window_steps += 1
        if result.metrics.get("accuracy") is not None:
            self.last_accuracy = result.metrics["accuracy"]
        if not step.logged:
            return
        rate = self.window_samples / max(self.window_seconds, 1e-9)
        record = {
            "step": trainer.step,
            "samples_per_sec": rate,
            **tokens_per_sec(trainer, rate),
            "loss": result.loss,
            **result.metrics,
            "grad_norm": result.grad_norm,
            "update_ratio": result.update_ratio,
            "lr": trainer.current_lr,
            **trainer.resources.sample(),
            **step.heat,
        }
        if trainer.sync.world_size > 1:  # this worker's wait on its peers since the last row, per step and share
            record["sync_s"] = self.window_sync / max(self.window_steps, 1)
            record["sync_share"] = self.window_sync / max(self.window_seconds, 1e-9)
        if step.workers:
            record["workers"] = step.workers
        self.window_seconds, self.window_samples = 0.0, 0
        self.window_sync, self.window_steps = 0.0, 0
        if scores:
            record.update(self.scores(trainer.step))
        self._write(record)
        shown = {"samples/s": record["samples_per_sec"]}
        if "tokens_per_sec" in record:
            shown["tokens/s"] = record["tokens_per_sec"]
        shown["loss"] = result.loss
        if result.metrics.get("bits_per_byte") is not None:
            shown["bpb"] = result.metrics["bits_per_byte"]
        shown["acc"] = self.last_accuracy if self.last_accuracy is not None else "-"
        shown["rss_mb"] = record["rss_mb"]
        self.bar.update(trainer.step, shown)


#: A step slower than this many times the median of the steps after the memory probe still warms up.
WARM_STEP = 2.0


class StepTimes(Hook):
    """Each step's time, for the summary's warm-up apart from its steady rate.

    The warm-up is the run's setup (building the trainer, opening the data, resuming) and its first steps: every
    step until the memory governor has stopped probing, then until the first step that takes at most WARM_STEP times
    the median step of the rest (compilation, CUDA graph recording and the allocator's first requests make the first
    steps slow). The steady rate is the samples over the training seconds of the steps after it. Place after the
    memory governor's cut as the loop applied it: it reads the probing at the step's end.
    """

    def __init__(self, started: float) -> None:
        self.started = started  # the clock when the run began to build its trainer
        self.setup_seconds = 0.0
        self.steps: list[tuple[float, int, float, bool]] = []  # (seconds, samples, end on the run's clock, probing)

    def start(self, loop: Loop) -> None:
        self.setup_seconds = loop.clock() - self.started

    def end_step(self, loop: Loop, step: Step) -> None:
        self.steps.append((step.result.seconds, step.result.samples, loop.step_end, loop.probing))

    def warmup_steps(self) -> int:
        """How many of the run's first steps are warm-up (all of them when none is steady yet)."""
        probed = next((i + 1 for i, (*_, probing) in enumerate(self.steps) if not probing), len(self.steps))
        first = max(1, probed)
        rest = [seconds for seconds, *_ in self.steps[first:]]
        if not rest:
            return len(self.steps)
        median = statistics.median(rest)
        steady = (i for i in range(first, len(self.steps)) if self.steps[i][0] <= WARM_STEP * median)
        return next(steady, len(self.steps))

    def summary(self) -> dict[str, Any]:
        """The summary's warm-up and steady figures: setup and warm-up seconds, steps of each, the steady rate."""
        warm = self.warmup_steps()
        steady = self.steps[warm:]
        seconds = sum(s for s, *_ in steady)
        rate = sum(n for _, n, *_ in steady) / seconds if steady and seconds > 0 else None
        return {
            "setup_seconds": self.setup_seconds,
            "warmup_seconds": self.steps[warm - 1][2] if warm else 0.0,
            "warmup_steps": warm,
            "steady_steps": len(steady),
            "steady_samples_per_sec": rate,
        }


class Checkpoints(Hook):
    """Saves the run every `interval` steps and after the last one: the trainer's state and its parts' (the hooks
    whose state a resume needs, each under its key). `on_checkpoint(step, path)` is told on every rank (the path on
    rank 0, None elsewhere)."""

    def __init__(
        self,
        trainer: Trainer,
        directory: Path,
        interval: int | None,
        parts: dict[str, Any],
        on_checkpoint: Callable[[int, Path | None], None] | None = None,
    ) -> None:
        self.trainer, self.directory, self.interval, self.parts = trainer, directory, interval, parts
        self.on_checkpoint = on_checkpoint
        self.rank0 = trainer.sync.rank == 0
        self.last: Path | None = None  # the checkpoint saved after the last step

    def restore(self) -> bool:
        """Load the latest good checkpoint (read on rank 0, sent to every rank) into the trainer and the parts;
        False where there is none."""
        state = ckpt.latest_good_checkpoint(self.directory) if self.rank0 else None
        state = self.trainer.sync.broadcast_object(state)
        if state is None:
            return False
        with ckpt.restoring(state):
            self.trainer.load_state_dict(state)
            for key, part in self.parts.items():
                part.load_state_dict(state.get(key))
        return True

    def save(self) -> Path | None:
        state = self.trainer.state_dict()  # with several workers, a collective: every rank takes part
        for key, part in self.parts.items():
            state[key] = part.state_dict()
        path = ckpt.save_checkpoint(state, self.directory, self.trainer.step) if self.rank0 else None
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.trainer.step, path)
        return path

    def end_step(self, loop: Loop, step: Step) -> None:
        if self.interval and self.trainer.step % self.interval == 0:
            self.save()

    def finish(self, loop: Loop) -> None:
        self.last = self.save()
