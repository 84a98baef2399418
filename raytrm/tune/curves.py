"""Learning curves in samples: a learning config's quality against the samples it has seen.

What a config has learned after N samples does not depend on the machine: the update is exact whatever the
micro-batch, the threads or the number of workers (DESIGN.md invariant 1). The machine sets only how fast samples
come. So a curve measured anywhere, and a throughput measured on each tier, give the quality a config reaches on that
tier in the user's horizon: curve(horizon_seconds x samples_per_sec). Speed knobs (SPEED_FIELDS) leave the curve
alone and move only the throughput; learning knobs (everything else) move the curve.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from raytrm import config as cfg

#: Training fields that change how fast samples are processed, never which update is made.
SPEED_FIELDS = (
    "training.micro_batch_size",
    "training.grad_accum_steps",
    "training.threads",
    "training.interop_threads",
    "training.dataloader_workers",
)


def is_speed_knob(name: str) -> bool:
    """Whether a dotted parameter name is a speed knob (see SPEED_FIELDS)."""
    return name in SPEED_FIELDS


def rungs(
    horizon_samples: int, global_batch: int, count: int = 4, eta: int = 3, extra: Sequence[int] = ()
) -> list[int]:
    """Sample counts at which a curve is evaluated: the horizon and count - 1 points eta times apart below it (each a
    whole number of global batches, at least one), plus `extra` points; sorted, without repeats."""
    points = {horizon_samples / eta**k for k in range(count)} | set(extra)
    return sorted({max(1, round(p / global_batch)) * global_batch for p in points})


def learning_curve(
    experiment: dict[str, Any],
    at_samples: Sequence[int],
    *,
    quality_metric: str,
    eval_puzzles: int | None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Train the experiment until each of `at_samples` and evaluate there; returns the points and the throughput.

    Each point: samples seen, quality, its standard error over the evaluated examples (where the task reports one),
    and the training seconds so far (evaluation not counted). on_point, if given, gets each point as it is measured.
    """
    from raytrm.train.trainer import Trainer
    from raytrm.tune.trial import _evaluate

    config = cfg.from_dict(cfg.ExperimentConfig, experiment, "<curve>")
    trainer = Trainer(config)
    points: list[dict[str, Any]] = []
    train_s = 0.0
    try:
        micro = trainer.micro_batch
        for target in sorted(at_samples):
            while trainer.samples_seen < target:
                start = clock()
                trainer.train_step()
                train_s += clock() - start
            scores = _evaluate(trainer, config, micro, eval_puzzles, quality_metric)
            point = {
                "samples": trainer.samples_seen,
                "quality": scores["quality"],
                "stderr": scores["eval"].get(f"{quality_metric}_se"),
                "train_seconds": train_s,
            }
            points.append(point)
            if on_point is not None:
                on_point(point)
    finally:
        trainer.close()
    return {"points": points, "samples_per_sec": trainer.samples_seen / max(train_s, 1e-9)}


def quality_at(points: Sequence[dict[str, Any]], samples: float) -> float | None:
    """The curve's quality at a sample count: linear in log(samples) between measured points, the first point's
    below it; None beyond the last point (not measured that far)."""
    if not points:
        return None
    ordered = sorted(points, key=lambda p: p["samples"])
    if samples <= ordered[0]["samples"]:
        return ordered[0]["quality"]
    for a, b in itertools.pairwise(ordered):
        if samples <= b["samples"]:
            span = math.log(b["samples"]) - math.log(a["samples"])
            w = (math.log(samples) - math.log(a["samples"])) / span if span else 1.0
            return a["quality"] + w * (b["quality"] - a["quality"])
    if math.isclose(samples, ordered[-1]["samples"], rel_tol=1e-9):
        return ordered[-1]["quality"]
    return None
