"""From a trial's measurements to what the sampler sees: objective values, constraints, and the pick of the best.

Objectives (all maximized):
- quality: the validation metric reached in the trial's fixed wall-clock budget. It folds speed (more steps in the
  budget) and statistical efficiency (what each step teaches) into one number: the default.
- throughput: sustained samples/s after warm-up, or tokens/s for a language model (whose samples grow with the
  searched sequence length); for spaces that search only system knobs (threads, micro-batch, sequence length).
- pareto: both; Optuna keeps the front, and `pick` chooses one point: the highest quality among front points whose
  throughput is within `throughput_slack` (default 10%) of the front's best throughput.

Constraints (value <= 0 is feasible, as optuna's trial.set_constraint wants), each scaled so 1 means "twice the
limit" and TPE can rank infeasible trials by how far they are off:
- memory: peak_memory_mb / budget - 1 (measured, or predicted by the memory model when the trial was stopped first)
- thermal: steps of the hottest state seen above the cap (nominal < fair < serious < critical); unknown (no sensor)
  counts as within the cap
- decay: throughput decay - the allowed decay
- failed: 1 when the trial crashed, was killed or ran out of memory, 0 otherwise
- learning: 1 when the trial's health checks stopped it as not learning (status not_learning), 0 otherwise
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from raytrm.config import THERMAL_STATES

CONSTRAINTS = ("memory", "thermal", "decay", "failed", "learning")
#: Result keys a trial reports (the trial function, fakes in tests and the bench replay all use them).
QUALITY, THROUGHPUT, PEAK_MB, THERMAL_MAX, DECAY = (
    "quality",
    "samples_per_sec",
    "peak_memory_mb",
    "thermal_max",
    "throughput_decay",
)
#: Reported beside samples/s by trials of models that count tokens (the language model).
TOKENS_THROUGHPUT = "tokens_per_sec"
BUDGET_MB, THERMAL_CAP, MAX_DECAY, STATUS = "memory_budget_mb", "thermal_cap", "max_throughput_decay", "status"
#: The status of a trial its health checks stopped (raytrm.tune.trial).
NOT_LEARNING = "not_learning"


def metric_names(objective: str) -> list[str]:
    """The result keys that are the study's objective values, in order."""
    return {"quality": [QUALITY], "throughput": [THROUGHPUT], "pareto": [QUALITY, THROUGHPUT]}[objective]


def objective_values(result: dict[str, Any], objective: str) -> list[float]:
    """The objective values of a result; a missing or NaN measurement counts as 0 (the worst: all are >= 0)."""
    out = []
    for key in metric_names(objective):
        value = result.get(key)
        if key == THROUGHPUT and result.get(TOKENS_THROUGHPUT):
            value = result[TOKENS_THROUGHPUT]
        out.append(float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0)
    return out


def constraints(result: dict[str, Any]) -> dict[str, float]:
    """The constraint values of a result against the limits it carries (see the module docstring)."""
    budget = result.get(BUDGET_MB)
    peak = result.get(PEAK_MB) or 0.0
    memory = peak / budget - 1 if budget else 0.0
    hottest, cap = result.get(THERMAL_MAX), result.get(THERMAL_CAP)
    thermal = 0.0
    if hottest in THERMAL_STATES and cap in THERMAL_STATES:
        thermal = float(THERMAL_STATES.index(hottest) - THERMAL_STATES.index(cap))
    decay = (result.get(DECAY) or 0.0) - result.get(MAX_DECAY, 1.0)
    failed = 1.0 if result.get(STATUS) == "failed" else 0.0
    learning = 1.0 if result.get(STATUS) == NOT_LEARNING else 0.0
    # A clean pass is exactly 0 or below; keep the margins the sampler can learn from, but never NaN.
    values = {"memory": memory, "thermal": thermal, "decay": decay, "failed": failed, "learning": learning}
    return {k: (v if math.isfinite(v) else 1.0) for k, v in values.items()}


def is_feasible(constraint_values: dict[str, float]) -> bool:
    return all(v <= 0 for v in constraint_values.values())


def _dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(x >= y for x, y in zip(a, b, strict=True)) and any(x > y for x, y in zip(a, b, strict=True))


def pareto_front(points: list[Sequence[float]]) -> list[int]:
    """Indices of the non-dominated points (all objectives maximized)."""
    return [i for i, p in enumerate(points) if not any(_dominates(q, p) for j, q in enumerate(points) if j != i)]


def pick(points: list[Sequence[float]], objective: str, throughput_slack: float = 0.1) -> list[int]:
    """Indices of feasible points from best to worst under the objective's rule (see the module docstring).

    points are objective-value lists of feasible trials. For pareto the order is: the rule's pick, then the rest of
    the candidates by quality, then the other front points, then everything else by quality.
    """
    if not points:
        return []
    if objective != "pareto":
        return sorted(range(len(points)), key=lambda i: -points[i][0])
    order: list[int] = []
    remaining = list(range(len(points)))
    while remaining:
        sub = [points[i] for i in remaining]
        front = [remaining[i] for i in pareto_front(sub)]
        best_tp = max(points[i][1] for i in front)
        near = [i for i in front if points[i][1] >= (1 - throughput_slack) * best_tp]
        rest = [i for i in front if i not in near]
        by_quality = sorted(near, key=lambda i: (-points[i][0], -points[i][1]))
        order += by_quality + sorted(rest, key=lambda i: (-points[i][0], -points[i][1]))
        remaining = [i for i in remaining if i not in front]
    return order


def best_trials(study: Any, objective: str, throughput_slack: float = 0.1) -> list[Any]:
    """A study's COMPLETE feasible trials, best first (the pick rule of `pick`)."""
    import optuna

    done = [
        t
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if is_feasible(t.constraints)
    ]
    points = [list(t.values) for t in done]
    return [done[i] for i in pick(points, objective, throughput_slack)]
