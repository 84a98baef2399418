"""A run directory is a user's work: what it holds, the guard every writing command calls, and moving a run aside.

A directory holds a run when it has config.yaml, metrics.jsonl, summary.json or a checkpoint in checkpoints/. A new
run starts in a path that does not exist or in an empty directory (hidden entries such as .DS_Store aside); a
directory that holds a run needs --resume (continue it) or --overwrite (move it aside, renamed to a sibling
`RUN.replaced-YYYYmmdd-HHMMSS`, never deleted); a directory of other files is nobody's run to replace and is refused,
so nothing of the user's is moved without being asked.

`guard_output` is the one check every command that writes a file or a directory (export-checkpoint, report, export,
data) calls on its output path before writing: it refuses to replace a checkpoint or a run's own files.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.train.checkpoint import list_checkpoints

logger = logging.getLogger(__name__)

CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINT_DIR = "config.yaml", "metrics.jsonl", "summary.json", "checkpoints"
#: What a run writes that resume reads: never replaced by another command.
RUN_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINT_DIR)
#: What else a run's directory may hold (its report, TensorBoard view, Ray Train's storage): moved aside with it.
RUN_EXTRAS = ("report", "tensorboard", "ray")


def resumable_config(run_dir: Path) -> cfg.ExperimentConfig:
    """The config a run directory was started with; refused with the fix when the directory is not a run."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise UserError(
            f"{run_dir}: not a raytrm run directory (no {CONFIG_FILE}); start one with `raytrm train --out {run_dir}`"
        )
    return cfg.load(cfg.ExperimentConfig, path)


def run_contents(directory: Path) -> list[str]:
    """The run's own files found in directory (empty where it holds no run): file names, and the checkpoint count."""
    if not directory.is_dir():
        return []
    found = [name for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE) if (directory / name).exists()]
    checkpoints = len(list_checkpoints(directory / CHECKPOINT_DIR))
    if checkpoints:
        found.append(f"{checkpoints} checkpoint{'s' if checkpoints > 1 else ''} in {CHECKPOINT_DIR}/")
    return found


def other_contents(directory: Path) -> list[str]:
    """Entries of directory that are no part of a run (hidden ones aside), sorted."""
    if not directory.is_dir():
        return []
    known = {*RUN_FILES, *RUN_EXTRAS}
    return sorted(p.name for p in directory.iterdir() if p.name not in known and not p.name.startswith("."))


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _owning_run(path: Path) -> tuple[Path, str] | None:
    """(the run, what path is of it) where path is one of a run's own files or lies in its checkpoint directory."""
    for parent in path.parents:
        if parent.name == CHECKPOINT_DIR and (run_contents(parent.parent) or list_checkpoints(parent)):
            return parent.parent, f"in the checkpoint directory of the run {parent.parent}, which resume reads"
    if path.name in RUN_FILES and run_contents(path.parent):
        return path.parent, f"the run {path.parent}'s own {path.name}"
    return None


def _is_checkpoint(path: Path) -> bool:
    """Whether the file at path starts with a raytrm checkpoint's header line."""
    try:
        with path.open("rb") as f:
            line = f.readline(4096)
        return b"raytrm_checkpoint" in line and isinstance(json.loads(line), dict)
    except (OSError, ValueError, RecursionError):
        return False


def guard_output(path: str | Path, flag: str = "--out", *, directory: bool = False) -> Path:
    """Refuse, in one line, an output path whose writing would replace a checkpoint or a run's own files.

    Every command that writes a file or directory calls it on its output path before writing anything: a path in a
    run's checkpoint directory, one of a run's own files (config.yaml, metrics.jsonl, summary.json, checkpoints/), an
    existing raytrm checkpoint, or a directory holding a run. directory: the command writes a directory there (else
    a file), so an existing path of the other kind is refused too. Returns the path.
    """
    path = Path(path)
    where = path.resolve()
    owner = _owning_run(path) or _owning_run(where)
    if owner is not None:
        run, what = owner
        raise UserError(
            f"{flag} {path}: {what}; a file written there would replace the run's work or be taken for it: choose a "
            f"path outside {run / CHECKPOINT_DIR} and other than {', '.join(RUN_FILES[:3])}"
        )
    if where.is_file() and _is_checkpoint(where):
        raise UserError(
            f"{flag} {path}: a raytrm checkpoint is there, and writing would replace it; choose another path"
        )
    held = run_contents(where)
    if held:
        raise UserError(
            f"{flag} {path}: a run directory is there ({_names(held)}), and writing would replace it; choose another "
            "path"
        )
    if directory and where.exists() and not where.is_dir():
        raise UserError(f"{flag} {path}: a file is there, expected a directory; give a path that is not a file")
    if not directory and where.is_dir():
        raise UserError(f"{flag} {path}: a directory is there, expected a file; give the path of a file to write")
    return path


def check_new_run_dir(
    path: str | Path, *, overwrite: bool = False, flag: str = "--out", resumable: bool = True
) -> None:
    """Refuse, in one line, a directory a new run may not start in (see the module docstring); nothing is moved.

    overwrite: a run there is to be moved aside (refused still where the directory holds other files too).
    resumable: the command can --resume and --overwrite, so the refusal offers them.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(
            f"{flag} {path}: a file is there, expected a run directory; give {flag} a new directory"
            + (" (or a run's directory with --resume)" if resumable else "")
        )
    owner = _owning_run(path) or _owning_run(path.resolve())
    if owner is not None:
        raise UserError(f"{flag} {path}: {owner[1]}; give {flag} a directory outside {owner[0]}")
    held, others = run_contents(path), other_contents(path)
    if held and others and overwrite:
        raise UserError(
            f"{flag} {path}: holds a run ({_names(held)}) and other files ({_names(others)}); --overwrite moves aside "
            f"only a directory that holds nothing but a run: move those files out, or choose another {flag}"
        )
    if held and not overwrite:
        fix = (
            f"continue it with --resume, start anew with --overwrite (the run is moved aside to "
            f"{path.name}.replaced-<time>, not deleted), or choose another {flag}"
            if resumable
            else f"choose another {flag}, a new or empty directory"
        )
        raise UserError(f"{flag} {path}: already holds a run ({_names(held)}); {fix}")
    if others and not held:
        raise UserError(
            f"{flag} {path}: holds files that are not a raytrm run ({_names(others)}); give {flag} a new or empty "
            "directory"
        )


def move_aside(path: str | Path) -> Path:
    """Rename the run at path to a free sibling `NAME.replaced-YYYYmmdd-HHMMSS` (logged); returns the new path."""
    path = Path(path)
    if Path.cwd().resolve().is_relative_to(path.resolve()):  # renamed, it would take this process's paths with it
        raise UserError(
            f"--overwrite {path}: the current directory is in that run; run the command from outside it, or choose "
            "another --out"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.replaced-{stamp}")
    n = 2
    while target.exists():
        target = path.with_name(f"{path.name}.replaced-{stamp}-{n}")
        n += 1
    try:
        os.rename(path, target)
    except OSError as e:
        raise UserError(
            f"--overwrite {path}: cannot move the run aside to {target} ({e.strerror or e}); move it yourself, or "
            "choose another --out"
        ) from None
    logger.warning("--overwrite: the run in %s was moved aside to %s (kept, not deleted)", path, target)
    return target


def claim_run_dir(path: str | Path, *, resume: bool = False, overwrite: bool = False) -> Path | None:
    """Make path ready for `raytrm train`: with resume, nothing to do; else refuse what check_new_run_dir refuses,
    and with overwrite move a run there aside. Returns where the old run went, or None."""
    if resume:
        return None
    path = Path(path)
    check_new_run_dir(path, overwrite=overwrite)
    return move_aside(path) if overwrite and run_contents(path) else None
