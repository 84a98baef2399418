"""Text records, JSONL, CSV or Parquet: one or more text fields and, for classification, a label field per record.

Every record is checked where it is read, and a bad one is refused with its file, line (or row), field and value,
never skipped: dropping records silently would change the data trained on.

- Each text is a non-empty string. A null, a number or a structure is refused, not converted: str() of them ("None",
  "3", "{...}") would train the model on text that is not in the file.
- The label is a non-empty string, or an integer, taken as its decimal string (3 and "3" are one class). A null, an
  empty string, a float, a boolean or a structure is refused: each would become a class of its own ("None", "",
  "1.0") that the file never meant.
- A JSONL record is one JSON object per line; a line ends at a newline only. A CSV row has as many cells as its header
  (quote a cell that holds a comma). A Parquet record is a row, read with pyarrow (the `hf` extra), and named by its
  1-based row number.

`read_records` serves the byte transformer (one text field, the file's text already read); `read_fields` reads any of
the three kinds from a path and gives a record's texts in the order of its text fields, for the caller to join.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from raytrm.errors import ConfigError, UserError

Record = tuple[str, str | None, str]  # (where: file and line, label or None, text)
#: (where: file and line or row, label or None, the texts of the text fields in their order)
FieldsRecord = tuple[str, str | None, tuple[str, ...]]
#: A field to read: (its name, the flag or config field that names it, its check).
_Field = tuple[str, str, Callable[[object, str, str, str], str]]

JSONL_SUFFIXES = (".jsonl",)
RECORD_SUFFIXES = (".jsonl", ".csv", ".parquet")
HF_EXTRA = 'pip install "raytrm[hf]"'


def _text_of(value: object, where: str, field: str, flag: str) -> str:
    """A record's text (see the module docstring)."""
    if isinstance(value, str) and value:
        return value
    raise ConfigError(
        where,
        field,
        value,
        "the document's text, a non-empty string",
        f"fill in or drop the record, or pass {flag} naming the field that holds the text",
    )


def _label_of(value: object, where: str, field: str, flag: str) -> str:
    """A record's class (see the module docstring)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value
    raise ConfigError(
        where,
        field,
        value,
        "the document's class, a non-empty string or an integer",
        f"label the record or drop it, or pass {flag} naming the field that holds the label",
    )


def _fields(text_fields: Sequence[str], label_field: str | None, text_flag: str, label_flag: str) -> list[_Field]:
    """The fields a record is read by: the texts in order, then the label (none for a language model)."""
    if not text_fields:
        raise UserError(f"{text_flag}: no text field named; fix: name the field (or fields) that hold the text")
    fields: list[_Field] = [(name, text_flag, _text_of) for name in text_fields]
    if label_field is not None:
        fields.append((label_field, label_flag, _label_of))
    return fields


def _split(values: list[str], labelled: bool) -> tuple[str | None, tuple[str, ...]]:
    return (values[-1], tuple(values[:-1])) if labelled else (None, tuple(values))


def read_records(path: Path, raw: str, text_field: str, label_field: str | None) -> Iterator[Record]:
    """The records of a JSONL or CSV file whose text is `raw`, in order; label_field None reads no label (lm)."""
    fields = _fields([text_field], label_field, "--text-field", "--label-field")
    for where, label, texts in _text_records(path, raw, fields, label_field is not None):
        yield where, label, texts[0]


def read_fields(
    path: Path,
    text_fields: Sequence[str],
    label_field: str | None,
    text_flag: str = "data.text_fields",
    label_flag: str = "data.label_field",
) -> Iterator[FieldsRecord]:
    """The records of a JSONL, CSV or Parquet file (by its suffix; anything else is read as JSONL), in order, each
    with the texts of `text_fields`; label_field None reads no label (lm). The flags name, in a refusal's fix, where
    the user names the fields."""
    fields = _fields(text_fields, label_field, text_flag, label_flag)
    labelled = label_field is not None
    if path.suffix == ".parquet":
        yield from _parquet_records(path, fields, labelled)
    else:
        yield from _text_records(path, read_text(path), fields, labelled)


def field_names(path: Path) -> list[str]:
    """The fields a records file's records have: a CSV's header, a JSONL file's first record's keys, a Parquet file's
    columns; [] for a file that is not records (text) or whose first record cannot be read (its reader says why)."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            return list(pq.ParquetFile(path).schema_arrow.names)
        except Exception:  # no pyarrow, or not Parquet: the reader says which, in one line
            return []
    if path.suffix not in (".csv", ".jsonl", ".json"):
        return []
    try:
        with path.open(encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError):
        return []
    if path.suffix == ".csv":
        return next(csv.reader([first.removeprefix("\ufeff")]), [])
    try:
        record = json.loads(first)
    except ValueError:
        return []
    return [str(key) for key in record] if isinstance(record, dict) else []


def read_text(path: Path) -> str:
    """A text file's contents as UTF-8; a file that is not is one line naming the byte's offset."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path}: not UTF-8 text (invalid byte at offset {e.start}); fix: convert it to UTF-8, or for records "
            "write CSV, JSONL or Parquet"
        ) from None


def _text_records(path: Path, raw: str, fields: list[_Field], labelled: bool) -> Iterator[FieldsRecord]:
    raw = raw.removeprefix("\ufeff")  # a BOM would rename the first column
    if path.suffix == ".csv":
        yield from _csv_records(path, raw, fields, labelled)
        return
    # Split at newlines only: str.splitlines would also cut at U+2028 and the like, which JSON allows inside a string.
    for i, line in enumerate(raw.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(f"{where}: not a JSON object ({e.msg}); fix: one JSON object per line") from None
        except RecursionError:
            raise UserError(f"{where}: a JSON value nested too deep; fix: one flat JSON object per line") from None
        if not isinstance(record, dict):
            raise ConfigError(where, "(the record)", record, "a JSON object", "one JSON object per line")
        values = []
        for name, flag, check in fields:
            if name not in record:
                raise UserError(
                    f"{where}: no field {name!r} (fields: {', '.join(map(str, record)) or 'none'}); "
                    f"fix: add it, or pass {flag} with the right name"
                )
            values.append(check(record[name], where, name, flag))
        yield (where, *_split(values, labelled))


def _csv_records(path: Path, raw: str, fields: list[_Field], labelled: bool) -> Iterator[FieldsRecord]:
    # A document's text may be longer than the csv module's default field limit (128 KiB).
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    reader = csv.DictReader(io.StringIO(raw, newline=""))
    try:
        columns = reader.fieldnames or []
        _require_columns(path, columns, fields)
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row:  # DictReader keeps a row's cells past the header under None
                raise UserError(
                    f"{where}: {len(columns) + len(row[None])} cells, the header has {len(columns)}; fix: quote a "
                    'cell that holds a comma ("a, b"), or drop the extra cells'
                )
            short = [name for name, _, _ in fields if row[name] is None]  # DictReader fills a short row with None
            if short:
                cells = sum(value is not None for value in row.values())
                raise UserError(
                    f"{where}: {cells} cells, the header has {len(columns)}: no {short[0]!r}; fix: fill in the "
                    "row's missing cells, or drop the row"
                )
            values = [check(row[name], where, name, flag) for name, flag, check in fields]
            yield (where, *_split(values, labelled))
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: not CSV ({e}); fix: check the quoting there") from None


def _require_columns(path: Path, columns: Sequence[str], fields: list[_Field]) -> None:
    for name, flag, _ in fields:
        if name not in columns:
            raise UserError(
                f"{path}: no column {name!r} (columns: {', '.join(columns) or 'none'}); fix: pass {flag} with one of "
                "them"
            )


def _parquet_records(path: Path, fields: list[_Field], labelled: bool) -> Iterator[FieldsRecord]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading Parquet needs pyarrow; fix: {HF_EXTRA}") from None
    try:
        table = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a Parquet file ({e}); fix: write it with pandas.to_parquet or pyarrow") from None
    _require_columns(path, table.schema_arrow.names, fields)
    names = list(dict.fromkeys(name for name, _, _ in fields))  # a column named twice is read once
    row = 0
    try:
        for batch in table.iter_batches(columns=names):
            columns = {name: batch.column(name).to_pylist() for name in names}
            for i in range(batch.num_rows):
                row += 1
                where = f"{path}: row {row}"
                values = [check(columns[name][i], where, name, flag) for name, flag, check in fields]
                yield (where, *_split(values, labelled))
    except pyarrow.ArrowException as e:
        raise UserError(f"{path}: row {row + 1}: unreadable ({e}); fix: write the file again") from None
