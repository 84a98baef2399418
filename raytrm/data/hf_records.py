"""A user's records tokenized by a Hugging Face tokenizer: the hf family's training and held-out data.

`open_records(data, model, tokenizer)` gives (train, held-out) `TokenizedRecords`, which the loader
(raytrm.data.loader) reads through `len()` and `batch(indices) -> dict of int64 arrays`, a pure function of the indices.

classify (model.task "classify"): one sample per record of a CSV, JSONL or Parquet file (raytrm.data.records checks
each). One text field is encoded alone; two as a text pair, so the tokenizer adds its own special tokens (BERT's
[CLS] a [SEP] b [SEP]); more are joined with the tokenizer's sep_token (a space where it has none) and encoded as one
text. Each is truncated to model.seq_len tokens. Labels are strings (an integer is its decimal string); the label map
is the sorted distinct labels of the training records, and a held-out label outside it is refused. The held-out
records are data.validation_path, else a stratified, seeded (data.seed) share data.validation_share of each label's
records, rounded, of which every label with two or more records keeps one in training; a label of one record stays
in training whole (logged), as a record cannot be learnt and held out at once.

    batch(indices): the samples sorted by length, longest first (stable), padded with pad_id to the longest of them
      input_ids       int64 [B, L]   L = the longest sample of the batch (<= seq_len)
      attention_mask  int64 [B, L]   1 on a sample's tokens, 0 on its padding
      token_type_ids  int64 [B, L]   only where the tokenizer makes them (its model_input_names): 1 on a pair's second
      labels          int64 [B]      index into metadata.label_names
      lengths         int64 [B]      each sample's tokens, non-increasing down the batch

  So a Trainer's micro-batches, contiguous slices of a global batch (or of a worker's share), hold samples of like
  length, and the task trims each to its own longest (`lengths[part].max()`): padding is per micro-batch, while the
  global batch holds the same samples whatever the cut.

lm (model.task "lm"): documents from the first text field of records, or plain text files (a file, or a directory of
.txt files in sorted order, each one document), each encoded without special tokens and followed by the tokenizer's
EOS (the last document's end is learnt too), cut into windows of seq_len + 1 tokens, window i starting at token
i * seq_len (consecutive windows share one token), without padding. The held-out windows are data.validation_path's,
else those of the last data.validation_share of the documents (at least one, rounded; the last share of the tokens
where there is one document only).

    batch(indices): input_ids int64 [B, seq_len] (a window's first seq_len tokens), labels int64 [B, seq_len] (the
      next token of each)

Each file is tokenized once and cached on disk by raytrm.data.hf_cache (keyed by the tokenizer, the task, the
fields, the max length and the file's contents); the split and the batches are cheap, and made at each open.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raytrm.config import DataConfig, ModelConfig
from raytrm.data.hf_cache import TokenizedFile, tokenized_file, tokenizer_name
from raytrm.data.records import RECORD_SUFFIXES
from raytrm.errors import ConfigError, UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordsMetadata:
    """What the hf family's task needs to know about its data."""

    task: str  # "classify" or "lm"
    seq_len: int
    pad_id: int
    label_names: tuple[str, ...]
    tokens_per_sample: int | None  # lm: seq_len; classify: None (a sample's tokens vary)
    vocab_size: int

    @property
    def num_classes(self) -> int:
        return len(self.label_names)


class TokenizedRecords:
    """Samples for raytrm.data.loader: len() and batch(indices), with their metadata (see the module docstring)."""

    metadata: RecordsMetadata

    def __len__(self) -> int:
        raise NotImplementedError

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError


class LabelledRecords(TokenizedRecords):
    """Some records of one tokenized file, each with its label's index in metadata.label_names."""

    def __init__(
        self, cache: TokenizedFile, records: np.ndarray, labels: np.ndarray, metadata: RecordsMetadata
    ) -> None:
        self.cache, self.records, self.labels, self.metadata = cache, records, labels, metadata
        self.lengths = np.diff(cache.offsets)[records]

    def __len__(self) -> int:
        return len(self.records)

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        idx = idx[np.argsort(-self.lengths[idx], kind="stable")]
        lengths = self.lengths[idx].astype(np.int64)
        width = int(lengths.max()) if len(idx) else 0
        ids = np.full((len(idx), width), self.metadata.pad_id, dtype=np.int64)
        mask = np.zeros((len(idx), width), dtype=np.int64)
        types = np.zeros((len(idx), width), dtype=np.int64) if self.cache.token_types is not None else None
        for row, record in enumerate(self.records[idx]):
            a, b = int(self.cache.offsets[record]), int(self.cache.offsets[record + 1])
            ids[row, : b - a] = self.cache.tokens[a:b]
            mask[row, : b - a] = 1
            if types is not None:
                types[row, : b - a] = self.cache.token_types[a:b]
        out = {"input_ids": ids, "attention_mask": mask, "labels": self.labels[idx].astype(np.int64)}
        if types is not None:
            out["token_type_ids"] = types
        out["lengths"] = lengths
        return out


class TokenWindows(TokenizedRecords):
    """Windows of seq_len + 1 tokens of a token stream: inputs the first seq_len, labels the next token of each."""

    def __init__(self, stream: np.ndarray, metadata: RecordsMetadata) -> None:
        self.stream, self.metadata, self.seq_len = stream, metadata, metadata.seq_len
        self.count = max(0, (len(stream) - 1) // self.seq_len)
        self._span = np.arange(self.seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.count

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        windows = np.asarray(self.stream[starts[:, None] + self._span], dtype=np.int64)
        return {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}


def open_records(data: DataConfig, model: ModelConfig, tokenizer: Any) -> tuple[TokenizedRecords, TokenizedRecords]:
    """(train, held-out) samples of the records a config names, tokenized by `tokenizer` (cached on disk)."""
    path = require_records(data, model.task)
    held_path = Path(data.validation_path).expanduser() if data.validation_path else None
    if model.task == "classify":
        return _open_classify(path, held_path, data, model, tokenizer)
    return _open_lm(path, held_path, data, model, tokenizer)


def require_records(data: DataConfig, task: str | None = None) -> Path:
    """The records file (for lm also text files) a config names, or one line saying what is wrong with it."""
    if not data.path:
        raise UserError(
            "data.path: not set; expected a CSV, JSONL or Parquet file of records; fix: give data.path (flag: --data "
            "FILE)"
        )
    path = _existing(data.path, "data.path")
    if data.validation_path:
        _existing(data.validation_path, "data.validation_path")
    if task == "classify" and (path.is_dir() or path.suffix not in RECORD_SUFFIXES):
        raise ConfigError(
            str(path),
            "data.path",
            path.suffix or "a directory",
            f"records to classify: a file ending in {', '.join(RECORD_SUFFIXES)}",
            "write the records as CSV, JSONL or Parquet with a text and a label column",
        )
    return path


def _existing(value: str, field: str) -> Path:
    path = Path(value).expanduser()
    if not path.exists():
        raise UserError(f"{path}: no such file or directory; fix: check {field}")
    return path


# -- classify ------------------------------------------------------------------------------------------------------


def _open_classify(
    path: Path, held_path: Path | None, data: DataConfig, model: ModelConfig, tokenizer: Any
) -> tuple[LabelledRecords, LabelledRecords]:
    pad_id = _pad_id(tokenizer)
    train_cache = tokenized_file(path, "classify", data, model, tokenizer)
    names = tuple(train_cache.label_names)
    if len(names) < 2:
        raise UserError(
            f"{path}: one class only ({names[0]!r}) among {train_cache.count} records; a classifier needs at least "
            f"two labels; fix: add records of other labels, or check data.label_field ({data.label_field!r})"
        )
    meta = RecordsMetadata("classify", model.seq_len, pad_id, names, None, len(tokenizer))
    ids = np.arange(train_cache.count, dtype=np.int64)
    if held_path is not None:
        held_cache = tokenized_file(held_path, "classify", data, model, tokenizer)
        held_labels = _map_labels(held_cache, held_path, names, path)
        logger.info("records: %d to train from %s, %d held out from %s", len(ids), path, held_cache.count, held_path)
        return (
            LabelledRecords(train_cache, ids, train_cache.labels, meta),
            LabelledRecords(held_cache, np.arange(held_cache.count, dtype=np.int64), held_labels, meta),
        )
    held = stratified_split(train_cache.labels, data.validation_share, data.seed)
    if not held.any():
        raise UserError(
            f"{path}: a share {data.validation_share:g} of each label's records holds out none of its "
            f"{train_cache.count}; fix: raise data.validation_share, add records, or give data.validation_path"
        )
    single = [names[i] for i in range(len(names)) if (train_cache.labels == i).sum() == 1]
    if single:
        logger.warning(
            "records %s: label(s) %s have one record each, kept in training and never held out", path, single
        )
    logger.info(
        "records: %d of %d in %s held out (data.validation_share %g of each label, seed %d)",
        int(held.sum()),
        train_cache.count,
        path,
        data.validation_share,
        data.seed,
    )
    return (
        LabelledRecords(train_cache, ids[~held], train_cache.labels[~held], meta),
        LabelledRecords(train_cache, ids[held], train_cache.labels[held], meta),
    )


def stratified_split(labels: np.ndarray, share: float, seed: int) -> np.ndarray:
    """Which records are held out: round(share x n) of each label's n records, drawn with the seed, but fewer than n."""
    held = np.zeros(len(labels), dtype=bool)
    rng = np.random.default_rng(seed)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        take = min(math.floor(share * len(members) + 0.5), len(members) - 1)
        held[rng.permutation(members)[:take]] = True
    return held


def _map_labels(cache: TokenizedFile, path: Path, names: tuple[str, ...], train_path: Path) -> np.ndarray:
    """A held-out file's labels as indices into the training label map; a label it lacks is one line."""
    index = {name: i for i, name in enumerate(names)}
    local = np.array([index.get(name, -1) for name in cache.label_names], dtype=np.int64)
    labels = local[cache.labels] if cache.count else np.zeros(0, dtype=np.int64)
    unseen = np.flatnonzero(labels < 0)
    if len(unseen):
        first = int(unseen[0])
        raise UserError(
            f"{cache.where(path, first)}: label {cache.label_names[cache.labels[first]]!r} is not among the training "
            f"labels of {train_path} ({', '.join(map(repr, names))}); fix: add records of it to the training file, "
            "or drop it from the held-out file"
        )
    return labels


def _pad_id(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        logger.info(
            "the tokenizer has no pad token: padding with its EOS token %r (id %d); the attention mask hides it",
            tokenizer.eos_token,
            tokenizer.eos_token_id,
        )
        return int(tokenizer.eos_token_id)
    raise UserError(
        f"{tokenizer_name(tokenizer)}: the tokenizer has neither a pad nor an EOS token, and records of unequal "
        "lengths need padding; fix: set pad_token in the model directory's tokenizer_config.json"
    )


# -- lm ------------------------------------------------------------------------------------------------------------


def _open_lm(
    path: Path, held_path: Path | None, data: DataConfig, model: ModelConfig, tokenizer: Any
) -> tuple[TokenWindows, TokenWindows]:
    if path.suffix in RECORD_SUFFIXES and len(data.text_fields) != 1:
        raise ConfigError(
            "data.text_fields",
            "",
            data.text_fields,
            "one field for a language model (its documents' text)",
            "name only the field that holds the text",
        )
    if tokenizer.eos_token_id is None:
        raise UserError(
            f"{tokenizer_name(tokenizer)}: the tokenizer has no EOS token to end each document with; fix: set "
            "eos_token in the model directory's tokenizer_config.json"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    meta = RecordsMetadata("lm", model.seq_len, int(pad), (), model.seq_len, len(tokenizer))
    train = tokenized_file(path, "lm", data, model, tokenizer)
    if held_path is not None:
        held = tokenized_file(held_path, "lm", data, model, tokenizer)
        streams = [(train.tokens, path), (held.tokens, held_path)]
        logger.info("lm: %d documents to train from %s, %d held out from %s", train.count, path, held.count, held_path)
    elif train.count > 1:
        keep = train.count - min(max(1, math.floor(data.validation_share * train.count + 0.5)), train.count - 1)
        cut = int(train.offsets[keep])
        streams = [(train.tokens[:cut], path), (train.tokens[cut:], path)]
        logger.info(
            "lm: the last %d of %d documents of %s held out (data.validation_share %g)",
            train.count - keep,
            train.count,
            path,
            data.validation_share,
        )
    else:
        cut = len(train.tokens) - max(1, math.floor(data.validation_share * len(train.tokens) + 0.5))
        streams = [(train.tokens[:cut], path), (train.tokens[cut:], path)]
        logger.info(
            "lm: %s is one document: its last %d of %d tokens held out (data.validation_share %g)",
            path,
            len(train.tokens) - cut,
            len(train.tokens),
            data.validation_share,
        )
    windows = []
    for (stream, source), part in zip(streams, ("training", "held-out"), strict=True):
        if len(stream) < model.seq_len + 1:
            raise UserError(
                f"{source}: its {part} text is {len(stream)} tokens, fewer than one window of model.seq_len + 1 "
                f"({model.seq_len + 1}); fix: add text, lower model.seq_len, or change data.validation_share"
            )
        windows.append(TokenWindows(stream, meta))
    return windows[0], windows[1]
