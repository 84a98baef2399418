"""`raytrm report` on a Hugging Face classifier's run: the final evaluation's accuracy, macro-F1 and majority baseline
in its text, its confusion matrix in confusion.png; nothing of either for other runs; a summary whose matrix is not
one a run writes is one line. Run directories written by hand, as `raytrm train` writes them."""

from __future__ import annotations

import json
import struct

import pytest
import yaml

from raytrm.cli import main
from raytrm.report import load_run
from raytrm.report.classifier import MAX_CELL_NUMBERS, confusion_figure

HF_CLASSIFIER = {
    "model": {"name": "hf", "task": "classify", "path": "/models/minilm"},
    "data": {"name": "records", "path": "/data/mail.csv"},
}
LABELS = ["billing", "spam", "support"]
CONFUSION = [[40, 3, 1], [2, 79, 4], [5, 0, 97]]
SUMMARY = {
    "steps": 20,
    "eval_accuracy": 216 / 231,
    "eval_macro_f1": 0.9271,
    "eval_majority_acc": 0.4416,
    "eval_documents": 231.0,
    "eval_confusion": CONFUSION,
    "eval_labels": LABELS,
}


def step(n: int, **fields) -> dict:
    return {"step": n, "samples_per_sec": 50.0, "loss": 1.0 / n, **fields}


@pytest.fixture
def write_run(tmp_path):
    """A run directory: config.yaml (an hf classifier unless told), two step lines, summary.json where given."""

    def write(summary=None, config=HF_CLASSIFIER, lines=None, name="run"):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        lines = lines or [step(10), step(20, eval_accuracy=0.9, eval_macro_f1=0.88)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        if summary is not None:
            (run / "summary.json").write_text(json.dumps(summary))
        return run

    return write


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])  # the IHDR chunk's width and height


def report(run, capsys) -> str:
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert (run / "report" / "diagnosis.txt").read_text() == out
    return out


def test_a_classifier_run_prints_its_final_scores_and_plots_its_confusion(write_run, capsys):
    run = write_run(SUMMARY)
    out = report(run, capsys).splitlines()
    # Right under the run's line, the scores as the summary holds them, to the report's three decimals.
    assert out[1] == (
        f"final evaluation on 231 held-out documents: accuracy {SUMMARY['eval_accuracy']:.3f} (always the majority "
        f"class scores {SUMMARY['eval_majority_acc']:.3f}), macro-F1 {SUMMARY['eval_macro_f1']:.3f}"
    )
    assert out[1].endswith("accuracy 0.935 (always the majority class scores 0.442), macro-F1 0.927")
    assert f"plots in {run / 'report'}: training.png, throughput.png, confusion.png" in out
    width, height = png_size(run / "report" / "confusion.png")
    assert 300 < height <= width < 1500  # a figure of a few inches, the colorbar beside it
    fig = confusion_figure(load_run(run))
    ax = fig.axes[0]
    assert ax.images[0].get_array().tolist() == CONFUSION  # rows the true labels, columns the predicted ones
    assert [t.get_text() for t in ax.get_xticklabels()] == LABELS
    assert [t.get_text() for t in ax.get_yticklabels()] == LABELS
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("predicted label", "true label")
    assert [t.get_text() for t in ax.texts] == [str(n) for row in CONFUSION for n in row]
    assert "accuracy 0.935, macro-F1 0.927" in ax.get_title()


@pytest.mark.slow
def test_many_classes_keep_their_colors_and_names_but_drop_the_cell_numbers(write_run, capsys):
    classes = MAX_CELL_NUMBERS + 5
    names = [f"topic-{i}" for i in range(classes)]
    matrix = [[10 if t == p else 1 for p in range(classes)] for t in range(classes)]
    run = write_run({**SUMMARY, "eval_confusion": matrix, "eval_labels": names})
    report(run, capsys)
    ax = confusion_figure(load_run(run)).axes[0]
    assert ax.images[0].get_array().shape == (classes, classes)
    assert [t.get_text() for t in ax.get_yticklabels()] == names
    assert not ax.texts
    few = write_run(SUMMARY, name="few")
    report(few, capsys)
    # A larger figure, so that each row stays tall enough to read its name.
    assert png_size(run / "report" / "confusion.png")[1] > png_size(few / "report" / "confusion.png")[1]


@pytest.mark.parametrize(
    ("config", "summary"),
    [
        ({}, {"steps": 20, "eval_cell_acc": 0.5, "eval_exact_acc": 0.1}),  # TRM, the embedded default
        (
            {"model": {"name": "transformer", "task": "classify"}, "data": {"name": "text"}},
            {"steps": 20, "eval_accuracy": 0.7, "eval_macro_f1": 0.6, "eval_majority_acc": 0.5},
        ),
    ],
    ids=["trm", "byte-transformer-classifier"],
)
def test_other_runs_get_neither_the_scores_line_nor_a_confusion_plot(write_run, capsys, config, summary):
    run = write_run(summary, config=config)
    out = report(run, capsys)
    assert "evaluation on" not in out and "confusion" not in out
    assert not (run / "report" / "confusion.png").exists()
    assert sorted(p.name for p in (run / "report").iterdir()) == ["diagnosis.txt", "throughput.png", "training.png"]


def test_an_unfinished_classifier_run_prints_its_last_evaluation_and_says_why_no_matrix(write_run, capsys):
    # A row of a run written before rows kept numbers alone holds the matrix too: it is skipped, not refused.
    lines = [step(10), step(20, eval_accuracy=0.8125, eval_macro_f1=0.8, eval_confusion=[[3, 1], [2, 10]])]
    out = report(write_run(lines=lines), capsys).splitlines()
    assert out[1] == (
        "last evaluation, at step 20 (the run did not finish), on the held-out documents: accuracy 0.812, "
        "macro-F1 0.800"
    )
    assert "no confusion plot: the final evaluation records it in summary.json, and this run did not finish" in out


def test_a_summary_without_the_labels_names_names_them_by_number(write_run, capsys):
    run = write_run({key: value for key, value in SUMMARY.items() if key != "eval_labels"})
    report(run, capsys)
    labels = confusion_figure(load_run(run)).axes[0].get_xticklabels()
    assert [t.get_text() for t in labels] == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("confusion", "labels", "piece"),
    [
        ([[40, 3], [2, 79, 4], [5, 0, 97]], LABELS, "eval_confusion: got [[40, 3], [2, 79, 4], [5, 0, 97]], expected"),
        ([[1, 0], [0, 1]], LABELS, "eval_confusion: got [[1, 0], [0, 1]], expected a square list of counts"),
        ([[1, 0.5, 0], [0, 1, 0], [0, 0, 1]], LABELS, "eval_confusion: got [[1, 0.5, 0], [0, 1, 0], [0, 0, 1]]"),
        ([[1, -1, 0], [0, 1, 0], [0, 0, 1]], LABELS, "eval_confusion: got [[1, -1, 0], [0, 1, 0], [0, 0, 1]]"),
        ([[True, 0], [0, 1]], None, "eval_confusion: got [[True, 0], [0, 1]], expected a square list of counts"),
        ([[1, 2], [3]], None, "eval_confusion: got [[1, 2], [3]], expected a square list of counts (integers >= 0)"),
        ([1, 2, 3], LABELS, "eval_confusion: got [1, 2, 3], expected a square list of counts"),
        ([], None, "eval_confusion: got [], expected a square list of counts"),
        ("[[1, 0], [0, 1]]", None, "eval_confusion: got '[[1, 0], [0, 1]]', expected a list; fix: delete it"),
        (CONFUSION, [1, 2, 3], "eval_labels: got [1, 2, 3], expected a list of the labels' names (strings)"),
    ],
)
def test_a_malformed_confusion_matrix_is_one_line_and_nothing_written(write_run, capsys, confusion, labels, piece):
    summary = {**SUMMARY, "eval_confusion": confusion}
    if labels is None:
        del summary["eval_labels"]
    else:
        summary["eval_labels"] = labels
    run = write_run(summary)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"raytrm: error: {run}/summary.json: {piece}")
    if "expected a square" in piece:
        assert "one row and one column per label" in err[0]
        assert err[0].endswith("; fix: delete it to report from metrics.jsonl alone")
    assert not (run / "report").exists()
