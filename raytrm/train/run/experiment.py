"""Which experiment `raytrm train` runs: a config file, a profile, a run being resumed, or the embedded default.

The embedded default is the family's own (raytrm.families): a small TRM on generated Sudoku, sized to finish in a
few minutes on a laptop and to learn clearly more than copying the givens; with `--model transformer`, a small
byte-level language model (or, with `--task classify`, a classifier) on this machine's Python standard library
sources. Threads and loader workers come from this machine's tier.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

from raytrm import config as cfg
from raytrm.errors import SHOWN_FIELDS, UserError
from raytrm.families import family
from raytrm.train.run.size_rule import size_rule

logger = logging.getLogger(__name__)

#: The flags that move a model away from the embedded default; the size rule then sets its lr and warm-up.
SIZE_FIELDS = {
    ("model", "variant"),
    ("model", "hidden_size"),
    ("model", "H_cycles"),
    ("model", "L_cycles"),
    ("model", "L_layers"),
    ("model", "layers"),
    ("training", "global_batch_size"),
}


def _apply_size_rule(experiment: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The embedded default moved by flags to another size: its lr and warm-up by the size rule, unless given."""
    moved = sorted(f"{s}.{n}" for s, values in overrides.items() for n in values if (s, n) in SIZE_FIELDS)
    training = overrides.get("training", {})
    if not moved or "lr" in training:
        return experiment
    config = cfg.from_dict(cfg.ExperimentConfig, experiment, "the embedded default + flags")
    lr, warmup, why = size_rule(config.model)
    experiment["training"]["lr"] = lr
    if "warmup_steps" not in training:
        experiment["training"]["warmup_steps"] = warmup
    logger.info(
        "learning rate %.3g, warm-up %d steps: %s moved the embedded default, and the size rule gives %s "
        "(--lr sets it yourself)",
        lr,
        experiment["training"]["warmup_steps"],
        ", ".join(moved),
        why,
    )
    return experiment


def _merge(base: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values)
    return merged


def tier_settings(tier: Any) -> dict[str, Any]:
    """The training settings a tier decides (TrainConfig field -> value): threads, loader workers, its limits."""
    return {
        "threads": tier.threads,
        "interop_threads": tier.interop_threads,
        "dataloader_workers": tier.dataloader_workers,
        "memory_budget_mb": tier.memory_budget_mb,
        "thermal_cap": tier.thermal_cap,
    }


def fill_from_tier(training: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """Fill a training section's unset fields (None) from a tier's settings (see tier_settings)."""
    for key, value in settings.items():
        if training.get(key) is None:
            training[key] = value
    return training


def require_data_path(experiment: cfg.ExperimentConfig) -> None:
    """The data openers' own one-line error for a data path that names no dataset (checked before a run starts)."""
    family(experiment.model.name).require_data(experiment.data)


def _with_tier_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """Fill threads, loader workers and limits from this machine's tier where the config leaves them unset."""
    from raytrm.hardware.probe import detect
    from raytrm.hardware.tiers import match_tier

    tier = match_tier(detect())
    fill_from_tier(data.setdefault("training", {}), tier_settings(tier))
    logger.info("tier %s: %s", tier.name, tier.reason)
    return data


def _refuse(changed: list[str], source: str, asked_by: str) -> None:
    """The one refusal of a resume that would change the run: each field with its stored and asked values."""
    if changed:
        more = f" (and {len(changed) - SHOWN_FIELDS} more fields)" if len(changed) > SHOWN_FIELDS else ""
        raise UserError(
            f"--resume continues {source} as it was; only --steps and --time-budget may change, but "
            f"{'; '.join(changed[:SHOWN_FIELDS])}{more}: drop {asked_by}, or start a new run with another --out"
        )


def _refuse_changes(stored: dict[str, Any], overrides: dict[str, dict[str, Any]], source: str) -> None:
    """Refuse flags that would change a resumed run's config, naming each field with its stored and asked values.

    Flags are compared as the config reads them (`--lr 3e-3` equals a stored 0.003), so the command that started the
    run, with --resume appended, continues it.
    """
    asked = cfg.to_dict(cfg.from_dict(cfg.ExperimentConfig, _merge(stored, overrides), f"{source} + flags"))
    changed = [
        f"{section}.{name} is {stored[section].get(name)!r} there, {asked[section][name]!r} asked"
        for section, values in overrides.items()
        for name in values
        if (section, name) not in cfg.RESUMABLE_CHANGES and asked[section][name] != stored[section].get(name)
    ]
    _refuse(changed, source, "those flags")


def _resume_with_file(
    stored: dict[str, Any],
    asked: dict[str, Any],
    overrides: dict[str, dict[str, Any]],
    source: str,
    given: str,
    machines_free: bool,
) -> dict[str, Any]:
    """The stored config, continued as the --config or --profile `given` with --resume asks (asked: the file with its
    flags, validated).

    The file must describe the stored run field by field; it may change only how long the run goes on (its steps
    and time budget then replace the stored ones). Machine settings it leaves unset were filled from the tier when
    the run started, so they are the stored ones; with machines_free (a distributed run's profile, whose machine
    settings each worker takes from its own tier) they are not compared.
    """
    changed, flagged = [], False
    for section in ("model", "data", "training"):
        for name, value in asked[section].items():
            if section == "training" and name in cfg.MACHINE_SETTINGS and (machines_free or value is None):
                continue
            if (section, name) not in cfg.RESUMABLE_CHANGES and value != stored[section].get(name):
                changed.append(f"{section}.{name} is {stored[section].get(name)!r} there, {value!r} asked")
                flagged = flagged or name in overrides.get(section, {})
    _refuse(changed, source, f"{given}{' and those flags' if flagged else ''} (the run keeps its own config)")
    resumed = copy.deepcopy(stored)
    limits = {name: asked["training"][name] for _, name in cfg.RESUMABLE_CHANGES}
    if any(value is not None for value in limits.values()):
        resumed["training"].update(limits)
    return resumed


def _requested(
    config_file: str | None, profile_file: str | None, overrides: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], str]:
    """The experiment the arguments name, as a dict before the flags and the tier, and where it comes from."""
    if profile_file:
        profile = cfg.load_profile(profile_file)
        base = {k: cfg.to_dict(getattr(profile, k)) for k in ("model", "data", "training")}
        # The profile's limits are the tier's: they bound the run unless its training section says otherwise.
        base["training"]["memory_budget_mb"] = base["training"]["memory_budget_mb"] or profile.limits.memory_budget_mb
        base["training"]["thermal_cap"] = base["training"]["thermal_cap"] or profile.limits.thermal_cap
        if {"steps", "time_budget_s"} & set(overrides.get("training", {})):
            # The profile trains for the horizon it was tuned for, unless told otherwise: then only as told.
            base["training"].update(steps=None, time_budget_s=None)
        return base, profile_file
    if config_file:
        return cfg.to_dict(cfg.load(cfg.ExperimentConfig, config_file)), config_file
    name = overrides.get("model", {}).get("name") or cfg.ModelConfig().name
    return copy.deepcopy(family(str(name)).embedded_default), "the embedded default"


def resolve_experiment(
    *,
    config_file: str | None,
    profile_file: str | None,
    out: str | None,
    resume: bool,
    overrides: dict[str, dict[str, Any]],
    tier_defaults: bool = True,
    overwrite: bool = False,
) -> tuple[cfg.ExperimentConfig, Path]:
    """The validated experiment and its run directory for `raytrm train`'s arguments.

    tier_defaults=False leaves the machine settings a config does not give unset: distributed workers fill them
    from their own machines' tiers. A new run's --out is checked here, before anything else is looked at
    (raytrm.train.run.directory: a run there needs --resume or --overwrite); nothing is moved here.
    """
    if config_file and profile_file:
        raise UserError("give --config or --profile, not both")
    if resume and overwrite:
        raise UserError(
            f"--resume continues the run in {out} and --overwrite moves it aside to start anew: give one of them"
        )
    if resume:
        if not out:
            raise UserError("--resume needs --out RUN_DIR, the run to continue")
        from raytrm.train.run.directory import CONFIG_FILE, resumable_config

        run_dir = Path(out)
        base = cfg.to_dict(resumable_config(run_dir))
        source = str(run_dir / CONFIG_FILE)
        if config_file or profile_file:
            requested, named = _requested(config_file, profile_file, overrides)
            asked = cfg.to_dict(cfg.from_dict(cfg.ExperimentConfig, _merge(requested, overrides), named))
            given = f"--config {config_file}" if config_file else f"--profile {profile_file}"
            machines_free = bool(profile_file) and not tier_defaults
            base = _resume_with_file(base, asked, overrides, source, given, machines_free)
        else:
            _refuse_changes(base, overrides, source)
    else:
        if out:
            from raytrm.train.run.directory import check_new_run_dir

            check_new_run_dir(out, overwrite=overwrite)
        base, source = _requested(config_file, profile_file, overrides)
    merged = _merge(base, overrides)
    if source == "the embedded default":
        merged = _apply_size_rule(merged, overrides)
        infer = family(str(merged["model"].get("name", cfg.ModelConfig().name))).infer
        if infer is not None and "task" not in overrides.get("model", {}):
            infer(merged)
    source = source if not overrides else f"{source} + flags"
    experiment = cfg.from_dict(cfg.ExperimentConfig, merged, source)
    # Bad input is one line: the config and its data path are checked before the machine's tier is looked up
    # (and logged). The tier fills only what the config and flags leave unset. A distributed run (no tier here)
    # checks its data on every node instead, where the workers will read it.
    if tier_defaults:
        require_data_path(experiment)
    if tier_defaults and not resume and not profile_file:
        experiment = cfg.from_dict(cfg.ExperimentConfig, _with_tier_defaults(merged), source)
    run_dir = Path(out) if out else Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")
    return experiment, run_dir
