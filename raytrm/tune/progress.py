"""The live view of a tuning run: one line per finished trial, as Ray Tune reports it."""

from __future__ import annotations

import sys
from fractions import Fraction
from typing import Any, TextIO

from ray.tune import Callback

from raytrm.tune import objectives
from raytrm.tune.tables import format_params


def trial_line(result: dict[str, Any], objective: str) -> str:
    """One finished trial: tier and number, feasibility, objective, samples/s, peak vs budget, params."""
    cons = objectives.constraints(result)
    violated = [k for k, v in cons.items() if v > 0]
    values = objectives.objective_values(result, objective)
    names = objectives.metric_names(objective)
    shown = " ".join(f"{n}={v:.4g}" for n, v in zip(names, values, strict=True))
    curve = result.get("curve") or []
    if curve and curve[-1].get("stderr"):
        shown += f" +-{curve[-1]['stderr']:.2g}"
    if result.get("horizon_samples"):
        shown += f" at the horizon ({result['horizon_samples']:,} samples)"
    budget = result.get("memory_budget_mb")
    peak = f"{result.get('peak_memory_mb') or 0:.0f}" + (f"/{budget:.0f}" if budget else "")
    status = "feasible" if not violated else "INFEASIBLE(" + ",".join(violated) + ")"
    if result.get("status") == objectives.NOT_LEARNING:
        status = "NOT LEARNING"
    if result.get("final") is False and result.get("horizon_share"):
        status = f"pruned at {Fraction(result['horizon_share']).limit_denominator(1000)} of the horizon"
    elif result.get("final") is False:
        status = f"pruned at evaluation {result.get('evaluation')}"
    tier, number = result.get("tier", "?"), result.get("trial_number", "?")
    who = {"speed": f"{tier} speed #{number}", "learning": f"learning #{number} on {tier}"}.get(
        result.get("stage"), f"{tier} #{number}"
    )
    rate = "" if objective == "throughput" else f"samples/s={result.get('samples_per_sec') or 0:.1f} "
    line = (
        f"[{who}] {status} {shown} {rate}peak_mb={peak} "
        f"thermal={result.get('thermal_max', 'unknown')} | {format_params(result.get('params') or {})}"
    )
    if result.get("error"):
        line += f" | {str(result['error'])[:120]}"
    elif result.get("status") == objectives.NOT_LEARNING and result.get("health"):
        line += f" | {result['health'][0].get('reason', '')[:160]}"
    return line


class TrialProgress(Callback):
    """A Tune callback that prints `trial_line` for every completed or errored trial."""

    def __init__(self, stream: TextIO = sys.stdout, objective: str = "quality") -> None:
        self.stream, self.objective = stream, objective

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its run config into the experiment state; the live callback keeps its stream.
        return {"objective": self.objective}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.stream, self.objective = sys.stdout, state["objective"]

    def _print(self, trial: Any, failed: bool) -> None:
        result = dict(trial.last_result or {})
        result.setdefault("tier", trial.config.get("tier"))
        result.setdefault("trial_number", trial.config.get("trial_number"))
        result.setdefault("params", trial.config.get("params"))
        if failed or "status" not in result:
            result.pop("final", None)  # its last word was a progress report, not a pruned evaluation
            result.update(status="failed", error=result.get("error") or "the trial process died")
        print(trial_line(result, self.objective), file=self.stream, flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._print(trial, failed=False)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._print(trial, failed=True)
