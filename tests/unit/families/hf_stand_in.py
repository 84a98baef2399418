"""A stand-in for raytrm.data.hf_records (built in parallel): its interface, `open_records(data, model, tokenizer) ->
(train, held_out)` of records whose `batch(indices)` gives, for classify, `input_ids` and `attention_mask` [B, L]
sorted by length, longest first, and padded to the longest, `labels` [B] and `lengths` [B]; for lm, `input_ids` and
`labels` (the next token) [B, seq_len]; and whose `metadata` holds task, label_names, pad_id, seq_len and
tokens_per_sample. The records are made of the tiny tokenizers' words, of very different lengths."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tests.support.hf_models import WORDS


@dataclasses.dataclass(frozen=True)
class Metadata:
    task: str
    label_names: tuple[str, ...] | None
    pad_id: int
    seq_len: int
    tokens_per_sample: int | None
    vocab_size: int

    @property
    def num_classes(self) -> int:  # what the health checks read of a classifier's data
        return len(self.label_names or ())


class Records:
    """Tokenized, labelled records: one row each, padded per batch."""

    def __init__(self, ids: list[list[int]], labels: np.ndarray, metadata: Metadata) -> None:
        self.ids, self.labels, self.metadata = ids, labels, metadata

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        lengths = np.array([len(self.ids[i]) for i in indices], dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        longest = int(lengths.max())
        ids = np.full((len(indices), longest), self.metadata.pad_id, dtype=np.int64)
        mask = np.zeros((len(indices), longest), dtype=np.int64)
        for row, k in enumerate(order):
            tokens = self.ids[indices[k]]
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": self.labels[np.asarray(indices)[order]],
            "lengths": lengths[order],
        }


class Windows:
    """A token stream cut in windows of seq_len + 1: the inputs and their next tokens."""

    def __init__(self, stream: np.ndarray, metadata: Metadata) -> None:
        self.stream, self.metadata = stream, metadata

    def __len__(self) -> int:
        return (len(self.stream) - 1) // self.metadata.seq_len

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        n = self.metadata.seq_len
        starts = np.asarray(indices) * n
        windows = np.stack([self.stream[s : s + n + 1] for s in starts])
        return {"input_ids": windows[:, :-1].copy(), "labels": windows[:, 1:].copy()}


def texts(count: int, seed: int, shortest: int = 2, longest: int = 40) -> tuple[list[str], list[str]]:
    """Texts of the tiny tokenizers' words, of lengths from `shortest` to `longest` words, labelled 'pos' where
    'sun' is in them, else 'neg' (a class a classifier can learn)."""
    rng = np.random.default_rng(seed)
    out, labels = [], []
    for _ in range(count):
        words = list(rng.choice(WORDS, rng.integers(shortest, longest + 1)))
        if rng.random() < 0.4:
            words[rng.integers(len(words))] = "sun"
        elif "sun" in words:
            words = [w for w in words if w != "sun"] or ["cat"]
        out.append(" ".join(words))
        labels.append("pos" if "sun" in words else "neg")
    return out, labels


def opener(label_names: tuple[str, ...] = ("neg", "pos"), count: int = 64, held_out: int = 16, relabel: Any = None):
    """An `open_records` of the stand-in's records; relabel(i, label) may give a record another label."""

    def open_records(data: Any, model: Any, tokenizer: Any) -> tuple[Any, Any]:
        pad = tokenizer.pad_token_id
        if model.task == "lm":
            words, _ = texts(count, seed=1)
            stream = np.array(tokenizer(" ".join(words))["input_ids"], dtype=np.int64)
            cut = int(len(stream) * 0.8)
            meta = Metadata("lm", None, pad, model.seq_len, model.seq_len, len(tokenizer))
            return Windows(stream[:cut], meta), Windows(stream[cut:], meta)
        meta = Metadata("classify", tuple(label_names), pad, model.seq_len, None, len(tokenizer))
        made = []
        for seed, n in ((1, count), (2, held_out)):
            words, labels = texts(n, seed)
            if relabel is not None:
                labels = [relabel(i, label) for i, label in enumerate(labels)]
            ids = [tokenizer(t, truncation=True, max_length=model.seq_len)["input_ids"] for t in words]
            made.append(Records(ids, np.array([label_names.index(x) for x in labels], dtype=np.int64), meta))
        return made[0], made[1]

    return open_records
