"""Write a small labelled JSONL corpus from this repository, to stand in for your own records.

    python examples/own_text/make_records.py runs/own_text/functions.jsonl

One record per top-level function or class of raytrm's source: {"body": its source, "package": the raytrm package it
is in}, e.g. {"body": "def lr_at(step, train, ...", "package": "train"}. Your own JSONL needs only a text field and a
label field (name them with --text-field and --label-field); a CSV with such columns works the same way.
"""

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def records():
    for path in sorted((ROOT / "raytrm").glob("*/*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                yield {"body": ast.get_source_segment(source, node), "package": path.parent.name}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        count = sum(f.write(json.dumps(r) + "\n") > 0 for r in records())
    print(f"wrote {count} records to {out}")
