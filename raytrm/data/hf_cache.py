"""The hf family's token caches: each file of records (or text) tokenized once by a tokenizer, kept on disk.

A cache lives under raytrm's cache dir (hf-records/), one directory per key: the tokenizer (a hash of its vocabulary,
rules and special tokens, not of the settings of its last call), the task, the fields, the max length (classify only:
a language model's documents are not truncated, so its cache serves every seq_len) and the file's contents (a hash,
not its size and mtime: two edits of one size in one clock tick must not reuse the first's tokens). It holds
tokens.npy (int32, every sample's ids end to end), offsets.npy (int64 [records + 1]), labels.npy (int32 indices into
meta.json's label_names, the file's own sorted labels; empty for lm), positions.npy (int64: each record's line, or
Parquet row, for errors), token_types.npy (uint8, where the tokenizer makes token type ids) and meta.json. It is built
under a private name and renamed into place whole, so it is complete or absent; one that does not read whole is built
again (it is raytrm's own, not the user's).

classify: a record's texts as raytrm.data.hf_records describes, truncated to max length. lm: each document encoded
without special tokens and followed by the tokenizer's EOS.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raytrm.config import DataConfig, ModelConfig
from raytrm.constants import cache_dir
from raytrm.data.records import RECORD_SUFFIXES, read_fields, read_text
from raytrm.errors import UserError

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
TEXT_SUFFIX = ".txt"
#: Records tokenized per call of the tokenizer: a fast tokenizer works through a list at once.
_CHUNK = 1024
_ARRAYS = ("tokens", "offsets", "labels", "positions", "token_types")


@dataclass
class TokenizedFile:
    """One file's records, tokenized: classify's samples (with labels), or lm's documents each ending in EOS."""

    tokens: np.ndarray  # int32 [all tokens]
    offsets: np.ndarray  # int64 [records + 1]
    labels: np.ndarray  # int32 [records], into label_names; empty for lm
    positions: np.ndarray  # int64 [records]: each record's line (JSONL, CSV) or row (Parquet)
    token_types: np.ndarray | None
    label_names: list[str]
    kind: str  # "line" or "row"

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    def where(self, path: Path, record: int) -> str:
        n = int(self.positions[record])
        return f"{path}: row {n}" if self.kind == "row" else f"{path}:{n}"


def tokenizer_name(tokenizer: Any) -> str:
    """Where a tokenizer came from (its directory or hub name), for an error line."""
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def tokenized_file(path: Path, task: str, data: DataConfig, model: ModelConfig, tokenizer: Any) -> TokenizedFile:
    """The file's tokenized records: from the cache where its key matches, else tokenized and cached."""
    files = _text_files(path) if task == "lm" and path.suffix not in RECORD_SUFFIXES else [path]
    recipe = {
        "version": CACHE_VERSION,
        "task": task,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "contents": contents_hash(files, path),
        "text_fields": list(data.text_fields) if path.suffix in RECORD_SUFFIXES else None,
        "label_field": data.label_field if task == "classify" else None,
        "max_length": model.seq_len if task == "classify" else None,
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    directory = cache_dir() / "hf-records" / f"{path.stem}-{task}-{key[:20]}"
    cache = _load(directory, key)
    if cache is not None:
        logger.info("tokenized records of %s from the cache %s", path, directory)
        return cache
    logger.info("tokenizing %s into the cache %s", path, directory)
    arrays, meta = _tokenize(path, files, task, data, model, tokenizer)
    _store(directory, arrays, {**meta, "key": key, "source": str(path)})
    cache = _load(directory, key)
    if cache is None:  # replaced between our rename and this read by a process that should have built the same
        raise UserError(f"{directory}: the token cache changed while it was opened; fix: run again")
    return cache


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(
        p
        for p in path.rglob(f"*{TEXT_SUFFIX}")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise UserError(f"{path}: no {TEXT_SUFFIX} files in it; fix: point data.path at text files or records")
    return files


def contents_hash(files: list[Path], root: Path) -> str:
    """A hash of the files' names (relative to root) and contents: any edit, addition or removal changes it."""
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(root) if root.is_dir() else p.name}\0".encode())
        with p.open("rb") as f:
            while chunk := f.read(16 * 2**20):
                h.update(chunk)
        h.update(f"\0{p.stat().st_size}\n".encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides a tokenizer's ids: its vocabulary and rules, its special and added tokens."""
    h = hashlib.sha256()
    parts: dict[str, Any] = {}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: its whole pipeline (normalizer, model, post-processor) in one JSON
        pipeline = json.loads(backend.to_str())
        # Its truncation and padding are the settings of the last call (ours set max_length), not of the tokenizer.
        pipeline.pop("truncation", None)
        pipeline.pop("padding", None)
        h.update(json.dumps(pipeline, sort_keys=True).encode())
    else:  # a Python one: its vocabulary, and the files it keeps it in (a sentencepiece model's rules too)
        parts["vocab"] = sorted(tokenizer.get_vocab().items())
        if hasattr(tokenizer, "save_vocabulary"):
            with tempfile.TemporaryDirectory() as tmp:
                for name in sorted(tokenizer.save_vocabulary(tmp)):
                    h.update(Path(name).read_bytes())
    parts |= {
        "class": type(tokenizer).__name__,
        "special": {str(k): str(v) for k, v in tokenizer.special_tokens_map.items()},
        "added": sorted(tokenizer.get_added_vocab().items()),
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "inputs": list(getattr(tokenizer, "model_input_names", [])),
    }
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _tokenize(
    path: Path, files: list[Path], task: str, data: DataConfig, model: ModelConfig, tokenizer: Any
) -> tuple[dict[str, np.ndarray], dict]:
    for p in files:
        if p.stat().st_size == 0:
            raise UserError(f"{p}: empty file; fix: point data.path (or data.validation_path) at a file with text")
    chunks: list[np.ndarray] = []
    types: list[np.ndarray] = []
    lengths: list[int] = []
    labels: list[str] = []
    positions: list[int] = []
    for batch in _chunks(_documents(path, files, task, data)):
        wheres, names, texts = zip(*batch, strict=True)
        positions.extend(map(_position, wheres))
        if task == "classify":
            labels.extend(names)
            encoded = encode_records(tokenizer, texts, model.seq_len)
        else:
            # verbose=False: a document longer than the model's positions is no error here, it is cut into windows.
            encoded = tokenizer(
                [t[0] for t in texts], add_special_tokens=False, return_attention_mask=False, verbose=False
            )
            encoded = {"input_ids": [[*ids, tokenizer.eos_token_id] for ids in encoded["input_ids"]]}
        for where, ids in zip(wheres, encoded["input_ids"], strict=True):
            if not ids:
                raise UserError(
                    f"{where}: the text makes no tokens ({tokenizer_name(tokenizer)}'s tokenizer drops all of it); "
                    "fix: give the record some text, or drop it"
                )
            chunks.append(np.asarray(ids, dtype=np.int32))
            lengths.append(len(ids))
        if "token_type_ids" in encoded:
            types.extend(np.asarray(t, dtype=np.uint8) for t in encoded["token_type_ids"])
    if not lengths:
        raise UserError(
            f"{path}: no records in it (a header or blank lines only); fix: point data.path at a file with records"
        )
    label_names = sorted(set(labels))
    index = {name: i for i, name in enumerate(label_names)}
    arrays = {
        "tokens": np.concatenate(chunks),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "labels": np.asarray([index[n] for n in labels], dtype=np.int32),
        "positions": np.asarray(positions, dtype=np.int64),
    }
    if types:
        arrays["token_types"] = np.concatenate(types)
    kind = "row" if path.suffix == ".parquet" else "line"
    return arrays, {"label_names": label_names, "records": len(lengths), "kind": kind}


def _position(where: str) -> int:
    """A record's line (`file:12`) or row (`file: row 12`) from where the reader says it is."""
    return int(where.rpartition(" ")[2] if ": row " in where else where.rpartition(":")[2])


def _documents(path: Path, files: list[Path], task: str, data: DataConfig) -> Iterator[tuple[str, Any, tuple]]:
    if path.suffix in RECORD_SUFFIXES:
        label_field = data.label_field if task == "classify" else None
        yield from read_fields(path, data.text_fields, label_field)
        return
    for i, p in enumerate(files, start=1):
        yield f"{p}:{i}", None, (read_text(p),)


def _chunks(items: Iterator[Any]) -> Iterator[list[Any]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == _CHUNK:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_records(tokenizer: Any, texts: Sequence[tuple[str, ...]], max_length: int, **options: Any) -> dict[str, Any]:
    """Records' texts as the model reads them, the one encoding of training, evaluation and predict: one field alone,
    a pair as the tokenizer's own pair (its special tokens and segments), more joined with its separator; truncated
    to max_length. options go to the tokenizer (padding, return_tensors)."""
    options = {"truncation": True, "max_length": max_length, "return_attention_mask": False, **options}
    if len(texts[0]) == 1:
        return tokenizer([t[0] for t in texts], **options)
    if len(texts[0]) == 2:
        return tokenizer([t[0] for t in texts], [t[1] for t in texts], **options)
    sep = tokenizer.sep_token or " "
    return tokenizer([sep.join(t) for t in texts], **options)


def _store(directory: Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """Write the cache under a private name, then rename it into place whole: never a half-written cache."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    try:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array)
        (tmp / "meta.json").write_text(json.dumps({**meta, "version": CACHE_VERSION}, indent=1))
        if directory.exists():  # a damaged cache (or one a racing process just built: the same contents)
            shutil.rmtree(directory, ignore_errors=True)
        try:
            os.rename(tmp, directory)
        except OSError:
            if _load(directory, meta["key"]) is None:  # another process's rename won; anything else is an error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load(directory: Path, key: str) -> TokenizedFile | None:
    """The cache in directory if it is whole and built for key; None otherwise (raytrm's own: rebuilt, not refused)."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        if not isinstance(meta, dict) or meta.get("key") != key or meta.get("version") != CACHE_VERSION:
            return None
        arrays = {
            name: np.load(directory / f"{name}.npy", mmap_mode="r" if name == "tokens" else None, allow_pickle=False)
            for name in _ARRAYS
            if name != "token_types" or (directory / "token_types.npy").exists()
        }
        offsets, count = arrays["offsets"], int(meta["records"])
        intact = (
            len(offsets) == count + 1
            and int(offsets[-1]) == len(arrays["tokens"])
            and len(arrays["positions"]) == count
            and len(arrays["labels"]) in (0, count)
            and len(arrays.get("token_types", arrays["tokens"])) == len(arrays["tokens"])
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not intact:
        return None
    return TokenizedFile(
        arrays["tokens"],
        offsets,
        arrays["labels"],
        arrays["positions"],
        arrays.get("token_types"),
        list(meta["label_names"]),
        meta["kind"],
    )
