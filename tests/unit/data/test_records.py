"""Text records (JSONL, CSV) checked where they are read: a bad record is one line naming its file, line, field and
value, never trained on as something else."""

from __future__ import annotations

import json
import sys

import pytest

from raytrm import config as cfg
from raytrm.cli import main
from raytrm.data.records import read_fields, read_records
from raytrm.data.text import open_text_dataset
from raytrm.errors import UserError


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))


def data_config(path, task="classify", **data):
    model = {"name": "transformer", "task": task, "seq_len": 8, "hidden_size": 32, "num_heads": 2}
    return cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": {"name": "text", "path": str(path), **data}})


def open_split(path, task="classify", **data):
    e = data_config(path, task, **data)
    return open_text_dataset(e.data, e.model)


GOOD = [{"text": f"document {i}", "label": ["spam", "ham"][i % 2]} for i in range(20)]


def jsonl(tmp_path, bad: dict | str, at: int = 3) -> str:
    """GOOD with record `at` (0-based, so line at + 1) replaced by `bad`."""
    lines = [json.dumps(r) for r in GOOD]
    lines[at] = bad if isinstance(bad, str) else json.dumps(bad)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize(
    ("record", "task", "piece"),
    [
        (
            {"text": "a"},
            "classify",
            "d.jsonl:4: no field 'label' (fields: text); fix: add it, or pass --label-field with the right name",
        ),
        (
            {"text": None, "label": "ham"},
            "classify",
            "d.jsonl:4: text: got None, expected the document's text, a non-empty string; fix: fill in or drop the "
            "record, or pass --text-field naming the field that holds the text",
        ),
        ({"text": "", "label": "ham"}, "lm", "d.jsonl:4: text: got '', expected the document's text"),
        ({"text": 12, "label": "ham"}, "lm", "d.jsonl:4: text: got 12, expected the document's text"),
        ({"text": ["a"], "label": "ham"}, "lm", "d.jsonl:4: text: got ['a'], expected the document's text"),
        (
            {"text": "a", "label": None},
            "classify",
            "d.jsonl:4: label: got None, expected the document's class, a non-empty string or an integer; fix: "
            "label the record or drop it, or pass --label-field naming the field that holds the label",
        ),
        ({"text": "a", "label": ""}, "classify", "d.jsonl:4: label: got '', expected the document's class"),
        ({"text": "a", "label": "\t "}, "classify", "d.jsonl:4: label: got '\\t ', expected the document's class"),
        ({"text": "a", "label": {"x": 1}}, "classify", "d.jsonl:4: label: got {'x': 1}, expected the document's class"),
        ({"text": "a", "label": ["ham"]}, "classify", "d.jsonl:4: label: got ['ham'], expected the document's class"),
        ({"text": "a", "label": 1.0}, "classify", "d.jsonl:4: label: got 1.0, expected the document's class"),
        ({"text": "a", "label": True}, "classify", "d.jsonl:4: label: got True, expected the document's class"),
        ("[1, 2]", "lm", "d.jsonl:4: (the record): got [1, 2], expected a JSON object; fix: one JSON object per line"),
        ("{bad", "lm", "d.jsonl:4: not a JSON object (Expecting property name"),
        ("[" * 50_000, "lm", "d.jsonl:4: a JSON value nested too deep"),
    ],
)
def test_a_bad_jsonl_record_is_one_line_naming_its_line_and_field(tmp_path, record, task, piece):
    path = jsonl(tmp_path, record)
    with pytest.raises(UserError) as refused:
        open_split(path, task)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path}/{piece}"), message
    assert "\n" not in message
    assert not list((tmp_path / "cache").rglob("tokens.u8"))  # nothing half-built left behind


def test_an_integer_label_is_its_decimal_string(tmp_path):
    records = [{"text": f"doc {i}", "label": i % 2 if i % 4 else str(i % 2)} for i in range(20)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    train, test = open_split(path)
    assert train.metadata.label_names == ("0", "1") and len(train) + len(test) == 20


def test_the_lm_task_reads_no_label(tmp_path):
    path = jsonl(tmp_path, {"text": "no label here " * 40})
    train, _ = open_split(path, "lm")
    assert len(train) > 0


@pytest.mark.parametrize(
    ("rows", "piece"),
    [
        ("text,label\na,ham\nb\nc,spam\n", "d.csv:3: 1 cells, the header has 2: no 'label'; fix: fill in the row's"),
        ("text,label\na,ham\nb,spam,extra\n", "d.csv:3: 3 cells, the header has 2; fix: quote a cell that holds"),
        ("text,label\na,ham\n,spam\n", "d.csv:3: text: got '', expected the document's text"),
        ("text,label\na,ham\nb,\n", "d.csv:3: label: got '', expected the document's class"),
        ('text,label\na,ham\n"b\nc",\n', "d.csv:4: label: got '', expected the document's class"),
        ("label,txt\nham,a\n", "d.csv: no column 'text' (columns: label, txt); fix: pass --text-field"),
    ],
)
def test_a_bad_csv_row_is_one_line_naming_its_line_and_column(tmp_path, rows, piece):
    path = tmp_path / "d.csv"
    path.write_text(rows + "".join(f"doc {i},{['spam', 'ham'][i % 2]}\n" for i in range(20)))
    with pytest.raises(UserError) as refused:
        open_split(path)
    assert str(refused.value).startswith(f"{tmp_path}/{piece}"), str(refused.value)


def test_csv_with_a_bom_and_a_long_quoted_document(tmp_path):
    long = "word " * 40_000  # past the csv module's default field limit (128 KiB)
    rows = "".join(f'"{long if i == 0 else f"doc {i}"}",{["spam", "ham"][i % 2]}\n' for i in range(20))
    path = tmp_path / "d.csv"
    path.write_bytes(b"\xef\xbb\xbf" + ("text,label\n" + rows).encode())
    train, test = open_split(path)
    assert train.metadata.label_names == ("ham", "spam") and len(train) + len(test) == 20


def test_a_bad_record_through_the_cli_is_one_line_and_exit_2(tmp_path, capsys):
    path = jsonl(tmp_path, {"text": "a", "label": None})
    argv = ["train", "--model", "transformer", "--task", "classify", "--data", path, "--steps", "1"]
    assert main([*argv, "--out", str(tmp_path / "run"), "--seq-len", "8", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"raytrm: error: {path}:4: label: got None"), err


def test_a_jsonl_text_may_hold_any_line_separator_but_a_newline(tmp_path):
    """JSON allows U+2028, U+0085 and the like raw inside a string; only a newline ends a JSONL record."""
    records = [{"text": f"line\u2028sep\u0085 {i}\r", "label": ["spam", "ham"][i % 2]} for i in range(20)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in records), newline="")
    train, test = open_split(path)
    assert len(train) + len(test) == 20
    assert bytes(train.cache.tokens[: train.cache.offsets[1]]) == "line\u2028sep\u0085 0\r\n".encode()


# -- several text fields, and Parquet (the hf family's records) -----------------------------------------------------

PAIRS = [{"subject": f"subject {i}", "body": f"body {i}", "label": [7, "ham"][i % 2]} for i in range(4)]
WANT = [(f"subject {i}", f"body {i}") for i in range(4)]


def write_records(path, rows):
    if path.suffix == ".parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        path.write_text("subject,body,label\n" + "".join(f"{r['subject']},{r['body']},{r['label']}\n" for r in rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("suffix", "lines"), [(".jsonl", [1, 2, 3, 4]), (".csv", [2, 3, 4, 5])])
def test_several_text_fields_in_their_order_with_each_records_line(tmp_path, suffix, lines):
    rows = [{**r, "label": str(r["label"])} for r in PAIRS] if suffix == ".csv" else PAIRS
    path = write_records(tmp_path / f"d{suffix}", rows)
    got = list(read_fields(path, ["subject", "body"], "label"))
    assert got == [(f"{path}:{n}", ["7", "ham"][i % 2], WANT[i]) for i, n in enumerate(lines)]
    assert [texts for _, _, texts in read_fields(path, ["body", "subject"], None)] == [w[::-1] for w in WANT]
    assert {label for _, label, _ in read_fields(path, ["body"], None)} == {None}


def test_parquet_rows_are_read_and_named_by_their_row(tmp_path):
    rows = [{**r, "label": str(r["label"])} for r in PAIRS]  # a Parquet column has one type
    path = write_records(tmp_path / "d.parquet", rows)
    assert list(read_fields(path, ["subject", "body"], "label")) == [
        (f"{path}: row {i + 1}", r["label"], WANT[i]) for i, r in enumerate(rows)
    ]
    ints = write_records(tmp_path / "i.parquet", [{**r, "label": i % 3} for i, r in enumerate(PAIRS)])
    assert [label for _, label, _ in read_fields(ints, ["subject"], "label")] == ["0", "1", "2", "0"]


@pytest.mark.parametrize(
    ("suffix", "bad", "piece"),
    [
        (".jsonl", {"body": None}, "d.jsonl:3: body: got None, expected the document's text"),
        (".jsonl", {"body": 5}, "d.jsonl:3: body: got 5, expected the document's text"),
        (".parquet", {"body": None}, "d.parquet: row 3: body: got None, expected the document's text"),
        (".parquet", {"body": ""}, "d.parquet: row 3: body: got '', expected the document's text"),
        (".parquet", {"label": None}, "d.parquet: row 3: label: got None, expected the document's class"),
        (".jsonl", {"label": 2.0}, "d.jsonl:3: label: got 2.0, expected the document's class"),
    ],
)
def test_each_text_field_and_the_label_are_checked(tmp_path, suffix, bad, piece):
    rows = [{**r, "label": str(r["label"])} for r in PAIRS]
    rows[2] = {**rows[2], **bad}
    path = write_records(tmp_path / f"d{suffix}", rows)
    with pytest.raises(UserError) as refused:
        list(read_fields(path, ["subject", "body"], "label"))
    message = str(refused.value)
    assert message.startswith(f"{tmp_path}/{piece}") and "\n" not in message, message
    assert message.endswith("naming the field that holds the text") or "data.label_field" in message, message


def test_parquet_columns_of_another_type_are_refused_not_converted(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"subject": [1, 2], "body": ["a", "b"], "label": [0.5, 1.5]}), path)
    with pytest.raises(UserError, match=r"d.parquet: row 1: subject: got 1, expected the document's text"):
        list(read_fields(path, ["subject", "body"], "label"))
    with pytest.raises(UserError, match=r"d.parquet: row 1: label: got 0.5, expected the document's class"):
        list(read_fields(path, ["body"], "label"))
    with pytest.raises(UserError) as refused:
        list(read_fields(path, ["body", "text"], "label"))
    assert str(refused.value) == (
        f"{path}: no column 'text' (columns: subject, body, label); fix: pass data.text_fields with one of them"
    )


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # an import of it fails, as where it is not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError) as refused:
        list(read_fields(path, ["text"], "label"))
    assert str(refused.value) == f'{path}: reading Parquet needs pyarrow; fix: pip install "raytrm[hf]"'


def test_the_byte_transformer_reads_one_field_as_before(tmp_path):
    path = write_records(tmp_path / "d.jsonl", PAIRS)
    assert list(read_records(path, path.read_text(), "body", "label")) == [
        (f"{path}:{i + 1}", ["7", "ham"][i % 2], f"body {i}") for i in range(4)
    ]


def test_field_names_are_a_records_files_fields_and_none_for_text(tmp_path):
    from raytrm.data.records import field_names

    (tmp_path / "a.csv").write_text("\ufeffsubject,body,label\nhi,there,x\n")
    (tmp_path / "a.jsonl").write_text('\n{"text": "hi", "label": 1}\n')
    (tmp_path / "a.txt").write_text("plain text\n")
    (tmp_path / "b.jsonl").write_text("not json\n")
    assert field_names(tmp_path / "a.csv") == ["subject", "body", "label"]
    assert field_names(tmp_path / "a.jsonl") == ["text", "label"]
    assert field_names(tmp_path / "a.txt") == [] and field_names(tmp_path / "b.jsonl") == []
    pyarrow = pytest.importorskip("pyarrow", reason="needs pyarrow (the hf extra)")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.table({"text": ["a"], "label": ["b"]}), tmp_path / "a.parquet")
    assert field_names(tmp_path / "a.parquet") == ["text", "label"]
