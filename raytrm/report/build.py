"""`raytrm report RUN_DIR`: plots and a diagnosis of a training run, or the study plots and table of a tuning run.

Everything is read and checked before anything is written, and the text (diagnosis.txt, tuning.txt) is written
last: a report directory without it is one whose writing failed.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raytrm import config as cfg
from raytrm.errors import UserError
from raytrm.report.classifier import score_lines
from raytrm.report.diagnosis import NOT_RECORDED, Finding, diagnose, log_lines
from raytrm.report.plots import write_run_plots
from raytrm.report.runs import RunRecord, load_run
from raytrm.report.sync import membership_lines, sync_lines
from raytrm.train.run.directory import guard_output
from raytrm.train.run.training import CONFIG_FILE, METRICS_FILE

REPORT_DIR, DIAGNOSIS_FILE, TUNING_FILE = "report", "diagnosis.txt", "tuning.txt"


@dataclass
class Report:
    """What `write_report` wrote: the directory, its plots, and the text it printed there."""

    out: Path
    plots: list[Path]
    text: str


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Report:
    """Report on a training or a tuning run directory, into out (default RUN_DIR/report)."""
    from raytrm.tune.layout import TUNE_FILE

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(
            f"{run_dir}: no such directory; give the --out directory of a `raytrm train` or `raytrm tune` run"
        )
    out_dir = Path(out) if out else run_dir / REPORT_DIR
    _check_out(out_dir)
    if (run_dir / TUNE_FILE).is_file():
        return _tuning_report(run_dir, out_dir)
    if (run_dir / CONFIG_FILE).is_file() or (run_dir / METRICS_FILE).is_file():
        return _training_report(run_dir, out_dir)
    raise UserError(
        f"{run_dir}: neither a training run (no {CONFIG_FILE} or {METRICS_FILE}) nor a tuning run (no {TUNE_FILE}); "
        "give the --out directory of a `raytrm train` or `raytrm tune` run"
    )


def _check_out(out_dir: Path) -> None:
    """The report goes into a directory: a file where it or a parent would be is refused, never replaced, and so is a
    place where a run keeps its own files (its checkpoints, another run's directory)."""
    for path in (out_dir, *out_dir.parents):
        if path.exists() and not path.is_dir():
            what = "an existing file" if path == out_dir else f"under {path}, an existing file"
            raise UserError(
                f"--out {out_dir}: {what}; expected a directory for the report's plots and text (default "
                "RUN_DIR/report); fix: give --out a new or an existing directory"
            )
    guard_output(out_dir, directory=True)


def _writing(out_dir: Path) -> None:
    """Make the report directory; one that cannot be made is one line."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"--out {out_dir}: cannot make the report directory ({e.strerror}); fix: give --out a writable directory"
        ) from None


def _training_report(run_dir: Path, out_dir: Path) -> Report:
    record = load_run(run_dir)
    _writing(out_dir)
    plots, skipped = write_run_plots(record, out_dir)
    text = format_diagnosis(record, diagnose(record), out_dir, plots, skipped)
    cfg.write_text_atomic(text + "\n", out_dir / DIAGNOSIS_FILE)
    return Report(out_dir, plots, text)


def _tuning_report(run_dir: Path, out_dir: Path) -> Report:
    from raytrm.tune.plots import write_plots
    from raytrm.tune.tables import format_table

    table = format_table(run_dir)
    _writing(out_dir)
    plots = [Path(shutil.copy2(path, out_dir / path.name)) for path in write_plots(run_dir)]
    lines = [f"tuning run {run_dir}", table, _plot_line(out_dir, plots)]
    text = "\n".join(lines)
    cfg.write_text_atomic(text + "\n", out_dir / TUNING_FILE)
    return Report(out_dir, plots, text)


def _plot_line(out_dir: Path, plots: list[Path]) -> str:
    return f"plots in {out_dir}: {', '.join(p.name for p in plots)}" if plots else f"no plots written to {out_dir}"


def format_diagnosis(
    record: RunRecord, findings: list[Finding], out_dir: Path, plots: list[Path], skipped: list[str]
) -> str:
    """The text a person reads: what ran (and a classifier's scores), what limited it and how to fix it, what was not
    recorded, the plots."""
    summary = record.summary or {}
    rows = record.worker_rows
    _, rates = record.series("samples_per_sec")
    parts = [f"{int(record.steps[-1]['step'])} steps", f"{record.samples[-1]:.0f} samples"]
    parts.append(f"{record.time_s[-1]:.1f} s in training steps")
    if len(rates):
        parts.append(f"median {float(np.median(rates)):.1f} samples/s")
    if summary.get("steady_samples_per_sec"):
        warmup = summary.get("setup_seconds", 0.0) + summary.get("warmup_seconds", 0.0)
        parts.append(f"steady {summary['steady_samples_per_sec']:.1f} samples/s after a {warmup:.1f} s warm-up")
    if summary.get("stop_reason"):
        parts.append(f"stopped: {summary['stop_reason']}")
    if summary.get("device"):
        parts.append(f"{summary['device']} {summary.get('dtype', '')}".strip())
    if record.threads:
        parts.append(f"{record.threads} thread(s)")
    if rows:
        parts.append(f"{len(rows[-1][1])} workers")
    lines = [f"run {record.run_dir}: {', '.join(parts)}"]
    lines += score_lines(record)
    lines += [f"note: {note}" for note in record.notes]
    lines += sync_lines(record)
    lines += membership_lines(record)
    if findings:
        lines.append("what limited it:")
        lines += [finding.format() for finding in findings]
    else:
        lines.append("no limit found in what was recorded")
    lines.append(f"not recorded, so not diagnosed: {'; '.join(NOT_RECORDED)}")
    lines += log_lines(record)
    lines.append(_plot_line(out_dir, plots))
    lines += skipped
    return "\n".join(lines)
