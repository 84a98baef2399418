"""Text records, JSONL or CSV: a text field and, for classification, a label field per record.

Every record is checked where it is read, and a bad one is refused with its file, line, field and value, never
skipped: dropping records silently would change the data trained on.

- The text is a non-empty string. A null, a number or a structure is refused, not converted: str() of them ("None",
  "3", "{...}") would train the model on text that is not in the file.
- The label is a non-empty string, or an integer, taken as its decimal string (3 and "3" are one class). A null, an
  empty string, a float, a boolean or a structure is refused: each would become a class of its own ("None", "",
  "1.0") that the file never meant.
- A JSONL record is one JSON object per line; a line ends at a newline only. A CSV row has as many cells as its header
  (quote a cell that holds a comma).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path

from raytrm.errors import ConfigError, UserError

Record = tuple[str, str | None, str]  # (where: file and line, label or None, text)


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


def read_records(path: Path, raw: str, text_field: str, label_field: str | None) -> Iterator[Record]:
    """The records of a JSONL or CSV file whose text is `raw`, in order; label_field None reads no label (lm)."""
    raw = raw.removeprefix("\ufeff")  # a BOM would rename the first column
    fields = ((text_field, "--text-field", _text_of), (label_field, "--label-field", _label_of))
    if path.suffix == ".csv":
        yield from _csv_records(path, raw, [f for f in fields if f[0] is not None])
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
            if name is None:
                values.append(None)
                continue
            if name not in record:
                raise UserError(
                    f"{where}: no field {name!r} (fields: {', '.join(map(str, record)) or 'none'}); "
                    f"fix: add it, or pass {flag} with the right name"
                )
            values.append(check(record[name], where, name, flag))
        yield where, values[1], values[0]


def _csv_records(path: Path, raw: str, fields: list) -> Iterator[Record]:
    # A document's text may be longer than the csv module's default field limit (128 KiB).
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    reader = csv.DictReader(io.StringIO(raw, newline=""))
    try:
        columns = reader.fieldnames or []
        for name, flag, _ in fields:
            if name not in columns:
                raise UserError(
                    f"{path}: no column {name!r} (columns: {', '.join(columns) or 'none'}); "
                    f"fix: pass {flag} with one of them"
                )
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
            values = {name: check(row[name], where, name, flag) for name, flag, check in fields}
            label = values.get(fields[1][0]) if len(fields) > 1 else None
            yield where, label, values[fields[0][0]]
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: not CSV ({e}); fix: check the quoting there") from None
