"""Choices measured once on this machine, kept on disk so the next process skips measuring them: a fast path's
algorithm per shape, the memory governor's fit per model on a GPU.

A store is one JSON file of key -> value, named by what the choice depends on (for cuBLASLt's algorithms: the GPU,
the driver and the library's version), under raytrm's cache dir. Processes that share the machine (tuning trials)
may write it at once: each write merges into what is on disk and replaces the file atomically, so a reader sees a
whole file and at worst a choice is measured twice.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from raytrm.constants import cache_dir

logger = logging.getLogger(__name__)


def store_path(kind: str, *parts: str) -> Path:
    """The file of a kind of choice for the given circumstances (each part made safe for a file name)."""
    name = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", part).strip("_") for part in parts)
    return cache_dir() / "tuned" / kind / f"{name}.json"


class TunedChoices:
    """One store of measured choices (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._choices = self._read()

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:  # a damaged store is measured again, not trusted
            logger.warning("%s: unreadable (%s); its choices are measured again", self.path, error)
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> tuple[bool, Any]:
        """(whether a choice is kept for key, the choice)."""
        return (key in self._choices, self._choices.get(key))

    def put(self, key: str, value: Any) -> None:
        """Keep a choice: merged into the file as it is now on disk."""
        self._choices[key] = value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._read(), key: value}
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump(merged, f)
            os.replace(f.name, self.path)
            self._choices = {**merged, **self._choices}
        except OSError as error:  # a read-only cache costs the next process its measurement, nothing more
            logger.debug("could not keep a choice in %s: %s", self.path, error)
