"""Learning curves in samples: a learning config's quality against the samples it has seen.

What a config has learned after N samples does not depend on the machine: the update is exact whatever the
micro-batch, the threads or the number of workers (docs/architecture.md, invariant 1). The machine sets only how
fast samples come. So a curve measured anywhere, and a throughput measured on each tier, give the quality a config
reaches on that tier in the user's horizon: curve(horizon_seconds x samples_per_sec). Speed knobs (SPEED_FIELDS)
leave the curve alone and move only the throughput; learning knobs (everything else) move the curve.
"""

from __future__ import annotations

import itertools
import math
import statistics
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
    "model.gradient_checkpointing",  # recomputes activations: the same gradients, less memory, more time
)


#: The factor between a horizon's rungs: a successive-halving pruner keeps the best third at each.
HORIZON_ETA = 3


def horizon_rungs(evaluations: int, eta: int = HORIZON_ETA) -> list[tuple[float, int]]:
    """Where a trial trained to the horizon is evaluated: (share of the horizon, evaluation number) for each,
    eta times apart and the last at the horizon; the number is the share in units of the first rung (1, 3, 9 for
    three), the resource a successive-halving pruner counts in."""
    first = eta ** (evaluations - 1)
    return [(eta**k / first, eta**k) for k in range(evaluations)]


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
    from raytrm.train.loop import Loop
    from raytrm.train.run.evaluations import Evaluations, evaluate_quality
    from raytrm.train.run.health import Health
    from raytrm.train.run.stop_rules import SampleLimit
    from raytrm.train.trainer import Trainer

    config = cfg.from_dict(cfg.ExperimentConfig, experiment, "<curve>")
    trainer = Trainer(config)
    targets = sorted(at_samples)
    points: list[dict[str, Any]] = []

    def take(loop: Loop, index: int, scores: dict[str, Any]) -> None:
        point = {
            "samples": trainer.samples_seen,
            "quality": scores["quality"],
            "stderr": scores["quality_stderr"],
            "train_seconds": loop.now(),
        }
        points.append(point)
        if on_point is not None:
            on_point(point)

    evaluations = Evaluations(
        targets,
        lambda loop: trainer.samples_seen,
        lambda loop: evaluate_quality(trainer, eval_puzzles, quality_metric),
        take,
    )
    health = Health(trainer) if config.training.health_checks else None  # warns; a curve runs to its end
    hooks = [SampleLimit(targets[-1] if targets else 0), health, evaluations]
    loop = Loop(trainer, [h for h in hooks if h is not None], clock=clock, measure_peak=False)
    try:
        loop.run()
        train_s = loop.now()
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


def extrapolate(points: Sequence[dict[str, Any]], samples: float) -> float:
    """The quality a curve predicts at `samples`: the least-squares line through its points in log(samples), never
    below the last point and at most 1; the last point's quality where there is one point or `samples` is not
    beyond it.

    Deeper recursion learns slower at first and keeps learning longer: the slope, not the level, says so, and a line
    through every point so far is steadier than the last two (each has its evaluation noise).
    """
    ordered = sorted(points, key=lambda p: p["samples"])
    last = ordered[-1]
    if len(ordered) < 2 or samples <= last["samples"]:
        return last["quality"]
    xs = [math.log(p["samples"]) for p in ordered]
    ys = [p["quality"] for p in ordered]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    return min(1.0, max(last["quality"], my + slope * (math.log(samples) - mx)))
