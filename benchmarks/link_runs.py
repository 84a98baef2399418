"""One run's figures on the pair, read from its run directory, and the rows: medians over rounds, against the
model's unshaped exact row.

A run's samples/s is taken over its steps after the first ones (start-up, the memory governor's probes) as total
samples over total seconds, so a mode whose rounds sync every H steps is timed over whole rounds, not by its median
step. Its sync share is summary.json's where the summary records one, else the workers' rows' (the slowest worker's
sync over its step, as `raytrm report` reads it). The mode the run ended in, why it was chosen and the megabytes a
sync sums are the summary's (its last sync-choice).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.link_models import BASELINE_MODE, QUALITY, LinkModel
from tests.support.hosts import UNSHAPED


@dataclass
class LinkRun:
    """One run's figures (or its failure)."""

    model: str
    rate: str
    mode: str
    round: int
    link_mbit: float  # what one TCP connection carried from host a to b just before
    load: float  # this machine's 1-minute load average at the run's end
    samples_per_sec: float | None = None
    sync_share: float | None = None
    sync_share_from: str = ""  # "summary" or "worker rows"
    quality: float | None = None
    chosen: str = ""  # the sync mode (and H) summary.json records, where it records one
    reason: str = ""  # why the run's last sync choice was made, as summary.json gives it
    sync_mb: float | None = None  # the megabytes of gradient (or of a round's deltas) one sync sums
    workers: int | None = None
    timed_steps: int = 0
    error: str = ""


def read_run(run_dir: Path, model: LinkModel) -> dict[str, Any]:
    """A finished run's figures from its summary.json and metrics.jsonl (a row each step)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "event" not in r and r.get("samples_per_sec")]
    timed = [r for r in rows if r["step"] > model.warmup] or rows
    seconds = [model.global_batch / r["samples_per_sec"] for r in timed]
    share, source = _summary_share(summary), "summary"
    if share is None:
        share, source = _rows_share(timed), "worker rows"
    chosen = summary.get("sync_mode") or ""
    if chosen and summary.get("sync_every"):
        chosen += f" H={summary['sync_every']}"
    if chosen and summary.get("sync_overlap"):
        chosen += f" behind {summary['sync_overlap']}"
    choices = summary.get("sync_choices") or [{}]

    def setting(choice: dict[str, Any]) -> tuple[Any, ...]:
        return choice.get("mode"), choice.get("every"), choice.get("overlap")

    if chosen and any(setting(c) != setting(choices[-1]) for c in choices[:-1]):  # switched on drift: since when
        before = ", ".join(str(c.get("mode")) for c in choices[:-1])
        chosen += f" from step {choices[-1].get('step')} (before: {before})"
    return {
        "samples_per_sec": model.global_batch * len(timed) / sum(seconds),
        "sync_share": share,
        "sync_share_from": source if share is not None else "",
        "quality": summary.get(QUALITY[model.name][0]),
        "chosen": chosen,
        "reason": summary.get("sync_reason") or "",
        "sync_mb": choices[-1].get("model_mb"),
        "workers": summary.get("workers", 1),
        "timed_steps": len(timed),
    }


def _summary_share(summary: dict[str, Any]) -> float | None:
    """The run's sync share where summary.json records it: a number, or the run's beside each worker's."""
    share = summary.get("sync_share")
    if isinstance(share, dict):
        share = share.get("run")
    return float(share) if isinstance(share, (int, float)) else None


def _rows_share(rows: list[dict[str, Any]]) -> float | None:
    """The slowest worker's sync over its step, summed over the rows: a worker's sync holds its wait for slower
    workers, so the sync itself is read off the one that waits for no one."""
    sync = step = 0.0
    for row in rows:
        workers = row.get("workers") or []
        if not workers:
            continue
        slow = max(workers, key=lambda w: w.get("compute_s") or 0.0)
        sync += slow.get("sync_s") or 0.0
        step += (slow.get("compute_s") or 0.0) + (slow.get("sync_s") or 0.0)
    return sync / step if step > 0 else None


def run_line(run: LinkRun) -> str:
    """A run's figures in a line, logged as the bench goes."""
    where = f"round {run.round} {run.model} {run.rate} {run.mode}"
    if run.error:
        return f"{where}: FAILED: {run.error.splitlines()[0]}"
    share = f"{run.sync_share:.3f}" if run.sync_share is not None else "-"
    line = (
        f"{where}: {run.samples_per_sec:.2f} samples/s, sync share {share}, quality {run.quality} (load {run.load:.1f})"
    )
    if run.chosen and run.mode in ("auto", "local"):  # modes the run chose itself (local without H): what and why
        line += f"; chose {run.chosen}: {run.reason}"
    return line


@dataclass
class LinkRow:
    """The medians of one (model, rate, mode) over the rounds, against the model's unshaped exact row."""

    model: str
    rate: str
    mode: str
    samples_per_sec: float | None
    ratio: float | None
    sync_share: float | None
    quality: float | None
    quality_delta: float | None
    link_mbit: float
    load: float
    runs: int
    failed: int
    chosen: list[str] = field(default_factory=list)


def _median(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def rows_of(runs: list[LinkRun]) -> list[LinkRow]:
    """One row per (model, rate, mode): a model's rows together, each in the order of its first run."""
    groups: dict[tuple[str, str, str], list[LinkRun]] = {}
    for run in runs:
        groups.setdefault((run.model, run.rate, run.mode), []).append(run)
    rows = []
    for (model, rate, mode), found in groups.items():
        ok = [r for r in found if not r.error]
        rows.append(
            LinkRow(
                model,
                rate,
                mode,
                _median([r.samples_per_sec for r in ok]),
                None,
                _median([r.sync_share for r in ok]),
                _median([r.quality for r in ok]),
                None,
                statistics.median(r.link_mbit for r in found),
                statistics.median(r.load for r in found),
                len(found),
                len(found) - len(ok),
                sorted({r.chosen for r in ok if r.chosen}),
            )
        )
    models = list(dict.fromkeys(run.model for run in runs))
    rows.sort(key=lambda row: models.index(row.model))
    for row in rows:
        base = next((b for b in rows if (b.model, b.rate, b.mode) == (row.model, UNSHAPED, BASELINE_MODE)), None)
        if base is None:
            continue
        if row.samples_per_sec is not None and base.samples_per_sec:
            row.ratio = row.samples_per_sec / base.samples_per_sec
        if row.quality is not None and base.quality is not None:
            row.quality_delta = row.quality - base.quality
    return rows


def format_rows(rows: list[LinkRow], models: list[dict[str, Any]]) -> str:
    lines = [
        f"{m['name']}: {m['description']}, {_sizes(m)}, {m['steps']} steps ({m['samples']:,} samples), timed after "
        f"step {m['warmup']}"
        for m in models
    ]
    width = max([5, *(len(r.model) for r in rows)])
    lines.append(
        f"{'model':<{width}} {'link':<9} {'mode':<11} {'samples/s':>9} {'ratio':>6} {'sync':>6} {'quality':>17} "
        f"{'delta':>7} {'link Mbit/s':>11} {'load':>5}  runs"
    )
    for r in rows:
        name = QUALITY[r.model][1]
        quality = f"{name} {r.quality:.4f}" if r.quality is not None else "-"
        cells = [
            f"{r.samples_per_sec:>9.2f}" if r.samples_per_sec is not None else f"{'-':>9}",
            f"{r.ratio:>6.3f}" if r.ratio is not None else f"{'':>6}",
            f"{r.sync_share:>6.3f}" if r.sync_share is not None else f"{'-':>6}",
            f"{quality:>17}",
            f"{r.quality_delta:>+7.4f}" if r.quality_delta is not None else f"{'':>7}",
        ]
        note = f"{r.runs}" + (f", {r.failed} failed" if r.failed else "")
        if r.chosen:
            note += f"; chose {', '.join(r.chosen)}"
        where = f"{r.model:<{width}} {r.rate:<9} {r.mode:<11}"
        lines.append(f"{where} {' '.join(cells)} {r.link_mbit:>11.1f} {r.load:>5.1f}  {note}")
    return "\n".join(lines)


def _sizes(model: dict[str, Any]) -> str:
    """The model's parameters, those that train where fewer, and the megabytes a sync sums."""
    text = f"{model['parameters']:,} parameters"
    trainable = model.get("trainable")
    if trainable is not None and trainable != model["parameters"]:
        text += f" ({trainable:,} trainable)"
    if model.get("sync_bytes") is not None:
        text += f", {model['sync_bytes'] / 1e6:.2f} MB summed a sync"
    return text
