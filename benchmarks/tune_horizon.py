"""The learning-curve table at the horizon: search methods replayed on it, judged by the quality each one's pick
reaches at the horizon and what it cost in training (`python -m benchmarks tune --curves`), and where a tuned profile's
config stands in it (`--curves --profile`).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from fractions import Fraction
from typing import Any

import optuna

from benchmarks.tune_measure import point_key
from raytrm.errors import UserError
from raytrm.tune.curves import extrapolate, horizon_rungs, is_speed_knob
from raytrm.tune.search import make_pruner, make_sampler, optimize
from raytrm.tune.space import SearchSpace, describe_horizon


def _until(row: dict[str, Any], fraction: float) -> list[dict[str, Any]]:
    """The curve's points up to `fraction` of the row's horizon (its rungs sit at 1/27, 1/9, 1/3 and 1, each rounded
    to whole global batches on its own, by up to 2.5% at the first: 25% of slack keeps a rung rounded up, and the
    short trial's point, 2.25x past the rung below it, out)."""
    limit = fraction * row["horizon_samples"] * 1.25
    return [p for p in sorted(row["points"], key=lambda p: p["samples"]) if p["samples"] <= limit]


def _halving(rows: list[dict[str, Any]], by_prediction: bool, eta: int = 3) -> tuple[dict[str, Any], float]:
    """Successive halving in each config's own horizon: all start, the best 1/eta go on at each rung (by the
    quality predicted at the horizon, or by the quality reached so far), the last one trains to the horizon.
    Returns the pick and the training it cost, in horizons."""
    alive, cost, done = list(rows), 0.0, 0.0
    for fraction in (1 / 9, 1 / 3):
        cost += len(alive) * (fraction - done)
        done = fraction

        def score(row: dict[str, Any], fraction: float = fraction) -> float:
            seen = _until(row, fraction)
            return extrapolate(seen, row["horizon_samples"]) if by_prediction else seen[-1]["quality"]

        alive = sorted(alive, key=score, reverse=True)[: max(1, math.ceil(len(alive) / eta))]
    cost += len(alive) * (1 - done)
    return max(alive, key=lambda r: r["points"][-1]["quality"]), cost


def truncated(rows: list[dict[str, Any]], fraction: float) -> list[dict[str, Any]]:
    """The table for a horizon `fraction` of the measured one: each curve's points up to there (its rungs at 1/27,
    1/9 and 1/3 are a third of the horizon's 1/9, 1/3 and 1)."""
    out = []
    for row in rows:
        points = _until(row, fraction)
        out.append({**row, "points": points, "horizon_samples": points[-1]["samples"]})
    return out


def _rung_quality(row: dict[str, Any], share: float) -> float:
    return _until(row, share)[-1]["quality"]


def _tuned_at_horizon(space: SearchSpace, rows: list[dict[str, Any]], seed: int) -> tuple[dict[str, Any], float]:
    """`raytrm tune` on a space with a horizon, replayed: the space's sampler over the learning knobs, each trial
    trained to the horizon and evaluated at its rungs, where the space's pruner may stop it.
    Returns the best completed trial's row and the training it cost, in horizons."""
    table = {point_key(r["params"]): r for r in rows}
    learning = {k: p for k, p in space.parsed.items() if not is_speed_knob(k)}
    rungs = horizon_rungs(space.budget.evaluations)

    def run(values: dict[str, Any]) -> dict[str, Any]:
        row = table[point_key(values)]
        early = [(number, _rung_quality(row, share)) for share, number in rungs[:-1]]
        return {"status": "ok", "quality": _rung_quality(row, 1.0), "intermediate": early}

    study = optuna.create_study(direction="maximize", sampler=make_sampler(space, seed), pruner=make_pruner(space))
    optimize(study, learning, run, space.trials, "quality")
    cost = 0.0
    for t in study.trials:
        if t.state == optuna.trial.TrialState.PRUNED:
            cost += max(t.intermediate_values) / rungs[-1][1]
        else:
            cost += 1.0
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = max(done, key=lambda t: t.value)
    return table[point_key(best.params)], cost


def replay_horizon(rows: list[dict[str, Any]], space: SearchSpace | None = None, seeds: int = 10) -> dict[str, Any]:
    """Each method's pick as a fraction of the best quality at the horizon, and what it cost in horizons of
    training (a horizon = one config trained for the whole horizon).

    - short budget: every config for the space's trial budget, the best there picked (`raytrm tune` without a
      horizon);
    - short budget, extrapolated: the same trials, the config whose curve so far, extrapolated in log samples,
      predicts the best quality at the horizon;
    - successive halving by quality so far / by extrapolation: every config starts, the best third goes on at 1/9
      and 1/3 of the horizon (ranked by the quality reached, or by the extrapolated quality), one trains to the end;
    - raytrm: `raytrm tune` with the space's horizon (its sampler, trials to the horizon, its pruner at the
      rungs), median over seeds; then the same with the other evaluation plans (pruned at 1/3 only, no pruning);
    - random at horizon: as many random configs trained to the horizon as the space's own plan costs (rounded
      up), the best picked; median over seeds.
    """
    import random

    truth = {point_key(r["params"]): r["points"][-1]["quality"] for r in rows}
    optimum = max(truth.values())

    def fraction(row: dict[str, Any]) -> float:
        return truth[point_key(row["params"])] / optimum

    def short_points(row: dict[str, Any]) -> list[dict[str, Any]]:
        return [p for p in sorted(row["points"], key=lambda p: p["samples"]) if p["samples"] <= row["short_samples"]]

    short_pick = max(rows, key=lambda r: short_points(r)[-1]["quality"])
    short_cost = sum(min(1.0, r["short_samples"] / r["horizon_samples"]) for r in rows)
    predicted_pick = max(rows, key=lambda r: extrapolate(short_points(r), r["horizon_samples"]))
    naive, naive_cost = _halving(rows, by_prediction=False)
    predicted_halving, predicted_cost = _halving(rows, by_prediction=True)
    methods: dict[str, dict[str, Any]] = {
        "short budget (no horizon)": {
            "fraction": fraction(short_pick),
            "cost": short_cost,
            "params": short_pick["params"],
        },
        "short budget, extrapolated to the horizon": {
            "fraction": fraction(predicted_pick),
            "cost": short_cost,
            "params": predicted_pick["params"],
        },
        "successive halving by quality so far": {
            "fraction": fraction(naive),
            "cost": naive_cost,
            "params": naive["params"],
        },
        "successive halving by extrapolation": {
            "fraction": fraction(predicted_halving),
            "cost": predicted_cost,
            "params": predicted_halving["params"],
        },
    }
    budget_cost = predicted_cost
    if space is not None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # The space as it is, then its other evaluation plans: where a pruner may stop a trial is what decides.
        plans = {(space.budget.evaluations, space.pruner)} | {(2, "successive_halving"), (1, "none")}
        ordered = sorted(plans, key=lambda plan: (plan != (space.budget.evaluations, space.pruner), -plan[0]))
        for evaluations, pruner in ordered:
            variant = copy.deepcopy(space)
            variant.budget.evaluations, variant.pruner = evaluations, pruner
            tuned = [_tuned_at_horizon(variant, rows, seed) for seed in range(seeds)]
            cost = statistics.median(c for _, c in tuned)
            if (evaluations, pruner) == (space.budget.evaluations, space.pruner):
                budget_cost = cost
            shares = [Fraction(share).limit_denominator(1000) for share, _ in horizon_rungs(evaluations)[:-1]]
            stops = f"pruned at {' and '.join(map(str, shares))}" if pruner != "none" and shares else "no pruning"
            methods[f"raytrm tune, {space.trials} trials to the horizon, {stops} (median of {seeds} seeds)"] = {
                "fraction": statistics.median(fraction(r) for r, _ in tuned),
                "cost": cost,
                "params": None,
                "optimum_found": sum(fraction(r) == 1.0 for r, _ in tuned),
                "seeds": seeds,
            }
    draws = max(1, math.ceil(budget_cost))
    randoms = [
        max(fraction(r) for r in random.Random(seed).sample(rows, min(draws, len(rows)))) for seed in range(seeds)
    ]
    methods[f"random at horizon ({draws} configs, median of {seeds} seeds)"] = {
        "fraction": statistics.median(randoms),
        "cost": float(draws),
        "params": None,
        "optimum_found": sum(f == 1.0 for f in randoms),
        "seeds": seeds,
    }
    best = max(rows, key=lambda r: truth[point_key(r["params"])])
    return {"grid": len(rows), "optimum": optimum, "optimum_params": best["params"], "methods": methods}


def format_horizon(out: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"{'params':<40} {'samples/s':>9} {'short q':>8} {'horizon q':>9} {'+-':>6}"]
    for r in rows:
        short = [p for p in r["points"] if p["samples"] <= r["short_samples"]][-1]
        last = r["points"][-1]
        lines.append(
            f"{json.dumps(r['params']):<40} {r['samples_per_sec']:>9.1f} {short['quality']:>8.4f} "
            f"{last['quality']:>9.4f} {last.get('stderr') or 0:>6.4f}"
        )
    lines.append(f"grid {out['grid']} learning configs, optimum at the horizon {out['optimum']:.4f}")
    lines.append(f"{'method':<82} {'best/optimum':>12} {'optimum':>8} {'cost (horizons)':>15}  pick")
    for name, m in out["methods"].items():
        pick = json.dumps(m["params"]) if m["params"] else ""
        found = f"{m['optimum_found']}/{m['seeds']}" if "seeds" in m else ("yes" if m["fraction"] == 1.0 else "no")
        lines.append(f"{name:<82} {m['fraction']:>12.3f} {found:>8} {m['cost']:>15.2f}  {pick}")
    return "\n".join(lines)


def rank_profile(
    rows: list[dict[str, Any]], measured_minutes: float, profile: Any, searched: set[str] | None = None
) -> dict[str, Any]:
    """Where a profile's learning config stands in a curve table at the profile's horizon: every config's quality
    there, best first, and the profile's rank. The table reaches its measured horizon and a third of it. With
    `searched` (the learning knobs the profile's space searched) only the table's configs that space could pick
    compete: those equal to the profile in every other knob."""
    minutes = (profile.measured.objective.get("horizon") or {}).get("minutes")
    if minutes is None and profile.training.time_budget_s:
        minutes = profile.training.time_budget_s / 60
    shares = {1.0: rows, 1 / 3: truncated(rows, 1 / 3)}
    share = next((s for s in shares if minutes and math.isclose(minutes, s * measured_minutes, rel_tol=1e-6)), None)
    if share is None:
        raise UserError(
            f"the profile trains for {minutes} minutes; the table reaches {measured_minutes:g} and "
            f"{measured_minutes / 3:g}: compare a profile tuned for one of those"
        )
    sections = {"model": profile.model, "training": profile.training}
    own = {k: getattr(sections[k.split(".")[0]], k.split(".", 1)[1]) for k in rows[0]["params"]}
    fixed = [k for k in own if searched is not None and k not in searched]
    grid = [r for r in shares[share] if all(r["params"][k] == own[k] for k in fixed)]
    ranked = sorted(grid, key=lambda r: -r["points"][-1]["quality"])
    order = [
        {"params": r["params"], "quality": r["points"][-1]["quality"], "stderr": r["points"][-1].get("stderr")}
        for r in ranked
    ]
    rank = next((i + 1 for i, r in enumerate(order) if r["params"] == own), None)
    return {"minutes": minutes, "profile_params": own, "rank": rank, "order": order}


def format_rank(out: dict[str, Any]) -> str:
    lines = [f"at the {describe_horizon({'minutes': out['minutes']})} horizon, cell accuracy in the table:"]
    for i, r in enumerate(out["order"]):
        mark = "  <- the profile" if r["params"] == out["profile_params"] else ""
        error = f" +-{r['stderr']:.3f}" if r.get("stderr") else ""
        lines.append(f"  {i + 1}. {point_key(r['params'])}  {r['quality']:.3f}{error}{mark}")
    rank = out["rank"]
    lines.append(
        f"the profile's config is {rank} of {len(out['order'])}" if rank else "the profile's config is not in the table"
    )
    return "\n".join(lines)
