"""What a training run shows and records: metrics.jsonl, a progress line, and process resource samples."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from raytrm.train.run.tensorboard import open_sink


class MetricsLog:
    """Appends one JSON line per logging step; on resume, drops the lines past the resumed step."""

    def __init__(self, path: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = self.path.open("a")
        self._sink = open_sink(self.path.parent, resume_step)  # TensorBoard's view of the same lines, if installed

    def write(self, record: dict[str, Any]) -> None:
        plain = _plain(record)
        self._file.write(json.dumps(plain) + "\n")
        self._file.flush()
        if self._sink is not None:
            self._sink.write(plain)

    def close(self) -> None:
        self._file.close()
        if self._sink is not None:
            self._sink.close()


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", math.inf)
    except ValueError:
        return math.inf  # a torn last line from a killed run is dropped


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, float):
            value = _rounded(value) if math.isfinite(value) else None
        out[key] = value
    return out


def _rounded(value: float) -> float:
    """Six decimals, or six significant digits where those keep more: an lr of 1e-12 or an update ratio of 3e-11
    would read 0 at six decimals."""
    if value == 0:
        return 0.0
    return round(value, max(6, 5 - math.floor(math.log10(abs(value)))))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Progress:
    """One status line: redrawn in place on a terminal, printed every few seconds otherwise."""

    def __init__(
        self,
        total: int | None,
        budget_s: float | None,
        stream: TextIO = sys.stderr,
        enabled: bool = True,
        every_s: float = 10.0,
    ) -> None:
        self.total, self.budget_s, self.stream, self.enabled = total, budget_s, stream, enabled
        self.tty = enabled and stream.isatty()
        self.every_s = every_s
        self._last = 0.0
        self._start = time.perf_counter()

    def update(self, step: int, fields: dict[str, Any]) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not self.tty and now - self._last < self.every_s:
            return
        self._last = now
        head = f"step {step}/{self.total} {100 * step / self.total:3.0f}%" if self.total else f"step {step}"
        if self.budget_s:
            head += f" {now - self._start:.0f}/{self.budget_s:.0f}s"
        body = " ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
        line = f"{head} | {body}"
        if self.tty:
            self.stream.write("\r" + line[:200].ljust(100))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
