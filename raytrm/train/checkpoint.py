"""Complete, versioned, checksummed checkpoints, written atomically.

A checkpoint file is one JSON header line (format version, step, payload size and SHA-256, raytrm version) followed
by the torch-serialised payload. It is written to a temporary file, flushed to disk and renamed into place, so a
kill mid-write leaves at most a stray temporary file, never a checkpoint that looks complete. Loading checks the
size and the checksum before unpickling anything, and unpickles with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import reprlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from raytrm import __version__
from raytrm.errors import UserError
from raytrm.train.memory.oom import is_out_of_memory

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
_NAME = re.compile(r"^step-(\d{8,})\.ckpt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.ckpt"


def header_line(payload: bytes, step: int) -> bytes:
    """The line before a checkpoint's payload: format, step, and the size and SHA-256 a load checks it against."""
    header = {
        "raytrm_checkpoint": CHECKPOINT_FORMAT,
        "step": step,
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "raytrm_version": __version__,
    }
    return json.dumps(header).encode() + b"\n"


def save_checkpoint(state: dict[str, Any], directory: str | Path, step: int, keep: int | None = 3) -> Path:
    """Write state atomically as the checkpoint of this step; keep only the newest `keep` checkpoints."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    final = checkpoint_path(directory, step)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{final.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(header_line(payload, step))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if not isinstance(e, OSError):
            raise
        # A full disk (or a read-only or vanished directory): the previous checkpoint is untouched, and resumable.
        kept = [p for p in list_checkpoints(directory) if p != final]
        previous = f"the previous checkpoint {kept[-1].name} is kept" if kept else "there is no earlier checkpoint"
        raise UserError(
            f"{final}: cannot write the checkpoint ({e.strerror or e}); {previous}; free space in {directory} (or make"
            f" it writable), then resume with `raytrm train --out {directory.parent} --resume`"
        ) from None
    _fsync_dir(directory)
    if keep:
        for old in list_checkpoints(directory)[:-keep]:
            old.unlink(missing_ok=True)
    return final


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in a directory, oldest first (temporary files of interrupted writes are not listed)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read and verify one checkpoint; a torn, corrupt or incompatible file is refused with one clear line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read checkpoint ({e.strerror}); check the path") from None
    line, _, payload = raw.partition(b"\n")
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: a line of deeply nested brackets
        header = None
    if not isinstance(header, dict) or "raytrm_checkpoint" not in header:
        raise UserError(
            f"{path}: not a raytrm checkpoint (no header line); point --resume at a run directory "
            "written by `raytrm train`"
        )
    if header["raytrm_checkpoint"] != CHECKPOINT_FORMAT:
        raise UserError(
            f"{path}: checkpoint format {header['raytrm_checkpoint']}, this raytrm reads "
            f"format {CHECKPOINT_FORMAT}; resume with the raytrm version that wrote it "
            f"({header.get('raytrm_version', 'unknown')})"
        )
    if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise UserError(
            f"{path}: checkpoint is corrupt (size or SHA-256 does not match its header); "
            "delete it to resume from an earlier one"
        )
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # the checksum matched, so this is a file from an incompatible writer
        raise UserError(
            f"{path}: checkpoint payload cannot be read ({type(e).__name__}); it was written by "
            f"raytrm {header.get('raytrm_version', 'unknown')}"
        ) from None
    if not isinstance(state, dict):
        raise UserError(
            f"{path}: checkpoint payload is a {type(state).__name__}, not the state dict raytrm writes; it was written"
            f" by raytrm {header.get('raytrm_version', 'unknown')}"
        )
    _check_steps(path, header, state)
    state["_header"] = {**header, "path": str(path)}
    return state


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_steps(path: Path, header: dict[str, Any], state: dict[str, Any]) -> None:
    """The step a checkpoint claims is one: a count in its header, and the same in its name and its contents; and
    the samples it has seen are its steps' global batches (every step trains one whole global batch)."""
    away = f"move it out of {path.parent} to resume from an earlier checkpoint"
    broken = f"the file is broken or was edited: {away}"
    step = header.get("step")
    if not _count(step):
        raise UserError(f"{path}: its header claims step {reprlib.repr(step)}, expected a step count >= 0; {broken}")
    if "step" in state and (not _count(state["step"]) or state["step"] != step):
        raise UserError(
            f"{path}: its header says step {step}, its contents step {reprlib.repr(state['step'])}; {broken}"
        )
    named = _NAME.match(path.name)
    if named and int(named.group(1)) != step:
        raise UserError(
            f"{path}: its name says step {int(named.group(1))}, its header step {step}; rename it "
            f"{checkpoint_path(path.parent, step).name} if that is its step, or {away}"
        )
    seen, config = state.get("samples_seen"), state.get("config")
    training = config.get("training") if isinstance(config, dict) else None
    batch = training.get("global_batch_size") if isinstance(training, dict) else None
    if "samples_seen" in state and _count(batch) and (not _count(seen) or seen != step * batch):
        raise UserError(
            f"{path}: it claims {reprlib.repr(seen)} samples seen at step {step}, expected {step * batch} (step x "
            f"the global batch {batch}); {broken}"
        )


#: What restoring a state of another shape raises: a key missing, a value of another type, size or count.
_CONTENT_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, ZeroDivisionError)


@contextlib.contextmanager
def restoring(state: dict[str, Any]) -> Iterator[None]:
    """Restore a loaded checkpoint's state inside this: contents that do not fit the run are one line naming it.

    The checksum only says the file is the one written; a checkpoint from a foreign or broken writer can still hold
    the wrong keys or shapes, and what that raises deep inside torch is no message for a person.
    """
    try:
        yield
    except _CONTENT_ERRORS as e:
        if is_out_of_memory(e):
            raise
        header = state.get("_header") or {}
        detail = " ".join(str(e).split())
        detail = detail if len(detail) <= 160 else detail[:160] + "..."
        path = Path(str(header.get("path", "checkpoint")))
        raise UserError(
            f"{path}: its contents do not fit this run ({type(e).__name__}: {detail}); it was written by raytrm "
            f"{header.get('raytrm_version', 'unknown')}: move it out of {path.parent} to resume from an earlier "
            "checkpoint, or start a new run with another --out"
        ) from None


def latest_good_checkpoint(directory: str | Path) -> dict[str, Any] | None:
    """The newest checkpoint that verifies; newer broken ones are skipped with a warning naming them."""
    candidates = list_checkpoints(directory)
    errors = []
    for path in reversed(candidates):
        try:
            state = load_checkpoint(path)
        except UserError as e:
            errors.append(str(e))
            continue
        for error in errors:  # said only where an earlier one is taken: else the refusal below is the one line
            logger.warning("skipping checkpoint %s", error)
        return state
    if errors:
        raise UserError(f"{directory}: no checkpoint verifies ({len(errors)} tried; newest: {errors[0]})")
    return None
