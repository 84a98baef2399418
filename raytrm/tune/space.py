"""Search space files (the shipped raytrm/tune_spaces/*.yaml, or a user's own): the base experiment, the parameters
to search, objective, budget, limits.

A file is validated completely before any trial runs: unknown keys, empty or inverted ranges, parameters that do not
apply to the model, tier names not in tiers.yaml, and parameter values that would build an invalid experiment (a
micro-batch that does not divide the global batch, a cycle count of zero) are one clear line, exit code 2.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.constants import named_file, spaces_dir
from raytrm.errors import ConfigError, UserError
from raytrm.schema import check_version, read_versioned_yaml, spec
from raytrm.tune.params import ParamSpec, parse_param
from raytrm.tune.space_sections import Budget, Horizon, Pareto, SpaceLimits, TierLimits

SPACE_SCHEMA_VERSION = 1
DEFAULT_SPACE = "quick"
OBJECTIVES = ("quality", "throughput", "pareto")
PRUNERS = ("none", "median", "successive_halving")
BATCH_FIELDS = ("training.global_batch_size", "training.micro_batch_size", "training.grad_accum_steps")
#: How to get a space file of this raytrm's version, beside upgrading raytrm.
SPACE_AGAIN = "write the space for this version (`raytrm validate quick` shows a shipped one and where it lies)"
#: Tier names that tiers.yaml does not list but a machine can have: the generic tier of an unlisted machine.
GENERIC_TIER_GLOB = "generic-*"


@dataclass
class SearchSpace:
    """A tune space file."""

    raytrm_space: int = spec(SPACE_SCHEMA_VERSION, "schema version", choices=(SPACE_SCHEMA_VERSION,))
    name: str = spec("", "study name; default: the file name")
    description: str = spec("", "one line for people")
    base: dict = spec({}, "the base experiment: model, data and training sections, as in a training config")
    params: dict = spec({}, "dotted config path -> {type, low, high, step, log, choices}")
    objective: str = spec("quality", "quality, throughput or pareto (both)", choices=OBJECTIVES)
    quality_metric: str = spec(
        "",
        "the evaluation score the quality objective maximizes: '' = the model family's own (TRM eval_cell_acc, a "
        "classifier's eval_macro_f1, a language model's eval_loss, maximized as exp(-loss))",
    )
    pareto: Pareto = spec(Pareto(), "how one point is picked from the Pareto front")
    budget: Budget = spec(Budget(), "wall-clock budget of each trial")
    horizon: Horizon = spec(
        Horizon(),
        "the training the profile is for, {minutes: N} or {samples: N}, and the length the profile trains for. With "
        "the quality objective the search is staged: speed knobs per tier in short runs, then learning knobs "
        "trained to the horizon and judged by the quality reached there on each tier (README.md, 'Tuning'); "
        "neither = each trial's budget, which favours whatever learns fastest in seconds",
    )
    trials: int = spec(
        12, "trials per tier; with a horizon and the quality objective, trials of the learning search (all tiers)", ge=1
    )
    speed_trials: int | None = spec(
        None,
        "with a horizon and the quality objective: trials of each tier's search of the speed knobs (micro-batch, "
        "threads, loader workers), short runs for samples/s; None = every point of a small grid, else trials",
        ge=1,
    )
    startup_trials: int | None = spec(None, "random trials before the model-based sampler; None = trials / 4", ge=1)
    sampler: str = spec("tpe", "tpe (default), gp (needs scipy) or random", choices=("tpe", "gp", "random"))
    pruner: str = spec(
        "none",
        "early stopping of single-objective studies: none, median (Optuna's MedianPruner) or successive_halving "
        "(Optuna's asynchronous successive halving); it acts at the evaluations of budget.evaluations",
        choices=PRUNERS,
    )
    seed: int = spec(0, "sampler seed")
    start_with: list = spec([], "parameter sets tried first (e.g. the hand-written defaults), before sampling")
    limits: SpaceLimits = spec(SpaceLimits(), "memory, heat and throughput-decay limits")
    tiers: list = spec([], "tune only these tiers; [] = every tier with a machine in the Ray cluster")

    # Filled by load_space: the validated pieces.
    source: str = dataclasses.field(default="<space>", metadata={"doc": "internal"})
    parsed: dict = dataclasses.field(default_factory=dict, metadata={"doc": "internal"})

    @property
    def n_startup(self) -> int:
        return self.startup_trials or max(2, min(10, self.trials // 4))

    @property
    def verify_s(self) -> float:
        return self.budget.verify_s or self.budget.measure_s

    def measure_args(self, measure_s: float | None = None) -> dict[str, Any]:
        """The keyword arguments of raytrm.tune.trial.measure that the space fixes for every run of a setting."""
        return {
            "warmup_s": self.budget.warmup_s,
            "measure_s": measure_s or self.budget.measure_s,
            "eval_puzzles": self.budget.eval_puzzles,
            "decay_window": self.budget.decay_window,
            "max_throughput_decay": self.limits.max_throughput_decay,
            "quality_metric": self.quality_metric,
            "horizon": horizon_of(self),
        }

    def to_dict(self) -> dict[str, Any]:
        """The file's content, as it would be written back (for the run directory's copy)."""
        out = cfg.to_dict(self)
        out.pop("source"), out.pop("parsed")
        return out


def horizon_of(space: SearchSpace) -> dict[str, float] | None:
    """The space's horizon as {minutes: N} or {samples: N}; None when it names none."""
    return {k: v for k, v in cfg.to_dict(space.horizon).items() if v is not None} or None


def describe_horizon(horizon: dict[str, float] | None, share: float = 1.0) -> str:
    """'3 minutes', '1 minute', '5000 samples' (share of the horizon); '' for none."""
    return ", ".join(f"{v * share:g} {k[:-1] if v * share == 1 else k}" for k, v in (horizon or {}).items())


def resolve_space_path(path: str | os.PathLike | None) -> Path:
    """The space file: a path, the name of a packaged space ('sudoku'), or the quick default."""
    if path is None:
        return spaces_dir() / f"{DEFAULT_SPACE}.yaml"
    return named_file(path) or Path(path)


def load_space(path: str | os.PathLike | None = None, base: dict[str, dict[str, Any]] | None = None) -> SearchSpace:
    """Read and validate a space file (see the module docstring). base: fields set over the file's base experiment,
    section by section (`raytrm tune --model-path DIR --data FILE`: the user's model and records in a shipped hf
    space)."""
    p = resolve_space_path(path)
    missing = (
        "this is not a search space; add `raytrm_space: 1`, or name a shipped space (quick, sudoku, maze, "
        "transformer, hf-classify, hf-lm)"
    )
    data = read_versioned_yaml(p, "raytrm_space", SPACE_SCHEMA_VERSION, missing, SPACE_AGAIN)
    if base and isinstance(data.get("base") or {}, dict):  # a malformed base is refused below, as it is
        data["base"] = dict(data.get("base") or {})
        for section, fields in base.items():
            data["base"][section] = {**(data["base"].get(section) or {}), **fields}
    return space_from_dict(data, str(p), default_name=p.stem)


def space_from_dict(data: Any, source: str, default_name: str = "study") -> SearchSpace:
    """Validate a space given as a mapping; source names it in errors."""
    if isinstance(data, dict) and ("source" in data or "parsed" in data):
        raise UserError(f"{source}: 'source' and 'parsed' are not space fields; remove them")
    if isinstance(data, dict) and "raytrm_space" in data:
        check_version(data, source, "raytrm_space", SPACE_SCHEMA_VERSION, "", SPACE_AGAIN)
    space = cfg.from_dict(SearchSpace, data, source)
    space.source, space.name = source, space.name or default_name
    base = cfg.from_dict(cfg.ExperimentConfig, space.base, source, "base")
    if not space.params:
        raise ConfigError(
            source,
            "params",
            space.params,
            "at least one parameter to search",
            "add e.g. training.micro_batch_size: {type: categorical, choices: [16, 32, 64]}",
        )
    parsed = {name: parse_param(name, raw, base, source) for name, raw in space.params.items()}
    space.quality_metric = _quality_metric(space, base, source)
    _check_tiers(space, source)
    if space.sampler == "gp":
        import importlib.util

        if importlib.util.find_spec("scipy") is None:
            raise ConfigError(
                source,
                "sampler",
                "gp",
                "tpe or random, or scipy installed",
                "pip install scipy (Optuna's GP sampler needs it), or use sampler: tpe",
            )
    if space.horizon.minutes is not None and space.horizon.samples is not None:
        raise ConfigError(
            source,
            "horizon",
            cfg.to_dict(space.horizon),
            "one of minutes or samples",
            "name the training length once, e.g. horizon: {minutes: 30}",
        )
    if horizon_of(space) and space.objective == "pareto":
        raise ConfigError(
            source,
            "objective",
            "pareto with a horizon",
            "quality or throughput",
            "at a horizon in minutes quality already counts the speed (a faster setting sees more samples): use "
            "objective: quality",
        )
    if space.pruner != "none" and space.objective == "pareto":
        raise ConfigError(
            source, "pruner", space.pruner, "none for a pareto study", "Optuna prunes single-objective studies only"
        )
    if space.pruner != "none" and space.budget.evaluations < 2:
        raise ConfigError(
            source,
            "budget.evaluations",
            space.budget.evaluations,
            f"2 or more with pruner {space.pruner}",
            "the pruner compares trials at the evaluations before the last; e.g. budget: {evaluations: 3}",
        )
    space.parsed = parsed
    for i, point in enumerate(space.start_with):
        if not isinstance(point, dict) or set(point) - set(parsed):
            raise ConfigError(
                source,
                f"start_with[{i}]",
                point,
                "a mapping of searched parameters to values",
                f"use names from params: {', '.join(parsed)}",
            )
        if _builds(space, point) is not None:
            _refuse(space, point, f"start_with[{i}]")
    _check_combinations(space, base)
    return space


def _quality_metric(space: SearchSpace, base: cfg.ExperimentConfig, source: str) -> str:
    """The score the space's quality objective maximizes: the named one if the base's model family has it, else its
    default."""
    from raytrm.families import family

    scores = family(base.model.name).scores(base.model)
    if not space.quality_metric:
        return scores[0].name
    if space.quality_metric not in [s.name for s in scores]:
        raise ConfigError(
            source,
            "quality_metric",
            space.quality_metric,
            f"a score of base's model ({', '.join(s.name for s in scores)})",
            f"use {scores[0].name}, or leave quality_metric out for it",
        )
    return space.quality_metric


def _check_tiers(space: SearchSpace, source: str) -> None:
    from raytrm.hardware.tiers import load_tiers

    known = {row.name for row in load_tiers()}
    named = [(f"tiers[{i}]", name) for i, name in enumerate(space.tiers)]
    named += [(f"limits.tiers.{name}", name) for name in space.limits.tiers]
    for path, name in named:
        if not isinstance(name, str) or (name not in known and not fnmatch.fnmatchcase(name, GENERIC_TIER_GLOB)):
            raise ConfigError(
                source,
                path,
                name,
                "a tier name from tiers.yaml (or generic-*)",
                "check the name with `raytrm probe` or `raytrm validate tiers`",
            )
    for name, raw in space.limits.tiers.items():
        cfg.from_dict(TierLimits, raw, source, f"limits.tiers.{name}")


def tier_limits(space: SearchSpace, tier: str) -> TierLimits:
    """The space's override of a tier's limits (fields left None come from tiers.yaml)."""
    own = cfg.from_dict(TierLimits, space.limits.tiers.get(tier) or {}, space.source)
    return TierLimits(
        memory_budget_mb=own.memory_budget_mb or space.limits.memory_budget_mb,
        thermal_cap=own.thermal_cap or space.limits.thermal_cap,
    )


def build_experiment(base: dict[str, Any], params: dict[str, Any], source: str = "<trial>") -> cfg.ExperimentConfig:
    """The experiment of one trial: base + searched values, with the batch cut kept consistent.

    A searched micro-batch sets the accumulation to global / micro (the global batch, the statistical setting,
    stays); a searched accumulation leaves the micro-batch to follow from it.
    """
    data = copy.deepcopy(base)
    for path, value in params.items():
        section, field = path.split(".", 1)
        data.setdefault(section, {})[field] = value
    training = data.setdefault("training", {})
    global_batch = training.get("global_batch_size", cfg.TrainConfig().global_batch_size)
    if "training.micro_batch_size" in params and "training.grad_accum_steps" not in params:
        micro = params["training.micro_batch_size"]
        # A micro-batch that does not divide the global batch fails validation below, naming the micro-batch.
        training["grad_accum_steps"] = max(1, global_batch // micro) if isinstance(micro, int) and micro > 0 else 1
    elif "training.grad_accum_steps" in params and "training.micro_batch_size" not in params:
        training["micro_batch_size"] = None
    return cfg.from_dict(cfg.ExperimentConfig, data, source)


#: A space of at most this many points (each parameter at its choices, or at the ends of a long range) has every
#: point checked; a larger one has every pair of parameters checked at their points, the others at the base's values.
MAX_CHECKED_POINTS = 1024
#: A range of at most this many values is checked at every value, a longer one at its two ends.
MAX_CHECKED_VALUES = 16


def _check_combinations(space: SearchSpace, base: cfg.ExperimentConfig) -> None:
    """Every point a trial can draw builds a valid experiment: the config's rules across fields (a micro-batch that
    divides the global batch, sync_overlap below sync_every, heads that divide the width) hold at every combination
    of the parameters' values, checked where a trial checks them (build_experiment), so a bad point fails here and
    not inside a trial. Divisibility needs every value, so the batch fields are always enumerated; other ranges
    are checked at their ends, where the config's bounds and orderings break first."""
    params: dict[str, ParamSpec] = space.parsed
    if "training.micro_batch_size" in params and "training.grad_accum_steps" in params:
        raise ConfigError(
            space.source,
            "params.training.grad_accum_steps",
            "searched with micro_batch_size",
            "one of the two",
            "search the micro-batch; the accumulation follows from the global batch",
        )
    points: dict[str, list] = {}
    for name, p in params.items():
        values = p.values()
        if name in BATCH_FIELDS and values is None:
            raise ConfigError(space.source, f"params.{name}", "a huge range", "a range of at most 4096 values")
        if values is None or (name not in BATCH_FIELDS and len(values) > MAX_CHECKED_VALUES):
            values = p.extremes()
        points[name] = values
    names = list(points)
    if math.prod(len(v) for v in points.values()) <= MAX_CHECKED_POINTS:
        groups = [names]
    else:
        groups = [list(pair) for pair in itertools.combinations(names, 2)]
    for group in groups:
        for combo in itertools.product(*(points[name] for name in group)):
            values = dict(zip(group, combo, strict=True))
            if _builds(space, values) is not None:
                _refuse(space, _smallest(space, values))


def _builds(space: SearchSpace, values: dict[str, Any]) -> UserError | None:
    """The error building the experiment of these values gives, or None where it builds."""
    try:
        build_experiment(space.base, values, "<check>")
    except UserError as e:
        return e
    return None


def _smallest(space: SearchSpace, values: dict[str, Any]) -> dict[str, Any]:
    """The values of a bad point without those that play no part in what breaks: each left at the base's value in
    turn, and dropped where the point still breaks the same rule without it."""
    wrong = _builds(space, values)
    rule = getattr(wrong, "path", str(wrong))
    for name in list(values):
        fewer = {k: v for k, v in values.items() if k != name}
        error = _builds(space, fewer) if fewer else None
        if error is not None and getattr(error, "path", str(error)) == rule:
            values = fewer
    return values


def _refuse(space: SearchSpace, values: dict[str, Any], where: str | None = None) -> None:
    """Refuse the space for the point `values` (at `where`; default the params), naming the parameters, their values
    and the rule they break."""
    error = _builds(space, values)
    names = list(values)
    if isinstance(error, ConfigError):
        where = where or ("params." + names[0] if len(names) == 1 else "params")
        if any(n in BATCH_FIELDS for n in names):
            fix = (
                "search the micro-batch among divisors of the global batch (categorical choices), or search "
                "training.grad_accum_steps"
            )
        elif len(names) == 1:
            fix = "narrow the range"
        else:
            fix = "drop the values that clash from one parameter's choices (a trial may draw any combination), or "
            fix += "set one of them in base"
        received = values if len(values) > 1 or where.startswith("start_with") else next(iter(values.values()))
        raise ConfigError(
            space.source,
            where,
            received,
            f"values that build a valid experiment ({error.path}: expected {error.expected})",
            fix,
        ) from None
    what = ", ".join(f"{k}={v}" for k, v in values.items())
    raise UserError(f"{space.source}: {what} builds an invalid experiment: {error}") from None
