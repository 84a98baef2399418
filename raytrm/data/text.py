"""Byte-level text datasets for the transformer: language-model windows and classified documents.

Both expose what the loader (raytrm.data.loader) needs, `__len__` and `batch(indices) -> dict of arrays`, with the
sample index -> bytes mapping a pure function of the index, so batches depend only on (seed, step) and resume,
retries and re-cuts see exactly the same samples. The bytes come from a token cache (raytrm.data.text_cache), held in
memory or memory-mapped; the two give identical batches.

Held-out split: for the language model, the last 5% of the corpus's bytes (at least one window); for the classifier,
every tenth document (documents come in source order, often grouped by label, so a tail would miss classes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from raytrm.config import DataConfig, ModelConfig
from raytrm.data.text_cache import TokenCache, open_cache
from raytrm.errors import UserError

HELD_OUT_FRACTION = 0.05
HELD_OUT_EVERY = 10
#: Evaluation reads at most this many held-out windows, evenly spaced over the held-out bytes.
MAX_EVAL_WINDOWS = 1024
BYTE_VOCAB = 256


@dataclass(frozen=True)
class TextMetadata:
    """What a model needs to know about a text dataset."""

    task: str  # "lm" or "classify"
    seq_len: int
    vocab_size: int  # 256 bytes, plus the pad id for the classifier
    pad_id: int | None
    label_names: tuple[str, ...] = ()

    @property
    def num_classes(self) -> int:
        return len(self.label_names)


class LMWindows:
    """Windows of seq_len + 1 bytes of [start, stop): inputs are the first seq_len, labels the next byte of each.

    Window i starts at start + i * seq_len (consecutive windows share one byte); with max_samples, the windows are
    spread evenly over the range instead.
    """

    def __init__(self, cache: TokenCache, start: int, stop: int, seq_len: int, max_samples: int | None = None) -> None:
        self.cache, self.start, self.seq_len = cache, start, seq_len
        self.available = max(0, (stop - start - 1) // seq_len)
        self.count = min(self.available, max_samples) if max_samples else self.available
        self.metadata = TextMetadata("lm", seq_len, BYTE_VOCAB, None)
        self._span = np.arange(seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.count

    def starts(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        if self.count != self.available:
            idx = idx * self.available // self.count
        return self.start + idx * self.seq_len

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        starts = self.starts(indices)
        order = np.argsort(starts, kind="stable")  # ascending reads are sequential on a memory map
        windows = np.empty((len(starts), self.seq_len + 1), dtype=np.int32)
        windows[order] = self.cache.tokens[starts[order, None] + self._span]
        return {"inputs": windows[:, :-1], "labels": windows[:, 1:]}

    def byte_counts(self) -> np.ndarray:
        """How often each byte value occurs in the range's windows (the unigram baseline's statistics)."""
        counts = np.zeros(BYTE_VOCAB, dtype=np.int64)
        end = self.start + self.available * self.seq_len + 1
        for a in range(self.start, end, 2**24):
            counts += np.bincount(self.cache.tokens[a : min(end, a + 2**24)], minlength=BYTE_VOCAB)
        return counts


class Documents:
    """Some documents of a labelled cache, each cut to its first seq_len bytes and padded with pad_id."""

    def __init__(self, cache: TokenCache, documents: np.ndarray, seq_len: int) -> None:
        self.cache, self.documents, self.seq_len = cache, documents, seq_len
        self.pad_id = BYTE_VOCAB
        self.metadata = TextMetadata("classify", seq_len, BYTE_VOCAB + 1, self.pad_id, tuple(cache.label_names))
        self.labels = cache.labels[documents]

    def __len__(self) -> int:
        return len(self.documents)

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        docs = self.documents[np.asarray(indices, dtype=np.int64)]
        inputs = np.full((len(docs), self.seq_len), self.pad_id, dtype=np.int32)
        for row, doc in enumerate(docs):
            a = int(self.cache.offsets[doc])
            b = min(int(self.cache.offsets[doc + 1]), a + self.seq_len)
            inputs[row, : b - a] = self.cache.tokens[a:b]
        return {"inputs": inputs, "labels": self.cache.labels[docs].astype(np.int32)}


def split_lm(cache: TokenCache, seq_len: int) -> tuple[LMWindows, LMWindows]:
    total = len(cache.tokens)
    held = max(math.ceil(HELD_OUT_FRACTION * total), seq_len + 1)
    need = held + seq_len + 1
    if total < need:
        raise UserError(
            f"{cache.source}: {total} bytes of text is too little for seq_len {seq_len}: training and the held-out "
            f"5% need at least {need}; fix: add text or lower --seq-len"
        )
    cut = total - held
    return LMWindows(cache, 0, cut, seq_len), LMWindows(cache, cut, total, seq_len, max_samples=MAX_EVAL_WINDOWS)


def split_documents(cache: TokenCache, seq_len: int) -> tuple[Documents, Documents]:
    n = cache.num_documents
    if len(cache.label_names) < 2:
        only = cache.label_names[0] if cache.label_names else "none"
        raise UserError(
            f"{cache.source}: one class only ({only!r}) among {n} documents; a classifier needs at least two labels; "
            "fix: add documents of other labels, or check --label-field"
        )
    if n < HELD_OUT_EVERY:
        raise UserError(
            f"{cache.source}: {n} documents; the classifier needs at least {HELD_OUT_EVERY} (every tenth is held "
            "out for evaluation); fix: add documents"
        )
    ids = np.arange(n, dtype=np.int64)
    held = ids % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    return Documents(cache, ids[~held], seq_len), Documents(cache, ids[held], seq_len)


def open_text_dataset(data: DataConfig, model: ModelConfig) -> tuple[LMWindows | Documents, LMWindows | Documents]:
    """(train, held-out) splits of the text a config names, for the model's task and sequence length."""
    labelled = model.task == "classify"
    cache = open_cache(data, labelled)
    return split_documents(cache, model.seq_len) if labelled else split_lm(cache, model.seq_len)
