"""When a run evaluates: `raytrm train`'s schedule (every eval_interval steps, into the metrics row, and at the end)
and `Evaluations` at the points of a schedule (a trial's rungs, a curve's sample counts), taken off the run's clock."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from raytrm.families import score
from raytrm.train.loop import Hook, Loop
from raytrm.train.trainer import Trainer


def evaluate_quality(trainer: Trainer, eval_puzzles: int | None, quality_metric: str = "") -> dict[str, Any]:
    """Quality on a fixed number of held-out examples, whatever the micro-batch, so trials and curves compare:
    {"quality": the score named quality_metric ("" the family's default) as the tuner maximizes it
    (raytrm.families.Score), "quality_stderr": its standard error where the task reports one, "eval": every score}.
    The trainer's cut is restored afterwards."""
    measure = score(trainer.config.model, quality_metric)
    micro = trainer.micro_batch
    trainer.set_micro_batch(trainer.cut.units(trainer.global_batch))
    batches = math.ceil(eval_puzzles / trainer.cut.samples_at_widest()) if eval_puzzles else None
    scores = trainer.evaluate(max_batches=batches)
    trainer.set_micro_batch(micro)
    value = scores.get(measure.name)
    stderr = None if measure.loss else scores.get(f"{measure.name}_se")
    return {
        "quality": measure.quality(float(value)) if value is not None else 0.0,
        "quality_stderr": stderr,
        "eval": scores,
    }


class Evaluations(Hook):
    """Evaluations at the points of a schedule, ascending in `position` (a trial's share of its run, a curve's
    samples): each is taken before the first step after the run reaches it, off the run's clock, and handed to
    `take(loop, index, scores)`. The points left when the run ends are taken then, unless a hook halted the run or
    `final` is off."""

    def __init__(
        self,
        points: Sequence[float],
        position: Callable[[Loop], float],
        evaluate: Callable[[Loop], dict[str, Any]],
        take: Callable[[Loop, int, dict[str, Any]], None],
        *,
        final: bool = True,
    ) -> None:
        self.points, self.position, self.evaluate, self.take, self.final = list(points), position, evaluate, take, final
        self.taken = 0

    def before_step(self, loop: Loop) -> None:
        while self.taken < len(self.points) and self.position(loop) >= self.points[self.taken]:
            self._take(loop)

    def finish(self, loop: Loop) -> None:
        while self.final and not loop.halted and self.taken < len(self.points):
            self._take(loop)

    def _take(self, loop: Loop) -> None:
        index = self.taken
        self.taken += 1
        with loop.off_clock():
            scores = self.evaluate(loop)
        self.take(loop, index, scores)


#: How an elastic run lets rank 0 work alone (raytrm.train.elastic.Elastic.alone): every rank calls it with the same
#: tag, rank 0 with the work, the others with None to hold for it.
Alone = Callable[[str, Callable[[], dict[str, Any]] | None], dict[str, Any] | None]


class IntervalEvaluation(Hook):
    """`raytrm train`'s evaluations, on rank 0 (which writes the run): every `interval` steps where a metrics row is
    written (its numbers go into the row), and once after the last step (`final`, into the summary, whole). In an
    elastic run (`alone`) the other ranks hold for each one, outside the deadline of the group's collectives."""

    def __init__(self, trainer: Trainer, interval: int | None, alone: Alone | None = None) -> None:
        self.trainer, self.interval, self.alone = trainer, interval, alone
        self.rank0 = trainer.sync.rank == 0
        self.final: dict[str, Any] = {}

    def _on_rank0(self, tag: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if self.alone is not None:
            return self.alone(tag, work if self.rank0 else None) or {}
        return work() if self.rank0 else {}

    def row_scores(self, step: int) -> dict[str, Any]:
        """The scores for the row of this step, where one is due: its numbers alone. A metrics row is a set of
        series (the report's curves, TensorBoard's scalars); the structures an evaluation also gives (a classifier's
        confusion matrix and its labels) go to the summary, with the final evaluation."""
        if not (self.interval and step % self.interval == 0):
            return {}
        scores = self._on_rank0(f"eval/{step}", self.trainer.evaluate)
        return {key: value for key, value in scores.items() if not isinstance(value, (list, dict))}

    def finish(self, loop: Loop) -> None:
        self.final = self._on_rank0("final", self.trainer.evaluate)
