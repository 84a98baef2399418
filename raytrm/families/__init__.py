"""Model families behind one registry: what the Trainer, the run policy and the tuner need of each family.

A family is one module of this package that registers a `Family` at import: how its task is built (its data, its
model, one micro-batch's loss and its evaluation: raytrm.families.task.Task), which data kinds it trains on, the
one-line check of a data path before a run starts, the experiment `raytrm train --model NAME` runs without a config,
where that default was tuned (the size rule's anchor) with how its learning rate falls with width, the scores a
tuner's quality objective may maximize, and what a run leaves behind besides its checkpoints (the Hugging Face
family's model directory). Every module here is found and imported on the first lookup, so adding a family is adding
its module. (Its config fields are declared with the others in raytrm.config, which is read before any family is
imported.)
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from raytrm import config as cfg
from raytrm.errors import UserError


class Anchor(NamedTuple):
    """Where a family's embedded default was tuned: its width, learning rate and warm-up steps."""

    width: int
    lr: float
    warmup_steps: int


class Score(NamedTuple):
    """An evaluation score that a tuning space's quality objective may maximize (its quality_metric)."""

    name: str
    #: Lower is better: a mean cross-entropy in nats. The tuner maximizes exp(-loss), the geometric mean of the
    #: probability the model gives the right token, which lies in (0, 1] as an accuracy does.
    loss: bool = False

    def quality(self, value: float) -> float:
        return math.exp(-value) if self.loss else value


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family, as the rest of raytrm sees it."""

    name: str
    #: The data kinds (DataConfig.name) it trains on.
    data_kinds: tuple[str, ...]
    #: The task of a config of this family, its data opened and its model built on the device:
    #: build(config, device, dtype, loss_dtype).
    build: Callable[..., Any]
    #: Refuse, in one line, a data path that names no dataset of this family (before a run starts).
    require_data: Callable[[cfg.DataConfig], None]
    #: What `raytrm train --model NAME` trains without a config (model, data and training sections).
    embedded_default: dict[str, Any]
    #: Where the embedded default was tuned, for the size rule.
    anchor: Anchor
    #: How the learning rate falls with width for a model of this family: (the kind in words, the exponent of
    #: anchor width / width).
    lr_exponent: Callable[[cfg.ModelConfig], tuple[str, float]]
    #: The scores a tuner may take as quality for a model of this family, the default first.
    scores: Callable[[cfg.ModelConfig], tuple[Score, ...]]
    #: What a run leaves behind besides its checkpoints, written by rank 0 after the final one: finish(task, run_dir)
    #: (the Hugging Face family's RUN_DIR/model); None for none.
    finish: Callable[[Any, Path], None] | None = None
    #: Settings the family reads off the data where the flags of `raytrm train` left them unset, on the embedded
    #: default: infer(experiment) fills the experiment's sections in place (hf: classify where the records have a
    #: label column, else a language model).
    infer: Callable[[dict[str, Any]], None] | None = None


_FAMILIES: dict[str, Family] = {}
_HELPERS = ("task", "hf_model", "hf_predict")  # modules of this package that are not families


def register(family: Family) -> Family:
    """Make a family known by its name (each family's module calls it at import)."""
    _FAMILIES[family.name] = family
    return family


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        if module.name not in _HELPERS and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


def family(name: str) -> Family:
    """The family named `name` (ModelConfig.name); an unknown one is one line naming the known ones."""
    if name not in _FAMILIES:
        _discover()
    if name not in _FAMILIES:
        raise UserError(f"model.name {name!r}: no such model family; expected one of {', '.join(names())}")
    return _FAMILIES[name]


def names() -> list[str]:
    """Every family's name, sorted."""
    _discover()
    return sorted(_FAMILIES)


def score(model: cfg.ModelConfig, name: str = "") -> Score:
    """The score named `name` of the model's family ("" for the family's default); one line naming the scores the
    family has when it has no such one."""
    scores = family(model.name).scores(model)
    if not name:
        return scores[0]
    for candidate in scores:
        if candidate.name == name:
            return candidate
    task = f" ({model.task})" if model.name in cfg.TEXT_MODELS else ""
    raise UserError(
        f"quality_metric {name!r}: model.name {model.name}{task} has no such score; expected one of "
        f"{', '.join(s.name for s in scores)}"
    )


def build_task(config: cfg.ExperimentConfig, device: Any, dtype: Any, loss_dtype: Any) -> Any:
    """The task of the config's model family, with its data opened and its model built on device."""
    return family(config.model.name).build(config, device, dtype, loss_dtype)
