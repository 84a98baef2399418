"""`python -m benchmarks tune`: how well the tuner searches, on tables measured once and replayed.

`--measure` runs every combination of a space's (discrete) parameters once on this machine, with the space's trial
budget, and writes the table as JSON (long: only on a machine you can spare); replaying the table compares
raytrm's search with random search and a DeepSpeed-style probe (benchmarks.tune_replay).

`--curves` measures (with --measure) each learning config's curve to the space's horizon once, then replays search
methods judged by the quality at the horizon (benchmarks.tune_horizon).

`--profile P` instead runs a tuned profile against what a user has without tuning (the space's base settings with
the tier's hand-written defaults from tiers.yaml), in alternation, and prints both objectives side by side; with
`--curves --table` it ranks the profile's config in the curve table instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna

from benchmarks.tune_horizon import format_horizon, format_rank, rank_profile, replay_horizon, truncated
from benchmarks.tune_measure import against_defaults, format_against, measure_curves, measure_grid
from benchmarks.tune_replay import format_replay, replay
from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.tune.curves import is_speed_knob
from raytrm.tune.space import describe_horizon, horizon_of, load_space, space_from_dict


def cmd(args: Any) -> int:
    """The bench's entry from the CLI: measure a grid (--measure), replay a recorded table, or compare a profile."""
    if args.profile and args.curves and args.table and not args.measure:
        path = Path(args.table)
        if not path.is_file():
            raise UserError(f"{path}: no such table; measure one with `python -m benchmarks tune --curves --measure`")
        doc = json.loads(path.read_text())
        if "curves" not in doc:
            raise UserError(f"{path}: not a learning-curve table (no 'curves'); measure one with --curves --measure")
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
        raise UserError("tune needs --table FILE: the grid's JSON (written with --measure, read otherwise)")
    path = Path(args.table)
    if args.curves:
        return _curves_cmd(args, path)
    if args.measure:
        space = load_space(args.space)
        rows = measure_grid(space, path)
    else:
        if not path.is_file():
            raise UserError(
                f"{path}: no such table; measure one with `python -m benchmarks tune --measure --table {path}`"
            )
        doc = json.loads(path.read_text())
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
    if args.measure:
        space = load_space(args.space or "horizon")
        rows = measure_curves(space, path)
        measured = horizon_of(space) or {}
    else:
        if not path.is_file():
            raise UserError(
                f"{path}: no such table; measure one with `python -m benchmarks tune --curves --measure --table {path}`"
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
