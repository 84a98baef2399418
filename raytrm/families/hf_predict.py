"""A finished Hugging Face run's classifier on new records: `predict` writes each record's label and score, `evaluate`
scores records that hold their labels. Both read RUN_DIR/model (what transformers loads) and the run's config (which
fields make a record's text, which holds its label, how many tokens are kept).

Records are read as training reads them (CSV, JSONL or Parquet; a record's text fields joined with the tokenizer's
separator), tokenized in batches padded to each batch's longest, and scored without gradients.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raytrm import config as cfg
from raytrm.data.records import read_records
from raytrm.errors import ConfigError, UserError
from raytrm.families.hf_model import MODEL_DIR, join_fields, require_libraries
from raytrm.families.task import macro_f1
from raytrm.hardware import device as devices

logger = logging.getLogger(__name__)

#: Records scored at once.
BATCH = 32


class Classifier:
    """RUN_DIR/model's classifier and tokenizer, with the run's config, on this machine's device."""

    def __init__(self, run_dir: str | Path, device: str = "auto") -> None:
        run_dir = Path(run_dir)
        # config.yaml: the run directory's config (raytrm.train.run.directory, a layer above this one, names it).
        config_file, model_dir = run_dir / "config.yaml", run_dir / MODEL_DIR
        if not config_file.is_file() or not model_dir.is_dir():
            missing = config_file if not config_file.is_file() else model_dir
            raise UserError(
                f"{run_dir}: not a finished Hugging Face run, {missing.name} is missing (a run writes its model "
                "directory at its end); fix: give the --out of a run of model.name hf that has finished"
            )
        self.config = cfg.load(cfg.ExperimentConfig, config_file)
        if self.config.model.name != "hf" or self.config.model.task != "classify":
            kind = f"model.name {self.config.model.name}, task {self.config.model.task}"
            raise ConfigError(
                str(config_file),
                "model",
                kind,
                "a classifier of the hf family (model.name hf, model.task classify)",
                "give the run of a classifier",
            )
        require_libraries()
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = devices.pick_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir).to(self.device).eval()
        if self.tokenizer.pad_token is None:  # a decoder's tokenizer often has none: pad as the run padded
            pad = self.model.config.pad_token_id
            self.tokenizer.pad_token = (
                self.tokenizer.convert_ids_to_tokens(pad) if pad is not None else self.tokenizer.eos_token
            )
        labels = self.model.config.id2label
        self.label_names = [str(labels[i]) for i in range(len(labels))]

    @torch.no_grad()
    def scores(self, texts: Sequence[str]) -> np.ndarray:
        """Each text's probabilities over the labels, [len(texts), labels], a batch at a time."""
        out = []
        for start in range(0, len(texts), BATCH):
            encoded = self.tokenizer(
                list(texts[start : start + BATCH]),
                truncation=True,
                max_length=self.config.model.seq_len,
                padding=True,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).logits
            out.append(logits.float().softmax(-1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, len(self.label_names)))

    def records(self, path: str | Path, labelled: bool) -> tuple[list[str], list[str | None], list[str]]:
        """(where, label, text) of each record of path, in order; an empty file is one line."""
        data = self.config.data
        path = Path(path).expanduser()
        if not path.is_file():
            raise ConfigError(str(path), "records", "no such file", "a CSV, JSONL or Parquet file", "check the path")
        rows = list(_read(path, list(data.text_fields), data.label_field if labelled else None))
        if not rows:
            raise UserError(
                f"{path}: no records (the file is empty); expected one record a line (JSONL) or row (CSV, Parquet) "
                f"with {', '.join(data.text_fields)}; fix: give a file that holds records"
            )
        wheres = [where for where, _, _ in rows]
        labels = [label for _, label, _ in rows]
        texts = [join_fields(fields, self.tokenizer) for _, _, fields in rows]
        return wheres, labels, texts


def _read(path: Path, text_fields: list[str], label_field: str | None) -> Iterator[tuple[str, str | None, list[str]]]:
    """(where, label or None, the texts of text_fields) of each record: Parquet's rows, or JSONL and CSV through
    raytrm.data.records (each field's values checked as training checks them)."""
    if path.suffix == ".parquet":
        yield from _parquet(path, text_fields, label_field)
        return
    raw = path.read_text(encoding="utf-8")
    per_field = [read_records(path, raw, field, label_field if i == 0 else None) for i, field in enumerate(text_fields)]
    for parts in zip(*per_field, strict=True):
        where, label, _ = parts[0]
        yield where, label, [text for _, _, text in parts]


def _parquet(path: Path, text_fields: list[str], label_field: str | None) -> Iterator[tuple[str, str | None, list]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    wanted = [*text_fields, *([label_field] if label_field else [])]
    absent = [name for name in wanted if name not in table.column_names]
    if absent:
        raise UserError(
            f"{path}: no column {absent[0]!r} (columns: {', '.join(table.column_names) or 'none'}); fix: name the "
            "run's fields in the file, or score a file that has them"
        )
    columns = {name: table.column(name).to_pylist() for name in wanted}
    for i in range(table.num_rows):
        where = f"{path}:row {i + 1}"
        texts = []
        for name in text_fields:
            value = columns[name][i]
            if not isinstance(value, str) or not value:
                raise ConfigError(where, name, value, "the record's text, a non-empty string", "fill it in or drop it")
            texts.append(value)
        label = None
        if label_field:
            value = columns[label_field][i]
            if isinstance(value, bool) or not isinstance(value, (int, str)) or str(value).strip() == "":
                raise ConfigError(where, label_field, value, "a label, a non-empty string or an integer", "label it")
            label = str(value)
        yield where, label, texts


def predict(run_dir: str | Path, records_path: str | Path, out_path: str | Path, device: str = "auto") -> Path:
    """Write out_path (CSV): each record's number in the file (from 0), the label predicted and its probability."""
    model = Classifier(run_dir, device)
    _, _, texts = model.records(records_path, labelled=False)
    probs = model.scores(texts)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["record", "label", "score"])
    for i, row in enumerate(probs):
        best = int(row.argmax())
        writer.writerow([i, model.label_names[best], f"{row[best]:.6f}"])
    out = Path(out_path)
    cfg.write_text_atomic(buffer.getvalue(), out)
    logger.info("%d records' labels written to %s", len(texts), out)
    return out


def evaluate(run_dir: str | Path, records_path: str | Path, device: str = "auto") -> dict[str, Any]:
    """Accuracy, macro-F1 and the confusion matrix (rows the true labels, columns the predicted ones, in `labels`'
    order) of the run's classifier on labelled records; a label the run did not train on is one line."""
    model = Classifier(run_dir, device)
    wheres, labels, texts = model.records(records_path, labelled=True)
    index = {name: i for i, name in enumerate(model.label_names)}
    for where, label in zip(wheres, labels, strict=True):
        if label not in index:
            raise ConfigError(
                where,
                model.config.data.label_field,
                label,
                f"one of the labels the run trained on ({', '.join(model.label_names)})",
                "drop the record, or train a run whose records hold that label",
            )
    true = np.array([index[label] for label in labels if label is not None])
    pred = model.scores(texts).argmax(-1)
    classes = len(model.label_names)
    confusion = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(confusion, (true, pred), 1)
    return {
        "accuracy": float((pred == true).mean()),
        "macro_f1": macro_f1(pred, true, classes),
        "confusion": confusion.tolist(),
        "labels": list(model.label_names),
        "documents": len(true),
    }
