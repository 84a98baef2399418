"""The token cache: one that is damaged (its meta.json, its arrays, its tokens) is built again, to the same bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raytrm import config as cfg
from raytrm.data.text_cache import build_cache, open_cache


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYTRM_CACHE_DIR", str(tmp_path / "cache"))


def data_config(path):
    model = {"name": "transformer", "task": "classify", "seq_len": 8, "hidden_size": 32, "num_heads": 2}
    return cfg.from_dict(cfg.ExperimentConfig, {"model": model, "data": {"name": "text", "path": str(path)}})


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: (d / "meta.json").write_text("{not json"),
        lambda d: (d / "meta.json").write_bytes(b"\xff\xfe"),
        lambda d: (d / "meta.json").write_text("[]"),
        lambda d: (d / "offsets.npy").write_bytes(b"garbage"),
        lambda d: np.save(d / "labels.npy", np.array([7] * 20, dtype=np.int32)),
        lambda d: (d / "tokens.u8").write_bytes(b"short"),
        lambda d: (d / "labels.npy").unlink(),
    ],
    ids=[
        "meta-not-json",
        "meta-not-text",
        "meta-a-list",
        "offsets-garbage",
        "labels-out-of-range",
        "tokens-cut",
        "gone",
    ],
)
def test_a_damaged_cache_is_built_again(tmp_path, damage):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}", "label": ["a", "b"][i % 2]}) + "\n" for i in range(20)))
    config = data_config(path)
    directory = build_cache(config.data, True)
    before = open_cache(config.data, True)
    damage(directory)
    after = open_cache(config.data, True)
    assert np.array_equal(after.labels, before.labels) and np.array_equal(after.offsets, before.offsets)
    assert bytes(after.tokens) == bytes(before.tokens)
