"""A Hugging Face classifier run's scores as the report shows them: accuracy, macro-F1 and the majority class's
accuracy on the held-out records in one line, and the confusion matrix as a figure (confusion.png).

The final evaluation records them in summary.json, the matrix (rows the true labels, columns the predicted ones, in
the labels' order) beside the labels' names; the rows of metrics.jsonl hold the scores of the evaluations along the
way, without the matrix. Runs of other families have neither line nor figure.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from raytrm.report.runs import RunRecord

CONFUSION_PLOT = "confusion.png"
#: Past this many classes a cell is too small for its count to be read: the colors stay, the numbers go.
MAX_CELL_NUMBERS = 20
#: Past this many classes their names would overlap on an axis: every n-th is named.
MAX_NAMED = 40
#: A label's name longer than this is cut (with an ellipsis), so that long names do not squeeze the matrix.
NAME_CHARS = 24
#: More classes than this, or a name longer than this, and the predicted labels' names are turned to fit their columns.
TURN_NAMES = 6
#: The figure's side in inches: a class's row grows it up to the largest, which a screen still shows whole.
SIDE_PER_CLASS, MIN_SIDE, MAX_SIDE = 0.5, 4.0, 12.0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scores(scores: dict[str, Any]) -> str:
    """Accuracy beside the majority class's, and macro-F1, as `raytrm train` says them at its end."""
    documents = scores.get("eval_documents")
    on = f"{documents:.0f} held-out documents" if _number(documents) else "the held-out documents"
    accuracy = f"accuracy {scores['eval_accuracy']:.3f}"
    if _number(scores.get("eval_majority_acc")):
        accuracy += f" (always the majority class scores {scores['eval_majority_acc']:.3f})"
    parts = [accuracy]
    if _number(scores.get("eval_macro_f1")):
        parts.append(f"macro-F1 {scores['eval_macro_f1']:.3f}")
    return f"on {on}: {', '.join(parts)}"


def score_lines(record: RunRecord) -> list[str]:
    """The final evaluation's scores; where the run did not finish, its last evaluation's, at its step."""
    if not record.classifier:
        return []
    if record.summary is not None:
        return [f"final evaluation {_scores(record.summary)}"] if _number(record.summary.get("eval_accuracy")) else []
    index, _ = record.series("eval_accuracy")
    if not len(index):
        return []
    last = record.steps[index[-1]]
    return [f"last evaluation, at step {last['step']} (the run did not finish), {_scores(last)}"]


def confusion(record: RunRecord) -> tuple[list[str], np.ndarray] | None:
    """The labels' names and the final evaluation's confusion matrix (raytrm.report.runs checked its shape); the
    labels' numbers name them where the run did not record their names."""
    summary = record.summary or {}
    matrix = summary.get("eval_confusion")
    if not record.classifier or not matrix:
        return None
    counts = np.array(matrix, dtype=np.int64)
    names = summary.get("eval_labels") or [str(i) for i in range(len(counts))]
    return list(names), counts


def missing_confusion(record: RunRecord) -> str:
    """Why a classifier run has no confusion matrix to plot."""
    if record.summary is None:
        return "the final evaluation records it in summary.json, and this run did not finish"
    return "its summary.json holds none (a run of an older raytrm): `raytrm evaluate RUN_DIR RECORDS` prints one"


def _short(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def confusion_figure(record: RunRecord) -> Figure | None:
    """The confusion matrix: a row per true label, a column per predicted one, each cell's count in it while the
    classes are few enough to read them."""
    found = confusion(record)
    if found is None:
        return None
    names, counts = found
    classes = len(names)
    side = min(MAX_SIDE, max(MIN_SIDE, SIDE_PER_CLASS * classes + 2.5))
    fig = Figure(figsize=(side + 1.5, side))
    ax = fig.subplots()
    image = ax.imshow(counts, cmap="Blues", vmin=0, interpolation="nearest")
    fig.colorbar(image, ax=ax, label="documents", shrink=0.8)
    ticks = list(range(0, classes, math.ceil(classes / MAX_NAMED)))
    shown = [_short(str(names[i])) for i in ticks]
    if classes > TURN_NAMES or max(map(len, shown)) > TURN_NAMES:  # side by side they would overlap
        ax.set_xticks(ticks, shown, rotation=45, ha="right", rotation_mode="anchor")
    else:
        ax.set_xticks(ticks, shown)
    ax.set_yticks(ticks, shown)
    ax.set_xlabel("predicted label")
    ax.set_ylabel("true label")
    if classes <= MAX_CELL_NUMBERS:
        high = counts.max()
        size = 10 if classes <= 10 else 7
        for (true, predicted), count in np.ndenumerate(counts):
            color = "white" if high and count > high / 2 else "black"
            ax.text(predicted, true, str(count), ha="center", va="center", fontsize=size, color=color)
    ax.set_title(_title(record.summary or {}), fontsize=9)
    return fig


def _title(summary: dict[str, Any]) -> str:
    documents = summary.get("eval_documents")
    title = "confusion matrix, final evaluation" + (f" ({documents:.0f} documents)" if _number(documents) else "")
    named = (("eval_accuracy", "accuracy"), ("eval_macro_f1", "macro-F1"))
    scores = [f"{name} {summary[key]:.3f}" for key, name in named if _number(summary.get(key))]
    return title + "\n" + ", ".join(scores) if scores else title
