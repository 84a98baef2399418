"""One searched parameter of a space: its spec, its validation against the base experiment, and its Optuna form."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from raytrm import config as cfg
from raytrm.errors import ConfigError
from raytrm.schema import spec

PARAM_TYPES = ("int", "float", "log", "categorical")
#: Training fields that define the run rather than its speed or quality: the budget sets them for every trial.
NOT_SEARCHABLE = {"steps", "time_budget_s", "log_interval", "eval_interval", "checkpoint_interval", "device"}


@dataclass
class ParamSpec:
    """One searched parameter: an int or float range (optionally log or stepped), or a list of choices."""

    type: str = spec("int", "int, float, log (a float on a log scale) or categorical", choices=PARAM_TYPES)
    low: int | float | None = spec(None, "smallest value (int, float, log)")
    high: int | float | None = spec(None, "largest value, included (int, float, log)")
    step: int | float | None = spec(
        None, "spacing of the values (int, float); None = 1 for int, continuous float", gt=0
    )
    log: bool = spec(False, "sample on a log scale (int, float)")
    choices: list | None = spec(None, "the values to choose from (categorical)")

    def values(self) -> list | None:
        """Every value, where the parameter is discrete and small enough to enumerate; else None."""
        if self.type == "categorical":
            return list(self.choices or [])
        if self.type == "int":
            step = int(self.step or 1)
            n = (int(self.high) - int(self.low)) // step + 1
            return list(range(int(self.low), int(self.high) + 1, step)) if n <= 4096 else None
        return None

    def extremes(self) -> list:
        """Values that exercise the range: every choice, or both ends."""
        return self.values() if self.type == "categorical" else [self.low, self.high]


def parse_param(name: str, raw: Any, base: cfg.ExperimentConfig, source: str) -> ParamSpec:
    """Validate one entry of a space's params: a searchable field of the base's model family, a sane range."""
    where = f"params.{name}"
    section, _, field = str(name).partition(".")
    sections = {"model": cfg.ModelConfig, "training": cfg.TrainConfig}
    if section not in sections or not field or "." in field:
        fix = (
            "data settings define the task: fix them in base.data"
            if section == "data"
            else ("name a field as model.FIELD or training.FIELD")
        )
        raise ConfigError(source, where, name, "a dotted path model.FIELD or training.FIELD", fix)
    fields = {f.name for f in dataclasses.fields(sections[section])}
    if field not in fields:
        import difflib

        close = difflib.get_close_matches(field, fields, n=1)
        hint = f"did you mean {section}.{close[0]}?" if close else f"known: {', '.join(sorted(fields))}"
        raise ConfigError(source, where, name, f"a field of {section}", hint)
    if section == "model" and field not in cfg.model_fields(base.model.name):
        raise ConfigError(
            source,
            where,
            name,
            f"a field that applies to {base.model.name} models",
            "remove it, or set base.model.name to a family it applies to",
        )
    if (section, field) in {("model", "name")} or (section == "training" and field in NOT_SEARCHABLE):
        raise ConfigError(
            source,
            where,
            name,
            "a parameter that changes speed or quality",
            "the budget section sets the run length; set fixed values in base",
        )
    p = cfg.from_dict(ParamSpec, raw, source, where)
    if p.type == "log":
        p.type, p.log = "float", True
    if p.type == "categorical":
        if p.low is not None or p.high is not None or p.step is not None or p.log:
            raise ConfigError(source, where, raw, "only choices for a categorical parameter", "drop low/high/step/log")
        if not p.choices or len(p.choices) < 2:
            raise ConfigError(
                source,
                where + ".choices",
                p.choices,
                "at least two values",
                "a single value is not a search: set it in base",
            )
        if len(set(map(repr, p.choices))) != len(p.choices):
            raise ConfigError(source, where + ".choices", p.choices, "distinct values", "remove the duplicates")
        if not all(c is None or isinstance(c, (int, float, str, bool)) for c in p.choices):
            raise ConfigError(source, where + ".choices", p.choices, "numbers, strings, booleans or null")
        return p
    if p.choices is not None:
        raise ConfigError(
            source,
            where + ".choices",
            p.choices,
            f"no choices for a {p.type} range",
            "use type: categorical, or drop choices",
        )
    if p.low is None or p.high is None:
        raise ConfigError(source, where, raw, "low and high for a range", "add low: and high:")
    if p.type == "int" and not all(isinstance(v, int) for v in (p.low, p.high, p.step or 1)):
        raise ConfigError(source, where, raw, "integer low, high and step for an int parameter", "use type: float")
    if p.low >= p.high:
        word = "empty" if p.low == p.high else "inverted"
        raise ConfigError(
            source,
            where,
            f"low={p.low}, high={p.high}",
            "low < high",
            f"the range is {word}: swap or widen it (a single value belongs in base)",
        )
    if p.log and (p.low <= 0 or p.step is not None):
        raise ConfigError(source, where, raw, "low > 0 and no step for a log scale", "drop step or log")
    if p.step is not None and p.type == "int" and (p.high - p.low) % p.step:
        raise ConfigError(source, where, raw, "high - low a multiple of step", "adjust high to the grid")
    return p


def grid_size(params: dict[str, ParamSpec]) -> int | None:
    """How many distinct points the parameters have; None when one of them is continuous or huge."""
    sizes = [p.values() for p in params.values()]
    return None if any(v is None for v in sizes) else math.prod(len(v) for v in sizes)


def grid_points(params: dict[str, ParamSpec]) -> list[dict[str, Any]] | None:
    """Every point of the parameters' grid, in order; None when one of them is continuous or huge."""
    values = [p.values() for p in params.values()]
    if any(v is None for v in values):
        return None
    return [dict(zip(params, combo, strict=True)) for combo in itertools.product(*values)]


def suggest(trial: Any, params: dict[str, ParamSpec]) -> dict[str, Any]:
    """Ask an optuna.Trial for one value of every parameter (define-by-run, so the tuner and tests share it)."""
    out = {}
    for name, p in params.items():
        if p.type == "categorical":
            out[name] = trial.suggest_categorical(name, p.choices)
        elif p.type == "int":
            out[name] = trial.suggest_int(name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        else:
            out[name] = trial.suggest_float(name, float(p.low), float(p.high), step=p.step, log=p.log)
    return out
