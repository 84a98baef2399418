"""A tiny Sudoku dataset, tiny TRM configs and a scripted allocator failure, shared by the trainer and
distributed tests."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raytrm import config as cfg
from raytrm.data.build import build_dataset


@pytest.fixture(scope="session")
def sudoku_dir(tmp_path_factory):
    return build_dataset(
        "sudoku", tmp_path_factory.mktemp("data") / "sudoku", count=256, test_count=32, givens=40, seed=7
    )


@pytest.fixture
def tiny(sudoku_dir):
    """A config factory: a tiny TRM on the shared dataset, with overrides per section."""

    def make(**sections) -> cfg.ExperimentConfig:
        data = {
            "model": {
                "hidden_size": 32,
                "L_layers": 1,
                "H_cycles": 2,
                "L_cycles": 2,
                "halt_max_steps": 3,
                "halt_exploration_prob": 0.5,
            },
            "data": {"path": str(sudoku_dir)},
            "training": {
                "global_batch_size": 32,
                "lr": 3e-3,
                "warmup_steps": 2,
                "weight_decay": 0.1,
                "puzzle_emb_lr": 1e-2,
                "threads": 1,
                # The CPU's fp32, on a GPU machine too: these tests compare to fp32 rounding. CUDA tests ask for it.
                "device": "cpu",
                "log_interval": 1,
                "seed": 3,
                # Exact sync with several workers, whatever `auto` would choose from a loaded machine's timings:
                # these tests compare to one process. The sync modes' tests ask for theirs.
                "sync_mode": "exact",
            },
        }
        for section, values in sections.items():
            data[section].update(values)
        return cfg.from_dict(cfg.ExperimentConfig, data)

    return make


@pytest.fixture
def fail_forward(monkeypatch):
    """Make a model class's forward raise the allocator's out-of-memory error at the given call numbers.

    CUDA and MPS raise when a micro-batch does not fit; the CPU never does, so the tests script it.
    """

    def install(model_cls: type, at: tuple[int, ...], message: str) -> None:
        real, calls = model_cls.forward, {"n": 0}

        def forward(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] in at:
                raise torch.OutOfMemoryError(message)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(model_cls, "forward", forward)

    return install


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    """Byte text for the LM and labelled JSONL documents for the classifier."""
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(1)
    words = ["red", "cat", "sat", "on", "the", "mat", "and", "ran", "far", "away"]
    (root / "words.txt").write_text("".join(" ".join(rng.choice(words, 6)) + ".\n" for _ in range(600)))
    labels = ["vowels", "consonants"]
    docs = []
    for i in range(120):
        letters = "aeiou" if i % 2 == 0 else "xyzwq"
        docs.append({"text": "".join(rng.choice(list(letters + "bcdfg"), 40)), "label": labels[i % 2]})
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return root


@pytest.fixture
def text_config(text_corpus, tmp_path, monkeypatch):
    """A config factory: a small byte-level transformer, LM or classifier, global batch 12 (the distributed and
    sync tests' experiment)."""
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))

    def make(task: str = "lm") -> cfg.ExperimentConfig:
        return cfg.from_dict(
            cfg.ExperimentConfig,
            {
                "model": {
                    "name": "transformer",
                    "task": task,
                    "hidden_size": 32,
                    "num_heads": 4,
                    "layers": 2,
                    "seq_len": 24,
                },
                "data": {"name": "text", "path": str(text_corpus / ("words.txt" if task == "lm" else "docs.jsonl"))},
                "training": {
                    "global_batch_size": 12,
                    "lr": 3e-3,
                    "warmup_steps": 1,
                    "threads": 1,
                    "seed": 5,
                    "grad_clip": 1.0,
                    "sync_mode": "exact",  # these tests compare to one process
                },
            },
        )

    return make
