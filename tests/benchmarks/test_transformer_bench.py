"""The transformer bench: its nanoGPT-style reference has nanoGPT's shape and learns, and each raytrm row is followed
by the reference's, timed in the same run."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from benchmarks.cli import main
from benchmarks.nanogpt import NanoGPTTrainer
from benchmarks.transformer import as_json, bench_transformer, caches_in, format_rows, synthetic_corpus
from raytrm import config as cfg
from raytrm.constants import CACHE_DIR_ENV

HIDDEN, LAYERS, HEADS, SEQ, BATCH = 64, 2, 2, 32, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return synthetic_corpus(tmp_path_factory.mktemp("text") / "corpus.txt")


def _reference(corpus, lr: float = 1e-4) -> NanoGPTTrainer:
    experiment = cfg.from_dict(
        cfg.ExperimentConfig,
        {
            "model": {
                "name": "transformer",
                "hidden_size": HIDDEN,
                "num_heads": HEADS,
                "layers": LAYERS,
                "seq_len": SEQ,
            },
            "data": {"name": "text", "path": str(corpus)},
            "training": {"global_batch_size": BATCH, "lr": lr, "weight_decay": 0.1, "threads": 1, "device": "cpu"},
        },
    )
    return NanoGPTTrainer(experiment, corpus, torch.device("cpu"), torch.float32)


def test_reference_has_nanogpts_parameter_count(corpus):
    # Token and position tables, per block two LayerNorm weights, qkv (3D^2), output (D^2) and MLP (8D^2), a final
    # LayerNorm; the head is the token table.
    D = HIDDEN
    expected = 256 * D + SEQ * D + LAYERS * (12 * D * D + 2 * D) + D
    assert _reference(corpus).model.num_parameters() == expected


def test_reference_loss_at_init_is_uniform_over_bytes(corpus):
    ref = _reference(corpus)
    assert float(ref.loss(ref.get_batch())) == pytest.approx(math.log(256), abs=0.3)


def test_reference_steps_lower_the_loss_of_a_batch(corpus):
    ref = _reference(corpus, lr=3e-3)
    batch = ref.get_batch()
    assert batch[0].shape == batch[1].shape == (BATCH, SEQ)
    assert torch.equal(batch[0][:, 1:], batch[1][:, :-1])  # labels are the next bytes
    before = float(ref.loss(batch))
    for _ in range(5):
        ref.train_step(batch)
    assert float(ref.loss(batch)) < before - 0.1


@pytest.mark.slow
def test_bench_alternates_raytrm_and_reference_rows(tmp_path):
    rows = bench_transformer([SEQ], [HIDDEN], BATCH, threads=1, device="cpu", work_dir=tmp_path, repeats=1)
    assert [r.impl for r in rows] == ["raytrm", "nanogpt"]
    raytrm, nanogpt = rows
    assert raytrm.ratio == pytest.approx(raytrm.tokens_per_sec / nanogpt.tokens_per_sec)
    assert nanogpt.ratio is None
    assert (raytrm.hidden, raytrm.seq_len, raytrm.batch) == (nanogpt.hidden, nanogpt.seq_len, nanogpt.batch)
    assert all(r.gflop_per_step > 0 and r.fraction_of_matmul > 0 and r.compiled == "off" for r in rows)
    assert "nanogpt" in format_rows(rows) and as_json(rows)[1]["impl"] == "nanogpt"


@pytest.mark.slow
def test_cli_no_reference_times_raytrm_alone(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["transformer", "--hidden", str(HIDDEN), "--seq-lens", str(SEQ), "--batch", str(BATCH)]
    argv += ["--repeats", "1", "--threads", "1", "--device", "cpu", "--no-reference", "--json", str(out)]
    assert main(argv) == 0
    assert "raytrm" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in rows] == ["raytrm"] and rows[0]["ratio"] is None


@pytest.mark.slow
def test_cli_compile_auto_runs_what_training_runs_by_default_eager_on_a_cpu(tmp_path):
    out = tmp_path / "rows.json"
    argv = ["transformer", "--hidden", str(HIDDEN), "--seq-lens", str(SEQ), "--batch", str(BATCH)]
    argv += ["--repeats", "1", "--threads", "1", "--device", "cpu", "--compile", "auto", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["impl"], r["compiled"]) for r in rows] == [("raytrm", "off"), ("nanogpt", "off")]


def test_the_corpus_is_fixed_and_the_token_caches_stay_in_the_work_directory(tmp_path, monkeypatch):
    first = synthetic_corpus(tmp_path / "a.txt").read_bytes()
    assert first == synthetic_corpus(tmp_path / "b.txt").read_bytes() and b" " in first
    monkeypatch.setenv(CACHE_DIR_ENV, "/the/users/cache")
    with caches_in(tmp_path / "cache"):
        assert os.environ[CACHE_DIR_ENV] == str(tmp_path / "cache")
    assert os.environ[CACHE_DIR_ENV] == "/the/users/cache"
    monkeypatch.delenv(CACHE_DIR_ENV)
    with caches_in(tmp_path / "cache"):
        pass
    assert CACHE_DIR_ENV not in os.environ
