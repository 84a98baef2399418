"""A finished hf run's classifier on new records: `predict` writes each record's label and score as transformers'
pipeline gives them, `evaluate` scores labelled records, and bad input (a label the run never saw, an empty file, a
run without its model) is one line."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from raytrm.errors import ConfigError, UserError
from raytrm.families.hf_predict import evaluate, predict
from raytrm.families.task import macro_f1
from raytrm.train.run.training import run_training
from tests.unit.families import hf_stand_in


@pytest.fixture
def run(hf_config, tmp_path):
    """A classifier trained a few steps with LoRA (its RUN_DIR/model merged)."""
    run_dir = tmp_path / "run"
    run_training(hf_config(model={"lora_rank": 4}, steps=6, lr=3e-3, ema=False), run_dir)
    return run_dir


def reference(run_dir, texts: list[str]) -> list[dict]:
    """transformers' own pipeline on the run's model directory: the label and score of each text."""
    from transformers import pipeline

    serve = pipeline("text-classification", model=str(run_dir / "model"), device="cpu")
    return [serve(text, truncation=True, max_length=48)[0] for text in texts]


def write_jsonl(path, records: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_predict_writes_each_records_label_and_score(run, tmp_path):
    texts, _ = hf_stand_in.texts(40, seed=5)
    records = write_jsonl(tmp_path / "new.jsonl", [{"text": t} for t in texts])  # no labels needed
    out = predict(run, records, tmp_path / "labels.csv")
    rows = list(csv.DictReader(out.open()))
    expected = reference(run, texts)
    assert [int(r["record"]) for r in rows] == list(range(40))
    assert [r["label"] for r in rows] == [e["label"] for e in expected]
    assert [float(r["score"]) for r in rows] == pytest.approx([e["score"] for e in expected], abs=2e-6)


def test_predict_reads_csv_and_parquet_with_the_runs_text_fields(hf_config, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrm import config as cfg

    run_dir = tmp_path / "run"
    config = hf_config(steps=2, ema=False)
    config.data.text_fields = ["subject", "body"]
    run_training(config, run_dir)
    assert cfg.load(cfg.ExperimentConfig, run_dir / "config.yaml").data.text_fields == ["subject", "body"]
    subjects, _ = hf_stand_in.texts(12, seed=6, longest=4)
    bodies, _ = hf_stand_in.texts(12, seed=7)
    with (tmp_path / "mail.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["subject", "body"])
        writer.writerows(zip(subjects, bodies, strict=True))
    pq.write_table(pa.table({"subject": subjects, "body": bodies}), tmp_path / "mail.parquet")
    # The fields joined with the tokenizer's separator, as training joins them.
    expected = reference(run_dir, [f"{s} [SEP] {b}" for s, b in zip(subjects, bodies, strict=True)])
    for name in ("mail.csv", "mail.parquet"):
        rows = list(csv.DictReader(predict(run_dir, tmp_path / name, tmp_path / f"{name}.out").open()))
        assert [r["label"] for r in rows] == [e["label"] for e in expected], name
        assert [float(r["score"]) for r in rows] == pytest.approx([e["score"] for e in expected], abs=2e-6)


def test_evaluate_gives_accuracy_macro_f1_and_the_confusion_matrix(run, tmp_path):
    texts, labels = hf_stand_in.texts(40, seed=8)
    labelled = [{"text": t, "label": y} for t, y in zip(texts, labels, strict=True)]
    records = write_jsonl(tmp_path / "held.jsonl", labelled)
    scores = evaluate(run, records)
    names = ["neg", "pos"]
    pred = np.array([names.index(e["label"]) for e in reference(run, texts)])
    true = np.array([names.index(y) for y in labels])
    assert scores["labels"] == names and scores["documents"] == 40
    assert scores["confusion"] == [[int(((true == t) & (pred == p)).sum()) for p in range(2)] for t in range(2)]
    assert scores["accuracy"] == pytest.approx(float((pred == true).mean()))
    assert scores["macro_f1"] == pytest.approx(macro_f1(pred, true, 2))


def test_a_label_the_run_never_saw_is_one_line(run, tmp_path):
    records = write_jsonl(
        tmp_path / "held.jsonl", [{"text": "the cat", "label": "neg"}, {"text": "a dog", "label": "maybe"}]
    )
    with pytest.raises(ConfigError) as error:
        evaluate(run, records)
    text = str(error.value)
    assert "\n" not in text
    assert text.startswith(f"{records}:2: label: got 'maybe', expected one of the labels the run trained on (neg, pos)")
    assert "fix:" in text


def test_an_empty_file_and_a_run_without_its_model_are_one_line(run, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for call in (lambda: evaluate(run, empty), lambda: predict(run, empty, tmp_path / "out.csv")):
        with pytest.raises(UserError, match=r"empty\.jsonl: no records \(the file is empty\).*fix: give a file"):
            call()
    assert not (tmp_path / "out.csv").exists()
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((run / "config.yaml").read_text())
    with pytest.raises(UserError, match=r"unfinished: not a finished Hugging Face run, model is missing"):
        evaluate(unfinished, empty)


def test_a_decoders_classifier_predicts_padded_batches_when_its_tokenizer_has_no_pad_token(
    hf_config, hf_dirs, tmp_path
):
    run_dir = tmp_path / "run"
    run_training(hf_config(model={"path": str(hf_dirs["lm"])}, steps=2, ema=False), run_dir)
    tokenizer_config = run_dir / "model" / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings.pop("pad_token")
    tokenizer_config.write_text(json.dumps(settings))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(run_dir / "model").pad_token is None
    texts, _ = hf_stand_in.texts(20, seed=9)
    out = predict(run_dir, write_jsonl(tmp_path / "new.jsonl", [{"text": t} for t in texts]), tmp_path / "out.csv")
    rows = list(csv.DictReader(out.open()))
    expected = reference(run_dir, texts)  # one text at a time: no padding
    assert [r["label"] for r in rows] == [e["label"] for e in expected]
    assert [float(r["score"]) for r in rows] == pytest.approx([e["score"] for e in expected], abs=2e-6)


def test_a_run_that_keeps_its_adapters_apart_leaves_them_alone_and_predicts_the_same(hf_config, run, tmp_path):
    """model.lora_merge false: RUN_DIR/model holds the adapters and the head (no copy of the base weights), which
    transformers loads onto model.path's weights; the same seed and steps predict as the merged run does."""
    kept = tmp_path / "kept"
    run_training(hf_config(model={"lora_rank": 4, "lora_merge": False}, steps=6, lr=3e-3, ema=False), kept)
    assert (kept / "model" / "adapter_config.json").is_file()
    assert not (kept / "model" / "model.safetensors").exists() and (run / "model" / "model.safetensors").is_file()
    texts, _ = hf_stand_in.texts(12, seed=7)
    records = write_jsonl(tmp_path / "new.jsonl", [{"text": t} for t in texts])
    merged = list(csv.DictReader(predict(run, records, tmp_path / "merged.csv").open()))
    apart = list(csv.DictReader(predict(kept, records, tmp_path / "apart.csv").open()))
    assert [r["label"] for r in apart] == [r["label"] for r in merged]
    assert [float(r["score"]) for r in apart] == pytest.approx([float(r["score"]) for r in merged], rel=1e-4)


def test_keeping_adapters_apart_without_lora_is_one_line(hf_config):
    from raytrm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.lora_merge: got False, expected true without lora_rank"):
        hf_config(model={"lora_merge": False})
