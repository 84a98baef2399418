"""The PNG plots of a training run: learning curves, throughput, memory against the budget, thermal state, and a
classifier's confusion matrix.

Each plot puts every adaptation event (memory governor, thermal guard, rebalance) on its time axis as a dotted
line, so a change in a curve can be read against the decision that caused it. matplotlib's object API (Figure, no
pyplot): no global state and no display needed, whatever backend the user's matplotlib defaults to.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from raytrm.config import THERMAL_STATES
from raytrm.report.classifier import CONFUSION_PLOT, confusion_figure, missing_confusion
from raytrm.report.runs import RunRecord

#: Lower is better; a baseline is drawn dashed (what a model that learned nothing would score).
LOSS_KEYS = ("loss", "eval_loss", "bits_per_byte", "eval_bits_per_byte")
LOSS_BASELINES = ("eval_unigram_bits_per_byte",)
#: Higher is better: train accuracy on the sequences that halted, evaluation scores of each task.
SCORE_KEYS = ("accuracy", "exact_accuracy", "eval_cell_acc", "eval_exact_acc", "eval_accuracy", "eval_macro_f1")
SCORE_BASELINES = ("eval_copy_givens_acc", "eval_majority_acc")

EVENT_COLORS = {
    "memory": "tab:blue",
    "thermal": "tab:red",
    "rebalance": "tab:green",
    "health": "tab:orange",
    "sync": "tab:purple",
}
#: More labels than this overlap into a smear: past it the dotted lines stay, their labels go.
MAX_EVENT_LABELS = 12
TIME_LABEL = "seconds in training steps"
DPI = 100


def event_kind(event: dict[str, Any]) -> str:
    """memory (the governor's choose, shrink, grow, out-of-memory), thermal (thermal-*), health (health-*),
    rebalance or sync (a sync mode chosen)."""
    name = str(event.get("event"))
    if name.startswith("thermal-"):
        return "thermal"
    if name.startswith("health-"):
        return "health"
    if name == "sync-choice":
        return "sync"
    return "rebalance" if name == "rebalance" else "memory"


def _event_label(event: dict[str, Any]) -> str:
    rank = f" r{event['rank']}" if "rank" in event else ""
    return f"{event['event']}{rank}"


def mark_events(ax: Axes, record: RunRecord) -> None:
    """A dotted line at each event's training time, colored by kind, labeled while they stay few."""
    kinds = set()
    for event in record.events:
        kind = event_kind(event)
        kinds.add(kind)
        x = record.time_at(event["step"])
        ax.axvline(x, color=EVENT_COLORS[kind], linestyle=":", linewidth=1, alpha=0.8)
        if len(record.events) <= MAX_EVENT_LABELS:
            label = _event_label(event)
            ax.text(x, 0.98, label, transform=ax.get_xaxis_transform(), rotation=90, fontsize=7, va="top", ha="right")
    if kinds:
        handles, labels = ax.get_legend_handles_labels()
        for kind in sorted(kinds):
            handles.append(Line2D([], [], color=EVENT_COLORS[kind], linestyle=":"))
            labels.append(f"{kind} event")
        ax.legend(handles, labels, fontsize=8, loc="best")


def _curves(ax: Axes, record: RunRecord, x: np.ndarray, keys: tuple[str, ...], baselines: tuple[str, ...]) -> bool:
    drawn = False
    for key in keys + baselines:
        index, values = record.series(key)
        if not len(index):
            continue
        if key in baselines:
            style: dict[str, Any] = {"linestyle": "--"}
        elif key.startswith("eval_") or len(index) == 1:  # evaluations are few: show each one
            style = {"marker": "o", "markersize": 4}
        else:
            style = {}
        ax.plot(x[index], values, label=key, **style)
        drawn = True
    if drawn:
        ax.legend(fontsize=8, loc="best")
    return drawn


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def plot_training(record: RunRecord, out: Path) -> Path | None:
    """Loss and accuracy against samples (left) and training time (right)."""
    fig = Figure(figsize=(12, 7))
    axes = fig.subplots(2, 2, squeeze=False)
    drawn = False
    for row, (keys, baselines, name) in enumerate(
        ((LOSS_KEYS, LOSS_BASELINES, "loss"), (SCORE_KEYS, SCORE_BASELINES, "accuracy"))
    ):
        for col, (x, label) in enumerate(((record.samples, "samples"), (record.time_s, TIME_LABEL))):
            ax = axes[row][col]
            if _curves(ax, record, x, keys, baselines):
                drawn = True
                ax.set_xlabel(label)
                ax.set_ylabel(name)
                ax.grid(alpha=0.3)
                if col == 1:
                    mark_events(ax, record)
            else:
                ax.set_axis_off()
    return _save(fig, out / "training.png") if drawn else None


def plot_throughput(record: RunRecord, out: Path) -> Path | None:
    """samples/s over training time; with several workers, each worker's rate and the sync share of its step.

    A worker's rate is its share over its own compute, without the gradient sync: what it would train alone at that
    share. The rates do not add up to the run's (which waits for the sync and the slowest worker), and are labelled
    so, dashed beside the run's."""
    index, rate = record.series("samples_per_sec")
    if not len(index):
        return None
    rows = record.worker_rows
    fig = Figure(figsize=(12, 7 if rows else 4))
    axes = fig.subplots(2 if rows else 1, 1, squeeze=False)[:, 0]
    ax = axes[0]
    ax.plot(
        record.time_s[index], rate, label="the run (all workers, with the sync)" if rows else "samples/s", color="black"
    )
    if rows:
        where = np.array([i for i, _ in rows])
        ranks = sorted({w["rank"] for _, workers in rows for w in workers})
        for rank in ranks:
            theirs = [next((w for w in workers if w["rank"] == rank), {}) for _, workers in rows]
            rates = [w.get("samples_per_sec", np.nan) for w in theirs]
            ax.plot(record.time_s[where], rates, linestyle="--", label=f"worker {rank}: compute only, without the sync")
            axes[1].plot(record.time_s[where], [sync_share(w) for w in theirs], label=f"worker {rank}")
        axes[1].set_ylabel("sync share of step\n(with waiting for others)")
        axes[1].set_xlabel(TIME_LABEL)
        axes[1].set_ylim(0, 1)
        axes[1].grid(alpha=0.3)
        mark_events(axes[1], record)
    ax.set_ylabel("samples/s")
    ax.set_xlabel(TIME_LABEL)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    mark_events(ax, record)
    return _save(fig, out / "throughput.png")


def sync_share(row: dict[str, Any]) -> float:
    """The part of a worker's step spent in the gradient all-reduce after its backward (NaN if not recorded)."""
    compute, sync = row.get("compute_s"), row.get("sync_s")
    if not isinstance(compute, (int, float)) or not isinstance(sync, (int, float)) or compute + sync <= 0:
        return float("nan")
    return sync / (compute + sync)


def plot_memory(record: RunRecord, out: Path) -> Path | None:
    """Resident memory and its peak over training time, against the memory budget and the measured step peak."""
    fig = Figure(figsize=(12, 4))
    ax = fig.subplots()
    drawn = False
    for key, label in (("rss_mb", "RSS"), ("peak_rss_mb", "peak RSS")):
        index, values = record.series(key)
        if len(index):
            ax.plot(record.time_s[index], values, label=label)
            drawn = True
    if not drawn:
        return None
    summary = record.summary or {}
    if summary.get("peak_step_mb"):
        method = summary.get("peak_method") or "measured"
        ax.axhline(summary["peak_step_mb"], color="tab:purple", linestyle="--", label=f"step peak ({method})")
    if record.budget_mb:
        ax.axhline(record.budget_mb, color="tab:red", label=f"budget {record.budget_mb:.0f} MiB")
    ax.set_ylabel("MiB")
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    mark_events(ax, record)
    return _save(fig, out / "memory.png")


def plot_thermal(record: RunRecord, out: Path) -> Path | None:
    """The thermal state (macOS) or hottest temperature (Linux) over training time, with the guard's cap."""
    states = [(i, line["thermal_state"]) for i, line in enumerate(record.steps) if line.get("thermal_state")]
    t_index, celsius = record.series("temperature_c")
    thermal_events = [e for e in record.events if event_kind(e) == "thermal"]
    if not states and not len(t_index) and not thermal_events:
        return None
    panels: list[Callable[[Axes], None]] = []
    if states:

        def draw_states(ax: Axes) -> None:
            index = np.array([i for i, _ in states])
            ax.step(record.time_s[index], [THERMAL_STATES.index(s) for _, s in states], where="post", label="state")
            ax.set_yticks(range(len(THERMAL_STATES)), THERMAL_STATES)
            ax.set_ylim(-0.5, len(THERMAL_STATES) - 0.5)
            cap = record.config.training.thermal_cap
            if cap:
                ax.axhline(THERMAL_STATES.index(cap), color="tab:red", linestyle="--", label=f"cap {cap}")

        panels.append(draw_states)
    if len(t_index):

        def draw_celsius(ax: Axes) -> None:
            ax.plot(record.time_s[t_index], celsius, label="hottest sensor")
            ax.set_ylabel("°C")

        panels.append(draw_celsius)
    if not panels:  # the guard acted on a throughput decline: no sensor answered, so show what it read

        def draw_rate(ax: Axes) -> None:
            index, rate = record.series("samples_per_sec")
            ax.plot(record.time_s[index], rate, label="samples/s (no sensor: heat read from throughput)")
            ax.set_ylabel("samples/s")

        panels.append(draw_rate)
    fig = Figure(figsize=(12, 3 * len(panels) + 1))
    for ax, draw in zip(fig.subplots(len(panels), 1, squeeze=False)[:, 0], panels, strict=True):
        draw(ax)
        ax.set_xlabel(TIME_LABEL)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        mark_events(ax, record)
    return _save(fig, out / "thermal.png")


#: name -> (plot function, why it can be missing)
PLOTS: dict[str, tuple[Callable[[RunRecord, Path], Path | None], str]] = {
    "training": (plot_training, "no loss or accuracy recorded"),
    "throughput": (plot_throughput, "no samples/s recorded"),
    "memory": (plot_memory, "no memory reading recorded"),
    "thermal": (plot_thermal, "no thermal reading recorded (no sensor answered) and no thermal event"),
}


def write_run_plots(record: RunRecord, out: Path) -> tuple[list[Path], list[str]]:
    """Write every plot the record has data for; returns (paths written, a line saying why for each other one).
    A classifier's run also gets its confusion matrix (raytrm.report.classifier); other runs never miss one."""
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    for name, (draw, why) in PLOTS.items():
        path = draw(record, out)
        if path is None:
            skipped.append(f"no {name} plot: {why}")
        else:
            written.append(path)
    if record.classifier:
        fig = confusion_figure(record)
        if fig is None:
            skipped.append(f"no confusion plot: {missing_confusion(record)}")
        else:
            written.append(_save(fig, out / CONFUSION_PLOT))
    return written, skipped
