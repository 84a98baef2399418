"""Byte-level token caches of text on disk: sources in, one uint8 file of documents out, rebuilt when sources change.

A cache directory (under the cache dir, one per input and settings) holds tokens.u8 (every document's UTF-8 bytes,
each ending in a newline, concatenated), offsets.npy (int64 [documents + 1]), labels.npy (int32 label ids, -1 when
unlabelled) and meta.json (the sources' fingerprint, label names, sizes), written last: a cache without a matching
meta.json is rebuilt, and so is one whose files do not agree with it (a damaged cache). The fingerprint is each
source file's path, size and modification time.

Inputs: a text file (one document), a directory (every non-hidden file, in sorted order; for classification the
first sub-directory under it is the label), or JSONL / CSV records with a text field and, for classification, a
label field (raytrm.data.records, which checks each record). Without a path: the Python standard library's own .py
sources on this machine.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from raytrm.config import DataConfig
from raytrm.constants import cache_dir
from raytrm.data.records import read_records
from raytrm.errors import UserError

logger = logging.getLogger(__name__)

#: 2: records are checked as they are read (a null text or label refused, not kept as "None"), so a cache built
#: by version 1 from such a file is built again, and refused.
CACHE_VERSION = 2
RECORD_SUFFIXES = (".jsonl", ".csv")
#: The default language-model corpus reads standard-library sources up to this many bytes (quick to build and train).
DEFAULT_LM_BYTES = 8 * 2**20
#: The default classifier: top-level standard-library packages with at least this many .py files are the labels...
DEFAULT_MIN_FILES_PER_LABEL = 20
#: ...and each label keeps its first files in sorted order, up to this many, so the classes are balanced.
DEFAULT_FILES_PER_LABEL = 40
#: Not part of the standard library proper (installed packages) or machine-dependent in size.
STDLIB_SKIP = ("site-packages", "dist-packages", "test", "tests", "__pycache__")
_CHUNK = 16 * 2**20

Document = tuple[str, str | None, Iterator[bytes]]  # (source name, label or None, the text's byte chunks)


@dataclass
class TokenCache:
    """An opened cache: the tokens (in memory or memory-mapped), document offsets, labels and label names."""

    directory: Path
    tokens: np.ndarray  # uint8 [total bytes]
    offsets: np.ndarray  # int64 [documents + 1]
    labels: np.ndarray  # int32 [documents]; -1 when unlabelled
    label_names: list[str]
    source: str
    streamed: bool

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1


# -- sources ---------------------------------------------------------------------------------------------------


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    root = stdlib_dir()
    files = sorted(
        p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in STDLIB_SKIP and not p.is_symlink()
    )
    if not files:
        raise UserError(f"{root}: no Python standard library sources found there; fix: pass --data PATH to a text file")
    return files


def _listing(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
    if not files:
        raise UserError(f"{path}: empty directory, no text files in it; fix: point --data at a directory with text")
    return files


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def fingerprint(files: list[Path]) -> str:
    """Path, size and modification time of every source: any edit, addition or removal changes it."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


class _TextCheck:
    """Refuses NUL bytes and invalid UTF-8 in one source, chunk by chunk."""

    def __init__(self, source: str) -> None:
        self.source, self.decoder, self.seen = source, codecs.getincrementaldecoder("utf-8")(), 0

    def __call__(self, chunk: bytes, final: bool = False) -> bytes:
        nul = chunk.find(b"\0")
        if nul >= 0:
            raise UserError(
                f"{self.source}: NUL byte at offset {self.seen + nul}: a binary file, not text; "
                "fix: remove it from the input, or pass only text files"
            )
        try:
            self.decoder.decode(chunk, final=final)
        except UnicodeDecodeError as e:
            raise UserError(
                f"{self.source}: not UTF-8 text (invalid byte at offset {self.seen + e.start}); "
                "fix: convert it to UTF-8 or remove it from the input"
            ) from None
        self.seen += len(chunk)
        return chunk


def _file_chunks(path: Path) -> Iterator[bytes]:
    check = _TextCheck(str(path))
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            yield check(chunk)
    check(b"", final=True)


def _documents(root: Path, files: list[Path], data: DataConfig, labelled: bool) -> Iterator[Document]:
    label_field = data.label_field if labelled else None
    for path in files:
        if path.suffix in RECORD_SUFFIXES:
            raw = b"".join(_file_chunks(path)).decode("utf-8")
            for where, label, text in read_records(path, raw, data.text_field, label_field):
                yield where, label, iter([text.encode()])
            continue
        label = None
        if labelled:
            rel = path.relative_to(root) if root.is_dir() else Path(path.name)
            if len(rel.parts) < 2:
                raise UserError(
                    f"{path}: a text file has no label; fix: for classification pass JSONL or CSV with a "
                    f"{data.label_field!r} field, or a directory with one sub-directory of text files per label"
                )
            label = rel.parts[0]
        yield str(path), label, _file_chunks(path)


def _stdlib_documents(files: list[Path], labelled: bool) -> Iterator[Document]:
    """The default corpus: sources that are not clean UTF-8 are skipped (they are ours to choose, not the user's)."""
    root = stdlib_dir()
    if labelled:
        by_label: dict[str, list[Path]] = {}
        for p in files:
            rel = p.relative_to(root)
            if len(rel.parts) > 1:
                by_label.setdefault(rel.parts[0], []).append(p)
        chosen = [
            (label, p)
            for label, paths in sorted(by_label.items())
            if len(paths) >= DEFAULT_MIN_FILES_PER_LABEL
            for p in paths[:DEFAULT_FILES_PER_LABEL]
        ]
    else:
        chosen = [(None, p) for p in files]
    total = 0
    for label, path in chosen:
        try:
            text = b"".join(_file_chunks(path))
        except UserError as e:
            logger.debug("default corpus: skipping %s", e)
            continue
        if not labelled and total + len(text) > DEFAULT_LM_BYTES:
            break
        total += len(text)
        yield str(path), label, iter([text])


# -- the cache -------------------------------------------------------------------------------------------------


def _write(directory: Path, documents: Iterator[Document], meta: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "meta.json").unlink(missing_ok=True)  # the commit marker goes first and comes back last
    offsets, names = [0], []
    # A private temporary name: two trials building the same cache at once each write a whole file, then rename.
    fd, name = tempfile.mkstemp(dir=directory, prefix=".tokens.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            for _, label, chunks in documents:
                size, last = 0, b""
                for chunk in chunks:
                    f.write(chunk)
                    size += len(chunk)
                    last = chunk[-1:] or last
                if size == 0:
                    continue  # an empty file or record is no document
                if last != b"\n":
                    f.write(b"\n")
                    size += 1
                offsets.append(offsets[-1] + size)
                names.append(label)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / "tokens.u8")
    except BaseException:
        tmp.unlink(missing_ok=True)  # bad input leaves no half-built cache behind
        raise
    label_names = sorted({n for n in names if n is not None})
    ids = {name: i for i, name in enumerate(label_names)}
    np.save(directory / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    np.save(directory / "labels.npy", np.asarray([ids.get(n, -1) for n in names], dtype=np.int32))
    meta = {**meta, "label_names": label_names, "documents": len(names), "bytes": offsets[-1]}
    (directory / "meta.json").write_text(json.dumps(meta, indent=1))


def cache_location(data: DataConfig, labelled: bool) -> tuple[Path, str]:
    """(cache directory, a name for the source) of a text config: one directory per input and settings."""
    source = str(Path(data.path).expanduser().resolve()) if data.path else f"stdlib:{stdlib_dir()}"
    recipe = {"version": CACHE_VERSION, "source": source, "labelled": labelled}
    if data.path:
        recipe.update(text_field=data.text_field, label_field=data.label_field if labelled else None)
    else:
        recipe.update(
            lm_bytes=DEFAULT_LM_BYTES, per_label=DEFAULT_FILES_PER_LABEL, min_files=DEFAULT_MIN_FILES_PER_LABEL
        )
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    slug = Path(data.path).name if data.path else "stdlib"
    return cache_dir() / "text" / f"{slug}-{'classify' if labelled else 'lm'}-{digest}", source


def require_source(path: str | Path) -> Path:
    """The text source a data path names, or build_cache's one-line error if it names nothing."""
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"{root}: no such file or directory; fix: check --data (data.path)")
    return root


def _read_meta(directory: Path) -> dict | None:
    """A cache's meta.json, where the cache reads whole (its arrays there, of the sizes it records); None otherwise:
    the cache is raytrm's own, so a damaged one is built again rather than refused."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        offsets = np.load(directory / "offsets.npy", allow_pickle=False)
        labels = np.load(directory / "labels.npy", allow_pickle=False)
        size = (directory / "tokens.u8").stat().st_size
        intact = (
            isinstance(meta, dict)
            and isinstance(meta.get("label_names"), list)
            and meta.get("documents") == len(labels) == len(offsets) - 1
            and meta.get("bytes") == size == int(offsets[-1])
            and isinstance(meta.get("source"), str)
            and offsets.ndim == labels.ndim == 1
            and (not len(labels) or (int(labels.min()) >= -1 and int(labels.max()) < len(meta["label_names"])))
        )
    except (OSError, ValueError, TypeError, EOFError, IndexError):
        return None
    return meta if intact else None


def build_cache(data: DataConfig, labelled: bool) -> Path:
    """The cache directory for a text config, built (or rebuilt, when its sources changed) first if needed."""
    directory, source = cache_location(data, labelled)
    if data.path:
        root = require_source(data.path)
        files = _listing(root)
    else:
        root, files = stdlib_dir(), _stdlib_files()
    stamp = fingerprint(files)
    meta = _read_meta(directory)
    if meta is not None and meta.get("fingerprint") == stamp:
        return directory
    if (directory / "meta.json").is_file():
        logger.info(
            "%s changed since its token cache was built (or the cache is damaged): rebuilding %s", source, directory
        )
    else:
        logger.info("building the token cache of %s in %s", source, directory)
    documents = _documents(root, files, data, labelled) if data.path else _stdlib_documents(files, labelled)
    _write(directory, documents, {"version": CACHE_VERSION, "source": source, "fingerprint": stamp})
    return directory


def _in_memory(size: int, data: DataConfig) -> tuple[bool, str]:
    mib = size / 2**20
    if mib < data.in_memory_below_mb:
        return True, f"{mib:.1f} MiB is below in_memory_below_mb {data.in_memory_below_mb:g}"
    if mib > data.stream_above_mb:
        return False, f"{mib:.1f} MiB is above stream_above_mb {data.stream_above_mb:g}"
    available = psutil.virtual_memory().available
    fits = 4 * size < available
    return fits, (
        f"{mib:.1f} MiB is between in_memory_below_mb and stream_above_mb, and {available / 2**20:.0f} MiB free "
        f"{'holds' if fits else 'does not hold'} four times it"
    )


def open_cache(data: DataConfig, labelled: bool) -> TokenCache:
    """Build or reuse the token cache of a text config and open it, in memory or streamed (logged with why)."""
    directory = build_cache(data, labelled)
    meta = _read_meta(directory)
    if meta is None:  # changed between its check and now: another process is building it
        raise UserError(f"{directory}: the token cache changed while it was opened; fix: run again")
    offsets = np.load(directory / "offsets.npy")
    labels = np.load(directory / "labels.npy")
    where = meta["source"]
    if meta["documents"] == 0 or meta["bytes"] == 0:
        raise UserError(f"{where}: empty corpus, no text in it; fix: point --data at files with text")
    path = directory / "tokens.u8"
    in_memory, reason = _in_memory(int(meta["bytes"]), data)
    # Reading the file whole and mapping it give the same bytes, so the choice changes speed and memory, never data.
    tokens = np.fromfile(path, dtype=np.uint8) if in_memory else np.memmap(path, dtype=np.uint8, mode="r")
    logger.info(
        "text corpus %s: %d documents, %d bytes, %s (%s)",
        where,
        meta["documents"],
        meta["bytes"],
        "in memory" if in_memory else "streamed from disk",
        reason,
    )
    return TokenCache(directory, tokens, offsets, labels, list(meta["label_names"]), where, not in_memory)
