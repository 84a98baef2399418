"""Replay of searches on a measured grid (`python -m benchmarks tune --table`): raytrm's search (the space's sampler
with constraints, through the tuner's own suggest/record path), random search and a DeepSpeed-style probe (micro-batch
raised until it no longer fits or gains < 5%, other parameters at base values) each get 20% of the grid's trials;
per method, the best feasible objective found as a fraction of the grid's optimum, over seeds, and how soon it
reached 95% of it.
"""

from __future__ import annotations

import statistics
from typing import Any

import optuna

from benchmarks.tune_measure import point_key
from raytrm.errors import UserError
from raytrm.tune import objectives
from raytrm.tune.search import make_sampler, optimize
from raytrm.tune.space import SearchSpace

MICRO = "training.micro_batch_size"


def _value(result: dict[str, Any], objective: str) -> float:
    """A single number per result: the objective, or quality for pareto; infeasible is worth nothing."""
    if not objectives.is_feasible(objectives.constraints(result)):
        return 0.0
    return objectives.objective_values(result, "quality" if objective == "pareto" else objective)[0]


def replay(space: SearchSpace, rows: list[dict[str, Any]], seeds: int = 10, share: float = 0.2) -> dict[str, Any]:
    """Best-found fractions of the optimum per method over seeds, each with share x grid trials."""
    table = {point_key(r["params"]): r["result"] for r in rows}
    objective = "quality" if space.objective == "pareto" else space.objective
    optimum = max(_value(r, objective) for r in table.values())
    budget = max(1, round(share * len(table)))
    if optimum <= 0:
        raise UserError("the table has no feasible point: nothing to replay")

    def lookup(point: dict[str, Any]) -> dict[str, Any]:
        return table[point_key(point)]

    out: dict[str, Any] = {"grid": len(table), "budget": budget, "optimum": optimum, "trials_to_95": {}}
    for method in ("raytrm", "random"):
        fractions, reached = [], []
        for seed in range(seeds):
            space.sampler = "tpe" if method == "raytrm" else "random"
            study = optuna.create_study(direction="maximize", sampler=make_sampler(space, seed))
            optimize(study, space.parsed, lookup, budget, objective)
            found = [_value(lookup(t.params), objective) / optimum for t in study.trials]
            fractions.append(max(found))
            # Trials until 95% of the optimum was first reached; budget + 1 when it never was.
            reached.append(next((i + 1 for i, f in enumerate(found) if f >= 0.95), budget + 1))
        out[method] = fractions
        out["trials_to_95"][method] = reached
    out["deepspeed-probe"] = [_probe(space, lookup, objective, budget) / optimum]
    return out


def _probe(space: SearchSpace, lookup: Any, objective: str, budget: int) -> float:
    """DeepSpeed-style: other parameters at base values, raise the micro-batch until it fails or gains < 5%."""
    base = {}
    for name, p in space.parsed.items():
        section, field = name.split(".", 1)
        default = space.base.get(section, {}).get(field)
        base[name] = default if default in (p.values() or []) else p.values()[0]
    best = 0.0
    micros = sorted(space.parsed[MICRO].values()) if MICRO in space.parsed else [None]
    for runs, micro in enumerate(micros, start=1):
        point = {**base, **({MICRO: micro} if micro is not None else {})}
        value = _value(lookup(point), objective)
        if value <= 0 or (best and value < best * 1.05) or runs >= budget:
            best = max(best, value)
            break
        best = value
    return best


def format_replay(out: dict[str, Any]) -> str:
    lines = [
        f"grid {out['grid']} points, {out['budget']} trials each (20%), optimum {out['optimum']:.4g}",
        f"{'method':<16} {'median best/opt':>15} {'mean best/opt':>13} {'reached 95%':>12} "
        f"{'median trials to 95%':>21}",
    ]
    for method in ("raytrm", "random", "deepspeed-probe"):
        f = out[method]
        to_95 = out["trials_to_95"].get(method)
        shown = "" if to_95 is None else f"{statistics.median(to_95):g}"
        lines.append(
            f"{method:<16} {statistics.median(f):>15.3f} {statistics.mean(f):>13.3f} "
            f"{sum(x >= 0.95 for x in f):>9}/{len(f):<2} {shown:>21}"
        )
    return "\n".join(lines)
