"""A training run directory as the report reads it: the config, the lines of metrics.jsonl, summary.json if any.

metrics.jsonl holds two kinds of lines, as the training loop writes them: step lines (`step`, `samples_per_sec`,
loss and the task's metrics, `lr`, `rss_mb`, `peak_rss_mb`, `cpu_percent`, a thermal reading, evaluation scores
every eval_interval steps, and with several workers `sync_s`, `sync_share` and a `workers` list of per-rank rows)
and event lines (`step`, `event`: the memory governor's choose / shrink / grow / out-of-memory, the thermal guard's
thermal-*, rebalance, sync-choice; a worker's own events carry its `rank`). No line holds a clock time, so the
time axis is rebuilt from what each line says: the samples of its window over the window's samples/s, i.e. seconds
spent in training steps.
"""

from __future__ import annotations

import codecs
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from raytrm import config as cfg
from raytrm.config import THERMAL_STATES
from raytrm.errors import ConfigError, UserError
from raytrm.schema import check_fields, read_json
from raytrm.train.run.training import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE

logger = logging.getLogger(__name__)


@dataclass
class RunRecord:
    """What one training run recorded, with its step lines on a samples and a training-time axis."""

    run_dir: Path
    config: cfg.ExperimentConfig
    steps: list[dict[str, Any]]  # step lines, in file order
    events: list[dict[str, Any]]  # event lines, in file order
    summary: dict[str, Any] | None  # None when the run did not finish (killed, or still running)
    samples: np.ndarray  # samples trained at each step line
    time_s: np.ndarray  # seconds spent in training steps at each step line
    notes: list[str] = field(default_factory=list)  # what the report should say about the record itself

    @property
    def step_numbers(self) -> np.ndarray:
        return np.array([line["step"] for line in self.steps], dtype=float)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(indices of the step lines that hold a number for key, those numbers)."""
        found = [(i, line[key]) for i, line in enumerate(self.steps) if _number(line.get(key))]
        if not found:
            return np.array([], dtype=int), np.array([], dtype=float)
        index, values = zip(*found, strict=True)
        return np.array(index, dtype=int), np.array(values, dtype=float)

    def time_at(self, step: float) -> float:
        """Training seconds at the end of a step (events fall between step lines when log_interval > 1)."""
        return float(np.interp(step, self.step_numbers, self.time_s))

    def samples_at(self, step: float) -> float:
        return float(step * self.config.training.global_batch_size)

    @property
    def worker_rows(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """(step line index, per-rank rows) of the lines that have them: runs on several workers."""
        return [(i, line["workers"]) for i, line in enumerate(self.steps) if line.get("workers")]

    @property
    def budget_mb(self) -> float | None:
        budget = (self.summary or {}).get("memory_budget_mb") or self.config.training.memory_budget_mb
        return float(budget) if budget else None

    @property
    def threads(self) -> int | None:
        used = (self.summary or {}).get("threads") or {}
        return used.get("threads") or self.config.training.threads

    @property
    def classifier(self) -> bool:
        """Whether the run trained a Hugging Face classifier, whose final evaluation records its confusion matrix."""
        model = self.config.model
        return model.name == "hf" and model.task == "classify"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: Fields of a metrics line the report reads as they are (not through `series`, which skips what is not a number),
#: with their kinds; a line that has one of another kind was not written by `raytrm train`.
LINE_FIELDS = {
    "event": "str",
    "thermal_state": "str",
    "workers": "list",
    "rank": "int",
    "micro_batch_to": "int",
    "mode": "str",
    "every": "int",
    "overlap": "int",
}
#: Fields of a worker's row (a step line's `workers`) that the report reads.
WORKER_FIELDS = {
    "rank": "int",
    "share": "int",
    "micro_batch": "int",
    "compute_s": "number",
    "sync_s": "number",
    "samples_per_sec": "number",
}
#: Fields of a change of an `--elastic` run's workers (a `membership` event, and summary.json's `membership` list).
MEMBERSHIP_FIELDS = {
    **dict.fromkeys(("workers", "left", "entered"), "list"),
    **dict.fromkeys(("waited_s", "deadline_s", "seconds"), "number"),
}
#: Fields of summary.json the report reads, with their kinds.
SUMMARY_FIELDS = {
    **dict.fromkeys(("steps", "sync_every"), "int"),
    **dict.fromkeys(
        (
            "steady_samples_per_sec",
            "setup_seconds",
            "warmup_seconds",
            "peak_step_mb",
            "memory_budget_mb",
            "wall_seconds",
            "train_seconds",
            "eval_accuracy",
            "eval_macro_f1",
            "eval_majority_acc",
            "eval_documents",
        ),
        "number",
    ),
    **dict.fromkeys(("stop_reason", "device", "dtype", "peak_method", "sync_mode"), "str"),
    **dict.fromkeys(("threads", "sync_share"), "dict"),
    **dict.fromkeys(("micro_batches", "eval_confusion", "eval_labels", "membership"), "list"),
}
DAMAGED = "the file is damaged: delete or repair that line"


def _check_line(record: Any, path: Path, number: int, text: str) -> None:
    """A metrics line as `raytrm train` writes it, in the fields the report reads."""
    where = f"{path} line {number}"
    step = record.get("step") if isinstance(record, dict) else None
    if not _number(step) or not math.isfinite(step) or step < 0:
        raise UserError(
            f"{where}: expected a JSON object with a numeric step (>= 0), got {text[:60]!r}; the file is not one "
            "`raytrm train` wrote: give the run directory of a training run"
        )
    check_fields(record, where, LINE_FIELDS, fix=DAMAGED)
    if "event" in record:
        check_fields(record, where, {"event": "str"}, required=("event",), fix=DAMAGED)
    if record.get("event") == "sync-choice":
        check_fields(record, where, {"mode": "str"}, required=("mode",), fix=DAMAGED)
    if record.get("thermal_state") is not None and record["thermal_state"] not in THERMAL_STATES:
        raise ConfigError(
            where, "thermal_state", record["thermal_state"], f"one of {', '.join(THERMAL_STATES)}", DAMAGED
        )
    if "event" in record:  # a membership event names the workers that train together from its step
        if record["event"] == "membership":
            _check_change(record, where, "", DAMAGED)
        return
    for i, row in enumerate(record.get("workers") or []):  # a step line's: every worker's figures
        if not isinstance(row, dict):
            raise ConfigError(where, f"workers[{i}]", row, "a mapping of a worker's figures", DAMAGED)
        check_fields(row, where, WORKER_FIELDS, f"workers[{i}].", required=("rank",), fix=DAMAGED)


def _torn(data: bytes) -> bool:
    """Whether a last line that does not parse reads as the start of a line a run was writing when it stopped: an
    object's opening, in text (its last character may be cut mid-byte-sequence)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return data.lstrip().startswith(b"{") and b"\0" not in data


def read_lines(path: Path) -> tuple[list[dict[str, Any]], int | None]:
    """The records of a metrics.jsonl and the number of a torn last line (a run killed mid-write), which the caller
    skips with a warning; any other line that is not a JSON object with a step, in UTF-8, is refused."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror}); check its permissions") from None
    lines = [(n, text) for n, text in enumerate(raw.split(b"\n"), start=1) if text.strip()]
    records: list[dict[str, Any]] = []
    for position, (number, data) in enumerate(lines):
        try:
            text = data.decode("utf-8")
            record = json.loads(text)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            if position == len(lines) - 1 and _torn(data):
                return records, number
            what = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "not JSON"
            detail = f" ({e.msg})" if isinstance(e, json.JSONDecodeError) else ""
            raise UserError(f"{path} line {number}: {what}{detail}; {DAMAGED}") from None
        _check_line(record, path, number, text)
        records.append(record)
    return records, None


def read_summary(path: Path) -> dict[str, Any]:
    """summary.json, in the fields the report reads."""
    fix = f"delete it to report from {METRICS_FILE} alone"
    summary = read_json(path, fix)
    check_fields(summary, str(path), SUMMARY_FIELDS, fix=fix)
    threads = summary.get("threads") or {}
    check_fields(threads, str(path), {"threads": "int"}, "threads.", fix=fix)
    shares = summary.get("sync_share") or {}
    check_fields(shares, str(path), {"run": "number", "workers": "list"}, "sync_share.", fix=fix)
    if not all(_number(v) and isinstance(v, int) for v in summary.get("micro_batches") or []):
        raise ConfigError(str(path), "micro_batches", summary["micro_batches"], "a list of integers", fix)
    if not all(_number(v) for v in shares.get("workers") or []):
        raise ConfigError(str(path), "sync_share.workers", shares["workers"], "a list of numbers", fix)
    for i, change in enumerate(summary.get("membership") or []):
        if not isinstance(change, dict) or not _number(change.get("step")):
            raise ConfigError(str(path), f"membership[{i}]", change, "a mapping with a numeric step", fix)
        _check_change(change, str(path), f"membership[{i}].", fix)
    _check_confusion(summary, str(path), fix)
    return summary


def _check_change(change: dict[str, Any], where: str, prefix: str, fix: str) -> None:
    """A change of an `--elastic` run's workers: its numbers, and its lists of worker names."""
    check_fields(change, where, MEMBERSHIP_FIELDS, prefix, fix=fix)
    for key in ("workers", "left", "entered"):
        names = change.get(key) or []
        if not all(isinstance(name, str) for name in names):
            raise ConfigError(where, f"{prefix}{key}", names, "a list of worker names", fix)


def _check_confusion(summary: dict[str, Any], path: str, fix: str) -> None:
    """A classifier's final confusion matrix: a square list of counts, one row and one column per label's name."""
    names, matrix = summary.get("eval_labels"), summary.get("eval_confusion")
    if names is not None and not all(isinstance(name, str) for name in names):
        raise ConfigError(path, "eval_labels", names, "a list of the labels' names (strings)", fix)
    if matrix is None:
        return
    size = len(names) if names is not None else len(matrix)
    counts = (
        len(matrix) == size > 0
        and all(isinstance(row, list) and len(row) == size for row in matrix)
        and all(_number(n) and isinstance(n, int) and n >= 0 for row in matrix for n in row)
    )
    if not counts:
        labels = f" of eval_labels ({size})" if names is not None else ""
        expected = f"a square list of counts (integers >= 0), one row and one column per label{labels}"
        raise ConfigError(path, "eval_confusion", matrix, expected, fix)


def training_time(steps: list[dict[str, Any]], global_batch: int) -> np.ndarray:
    """Cumulative seconds in training steps at each step line: each window's samples over its samples/s."""
    seconds, previous, total = [], 0, 0.0
    for line in steps:
        rate = line.get("samples_per_sec")
        if _number(rate) and rate > 0:
            total += (line["step"] - previous) * global_batch / rate
        previous = line["step"]
        seconds.append(total)
    return np.array(seconds, dtype=float)


def load_run(run_dir: str | Path) -> RunRecord:
    """Read a `raytrm train` run directory; bad or missing files are refused with the fix."""
    run_dir = Path(run_dir)
    for name in (CONFIG_FILE, METRICS_FILE):
        if not (run_dir / name).is_file():
            raise UserError(
                f"{run_dir}: no {name}, so not a complete training run directory; give the --out directory of "
                "`raytrm train` (a run writes config.yaml and metrics.jsonl as it starts)"
            )
    config = cfg.load(cfg.ExperimentConfig, run_dir / CONFIG_FILE)
    records, torn = read_lines(run_dir / METRICS_FILE)
    steps = [r for r in records if "event" not in r]
    if not steps:
        raise UserError(
            f"{run_dir / METRICS_FILE}: no step line yet; a run logs every log_interval "
            f"({config.training.log_interval}) steps: report it once it has trained that far"
        )
    summary = read_summary(run_dir / SUMMARY_FILE) if (run_dir / SUMMARY_FILE).is_file() else None
    notes = []
    if torn:
        logger.warning("%s line %d: cut short (the run stopped mid-write); skipped", run_dir / METRICS_FILE, torn)
        notes.append(f"{METRICS_FILE} line {torn} was cut short (the run stopped mid-write): skipped")
    last = steps[-1]["step"]
    if summary is None:
        notes.append(f"no {SUMMARY_FILE}: the run did not finish (killed, or still running); read from {METRICS_FILE}")
    elif not last <= summary.get("steps", -1) < last + config.training.log_interval:
        # A run logs every log_interval steps, and may stop between two rows (a time budget): its summary is then
        # of a step past the last row, never a whole interval past it, and never before it.
        notes.append(
            f"{SUMMARY_FILE} is of step {summary.get('steps')}, {METRICS_FILE} goes to step {last}: a resumed run "
            f"did not finish; read from {METRICS_FILE}"
        )
        summary = None
    global_batch = config.training.global_batch_size
    return RunRecord(
        run_dir=run_dir,
        config=config,
        steps=steps,
        events=[r for r in records if "event" in r],
        summary=summary,
        samples=np.array([line["step"] * global_batch for line in steps], dtype=float),
        time_s=training_time(steps, global_batch),
        notes=notes,
    )
