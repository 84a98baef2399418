"""The hf family as a user types it: `raytrm train --model hf --model-path DIR --data records.csv --out RUN`, then
`raytrm predict` and `raytrm evaluate` on the run's model; a classifier where the records have a label column, a
language model where they have text alone; and bad input, one line each."""

from __future__ import annotations

import csv
import json

import pytest

from raytrm.cli import main
from tests.support.hf_models import write_records

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def train(hf_dirs, tmp_path, records, *extra):
    run = tmp_path / "run"
    argv = ["train", "--model", "hf", "--model-path", str(hf_dirs["classify"]), "--data", str(records)]
    argv += ["--text-fields", "subject", "body", "--out", str(run), "--steps", "30", "--seq-len", "48"]
    argv += ["--global-batch", "16", "--lr", "3e-3", "--device", "cpu", "--threads", "1", "--quiet", *extra]
    return main(argv), run


def test_a_user_fine_tunes_a_classifier_on_records_then_predicts_and_evaluates(hf_dirs, tmp_path, capsys):
    records = write_records(tmp_path / "mail.csv")
    code, run = train(hf_dirs, tmp_path, records)
    out = capsys.readouterr().out
    assert code == 0 and "trained 30 steps" in out
    config = json.loads(json.dumps(__import__("yaml").safe_load((run / "config.yaml").read_text())))
    assert config["model"]["task"] == "classify"  # the records have a label column
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_accuracy"] > summary["eval_majority_acc"] + 0.2, summary
    assert (run / "model" / "config.json").is_file() and (run / "model" / "tokenizer.json").is_file()
    # The report says the final scores and draws the confusion matrix, in the labels' names.
    assert summary["eval_labels"] == ["neg", "pos"]
    assert sum(map(sum, summary["eval_confusion"])) == summary["eval_documents"]
    assert main(["report", str(run)]) == 0
    scores = capsys.readouterr().out.splitlines()[1]
    held_out = f"{summary['eval_documents']:.0f} held-out documents"
    assert scores.startswith(f"final evaluation on {held_out}: accuracy {summary['eval_accuracy']:.3f}")
    assert (run / "report" / "confusion.png").read_bytes()[:4] == b"\x89PNG"

    from transformers import pipeline

    classify = pipeline("text-classification", model=str(run / "model"), tokenizer=str(run / "model"))
    assert classify("the cat sat")[0]["label"] in ("neg", "pos")

    fresh = write_records(tmp_path / "new.csv", count=20, seed=9)
    assert main(["predict", str(run), str(fresh), "--out", str(tmp_path / "predicted.csv")]) == 0
    predicted = list(csv.DictReader((tmp_path / "predicted.csv").open()))
    assert len(predicted) == 20 and {p["label"] for p in predicted} <= {"neg", "pos"}
    capsys.readouterr()
    assert main(["evaluate", str(run), str(fresh)]) == 0
    said = capsys.readouterr().out
    assert "accuracy" in said and "macro-F1" in said


def test_records_without_a_label_column_train_a_language_model(hf_dirs, tmp_path, capsys):
    records = write_records(tmp_path / "text.csv", labelled=False)
    run = tmp_path / "run"
    argv = ["train", "--model", "hf", "--model-path", str(hf_dirs["lm"]), "--data", str(records)]
    argv += ["--text-fields", "body", "--out", str(run), "--steps", "4", "--seq-len", "16", "--global-batch", "8"]
    assert main([*argv, "--device", "cpu", "--threads", "1", "--quiet"]) == 0, capsys.readouterr().err
    config = __import__("yaml").safe_load((run / "config.yaml").read_text())
    assert config["model"]["task"] == "lm"
    assert "eval_perplexity" in json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize(
    ("case", "piece"),
    [
        ("no-label-column", "no column 'label'"),
        ("empty-file", "empty file"),
        ("no-tokenizer", "tokenizer"),
        ("no-model-path", "model.path"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(hf_dirs, tmp_path, capsys, case, piece):
    records = write_records(tmp_path / "mail.csv", count=24)
    model = hf_dirs["classify"]
    argv = ["train", "--model", "hf", "--data", str(records), "--out", str(tmp_path / "run"), "--steps", "1"]
    argv += ["--device", "cpu", "--quiet", "--task", "classify", "--text-fields", "subject", "body"]
    if case == "no-label-column":
        argv += ["--label-field", "label", "--data", str(write_records(tmp_path / "t.csv", labelled=False))]
    elif case == "empty-file":
        (tmp_path / "empty.csv").write_text("")
        argv += ["--data", str(tmp_path / "empty.csv")]
    elif case == "no-tokenizer":
        import shutil

        model = tmp_path / "bare"
        shutil.copytree(hf_dirs["classify"], model)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            (model / name).unlink(missing_ok=True)
    if case != "no-model-path":
        argv += ["--model-path", str(model)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raytrm: error:") and piece in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()
