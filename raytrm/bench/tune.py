"""`raytrm bench tune`: tuner efficiency by replay of an exhaustively measured grid.

`--measure` runs every combination of a space's (discrete) parameters once on this machine, with the space's trial
budget, and writes the table as JSON (long: only on a machine you can spare). Replaying the table, raytrm's search
(the space's sampler with constraints, through the tuner's own suggest/record path), random search and a
DeepSpeed-style probe (micro-batch raised until it no longer fits or gains < 5%, other parameters at base values)
each get 20% of the grid's trials; the table shows, per method, the median over seeds of the best feasible
objective found as a fraction of the grid's optimum, and how often it reached 95% of it.

`--profile P` instead runs a tuned profile against what a user has without tuning (the space's base settings with
the tier's hand-written defaults from tiers.yaml), in alternation, and prints both objectives side by side.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import optuna

from raytrm.errors import UserError
from raytrm.tune import objectives
from raytrm.tune.search import make_sampler, optimize
from raytrm.tune.space import SearchSpace, build_experiment, load_space

MICRO = "training.micro_batch_size"


def grid(space: SearchSpace) -> list[dict[str, Any]]:
    """Every combination of the space's parameters (each must be discrete)."""
    values = {}
    for name, p in space.parsed.items():
        v = p.values()
        if v is None or p.type == "float":
            raise UserError(f"{space.source}: params.{name}: the replay bench needs discrete parameters (choices/int)")
        values[name] = v
    return [dict(zip(values, combo, strict=True)) for combo in itertools.product(*values.values())]


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

    Both run as a trial does (the space's warm-up, window and evaluation); alternating the two, repeat after repeat,
    lets a change in the machine's load reach both alike. Returns each side's runs and medians.
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


def cmd(args: Any) -> int:
    """The bench's entry from the CLI: measure a grid (--measure), replay a recorded table, or compare a profile."""
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
