"""`raytrm bench tune`: tuner efficiency by replay of an exhaustively measured grid.

`--measure` runs every combination of a space's (discrete) parameters once on this machine, with the space's trial
budget, and writes the table as JSON (long: only on a machine you can spare). Replaying the table, raytrm's search
(the space's sampler with constraints, through the tuner's own suggest/record path), random search and a
DeepSpeed-style probe (micro-batch raised until it no longer fits or gains < 5%, other parameters at base values)
each get 20% of the grid's trials; the table shows, per method, the median over seeds of the best feasible
objective found as a fraction of the grid's optimum, and how often it reached 95% of it.

`--curves` measures (with --measure) each learning config's curve to the space's horizon once, then replays search
methods judged by the quality at the horizon (see `replay_horizon`).

`--profile P` instead runs a tuned profile against what a user has without tuning (the space's base settings with
the tier's hand-written defaults from tiers.yaml), in alternation, and prints both objectives side by side.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from fractions import Fraction
from pathlib import Path
from typing import Any

import optuna

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.tune import objectives
from raytrm.tune.curves import extrapolate, horizon_rungs, is_speed_knob
from raytrm.tune.params import grid_points
from raytrm.tune.search import make_sampler, optimize
from raytrm.tune.space import SearchSpace, build_experiment, describe_horizon, horizon_of, load_space

MICRO = "training.micro_batch_size"


def grid(space: SearchSpace) -> list[dict[str, Any]]:
    """Every combination of the space's parameters (each must be discrete)."""
    for name, p in space.parsed.items():
        if p.values() is None or p.type == "float":
            raise UserError(f"{space.source}: params.{name}: the replay bench needs discrete parameters (choices/int)")
    return grid_points(space.parsed) or []


def measure_grid(space: SearchSpace, out: Path) -> list[dict[str, Any]]:
    """Measure every grid point with the space's budget, in this process; writes the table to out."""
    from raytrm import config as cfg
    from raytrm.tune.trial import measure, resolve_for_node

    rows = []
    for point in grid(space):
        experiment, limits = resolve_for_node(cfg.to_dict(build_experiment(space.base, point)), {})
        result = measure(
            experiment,
            memory_budget_mb=limits["memory_budget_mb"],
            thermal_cap=limits["thermal_cap"],
            **space.measure_args(),
        )
        rows.append({"params": point, "result": {k: v for k, v in result.items() if k != "eval"}})
        out.write_text(json.dumps({"space": space.to_dict(), "rows": rows}, indent=1, default=str))
    return rows


def _key(point: dict[str, Any]) -> str:
    return json.dumps(point, sort_keys=True)


def _value(result: dict[str, Any], objective: str) -> float:
    """A single number per result: the objective, or quality for pareto; infeasible is worth nothing."""
    if not objectives.is_feasible(objectives.constraints(result)):
        return 0.0
    return objectives.objective_values(result, "quality" if objective == "pareto" else objective)[0]


def replay(space: SearchSpace, rows: list[dict[str, Any]], seeds: int = 10, share: float = 0.2) -> dict[str, Any]:
    """Best-found fractions of the optimum per method over seeds, each with share x grid trials."""
    table = {_key(r["params"]): r["result"] for r in rows}
    objective = "quality" if space.objective == "pareto" else space.objective
    optimum = max(_value(r, objective) for r in table.values())
    budget = max(1, round(share * len(table)))
    if optimum <= 0:
        raise UserError("the table has no feasible point: nothing to replay")

    def lookup(point: dict[str, Any]) -> dict[str, Any]:
        return table[_key(point)]

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


# -- quality at the user's horizon ---------------------------------------------------------------------------------


def learning_grid(space: SearchSpace) -> list[dict[str, Any]]:
    """Every combination of the space's learning knobs; speed knobs stay at the base's values (the curve ignores
    them)."""
    return [{k: v for k, v in point.items() if not is_speed_knob(k)} for point in _unique(space, grid(space))]


def _unique(space: SearchSpace, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen, out = set(), []
    for point in points:
        key = _key({k: v for k, v in point.items() if not is_speed_knob(k)})
        if key not in seen:
            seen.add(key)
            out.append(point)
    return out


def measure_curves(space: SearchSpace, out: Path, throughput_s: float = 10.0) -> list[dict[str, Any]]:
    """Each learning config's throughput here, then its learning curve to the space's horizon (in samples, so a
    loaded machine changes how long it takes, not what it measures); writes the table to out as it goes.

    The throughputs are measured first, one after the other, so they see the machine in one state. A curve is
    evaluated at the horizon, at a third, a ninth and a 27th of it, and at the samples a trial of the space's
    budget sees (what today's short trials compare).
    """
    from raytrm import config as cfg
    from raytrm.tune.curves import learning_curve, rungs
    from raytrm.tune.trial import measure, resolve_for_node

    points = learning_grid(space)
    experiments = [resolve_for_node(cfg.to_dict(build_experiment(space.base, p)), {})[0] for p in points]
    rates = []
    for experiment in experiments:
        result = measure(
            experiment,
            warmup_s=space.budget.warmup_s,
            measure_s=throughput_s,
            memory_budget_mb=None,
            thermal_cap=None,
            max_throughput_decay=1.0,
            eval_puzzles=1,
        )
        rates.append(result["samples_per_sec"])
    short_s = space.budget.warmup_s + space.budget.measure_s
    rows: list[dict[str, Any]] = []
    for point, experiment, rate in zip(points, experiments, rates, strict=True):
        batch = experiment["training"]["global_batch_size"]
        horizon = space.horizon.samples_at(rate, short_s)
        at = rungs(round(horizon), batch, count=4, eta=3, extra=[round(short_s * rate)])
        curve = learning_curve(
            experiment, at, quality_metric=space.quality_metric, eval_puzzles=space.budget.eval_puzzles
        )
        rows.append(
            {
                "params": point,
                "samples_per_sec": rate,
                "horizon_samples": at[-1],
                "short_samples": max(batch, round(short_s * rate / batch) * batch),
                "points": curve["points"],
            }
        )
        out.write_text(json.dumps({"space": space.to_dict(), "curves": rows}, indent=1, default=str))
    return rows


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
    from raytrm.tune.search import make_pruner

    table = {_key(r["params"]): r for r in rows}
    learning = {k: p for k, p in space.parsed.items() if not is_speed_knob(k)}
    rungs = horizon_rungs(space.budget.evaluations)

    def run(values: dict[str, Any]) -> dict[str, Any]:
        row = table[_key(values)]
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
    return table[_key(best.params)], cost


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

    truth = {_key(r["params"]): r["points"][-1]["quality"] for r in rows}
    optimum = max(truth.values())

    def fraction(row: dict[str, Any]) -> float:
        return truth[_key(row["params"])] / optimum

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
    best = max(rows, key=lambda r: truth[_key(r["params"])])
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


def against_defaults(space: SearchSpace, profile_path: Path, repeats: int) -> dict[str, Any]:
    """The tuned profile's settings against the space's base with the tier's hand-written defaults, in alternation.

    Both run as a trial does (the space's warm-up, window and evaluation; with a horizon, trained to it and judged
    there); alternating the two, repeat after repeat, lets a change in the machine's load reach both alike. Returns
    each side's runs and medians.
    """
    from raytrm import config as cfg
    from raytrm.tune.trial import measure, resolve_for_node

    profile = cfg.load_profile(profile_path)
    tuned = cfg.to_dict(cfg.ExperimentConfig(model=profile.model, data=profile.data, training=profile.training))
    tuned["training"].update(steps=None, time_budget_s=None)  # the bench's own budget decides the length
    sides = {
        "tier defaults": resolve_for_node(cfg.to_dict(build_experiment(space.base, {})), {})[0],
        "tuned profile": resolve_for_node(tuned, {})[0],
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, experiment in sides.items():
            result = measure(experiment, memory_budget_mb=None, thermal_cap=None, **space.measure_args())
            runs[name].append({k: result[k] for k in ("status", "quality", "samples_per_sec", "peak_memory_mb")})
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("quality", "samples_per_sec", "peak_memory_mb")}
        for name, rs in runs.items()
    }
    return {"space": space.name, "profile": str(profile_path), "repeats": repeats, "runs": runs, "medians": medians}


def format_against(out: dict[str, Any]) -> str:
    lines = [f"{'settings':<14} {'quality':>8} {'samples/s':>10} {'peak MiB':>9}   (medians of {out['repeats']})"]
    for name, m in out["medians"].items():
        lines.append(f"{name:<14} {m['quality']:>8.4f} {m['samples_per_sec']:>10.1f} {m['peak_memory_mb']:>9.0f}")
    base, tuned = out["medians"]["tier defaults"], out["medians"]["tuned profile"]
    if base["quality"] > 0 and base["samples_per_sec"] > 0:
        lines.append(
            f"tuned / defaults: quality x{tuned['quality'] / base['quality']:.2f}, "
            f"samples/s x{tuned['samples_per_sec'] / base['samples_per_sec']:.2f}"
        )
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
        lines.append(f"  {i + 1}. {_key(r['params'])}  {r['quality']:.3f}{error}{mark}")
    rank = out["rank"]
    lines.append(
        f"the profile's config is {rank} of {len(out['order'])}" if rank else "the profile's config is not in the table"
    )
    return "\n".join(lines)


def cmd(args: Any) -> int:
    """The bench's entry from the CLI: measure a grid (--measure), replay a recorded table, or compare a profile."""
    if args.profile and args.curves and args.table and not args.measure:
        path = Path(args.table)
        if not path.is_file():
            raise UserError(f"{path}: no such table; measure one with `raytrm bench tune --curves --measure`")
        doc = json.loads(path.read_text())
        if "curves" not in doc:
            raise UserError(f"{path}: not a learning-curve table (no 'curves'); measure one with --curves --measure")
        from raytrm.tune.space import space_from_dict

        measured = horizon_of(space_from_dict(doc["space"], str(path))) or {}
        if not measured.get("minutes"):
            raise UserError(f"{path}: its space has no horizon in minutes to compare a profile at")
        searched = {k for k in load_space(args.space or "quick").parsed if not is_speed_knob(k)}
        out = rank_profile(doc["curves"], measured["minutes"], cfg.load_profile(args.profile), searched)
        print(format_rank(out))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return 0
    if args.profile:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        profile = Path(args.profile)
        if not profile.is_file():
            raise UserError(f"{profile}: no such profile; `raytrm tune` writes one to RUN_DIR/profiles/<tier>.yaml")
        out = against_defaults(load_space(args.space), profile, args.repeats)
        print(format_against(out))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return 0
    if not args.table:
        raise UserError("bench tune needs --table FILE: the grid's JSON (written with --measure, read otherwise)")
    path = Path(args.table)
    if args.curves:
        return _curves_cmd(args, path)
    if args.measure:
        space = load_space(args.space)
        rows = measure_grid(space, path)
    else:
        if not path.is_file():
            raise UserError(f"{path}: no such table; measure one with `raytrm bench tune --measure --table {path}`")
        doc = json.loads(path.read_text())
        from raytrm.tune.space import space_from_dict

        space, rows = space_from_dict(doc["space"], str(path)), doc["rows"]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = replay(space, rows, seeds=args.seeds)
    print(format_replay(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def _curves_cmd(args: Any, path: Path) -> int:
    """--curves: measure (with --measure) or read the learning-curve table, then replay the methods on it, at the
    measured horizon and at a third of it (the table's points reach both)."""
    from raytrm.tune.space import space_from_dict

    if args.measure:
        space = load_space(args.space or "horizon")
        rows = measure_curves(space, path)
        measured = horizon_of(space) or {}
    else:
        if not path.is_file():
            raise UserError(
                f"{path}: no such table; measure one with `raytrm bench tune --curves --measure --table {path}`"
            )
        doc = json.loads(path.read_text())
        if "curves" not in doc:
            raise UserError(f"{path}: not a learning-curve table (no 'curves'); measure one with --curves --measure")
        rows = doc["curves"]
        table_space = space_from_dict(doc["space"], str(path))
        # The table's horizon is the one it was measured to, whichever space's search is replayed on it.
        measured = horizon_of(table_space) or {}
        space = load_space(args.space) if args.space else table_space
    learning = sorted(k for k in space.parsed if not is_speed_knob(k))
    if any(sorted(r["params"]) != learning for r in rows):
        raise UserError(
            f"{path}: its learning configs are not those of space {space.name} ({', '.join(learning)}); replay "
            "with the space the table was measured for"
        )
    outs = {}
    for share in (1.0, 1 / 3):
        name = describe_horizon(measured, share) or f"{share:.3g} of the measured horizon"
        table = rows if share == 1.0 else truncated(rows, share)
        outs[name] = replay_horizon(table, space, seeds=args.seeds)
        print(f"-- horizon {name}{' (as measured)' if share == 1.0 else ' (a third of the measured one)'} --")
        print(format_horizon(outs[name], table))
    if args.json:
        Path(args.json).write_text(json.dumps(outs, indent=2))
    return 0
