"""The `hf` benchmark's labelled records: real text made offline, the docstrings of installed libraries, each record
labelled by the library it comes from.

The docstrings of the functions and classes in each library's Python sources (read with `ast`, never imported), tests
and vendored code left out, whitespace collapsed to single spaces, those of fewer than MIN_WORDS words dropped, and a
text found in two libraries dropped from both (it could not be told apart). Of each library's distinct docstrings a
seeded sample of at most `per_label` is kept, and the records are written in a seeded order as records.csv (text,
label), with corpus.json beside it (the sources, their versions, the counts, the seed). Their lengths vary as
documentation does: one-line summaries beside whole pages with parameters and examples.

The same installed versions, per_label and seed give the same file; a directory that already holds the file of
those settings is reused. A file built elsewhere, of the same settings but other versions, is reused where this
machine lacks a library it would need to build it again (a GPU machine the corpus was carried to): corpus.json keeps
the versions it was made from.
"""

from __future__ import annotations

import ast
import csv
import importlib.metadata
import importlib.util
import json
import logging
import platform
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from raytrm.errors import UserError

logger = logging.getLogger(__name__)

RECORDS_FILE = "records.csv"
MANIFEST_FILE = "corpus.json"

#: Label -> the top-level packages its docstrings come from (the standard library's: a few of its packages).
SOURCES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "numpy": ("numpy",),
    "ray": ("ray",),
    "optuna": ("optuna",),
    "transformers": ("transformers",),
    "stdlib": ("email", "http", "xml", "urllib", "logging", "json", "asyncio"),
}
#: Folders whose sources are not the library's own prose: tests, and code it vendors from others.
EXCLUDED_PARTS = frozenset(
    {"tests", "test", "testing", "_vendor", "vendor", "vendored", "_vendored", "third_party", "thirdparty_files"}
)
MIN_WORDS = 3


def package_files(package: str) -> list[Path]:
    """The Python sources of an installed package, sorted, without tests and vendored code (one line if absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise UserError(f"the hf benchmark's corpus reads the sources of {package}, which is not installed here")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] or [Path(str(spec.origin))]
    files = []
    for root in roots:
        found = root.rglob("*.py") if root.is_dir() else [root]
        files += [p for p in found if not EXCLUDED_PARTS & set(p.relative_to(root.parent).parts[:-1])]
    return sorted(files)


def docstrings(source: bytes) -> Iterator[str]:
    """The docstrings of a module's functions and classes, in the order `ast.walk` meets them, whitespace collapsed."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a file of another Python's syntax, or not Python text
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = ast.get_docstring(node)
            if text and len(words := text.split()) >= MIN_WORDS:
                yield " ".join(words)


def library_docstrings(packages: tuple[str, ...]) -> list[str]:
    """The distinct docstrings of some packages, in the order of their sorted files."""
    seen: dict[str, None] = {}
    for package in packages:
        for path in package_files(package):
            seen.update(dict.fromkeys(docstrings(path.read_bytes())))
    return list(seen)


def versions(sources: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Each source's installed version (the standard library's is Python's)."""
    out = {}
    for label, packages in sources.items():
        try:
            out[label] = importlib.metadata.version(packages[0])
        except importlib.metadata.PackageNotFoundError:
            out[label] = f"python {platform.python_version()}"
    return out


def build_corpus(
    out_dir: Path, per_label: int = 500, seed: int = 0, sources: dict[str, tuple[str, ...]] | None = None
) -> Path:
    """records.csv in out_dir (see the module docstring), reused where corpus.json says it was built the same way."""
    sources = SOURCES if sources is None else sources
    out_dir.mkdir(parents=True, exist_ok=True)
    records, manifest_path = out_dir / RECORDS_FILE, out_dir / MANIFEST_FILE
    recipe = {"sources": {k: list(v) for k, v in sources.items()}, "versions": versions(sources)}
    recipe |= {"per_label": per_label, "seed": seed, "min_words": MIN_WORDS}
    if records.is_file() and manifest_path.is_file():
        stored = json.loads(manifest_path.read_text())
        if {k: stored.get(k) for k in recipe} == recipe:
            logger.info("docstring records: %s, built before with these settings", records)
            return records
        settings = [k for k in recipe if k != "versions"]
        missing = [p for packages in sources.values() for p in packages if importlib.util.find_spec(p) is None]
        if missing and all(stored.get(k) == recipe[k] for k in settings):
            logger.warning(
                "docstring records: %s, built elsewhere from %s; reused as they are (%s not installed here)",
                records,
                ", ".join(f"{k} {v}" for k, v in stored["versions"].items()),
                ", ".join(missing),
            )
            return records
    texts = {label: library_docstrings(packages) for label, packages in sources.items()}
    shared = set()
    labels = list(texts)
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            shared |= set(texts[a]) & set(texts[b])
    rows = []
    for i, label in enumerate(labels):
        distinct = [t for t in texts[label] if t not in shared]
        rng = np.random.default_rng([seed, i])
        keep = np.sort(rng.permutation(len(distinct))[:per_label])
        rows += [(distinct[k], label) for k in keep]
    order = np.random.default_rng(seed).permutation(len(rows))
    with records.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(rows[k] for k in order)
    counts = {label: sum(1 for _, name in rows if name == label) for label in labels}
    available = {label: len(texts[label]) for label in labels}
    manifest_path.write_text(json.dumps({**recipe, "records": counts, "distinct": available}, indent=1))
    logger.info("docstring records: %s, %d records (%s)", records, len(rows), counts)
    return records


def describe_lengths(lengths: np.ndarray, max_length: int) -> dict[str, float]:
    """The distribution of records' token lengths: quantiles, mean, and the share cut at max_length."""
    q = np.percentile(lengths, [0, 10, 25, 50, 75, 90, 100])
    names = ("min", "p10", "p25", "median", "p75", "p90", "max")
    out = {name: float(v) for name, v in zip(names, q, strict=True)}
    out["mean"] = float(lengths.mean())
    out["truncated"] = float((lengths >= max_length).mean())
    return out
