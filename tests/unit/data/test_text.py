"""Byte-level text data: windows and documents, the token cache, streaming, and the errors a user can meet."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.data.loader import batch_indices, global_batches
from raytrm.data.text import open_text_dataset
from raytrm.data.text_cache import build_cache, open_cache
from raytrm.errors import UserError


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))


def experiment(path, task="lm", seq_len=16, **data) -> cfg.ExperimentConfig:
    return cfg.from_dict(
        cfg.ExperimentConfig,
        {
            "model": {"name": "transformer", "task": task, "seq_len": seq_len, "hidden_size": 32, "num_heads": 2},
            "data": {"name": "text", "path": str(path) if path else None, **data},
        },
    )


def open_split(path, task="lm", seq_len=16, **data):
    e = experiment(path, task, seq_len, **data)
    return open_text_dataset(e.data, e.model)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_lm_windows_are_next_bytes_with_the_tail_held_out(tmp_path):
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(200)).encode()
    (tmp_path / "a.txt").write_bytes(text)
    train, test = open_split(tmp_path / "a.txt", seq_len=16)
    assert len(train) == (len(text) - max(-(-len(text) // 20), 17) - 1) // 16
    batch = train.batch(np.array([3, 0]))
    assert batch["inputs"].shape == batch["labels"].shape == (2, 16)
    assert bytes(batch["inputs"][1].astype(np.uint8)) == text[:16]
    assert bytes(batch["labels"][1].astype(np.uint8)) == text[1:17]
    assert bytes(batch["inputs"][0].astype(np.uint8)) == text[48:64]
    held = test.batch(np.arange(len(test)))
    cut = len(text) - max(-(-len(text) // 20), 17)
    assert bytes(held["inputs"][0].astype(np.uint8)) == text[cut : cut + 16]  # the last 5% of bytes


def test_streamed_and_in_memory_give_the_same_batches(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "a.txt").write_bytes(rng.integers(97, 123, 50_000, dtype=np.uint8).tobytes())
    memory = experiment(tmp_path / "a.txt")
    streamed = experiment(tmp_path / "a.txt", stream_above_mb=0.001, in_memory_below_mb=0.0005)
    assert not open_cache(memory.data, False).streamed
    assert open_cache(streamed.data, False).streamed
    a, _ = open_text_dataset(memory.data, memory.model)
    b, _ = open_text_dataset(streamed.data, streamed.model)
    assert isinstance(b.cache.tokens, np.memmap) and not isinstance(a.cache.tokens, np.memmap)
    streams = [global_batches(d.batch, len(d), 32, seed=5, first_step=2) for d in (a, b)]
    for _ in range(3):
        x, y = next(streams[0]), next(streams[1])
        assert x.keys() == y.keys()
        for key in x:
            assert np.array_equal(x[key].numpy(), y[key].numpy()), key


def test_the_cache_is_reused_and_rebuilt_when_a_source_changes(tmp_path):
    source = tmp_path / "docs"
    source.mkdir()
    (source / "a.txt").write_text("alpha " * 100)
    (source / "b.txt").write_text("beta " * 100)
    data = experiment(source).data
    directory = build_cache(data, False)
    meta = directory / "meta.json"
    first = meta.stat().st_mtime_ns
    assert build_cache(data, False) == directory and meta.stat().st_mtime_ns == first  # reused
    (source / "b.txt").write_text("gamma " * 100)
    os.utime(source / "b.txt", ns=(first + 10**9, first + 10**9))  # a new mtime even on coarse clocks
    build_cache(data, False)
    tokens = (directory / "tokens.u8").read_bytes()
    assert b"gamma" in tokens and b"beta" not in tokens
    (source / "c.txt").write_text("delta " * 100)  # an added file changes the fingerprint too
    build_cache(data, False)
    assert b"delta" in (directory / "tokens.u8").read_bytes()


def test_jsonl_and_csv_records_with_labels(tmp_path):
    records = [{"body": f"document {i} " * 5, "kind": ["spam", "ham", "eggs"][i % 3]} for i in range(30)]
    jsonl = write_jsonl(tmp_path / "d.jsonl", records)
    train, test = open_split(jsonl, "classify", 8, text_field="body", label_field="kind")
    assert train.metadata.label_names == ("eggs", "ham", "spam")
    assert (len(train), len(test)) == (27, 3)
    batch = train.batch(np.array([0, 1]))
    assert bytes(batch["inputs"][0].astype(np.uint8)) == b"document"
    assert batch["labels"].tolist() == [2, 1]  # spam, ham
    csv = tmp_path / "d.csv"
    csv.write_text("kind,body\n" + "".join(f'{r["kind"]},"{r["body"]}"\n' for r in records))
    train_csv, _ = open_split(csv, "classify", 8, text_field="body", label_field="kind")
    assert np.array_equal(train_csv.batch(np.arange(27))["labels"], train.batch(np.arange(27))["labels"])


def test_a_directory_per_label_and_padding(tmp_path):
    for label in ("neg", "pos"):
        (tmp_path / "docs" / label).mkdir(parents=True)
        for i in range(6):
            (tmp_path / "docs" / label / f"{i}.txt").write_text(f"{label}{i}")
    train, test = open_split(tmp_path / "docs", "classify", 8)
    assert train.metadata.label_names == ("neg", "pos") and len(train) + len(test) == 12
    batch = train.batch(np.array([0]))
    assert batch["inputs"][0].tolist() == [*b"neg0\n", 256, 256, 256]


def test_the_default_corpus_is_the_standard_library():
    train, test = open_split(None, seq_len=64)
    assert len(train) > 10_000 and len(test) > 100
    assert b"import" in bytes(train.batch(np.arange(64))["inputs"].astype(np.uint8).ravel())


@pytest.mark.parametrize(
    ("files", "task", "fields", "message"),
    [
        ({"empty.txt": b""}, "lm", {}, "empty corpus"),
        ({"bin.txt": b"text\x00\x01\x02 more"}, "lm", {}, "NUL byte at offset 4"),
        ({"latin.txt": "caf\u00e9".encode("latin-1")}, "lm", {}, "not UTF-8"),
        ({"d.jsonl": b'{"text": "a", "label": "x"}\n{"text": "b"}\n'}, "classify", {}, "d.jsonl:2: no field 'label'"),
        ({"d.csv": b"text,tag\nhello,x\n"}, "classify", {}, "no column 'label' (columns: text, tag)"),
        ({"d.jsonl": b'{"txt": "a"}\n'}, "lm", {}, "no field 'text'"),
        ({"d.jsonl": b'{"text": "a", "label": "x"}\n' * 20}, "classify", {}, "one class only ('x')"),
        ({"one.txt": b"hello world\n" * 50}, "classify", {}, "a text file has no label"),
        ({"tiny.txt": b"short\n"}, "lm", {}, "too little for seq_len 16"),
    ],
)
def test_bad_inputs_are_one_clear_line(tmp_path, files, task, fields, message):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    path = tmp_path / next(iter(files))
    with pytest.raises(UserError) as info:
        open_split(path, task, **fields)
    text = str(info.value)
    assert message in text and "\n" not in text and "fix:" in text
    assert str(tmp_path) in text


def test_missing_path_exits_2_through_the_cli(tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    code = main(["train", "--model", "transformer", "--data", str(missing), "--steps", "1", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{missing}: no such file or directory" in err


def test_text_data_needs_the_transformer(tmp_path):
    with pytest.raises(UserError, match=r"data\.name: got 'text', expected sudoku or maze for model\.name trm"):
        cfg.from_dict(cfg.ExperimentConfig, {"data": {"name": "text"}})


def test_batch_indices_are_a_pure_function_of_seed_and_step(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefgh" * 500)
    train, _ = open_split(tmp_path / "a.txt")
    first = train.batch(batch_indices(len(train), 8, 1, 4))
    again = train.batch(batch_indices(len(train), 8, 1, 4))
    assert all(np.array_equal(first[k], again[k]) for k in first)
