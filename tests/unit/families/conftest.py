"""Tiny Hugging Face model directories (offline) and hf experiments on the records' stand-in, for the family's tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from raytrm import config as cfg
from tests.unit.families import hf_stand_in


@pytest.fixture(scope="session", autouse=True)
def offline():
    """No test reaches a model hub. Set before the session's fixtures import transformers: huggingface_hub reads
    HF_HUB_OFFLINE once, as it is imported (and is told again where something imported it earlier)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        if "huggingface_hub.constants" in sys.modules:
            patch.setattr(sys.modules["huggingface_hub.constants"], "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(autouse=True)
def cache_in_tmp(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))


def without_dropout(directory: Path) -> Path:
    """The model directory with every dropout probability of its config at 0 (for the exactness tests: a dropout
    mask drawn per micro-batch depends on the cut)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key in config:
        if "dropout" in key or key.endswith("_pdrop"):
            config[key] = 0.0
    path.write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """{"classify", "lm"} -> a tiny model's directory with its tokenizer; "-still" variants have no dropout."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.support.hf_models import causal_lm_dir, classifier_dir

    root = tmp_path_factory.mktemp("hf")
    return {
        "classify": classifier_dir(root / "classify"),
        "lm": causal_lm_dir(root / "lm"),
        "classify-still": without_dropout(classifier_dir(root / "classify-still")),
        "lm-still": without_dropout(causal_lm_dir(root / "lm-still")),
    }


@pytest.fixture
def hf_config(hf_dirs, tmp_path, monkeypatch):
    """A config factory: an hf experiment on the stand-in's records (opener: which records), CPU and fp32."""
    records = tmp_path / "records.jsonl"
    records.write_text('{"text": "the cat", "label": "neg"}\n')
    monkeypatch.setattr("raytrm.families.hf.open_records", hf_stand_in.opener())

    def make(
        task: str = "classify", model: dict | None = None, still: bool = False, opener=None, **training
    ) -> cfg.ExperimentConfig:
        if opener is not None:
            monkeypatch.setattr("raytrm.families.hf.open_records", opener)
        data = {
            "model": {
                "name": "hf",
                "task": task,
                "path": str(hf_dirs[f"{task}-still" if still else task]),
                "seq_len": 48 if task == "classify" else 16,
                **(model or {}),
            },
            "data": {"name": "records", "path": str(records)},
            "training": {
                "global_batch_size": 16,
                "lr": 1e-3,
                "warmup_steps": 2,
                "weight_decay": 0.01,
                "threads": 1,
                "device": "cpu",
                "log_interval": 1,
                "seed": 3,
                **training,
            },
        }
        return cfg.from_dict(cfg.ExperimentConfig, data)

    return make
