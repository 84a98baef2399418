"""The hf family's data: records tokenized by the model's own tokenizer, the label map, the stratified split, the
length-sorted padded batches, the language model's windows, the on-disk cache and each bad input's one line."""

from __future__ import annotations

import itertools
import json
import logging
import os

import numpy as np
import pytest

pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

from raytrm import config as cfg  # noqa: E402
from raytrm.data.hf_cache import tokenizer_fingerprint  # noqa: E402
from raytrm.data.hf_records import open_records, stratified_split  # noqa: E402
from raytrm.errors import UserError  # noqa: E402
from tests.support.hf_models import WORDS, causal_lm_dir, classifier_dir  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        root = tmp_path_factory.mktemp("hf")
        return classifier_dir(root / "classifier"), causal_lm_dir(root / "lm")


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))


def _load(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture
def bert(model_dirs):
    return _load(model_dirs[0])


@pytest.fixture
def gpt(model_dirs):
    return _load(model_dirs[1])


def sentence(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words))


def records(n: int = 24, labels=("spam", "ham")) -> list[dict]:
    """Records of two texts and a label, of unequal lengths."""
    return [
        {"subject": sentence(i, 1 + i % 3), "body": sentence(i + 1, 2 + (i * 5) % 13), "label": labels[i % len(labels)]}
        for i in range(n)
    ]


def write(path, rows: list[dict]):
    """Rows as JSONL, CSV or Parquet, by the path's suffix."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        columns = list(rows[0])
        path.write_text(",".join(columns) + "\n" + "".join(",".join(str(r[c]) for c in columns) + "\n" for r in rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(model_dir, path, task="classify", seq_len=16, **data):
    fields = ["subject", "body"] if task == "classify" else ["text"]
    data = {"name": "records", "path": str(path), "text_fields": fields, **data}
    model = {"name": "hf", "path": str(model_dir), "task": task, "seq_len": seq_len}
    return cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": data})


def open_(model_dir, tokenizer, path, task="classify", seq_len=16, **data):
    e = config(model_dir, path, task, seq_len, **data)
    return open_records(e.data, e.model, tokenizer)


def samples(split) -> list[list[int]]:
    """Each sample's token ids, in the split's order (one at a time: a batch of one is not reordered)."""
    out = []
    for i in range(len(split)):
        b = split.batch(np.array([i]))
        out.append(b["input_ids"][0, : b["lengths"][0]].tolist())
    return out


def labels_of(split) -> list[str]:
    names = split.metadata.label_names
    return [names[int(split.batch(np.array([i]))["labels"][0])] for i in range(len(split))]


# -- classify: the encoding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_two_text_fields_are_the_tokenizers_own_pair_encoding(tmp_path, model_dirs, bert, suffix):
    rows = records()
    train_path, held_path = write(tmp_path / f"t{suffix}", rows), write(tmp_path / f"v{suffix}", rows[:6])
    train, held = open_(model_dirs[0], bert, train_path, validation_path=str(held_path))
    want = [bert(r["subject"], r["body"], truncation=True, max_length=16)["input_ids"] for r in rows]
    assert samples(train) == want and samples(held) == want[:6]
    assert want[0][0] == bert.cls_token_id and want[0].count(bert.sep_token_id) == 2
    assert max(map(len, want)) == 16 and min(map(len, want)) < 16  # some truncated, some padded in a batch
    assert labels_of(train) == [r["label"] for r in rows]


def test_one_field_alone_and_three_joined_with_the_separator(tmp_path, model_dirs, bert, gpt):
    rows = [{**r, "extra": sentence(i + 3, 2)} for i, r in enumerate(records())]
    path = write(tmp_path / "t.jsonl", rows)
    one, _ = open_(model_dirs[0], bert, path, text_fields=["body"], validation_path=str(path))
    assert samples(one) == [bert(r["body"], truncation=True, max_length=16)["input_ids"] for r in rows]
    three, _ = open_(model_dirs[0], bert, path, text_fields=["subject", "body", "extra"], validation_path=str(path))
    joined = [f"{r['subject']}[SEP]{r['body']}[SEP]{r['extra']}" for r in rows]
    assert samples(three) == [bert(t, truncation=True, max_length=16)["input_ids"] for t in joined]
    # GPT-2's tokenizer has no separator: a space joins the texts.
    three, _ = open_(model_dirs[1], gpt, path, text_fields=["subject", "body", "extra"], validation_path=str(path))
    joined = [f"{r['subject']} {r['body']} {r['extra']}" for r in rows]
    assert samples(three) == [gpt(t, truncation=True, max_length=16)["input_ids"] for t in joined]


def test_token_type_ids_where_the_tokenizer_makes_them(tmp_path, model_dirs, bert):
    bert.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    rows = records()
    path = write(tmp_path / "t.jsonl", rows)
    train, _ = open_(model_dirs[0], bert, path, validation_path=str(path))
    batch = train.batch(np.arange(len(rows)))
    want = [bert(r["subject"], r["body"], truncation=True, max_length=16) for r in rows]
    for row, length in enumerate(batch["lengths"]):
        i = samples(train).index(batch["input_ids"][row, :length].tolist())
        assert batch["token_type_ids"][row, :length].tolist() == want[i]["token_type_ids"]
        assert not batch["token_type_ids"][row, length:].any()


def test_the_label_map_is_the_sorted_labels_and_an_integer_is_its_decimal_string(tmp_path, model_dirs, bert):
    rows = [{**r, "label": [10, "2", 2, "x"][i % 4]} for i, r in enumerate(records())]
    for suffix in (".jsonl", ".parquet"):
        if suffix == ".parquet":  # a Parquet column has one type: ints here
            rows = [{**r, "label": [10, 2, 3][i % 3]} for i, r in enumerate(rows)]
        path = write(tmp_path / f"t{suffix}", rows)
        train, held = open_(model_dirs[0], bert, path, validation_path=str(path))
        assert train.metadata.label_names == held.metadata.label_names == tuple(sorted({str(r["label"]) for r in rows}))
        assert labels_of(train) == [str(r["label"]) for r in rows]
    assert train.metadata.num_classes == 3 and train.metadata.tokens_per_sample is None


# -- classify: the held-out split ----------------------------------------------------------------------------------


def test_the_stratified_split_holds_out_a_share_of_each_label(tmp_path, model_dirs, bert):
    counts = {"a": 20, "b": 10, "c": 5, "d": 2, "e": 1}
    rows = [
        {"subject": sentence(i, 2), "body": sentence(i, 3), "label": k} for k, n in counts.items() for i in range(n)
    ]
    path = write(tmp_path / "t.jsonl", rows)
    train, held = open_(model_dirs[0], bert, path, validation_share=0.2, seed=5)
    held_labels, train_labels = labels_of(held), labels_of(train)
    assert {k: held_labels.count(k) for k in counts} == {"a": 4, "b": 2, "c": 1, "d": 0, "e": 0}
    assert {k: train_labels.count(k) for k in counts} == {"a": 16, "b": 8, "c": 4, "d": 2, "e": 1}
    assert train.metadata.label_names == ("a", "b", "c", "d", "e")
    assert sorted(train.records.tolist() + held.records.tolist()) == list(range(len(rows)))


def test_the_split_is_the_seeds_and_keeps_one_of_each_label_in_training():
    labels = np.repeat(np.arange(4), [30, 3, 2, 1])
    a, b, c = (stratified_split(labels, 0.5, seed) for seed in (0, 0, 1))
    assert (a == b).all() and not (a == c).all()
    assert [int(a[labels == k].sum()) for k in range(4)] == [15, 2, 1, 0]  # 3 x 0.5 rounds to 2, 1 stays
    assert all(int((~a)[labels == k].sum()) >= 1 for k in range(4))


def test_a_label_of_one_record_stays_in_training_and_is_logged(tmp_path, model_dirs, bert, caplog):
    rows = [*records(20), {"subject": "the cat", "body": "sat", "label": "rare"}]
    path = write(tmp_path / "t.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="raytrm.data.hf_records"):
        train, held = open_(model_dirs[0], bert, path)
    assert "rare" in labels_of(train) and "rare" not in labels_of(held)
    assert "['rare'] have one record each, kept in training" in caplog.text


# -- classify: batches ---------------------------------------------------------------------------------------------


def test_a_batch_is_sorted_longest_first_and_padded_to_its_longest(tmp_path, model_dirs, bert):
    rows = records(30)
    path = write(tmp_path / "t.csv", rows)
    train, _ = open_(model_dirs[0], bert, path, validation_path=str(path), seq_len=64)
    ids = samples(train)
    indices = np.random.default_rng(0).permutation(30)
    batch = train.batch(indices)
    lengths = [len(ids[i]) for i in indices]
    order = sorted(range(len(indices)), key=lambda k: -lengths[k])  # Python's sort is stable
    assert batch["lengths"].tolist() == [lengths[k] for k in order]
    assert batch["input_ids"].shape == (30, max(lengths)) and max(lengths) < 64
    assert {k: v.dtype for k, v in batch.items()} == dict.fromkeys(batch, np.int64)
    for row, k in enumerate(order):
        n = lengths[k]
        assert batch["input_ids"][row, :n].tolist() == ids[indices[k]]
        assert (batch["input_ids"][row, n:] == bert.pad_token_id).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert train.metadata.label_names[batch["labels"][row]] == rows[indices[k]]["label"]
    # Any cut into contiguous micro-batches: each one's longest is its first row, and trimming it there drops only
    # padding, so every sample's tokens are whole whatever the cut.
    for cuts in ([30], [7, 8, 15], [1] * 30):
        bounds = np.cumsum([0, *cuts])
        for a, b in itertools.pairwise(bounds):
            width = int(batch["lengths"][a:b].max())
            assert width == batch["lengths"][a] and not batch["attention_mask"][a:b, width:].any()
    # The same samples in another order make the same batch: what a micro-batch holds depends on the samples alone.
    again = train.batch(indices[::-1])
    ties = len(set(lengths)) < len(lengths)
    assert ties and sorted(map(tuple, again["input_ids"].tolist())) == sorted(map(tuple, batch["input_ids"].tolist()))
    assert (again["lengths"] == batch["lengths"]).all()


def test_a_causal_lm_tokenizer_without_a_pad_token_pads_with_eos(tmp_path, model_dirs, gpt, caplog):
    gpt.pad_token = None
    path = write(tmp_path / "t.jsonl", records())
    with caplog.at_level(logging.INFO, logger="raytrm.data.hf_records"):
        train, _ = open_(model_dirs[1], gpt, path)
    assert train.metadata.pad_id == gpt.eos_token_id
    assert "no pad token: padding with its EOS token '<eos>'" in caplog.text
    batch = train.batch(np.arange(len(train)))
    assert (batch["input_ids"][batch["attention_mask"] == 0] == gpt.eos_token_id).all()


# -- lm ------------------------------------------------------------------------------------------------------------


def stream_of(tokenizer, documents) -> list[int]:
    return [
        t for d in documents for t in [*tokenizer(d, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    ]


def windows(split) -> list[list[int]]:
    batch = split.batch(np.arange(len(split)))
    assert batch["input_ids"].dtype == batch["labels"].dtype == np.int64
    assert (batch["input_ids"][:, 1:] == batch["labels"][:, :-1]).all()
    return [[*x, int(y[-1])] for x, y in zip(batch["input_ids"].tolist(), batch["labels"], strict=True)]


def cut(stream, seq_len) -> list[list[int]]:
    return [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range((len(stream) - 1) // seq_len)]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_lm_windows_are_the_documents_ids_joined_with_eos(tmp_path, model_dirs, gpt, suffix):
    documents = [sentence(i, 5 + i % 7) for i in range(20)]
    path = write(tmp_path / f"t{suffix}", [{"text": d} for d in documents])
    train, held = open_(model_dirs[1], gpt, path, "lm", seq_len=8, validation_share=0.1)
    assert windows(train) == cut(stream_of(gpt, documents[:18]), 8)  # the last 10% of the documents held out
    assert windows(held) == cut(stream_of(gpt, documents[18:]), 8)
    assert train.metadata.tokens_per_sample == 8 and train.metadata.label_names == ()


def test_lm_from_a_directory_of_text_files_and_a_held_out_path(tmp_path, model_dirs, gpt):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    documents = {f"{name}.txt": sentence(i, 12) for i, name in enumerate(["b", "a", "sub/c"])}
    for name, text in documents.items():
        (tmp_path / "docs" / name).write_text(text)
    (tmp_path / "docs" / "notes.md").write_text("not a text file of the corpus")
    held = tmp_path / "held.txt"
    held.write_text(sentence(9, 30))
    train, test = open_(model_dirs[1], gpt, tmp_path / "docs", "lm", seq_len=8, validation_path=str(held))
    assert windows(train) == cut(stream_of(gpt, [documents[n] for n in ["a.txt", "b.txt", "sub/c.txt"]]), 8)
    assert windows(test) == cut(stream_of(gpt, [held.read_text()]), 8)


def test_lm_of_one_document_holds_out_its_last_tokens(tmp_path, model_dirs, gpt):
    path = tmp_path / "one.txt"
    path.write_text(" ".join(sentence(i, 10) for i in range(10)))
    train, held = open_(model_dirs[1], gpt, path, "lm", seq_len=8, validation_share=0.25)
    stream = stream_of(gpt, [path.read_text()])
    keep = len(stream) - round(0.25 * len(stream))
    assert windows(train) == cut(stream[:keep], 8) and windows(held) == cut(stream[keep:], 8)


# -- the cache -----------------------------------------------------------------------------------------------------


@pytest.fixture
def calls(monkeypatch):
    """Counts the tokenizer's encodings (every encoding goes through its __call__)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    count = [0]
    original = PreTrainedTokenizerBase.__call__

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", counted)
    return count


def test_a_second_open_tokenizes_nothing_and_a_change_tokenizes_again(tmp_path, model_dirs, bert, calls):
    path = write(tmp_path / "t.jsonl", records())
    first = samples(open_(model_dirs[0], bert, path)[0])
    assert calls[0] == 1
    assert samples(open_(model_dirs[0], bert, path)[0]) == first and calls[0] == 1  # a hit
    assert samples(open_(model_dirs[0], _load(model_dirs[0]), path)[0]) == first and calls[0] == 1  # same tokenizer
    # The same size and the same modification time, other contents: tokenized again.
    stat = path.stat()
    text = path.read_text()
    path.write_text(text.replace('"spam"', '"smap"'))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    train, _ = open_(model_dirs[0], bert, path)
    assert calls[0] == 2 and train.metadata.label_names == ("ham", "smap")
    open_(model_dirs[0], bert, path, seq_len=12)  # another max length
    assert calls[0] == 3
    open_(model_dirs[0], bert, path, text_fields=["body", "subject"])  # other fields
    assert calls[0] == 4
    open_(model_dirs[0], _load(model_dirs[1]), path)  # another tokenizer
    assert calls[0] == 5
    assert len(list((tmp_path / "cache" / "hf-records").iterdir())) == 5  # no temporary directory left


def test_the_lm_cache_serves_every_seq_len(tmp_path, model_dirs, gpt, calls):
    documents = [sentence(i, 9) for i in range(20)]
    path = write(tmp_path / "t.jsonl", [{"text": d} for d in documents])
    short, _ = open_(model_dirs[1], gpt, path, "lm", seq_len=8, validation_share=0.2)
    long, _ = open_(model_dirs[1], gpt, path, "lm", seq_len=16, validation_share=0.2)
    assert calls[0] == 1 and windows(long) == cut(stream_of(gpt, documents[:16]), 16) and len(short) > len(long)


def test_a_damaged_cache_is_built_again(tmp_path, model_dirs, bert, calls):
    path = write(tmp_path / "t.jsonl", records())
    first = samples(open_(model_dirs[0], bert, path)[0])
    (directory,) = (tmp_path / "cache" / "hf-records").iterdir()
    np.save(directory / "offsets.npy", np.zeros(3, dtype=np.int64))
    assert samples(open_(model_dirs[0], bert, path)[0]) == first and calls[0] == 2


def test_the_tokenizer_fingerprint_follows_its_vocabulary_and_special_tokens(model_dirs, bert):
    before = tokenizer_fingerprint(bert)
    bert(["the cat"], ["sat"], truncation=True, max_length=5, padding="max_length")  # settings of one call
    assert tokenizer_fingerprint(bert) == before == tokenizer_fingerprint(_load(model_dirs[0]))
    other = _load(model_dirs[0])
    other.add_tokens(["zebra"])
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(bert)
    other = _load(model_dirs[0])
    other.pad_token = "[MASK]"
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(bert)


def test_a_python_tokenizer_is_cached_by_its_vocabulary(tmp_path, model_dirs, calls):
    """A tokenizer without a Rust pipeline (ByT5's needs no files): the same encodings, and the cache still hits."""
    from transformers import ByT5Tokenizer

    rows = records()
    path = write(tmp_path / "t.jsonl", rows)
    train, _ = open_(model_dirs[0], ByT5Tokenizer(), path, seq_len=32, validation_path=str(path))
    want = [ByT5Tokenizer()(r["subject"], r["body"], truncation=True, max_length=32)["input_ids"] for r in rows]
    assert samples(train) == want and calls[0] == 1 + len(rows)
    open_(model_dirs[0], ByT5Tokenizer(), path, seq_len=32, validation_path=str(path))
    assert calls[0] == 1 + len(rows)
    open_(model_dirs[0], ByT5Tokenizer(extra_ids=10), path, seq_len=32, validation_path=str(path))
    assert calls[0] == 2 + len(rows)


# -- bad input: one line each --------------------------------------------------------------------------------------


def refused(call) -> str:
    with pytest.raises(UserError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and "fix: " in message, message
    return message


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_a_missing_label_or_text_column_is_one_line(tmp_path, model_dirs, bert, suffix):
    rows = [{"subject": r["subject"], "body": r["body"]} for r in records()]
    path = write(tmp_path / f"t{suffix}", rows)
    message = refused(lambda: open_(model_dirs[0], bert, path))
    if suffix == ".jsonl":
        assert message == (
            f"{path}:1: no field 'label' (fields: subject, body); fix: add it, or pass data.label_field with the "
            "right name"
        )
    else:
        assert (
            message
            == f"{path}: no column 'label' (columns: subject, body); fix: pass data.label_field with one of them"
        )
    message = refused(lambda: open_(model_dirs[0], bert, path, text_fields=["subject", "text"]))
    assert "no field 'text'" in message or "no column 'text'" in message
    assert "data.text_fields" in message


def test_a_held_out_label_unseen_in_training_names_its_line(tmp_path, model_dirs, bert):
    path = write(tmp_path / "t.jsonl", records())
    held = write(tmp_path / "v.jsonl", [*records(3), {"subject": "a", "body": "b", "label": "eggs"}])
    assert refused(lambda: open_(model_dirs[0], bert, path, validation_path=str(held))) == (
        f"{held}:4: label 'eggs' is not among the training labels of {path} ('ham', 'spam'); fix: add records of it "
        "to the training file, or drop it from the held-out file"
    )
    held = write(tmp_path / "v.parquet", [*records(3), {"subject": "a", "body": "b", "label": "eggs"}])
    assert refused(lambda: open_(model_dirs[0], bert, path, validation_path=str(held))).startswith(
        f"{held}: row 4: label 'eggs' is not among"
    )


@pytest.mark.parametrize(
    ("name", "contents", "piece"),
    [
        ("t.jsonl", "", "{path}: empty file; fix:"),
        ("t.csv", "", "{path}: empty file; fix:"),
        ("t.jsonl", "\n\n  \n", "{path}: no records in it (a header or blank lines only); fix:"),
        ("t.csv", "subject,body,label\n", "{path}: no records in it"),
        ("t.parquet", None, "{path}: no records in it"),
        ("t.parquet", b"PAR1 this is no parquet", "{path}: not a Parquet file ("),
        ("t.csv", b"subject,body,label\n\xff,b,c\n", "{path}: not UTF-8 text (invalid byte at offset 19)"),
    ],
)
def test_an_empty_or_unreadable_file_is_one_line(tmp_path, model_dirs, bert, name, contents, piece):
    path = tmp_path / name
    if contents is None:
        schema = pa.schema([("subject", pa.string()), ("body", pa.string()), ("label", pa.string())])
        pq.write_table(schema.empty_table(), path)
    elif isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        path.write_text(contents)
    assert refused(lambda: open_(model_dirs[0], bert, path)).startswith(piece.format(path=path))
    assert not list((tmp_path / "cache").rglob("*.npy"))  # nothing half-built left behind


def test_a_bad_parquet_record_names_its_row(tmp_path, model_dirs, bert):
    rows = [{**r, "label": None if i == 4 else r["label"]} for i, r in enumerate(records())]
    path = write(tmp_path / "t.parquet", rows)
    assert refused(lambda: open_(model_dirs[0], bert, path)).startswith(
        f"{path}: row 5: label: got None, expected the document's class, a non-empty string or an integer"
    )


def test_other_bad_inputs_are_one_line(tmp_path, model_dirs, bert, gpt):
    path = write(tmp_path / "t.jsonl", records(labels=("only",)))
    assert "one class only ('only') among 24 records" in refused(lambda: open_(model_dirs[0], bert, path))
    path = write(tmp_path / "t.jsonl", records())
    message = refused(lambda: open_(model_dirs[0], bert, path, validation_share=0.01))
    assert message.startswith(f"{path}: a share 0.01 of each label's records holds out none of its 24")
    assert refused(lambda: open_(model_dirs[0], bert, tmp_path / "nope.jsonl")).startswith(
        f"{tmp_path}/nope.jsonl: no such file or directory; fix: check data.path"
    )
    (tmp_path / "doc.txt").write_text("the cat")
    assert "expected records to classify: a file ending in .jsonl, .csv, .parquet" in refused(
        lambda: open_(model_dirs[0], bert, tmp_path / "doc.txt")
    )
    gpt.pad_token, gpt.eos_token = None, None
    assert "the tokenizer has neither a pad nor an EOS token" in refused(lambda: open_(model_dirs[1], gpt, path))
    lm = write(tmp_path / "lm.jsonl", [{"text": sentence(i, 9)} for i in range(12)])
    assert "the tokenizer has no EOS token to end each document with" in refused(
        lambda: open_(model_dirs[1], gpt, lm, "lm")
    )
    assert refused(lambda: open_(model_dirs[1], _load(model_dirs[1]), lm, "lm", text_fields=["a", "b"])) == (
        "data.text_fields: got ['a', 'b'], expected one field for a language model (its documents' text); "
        "fix: name only the field that holds the text"
    )
    assert "fewer than one window of model.seq_len + 1 (257)" in refused(
        lambda: open_(model_dirs[1], _load(model_dirs[1]), lm, "lm", seq_len=256)
    )
