"""Complete, versioned, checksummed checkpoints, written atomically.

A checkpoint file is one JSON header line (format version, step, payload size and SHA-256, raytrm version) followed
by the torch-serialised payload. It is written to a temporary file, flushed to disk and renamed into place, so a
kill mid-write leaves at most a stray temporary file, never a checkpoint that looks complete. Loading checks the
size and the checksum before unpickling anything, and unpickles with `weights_only=True`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from raytrm import __version__
from raytrm.errors import UserError

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
_NAME = re.compile(r"^step-(\d{8,})\.ckpt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.ckpt"


def save_checkpoint(state: dict[str, Any], directory: str | Path, step: int, keep: int | None = 3) -> Path:
    """Write state atomically as the checkpoint of this step; keep only the newest `keep` checkpoints."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = {
        "raytrm_checkpoint": CHECKPOINT_FORMAT,
        "step": step,
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "raytrm_version": __version__,
    }
    final = checkpoint_path(directory, step)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
        assert isinstance(header, dict) and "raytrm_checkpoint" in header
    except (ValueError, AssertionError):
        raise UserError(
            f"{path}: not a raytrm checkpoint (no header line); point --resume at a run directory "
            "written by `raytrm train`"
        ) from None
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
    state["_header"] = header
    return state


def latest_good_checkpoint(directory: str | Path) -> dict[str, Any] | None:
    """The newest checkpoint that verifies; newer broken ones are skipped with a warning naming them."""
    candidates = list_checkpoints(directory)
    errors = []
    for path in reversed(candidates):
        try:
            return load_checkpoint(path)
        except UserError as e:
            logger.warning("skipping checkpoint %s", e)
            errors.append(str(e))
    if errors:
        raise UserError(f"{directory}: no checkpoint verifies ({len(errors)} tried; newest: {errors[0]})")
    return None
