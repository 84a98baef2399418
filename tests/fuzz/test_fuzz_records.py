"""Fuzzing the transformer's records files: JSONL and CSV, for the classify and the lm task.

Property: opening the token cache of a file either reads every record as the file says it (one document per record,
in order, its text byte for byte, its label the class it names) or refuses the file with a UserError of one line;
never a traceback, and never a record dropped or read as something else.
"""

from __future__ import annotations

import csv
import io
import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mutations import FUZZ, FUZZ_EXAMPLES, GARBAGE, Counter, corrupted, load_or_refusal, mutated

from raytrm import config as cfg
from raytrm.data.text_cache import open_cache

pytestmark = pytest.mark.slow

LABELS = ["spam", "ham", 3, "eggs"]
#: Records with fields raytrm does not read besides the two it does, so that many edits leave a file raytrm reads.
SEED = [
    {
        "text": f'document {i}: caf\u00e9 \u2028 "quoted", {i}',
        "label": LABELS[i % 4],
        "id": i,
        "meta": {"source": "web", "tags": ["a", "b"], "score": 0.5},
    }
    for i in range(6)
]
#: Text of the kind CSV's syntax is made of, so the reader meets odd but plausible rows.
CSVISH = st.text(alphabet=st.sampled_from(list('ab,"\n\r \t\\;\u00e9\x00')), max_size=80)


def _config(path, task: str) -> cfg.DataConfig:
    model = {"name": "transformer", "task": task, "seq_len": 8, "hidden_size": 32, "num_heads": 2}
    return cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": {"name": "text", "path": str(path)}}).data


def _text(value) -> str | None:
    return value if isinstance(value, str) and value else None


def _label(value) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value if isinstance(value, str) and value.strip() else None


def _expected(records: list, labelled: bool) -> list[tuple[str, str | None]] | None:
    """(text, label) of each record as the file says it, or None where one of them is not a record raytrm reads."""
    out = []
    for record in records:
        if not isinstance(record, dict) or _text(record.get("text")) is None:
            return None
        label = _label(record.get("label")) if labelled else None
        if labelled and label is None:
            return None
        out.append((record["text"], label))
    return out


def _read_as_written(cache, expected: list[tuple[str, str | None]]) -> None:
    """The cache holds exactly the expected documents, in order: each text (with its newline), each label."""
    assert cache.num_documents == len(expected)
    for i, (text, label) in enumerate(expected):
        body = text.encode()
        body += b"" if body.endswith(b"\n") else b"\n"
        assert bytes(cache.tokens[cache.offsets[i] : cache.offsets[i + 1]]) == body, i
        assert (cache.label_names[cache.labels[i]] if cache.labels[i] >= 0 else None) == label, i


def _jsonl(records: list) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def _csv(rows: list) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    for row in rows:
        writer.writerow(row if isinstance(row, list) else [row])
    return out.getvalue().encode()


@pytest.fixture
def fresh_paths(tmp_path, monkeypatch):
    """A new file name per example: a cache is keyed by its source's path, and two examples written within one tick
    of the file system's clock, of one size, would share a fingerprint."""
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))
    counter = itertools.count()
    return lambda suffix: tmp_path / f"records-{next(counter)}{suffix}"


def test_jsonl_records(fresh_paths):
    counter = Counter("JSONL records")
    edits = mutated(SEED).map(lambda r: r if isinstance(r, list) else [r])  # a whole file of something else: a line

    @FUZZ
    @given(
        st.one_of(edits.map(lambda r: (r, _jsonl(r))), edits.map(_jsonl).flatmap(corrupted).map(lambda b: (None, b))),
        st.sampled_from(["classify", "lm"]),
    )
    def prop(case, task) -> None:
        records, content = case
        path = fresh_paths(".jsonl")
        path.write_bytes(content)
        labelled = task == "classify"
        cache, error = load_or_refusal(open_cache, _config(path, task), labelled)
        if records is not None and isinstance(records, list):
            expected = _expected(records, labelled)
            assert (cache is None) == (expected is None or not expected), (records, error)
            if cache is not None:
                _read_as_written(cache, expected)
        counter.add(error is not None)

    prop()
    print(counter.report())
    assert counter.ran >= FUZZ_EXAMPLES


ROWS = [["text", "label"], *([r["text"], r["label"]] for r in SEED)]


def test_csv_records(fresh_paths):
    counter = Counter("CSV records")
    cells = st.one_of(st.text(max_size=12), st.integers(-5, 5), st.sampled_from(["", " ", ",", '"', "\n"]))
    edits = mutated(ROWS, extra=cells).map(lambda r: r if isinstance(r, list) and r else [r])

    @FUZZ
    @given(
        st.one_of(
            edits.map(lambda r: (r, _csv(r))),
            edits.map(_csv).flatmap(corrupted).map(lambda b: (None, b)),
            CSVISH.map(lambda t: (None, ("text,label\n" + t).encode())),
            GARBAGE.map(lambda g: (None, str(g).encode())),
        ),
        st.sampled_from(["classify", "lm"]),
    )
    def prop(case, task) -> None:
        rows, content = case
        path = fresh_paths(".csv")
        path.write_bytes(content)
        labelled = task == "classify"
        cache, error = load_or_refusal(open_cache, _config(path, task), labelled)
        if cache is not None and rows is not None:
            # Every row past the header is one document, in order, as csv.writer wrote its cells.
            header = [str(c) for c in rows[0]] if isinstance(rows[0], list) else [str(rows[0])]
            cells = [r if isinstance(r, list) else [r] for r in rows[1:]]
            cells = [r for r in cells if r]  # csv writes an empty row as an empty line, which readers skip
            records = [dict(zip(header, map(str, r), strict=False)) for r in cells]
            expected = [(r["text"], r.get("label") if labelled else None) for r in records]
            _read_as_written(cache, expected)
        counter.add(error is not None)

    prop()
    print(counter.report())
    assert counter.ran >= FUZZ_EXAMPLES
