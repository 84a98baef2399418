"""A small transformer experiment on a generated corpus, for the distributed tests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raytrm import config as cfg


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
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
def text_config(corpus, tmp_path, monkeypatch):
    """A config factory: a small byte-level transformer, LM or classifier, global batch 12."""
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
                "data": {"name": "text", "path": str(corpus / ("words.txt" if task == "lm" else "docs.jsonl"))},
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
