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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raytrm import config as cfg
from raytrm.data.hf_cache import encode_records
from raytrm.data.records import read_fields
from raytrm.errors import ConfigError, UserError
from raytrm.families.hf_model import MODEL_DIR, quietly, require_libraries
from raytrm.families.task import classification_scores
from raytrm.hardware import device as devices

logger = logging.getLogger(__name__)

#: Records scored at once.
#: What a sequence classifier's forward takes of an encoding.
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
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
        with quietly():
            self.model = AutoModelForSequenceClassification.from_pretrained(model_dir).to(self.device).eval()
        if self.tokenizer.pad_token is None:  # a decoder's tokenizer often has none: pad as the run padded
            pad = self.model.config.pad_token_id
            self.tokenizer.pad_token = (
                self.tokenizer.convert_ids_to_tokens(pad) if pad is not None else self.tokenizer.eos_token
            )
        labels = self.model.config.id2label
        self.label_names = [str(labels[i]) for i in range(len(labels))]

    @torch.no_grad()
    def scores(self, texts: Sequence[tuple[str, ...]]) -> np.ndarray:
        """Each record's probabilities over the labels, [len(texts), labels], a batch at a time; its texts (one per
        text field) encoded as training encoded them."""
        out = []
        for start in range(0, len(texts), BATCH):
            encoded = encode_records(
                self.tokenizer,
                list(texts[start : start + BATCH]),
                self.config.model.seq_len,
                padding=True,
                return_attention_mask=True,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(**{k: v for k, v in encoded.items() if k in MODEL_INPUTS}).logits
            out.append(logits.float().softmax(-1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, len(self.label_names)))

    def records(self, path: str | Path, labelled: bool) -> tuple[list[str], list[str | None], list[tuple[str, ...]]]:
        """(where, label, text) of each record of path, in order; an empty file is one line."""
        data = self.config.data
        path = Path(path).expanduser()
        if not path.is_file():
            raise ConfigError(str(path), "records", "no such file", "a CSV, JSONL or Parquet file", "check the path")
        rows = list(read_fields(path, list(data.text_fields), data.label_field if labelled else None))
        if not rows:
            raise UserError(
                f"{path}: no records (the file is empty); expected one record a line (JSONL) or row (CSV, Parquet) "
                f"with {', '.join(data.text_fields)}; fix: give a file that holds records"
            )
        wheres = [where for where, _, _ in rows]
        labels = [label for _, label, _ in rows]
        texts = [tuple(fields) for _, _, fields in rows]
        return wheres, labels, texts


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
    scores = classification_scores(pred, true, len(model.label_names))
    return {**scores, "labels": list(model.label_names), "documents": len(true)}
